"""Loading libtoroid.so and declaring its C ABI (include/toroid.h) for ctypes."""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import os
import pathlib
import threading

c_int = ctypes.c_int
c_size_t = ctypes.c_size_t
c_int64 = ctypes.c_int64
c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p


class Result(enum.IntEnum):
    """toroid_result."""

    SUCCESS = 0
    SYSTEM_ERROR = 1
    INTERNAL_ERROR = 2
    INVALID_ARGUMENT = 3
    INVALID_USAGE = 4
    REMOTE_ERROR = 5
    TIMEOUT = 6
    ABORTED = 7
    UNSUPPORTED = 8


class DataType(enum.IntEnum):
    """toroid_datatype."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    BFLOAT16 = 7
    FLOAT32 = 8
    FLOAT64 = 9

    @property
    def itemsize(self) -> int:
        return {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 2, 8: 4, 9: 8}[int(self)]

    @classmethod
    def of(cls, value) -> "DataType":
        """A DataType from a DataType, its name ("float32", "bfloat16", ...) or its number."""
        if isinstance(value, DataType):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown toroid data type {value!r}") from None
        return cls(int(value))


class ReduceOp(enum.IntEnum):
    """toroid_redop."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4

    @classmethod
    def of(cls, value) -> "ReduceOp":
        """A ReduceOp from a ReduceOp, its name ("sum", "max", ...) or its number."""
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str):
            names = {"product": "PROD", "mean": "AVG"}
            try:
                return cls[names.get(value.lower(), value.upper())]
            except KeyError:
                raise ValueError(f"unknown toroid reduction op {value!r}") from None
        return cls(int(value))


SPLIT_NOCOLOR = -1


class ToroidError(RuntimeError):
    """A toroid call failed. `code` is the toroid_result, `detail` the last-error text."""

    def __init__(self, function: str, code: int, description: str, detail: str):
        self.function = function
        try:
            self.code = Result(code)
        except ValueError:
            self.code = code
        self.description = description
        self.detail = detail
        name = self.code.name if isinstance(self.code, Result) else str(code)
        text = f"{function} failed: TOROID_{name}: {description}"
        if detail:
            text += f"\n  detail: {detail}"
        super().__init__(text)


class InvalidArgumentError(ToroidError, ValueError):
    """TOROID_INVALID_ARGUMENT."""


class InvalidUsageError(ToroidError):
    """TOROID_INVALID_USAGE."""


class RemoteError(ToroidError):
    """TOROID_REMOTE_ERROR."""


class TimeoutError(ToroidError):  # noqa: A001 - toroid's own timeout, a RuntimeError
    """TOROID_TIMEOUT."""


class AbortedError(ToroidError):
    """TOROID_ABORTED."""


class UnsupportedError(ToroidError):
    """TOROID_UNSUPPORTED."""


_ERRORS = {
    Result.INVALID_ARGUMENT: InvalidArgumentError,
    Result.INVALID_USAGE: InvalidUsageError,
    Result.REMOTE_ERROR: RemoteError,
    Result.TIMEOUT: TimeoutError,
    Result.ABORTED: AbortedError,
    Result.UNSUPPORTED: UnsupportedError,
}

# Callback types of toroid_store_ops.
STORE_SET = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p, c_void_p, c_size_t)
STORE_GET = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p, c_void_p, c_size_t, ctypes.POINTER(c_size_t), c_int64)


class StoreOps(ctypes.Structure):
    """toroid_store_ops."""

    _fields_ = [("struct_size", c_size_t), ("set", STORE_SET), ("get", STORE_GET)]


class Config(ctypes.Structure):
    """toroid_config (first version)."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("rank", c_int),
        ("size", c_int),
        ("store_addr", c_char_p),
        ("timeout_ms", c_int64),
        ("socket_ifname", c_char_p),
    ]


_P = c_void_p  # opaque handles and buffers
_PP = ctypes.POINTER(c_void_p)
_SIGNATURES = {
    "toroid_comm_init_env": (c_int, [_PP]),
    "toroid_comm_init": (c_int, [_PP, ctypes.POINTER(Config)]),
    "toroid_comm_init_with_store": (c_int, [_PP, c_int, c_int, ctypes.POINTER(StoreOps), _P]),
    "toroid_comm_split": (c_int, [_P, c_int, c_int, _PP]),
    "toroid_comm_rank": (c_int, [_P, ctypes.POINTER(c_int)]),
    "toroid_comm_size": (c_int, [_P, ctypes.POINTER(c_int)]),
    "toroid_comm_abort": (c_int, [_P]),
    "toroid_comm_destroy": (c_int, [_P]),
    "toroid_all_reduce": (c_int, [_P, _P, _P, c_size_t, c_int, c_int]),
    "toroid_reduce_scatter": (c_int, [_P, _P, _P, c_size_t, c_int, c_int]),
    "toroid_all_gather": (c_int, [_P, _P, _P, c_size_t, c_int]),
    "toroid_broadcast": (c_int, [_P, _P, _P, c_size_t, c_int, c_int]),
    "toroid_reduce": (c_int, [_P, _P, _P, c_size_t, c_int, c_int, c_int]),
    "toroid_all_to_all": (c_int, [_P, _P, _P, c_size_t, c_int]),
    "toroid_barrier": (c_int, [_P]),
    "toroid_send": (c_int, [_P, _P, c_size_t, c_int, c_int]),
    "toroid_recv": (c_int, [_P, _P, c_size_t, c_int, c_int]),
    "toroid_all_reduce_async": (c_int, [_P, _P, _P, c_size_t, c_int, c_int, _PP]),
    "toroid_reduce_scatter_async": (c_int, [_P, _P, _P, c_size_t, c_int, c_int, _PP]),
    "toroid_all_gather_async": (c_int, [_P, _P, _P, c_size_t, c_int, _PP]),
    "toroid_broadcast_async": (c_int, [_P, _P, _P, c_size_t, c_int, c_int, _PP]),
    "toroid_reduce_async": (c_int, [_P, _P, _P, c_size_t, c_int, c_int, c_int, _PP]),
    "toroid_all_to_all_async": (c_int, [_P, _P, _P, c_size_t, c_int, _PP]),
    "toroid_barrier_async": (c_int, [_P, _PP]),
    "toroid_send_async": (c_int, [_P, _P, c_size_t, c_int, c_int, _PP]),
    "toroid_recv_async": (c_int, [_P, _P, c_size_t, c_int, c_int, _PP]),
    "toroid_work_wait": (c_int, [_P, c_int64]),
    "toroid_work_test": (c_int, [_P, ctypes.POINTER(c_int)]),
    "toroid_work_free": (None, [_P]),
    "toroid_get_error_string": (c_char_p, [c_int]),
    "toroid_get_last_error": (c_char_p, [_P]),
    "toroid_version": (c_char_p, []),
}


def _candidates() -> list[pathlib.Path]:
    """Where libtoroid.so may be: TOROID_LIBRARY, else the cargo target directory of the
    checkout this package lives in (release or debug, the newest first)."""
    env = os.environ.get("TOROID_LIBRARY")
    if env:
        return [pathlib.Path(env)]
    repo = pathlib.Path(__file__).resolve().parents[2]
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", repo / "target"))
    found = [p for p in (target / "release" / "libtoroid.so", target / "debug" / "libtoroid.so") if p.exists()]
    found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    system = ctypes.util.find_library("toroid")
    if system:
        found.append(pathlib.Path(system))
    return found


_lock = threading.Lock()
_lib = None


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use)."""
    global _lib
    with _lock:
        if _lib is None:
            candidates = _candidates()
            if not candidates:
                raise OSError(
                    "libtoroid.so not found: build it with `cargo build --release` in the toroid "
                    "checkout, or set TOROID_LIBRARY=/path/to/libtoroid.so"
                )
            loaded = ctypes.CDLL(str(candidates[0]))
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(loaded, name)
                fn.restype = restype
                fn.argtypes = argtypes
            _lib = loaded
        return _lib


def library_path() -> str:
    """The path of the library that is (or will be) loaded."""
    c = _candidates()
    return str(c[0]) if c else ""


def error_string(code: int) -> str:
    return lib().toroid_get_error_string(int(code)).decode()


def last_error(comm: int | None) -> str:
    return (lib().toroid_get_last_error(comm) or b"").decode(errors="replace")


def check(function: str, code: int, comm: int | None = None) -> None:
    """Raises the ToroidError for a failed call (with the comm's or this thread's last error)."""
    if code == Result.SUCCESS:
        return
    detail = last_error(comm)
    if comm is not None and not detail:
        detail = last_error(None)
    try:
        cls = _ERRORS.get(Result(code), ToroidError)
    except ValueError:
        cls = ToroidError
    raise cls(function, code, error_string(code), detail)


def version() -> str:
    """The library version."""
    return lib().toroid_version().decode()
