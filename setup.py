"""Builds the Python package with setuptools-rust (configuration in pyproject.toml).

Why setuptools-rust and not maturin: the Python side loads libtoroid.so with ctypes through the
C ABI (python/toroid/_lib.py), it is not a CPython extension module. setuptools-rust builds a
plain cdylib for that (Binding.NoBinding) and a Rust binary as a script (RustBin: toroid-run),
next to an ordinary setuptools package; maturin's layouts are a pyo3/cffi/uniffi extension module
or binaries alone.

Two adjustments, because the library does not depend on the Python version:
- the library is installed as toroid/libtoroid.so (not libtoroid.cpython-3XY-....so): _lib.py
  loads it by that name;
- the wheel's tag says which Pythons it is for. Built by CPython 3.11 or later, it carries
  toroid._fastcall (python/toroid/_fastcall.c), a small extension on Python's stable ABI that
  makes the binding's blocking all-reduce and broadcast without ctypes: the wheel is tagged
  cp311-abi3-<platform> (every CPython from 3.11). Built by an older Python or PyPy, or where the
  extension does not compile (it is optional: the binding then calls the same functions through
  ctypes), it is tagged py3-none-<platform> (every CPython 3.9+ and PyPy). auditwheel turns
  <platform> into the manylinux tag the glibc symbols allow.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import Binding, RustBin, RustExtension, Strip
from setuptools_rust.build import build_rust


class BuildRust(build_rust):
    def get_dylib_ext_path(self, ext, target_fname):
        path = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(path), "libtoroid.so")


# The stable ABI of Python 3.11 (the buffer protocol entered it then; see _fastcall.c).
FASTCALL = sys.implementation.name == "cpython" and sys.version_info >= (3, 11)


class BdistWheel(bdist_wheel):
    def get_tag(self):
        _, _, plat = super().get_tag()
        return ("cp311", "abi3", plat) if FASTCALL else ("py3", "none", plat)


# The release profile keeps line tables (debug = 1) for the crate's own profiling; the wheel
# drops them (26 MB -> a few MB) and keeps the symbols, so backtraces still name functions.
setup(
    rust_extensions=[
        RustExtension("toroid.libtoroid", path="Cargo.toml", binding=Binding.NoBinding, strip=Strip.Debug),
        RustBin("toroid-run", path="Cargo.toml", strip=Strip.Debug),
    ],
    ext_modules=[Extension("toroid._fastcall", ["python/toroid/_fastcall.c"], py_limited_api=True, optional=True)]
    if FASTCALL else [],
    cmdclass={"build_rust": BuildRust, "bdist_wheel": BdistWheel},
    zip_safe=False,
)
