"""Which toroid the tests use.

By default the package of this checkout (python/) with the library of its cargo target directory
(or $TOROID_LIBRARY): the directory goes first on the tests' own path, as launch.py does for the
processes they start. With TOROID_TEST_INSTALLED=1 (scripts/test-package.sh) the tests use the
installed package instead, the checkout stays off the path, and the session fails at once if
`toroid` or its library would come from the checkout."""

import os
import pathlib
import sys

PYTHON_DIR = str(pathlib.Path(__file__).resolve().parents[1])
INSTALLED = os.environ.get("TOROID_TEST_INSTALLED") == "1"
if not INSTALLED and PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)


def pytest_report_header(config):
    import toroid

    return f"toroid package {pathlib.Path(toroid.__file__).parent}, library {toroid.library_path()}"


def pytest_sessionstart(session):
    _build_native()
    if not INSTALLED:
        return
    import toroid

    checkout = pathlib.Path(PYTHON_DIR).parent
    package = pathlib.Path(toroid.__file__).resolve().parent
    library = pathlib.Path(toroid.library_path()).resolve()
    for what, path in (("package", package), ("library", library)):
        if path.is_relative_to(checkout):
            raise RuntimeError(f"TOROID_TEST_INSTALLED=1 but the toroid {what} is the checkout's: {path}")
    if "TOROID_LIBRARY" in os.environ or library.parent != package:
        raise RuntimeError(f"TOROID_TEST_INSTALLED=1 but the library is not the installed package's: {library}")


def _build_native():
    """Builds the C++ torch backend once, before any test starts ranks (each would otherwise
    wait for the first one's build), and makes it required in every process the tests start:
    TOROID_TORCH_NATIVE=1, so a build or load failure fails the tests instead of falling back.
    TOROID_TORCH_NATIVE=0 in the environment runs the Python backend alone (the tests then print
    that the C++ one DID NOT RUN). Without torch, nothing to build."""
    if os.environ.get("TOROID_TORCH_NATIVE") == "0":
        print("conftest: TOROID_TORCH_NATIVE=0: the C++ torch backend DID NOT RUN", file=sys.stderr)
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    from toroid.torch import _native

    path = _native.build()
    os.environ["TOROID_TORCH_NATIVE"] = "1"
    print(f"conftest: the C++ torch backend: {path}", file=sys.stderr)
