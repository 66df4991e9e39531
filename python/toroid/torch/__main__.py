"""`python -m toroid.torch`: builds toroid's C++ torch backend for the torch that is installed
(or finds it in the cache) and prints its path: for a container image or a job's first step,
so that no rank builds it inside init_process_group (see _native.py)."""

from ._native import build

if __name__ == "__main__":
    print(build())
