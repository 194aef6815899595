import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Loopback only: checkpoint servers advertise 127.0.0.1.
os.environ.setdefault("FT_ADVERTISE_HOST", "127.0.0.1")
