import os

# Loopback only: checkpoint servers advertise 127.0.0.1.
os.environ.setdefault("FT_ADVERTISE_HOST", "127.0.0.1")
