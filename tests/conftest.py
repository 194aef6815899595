import os
import sys

# Tests import the in-tree package (built with `python setup.py build_ext --inplace`).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
