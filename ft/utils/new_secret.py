"""Prints a new job secret: ``python -m ft.utils.new_secret > secret && chmod 600 secret``.

64 hex characters (256 random bits) from the operating system's generator; see ft.utils.auth.
"""

from ft.utils.auth import JobSecret

if __name__ == "__main__":
    print(JobSecret.generate().export())
