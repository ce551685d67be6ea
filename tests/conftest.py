import os
import sys

# Tests import helpers as top-level modules (``_dist``, ``_tiny_models``); worker processes inherit sys.path.
sys.path.insert(0, os.path.dirname(__file__))
