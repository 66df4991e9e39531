"""Makes the toroid package of this checkout (python/) importable by the tests themselves, as
launch.py does for the processes they start."""

import pathlib
import sys

PYTHON_DIR = str(pathlib.Path(__file__).resolve().parents[1])
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)
