"""The release of ft. setup.py and pyproject metadata read it from here (one place)."""

__version__ = "0.1.0"
