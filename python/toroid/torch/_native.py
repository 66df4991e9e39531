"""toroid's torch backend in C++ (`_native.cpp`, which includes `_native_work.hpp` and
`_native_batch.hpp`): built once per torch and Python with the compiler and the headers of the
torch that is imported, cached, and loaded by the groups.

TOROID_TORCH_NATIVE (docs/ENV.md): unset or "auto", build it when it is not cached and fall back
to the Python backend (with a warning) where it cannot be built; "0", never (the Python backend
alone); "1", it must load (an error otherwise). The cache is TOROID_CACHE_DIR, else
$XDG_CACHE_HOME/toroid, else ~/.cache/toroid. `python -m toroid.torch` builds it ahead of time
(a container image, a job's first step) and prints its path."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any, Optional

import torch

from .. import _lib

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native.cpp")
_HEADERS = tuple(os.path.join(os.path.dirname(_SOURCE), h)  # (included by _SOURCE)
                 for h in ("_native_work.hpp", "_native_batch.hpp"))
_NAME = "_toroid_native"  # (the module's PyInit name: TORCH_EXTENSION_NAME)
_BUILD_SECONDS = 600  # the longest a build, or the wait for another process's build, may take
_UNSET = object()
_loaded: Any = _UNSET  # the module, None when off or unavailable, _UNSET before the first try
# Held while the first try builds and loads it: groups made at once on other threads (torchft's
# tests run a rank per thread) wait for it rather than see None and take the Python path.
_loading = threading.Lock()


def _mode() -> str:
    mode = os.environ.get("TOROID_TORCH_NATIVE", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"TOROID_TORCH_NATIVE={mode!r}: expected auto, 0 or 1")
    return mode


def cache_dir() -> str:
    """Where built modules are kept."""
    if os.environ.get("TOROID_CACHE_DIR"):
        return os.environ["TOROID_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "toroid")


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    path = shutil.which(cxx)
    if path is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} is not on PATH; set CXX)")
    return path


def _command(cxx: str, out: str) -> list:
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = include_paths() + [sysconfig.get_paths()["include"]]
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return ([cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-DTORCH_EXTENSION_NAME={_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
            + [f"-isystem{d}" for d in includes] + [_SOURCE, "-o", out]
            + [f"-L{d}" for d in library_paths()] + ["-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"])


def _path(cxx: str) -> str:
    """The cached module's path: one per source, torch, Python and compiler."""
    key = hashlib.sha256()
    for source in (_SOURCE, *_HEADERS):
        with open(source, "rb") as f:
            key.update(f.read())
    for part in (torch.__version__, str(getattr(torch.version, "git_version", "")), sys.version, cxx,
                 sysconfig.get_config_var("EXT_SUFFIX") or ""):
        key.update(b"\0" + part.encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return os.path.join(cache_dir(), f"{_NAME}-{key.hexdigest()[:20]}{suffix}")


def build(quiet: bool = False) -> str:
    """Builds the module unless it is cached, and returns its path. Concurrent builds (the ranks
    of a host starting together) take turns on a lock: one compiles, the others load its
    result. Bounded: a build or a wait past _BUILD_SECONDS is an error."""
    cxx = _compiler()
    path = _path(cxx)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a+") as lock:
        deadline = time.monotonic() + _BUILD_SECONDS
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise RuntimeError(f"waited {_BUILD_SECONDS} s for another process's build of {path}") from e
                time.sleep(0.2)
        if os.path.exists(path):  # (another process built it meanwhile)
            return path
        if os.path.exists(path + ".failed"):
            os.unlink(path + ".failed")  # (this build is the retry)
        if not quiet:
            print(f"toroid: building the C++ torch backend for torch {torch.__version__} (once per torch; "
                  f"about 30 s on 2 cores) into {path}", file=sys.stderr, flush=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        try:
            run = subprocess.run(_command(cxx, tmp), capture_output=True, text=True, timeout=_BUILD_SECONDS)
            if run.returncode != 0:
                raise RuntimeError(f"compiling {_SOURCE} failed ({run.returncode}):\n{run.stderr[-4000:]}")
            os.replace(tmp, path)  # (atomic: a reader never sees half a module)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _load(path: str):
    name = f"{__package__}.{_NAME}"  # (its classes' __module__: toroid.torch._toroid_native)
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def module():
    """The native module, built if needed; None where TOROID_TORCH_NATIVE=0, or (with a warning,
    once per process) where it cannot be built or loaded under "auto". A failed build is
    remembered in the cache (`<module>.failed`, its error), so that under "auto" every later
    process does not compile again for nothing; "1", or removing that file, tries again."""
    if _loaded is _UNSET:
        with _loading:
            if _loaded is _UNSET:
                _first_load()
    return _loaded


def _first_load() -> None:
    """module()'s first try (under _loading): sets _loaded once it knows (a thread that reads it
    meanwhile sees _UNSET and waits for the lock)."""
    global _loaded
    mode = _mode()
    loaded = None
    if mode != "0":
        failed = None
        try:
            failed = _path(_compiler()) + ".failed"
            if mode == "auto" and os.path.exists(failed):
                with open(failed) as f:
                    raise RuntimeError(f"an earlier build failed ({failed}): {f.read(2000)}")
            loaded = _load(build())
        except Exception as e:
            if mode == "1":
                _loaded = None
                raise RuntimeError(f"toroid: TOROID_TORCH_NATIVE=1 but the C++ torch backend is unavailable: {e}") from e
            if failed is not None and not os.path.exists(failed):
                try:
                    with open(failed, "w") as f:
                        f.write(str(e))
                except OSError:
                    pass
            warnings.warn(f"toroid: the C++ torch backend is unavailable, the Python one runs every call "
                          f"(TOROID_TORCH_NATIVE=0 silences this): {e}", RuntimeWarning, stacklevel=4)
    _loaded = loaded


def _native_error(group_ref, function: str, code: int, name: str) -> BaseException:
    """The exception the group's Python path raises for this toroid failure (see _torch_error)."""
    from ._errors import _torch_error

    pg = group_ref()
    handle = pg._comm._handle_or_none() if pg is not None else None
    try:
        _lib.check(function, code, handle)
    except _lib.ToroidError as e:
        err = _torch_error(e, name, pg.rank() if pg is not None else -1, pg._timeout_s if pg is not None else None)
        if err is not e:
            err.__cause__ = e
        return err
    return RuntimeError(f"toroid: {name} failed with result {code}")


def comm_state(native, pg) -> Any:
    """The native module's view of the group's communicator: its handle, toroid's functions, the
    types and operators the C++ path takes (those of the Python fast path), and how to report a
    failure (weakly referring to the group: the group holds this)."""
    from ._types import _OPS, _TYPES

    loaded = _lib.lib()
    names = [f"toroid_{op}{form}" for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce",
                                             "all_to_all", "all_to_all_v", "barrier") for form in ("", "_async")]
    names += ["toroid_send", "toroid_send_async", "toroid_recv", "toroid_recv_async", "toroid_group_start", "toroid_group_end",
              "toroid_group_end_async", "toroid_work_wait", "toroid_work_test", "toroid_work_free"]
    addresses = {n: ctypes.cast(getattr(loaded, n), ctypes.c_void_p).value for n in names}
    ref = weakref.ref(pg)
    state = native.CommState(pg._comm._live(), addresses, lambda f, c, n: _native_error(ref, f, c, n), pg.rank())
    for dtype, code in _TYPES.items():
        state.set_type(dtype, int(code))
    for torch_op, op in _OPS:
        state.set_op(int(torch_op), int(op))
    return state
