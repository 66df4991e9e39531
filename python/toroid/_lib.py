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
        """A DataType from a DataType, its name ("float32", "bfloat16", ...; short forms "bf16",
        "f16", "fp16", "f32", "f64" too) or its number."""
        if isinstance(value, DataType):
            return value
        if isinstance(value, str):
            name = value.upper()
            try:
                return cls[_ALIASES.get(name, name)]
            except KeyError:
                raise ValueError(f"unknown toroid data type {value!r}") from None
        return cls(int(value))


_ALIASES = {"BF16": "BFLOAT16", "F16": "FLOAT16", "FP16": "FLOAT16", "HALF": "FLOAT16", "F32": "FLOAT32",
            "FP32": "FLOAT32", "F64": "FLOAT64", "FP64": "FLOAT64"}


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


class Stat(ctypes.Structure):
    """toroid_stat: one row of toroid_comm_stats (see Comm.stats)."""

    _fields_ = [
        ("kind", c_int),
        ("algorithm", c_int),
        ("size_class", c_int),
        ("count", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("moved", ctypes.c_uint64),
        ("total_ns", ctypes.c_uint64),
        ("min_ns", ctypes.c_uint64),
        ("max_ns", ctypes.c_uint64),
        ("hist", ctypes.c_uint64 * 32),
    ]


# toroid_stat.kind -> name (src/collective.rs, CollKind).
KIND_NAMES = {1: "all_reduce", 2: "reduce_scatter", 3: "all_gather", 4: "broadcast", 5: "reduce",
              6: "all_to_all", 7: "barrier", 8: "send/recv", 9: "split", 10: "probe"}
# toroid_stat.algorithm -> name, as TOROID_ALGO spells it (src/collective.rs, Algorithm).
ALGORITHM_NAMES = {1: "ring", 2: "rd", 3: "chain", 4: "tree", 5: "pairwise", 6: "dissemination",
                   7: "direct", 8: "hd", 9: "hring", 10: "torus2d", 11: "shm_direct"}


# ---- The C ABI of include/toroid.h, as tables ------------------------------------------------
# python/tests/test_header.py parses the header and fails on any difference from these tables:
# a function, enum member, struct field, callback type or constant missing on either side, an
# argument count or type, a return type or a value that differs. C types map to ctypes thus:
#   an enum (toroid_result, toroid_datatype, ...) -> c_int; int -> c_int; size_t -> c_size_t;
#   int64_t -> c_int64; void (result) -> None; char * -> c_char_p; void * -> c_void_p;
#   a pointer to an opaque struct (a handle: toroid_comm *, toroid_work *) -> c_void_p;
#   a pointer to a struct of STRUCTS -> POINTER(its class); a callback typedef -> its CFUNCTYPE;
#   any other T * -> POINTER(T's ctype) (so toroid_comm ** -> POINTER(c_void_p)).
# `const` does not change the ctype.

# enum name -> IntEnum whose members are the C enumerators without the "TOROID_" prefix.
ENUMS = {"toroid_result": Result, "toroid_datatype": DataType, "toroid_redop": ReduceOp}
# #define name -> value.
CONSTANTS = {"TOROID_SPLIT_NOCOLOR": SPLIT_NOCOLOR}
# Opaque structs: only ever handled through pointers (c_void_p here).
OPAQUE = ("toroid_comm", "toroid_work", "toroid_pending", "toroid_request")
# struct name -> ctypes.Structure with the same fields in the same order.
STRUCTS = {"toroid_config": Config, "toroid_store_ops": StoreOps, "toroid_stat": Stat}
# function-pointer typedef -> CFUNCTYPE.
CALLBACKS = {"toroid_store_set_fn": STORE_SET, "toroid_store_get_fn": STORE_GET}

_P = c_void_p  # opaque handles and buffers
_PP = ctypes.POINTER(c_void_p)  # where a handle is written
_E = c_int  # an enum (toroid_result, toroid_datatype, toroid_redop)
# function -> (restype, argtypes): every function of the header.
SIGNATURES = {
    "toroid_comm_init_env": (_E, [_PP]),
    "toroid_comm_init": (_E, [_PP, ctypes.POINTER(Config)]),
    "toroid_comm_init_with_store": (_E, [_PP, c_int, c_int, ctypes.POINTER(StoreOps), _P]),
    "toroid_comm_init_with_store_config": (_E, [_PP, ctypes.POINTER(Config), ctypes.POINTER(StoreOps), _P]),
    "toroid_comm_split": (_E, [_P, c_int, c_int, _PP]),
    "toroid_comm_shrink": (_E, [_P, ctypes.POINTER(c_int), c_int, _PP]),
    "toroid_comm_init_env_async": (_E, [_PP]),
    "toroid_comm_init_async": (_E, [_PP, ctypes.POINTER(Config)]),
    "toroid_comm_shrink_async": (_E, [_P, ctypes.POINTER(c_int), c_int, _PP]),
    "toroid_pending_test": (_E, [_P, ctypes.POINTER(c_int)]),
    "toroid_pending_wait": (_E, [_P, _PP]),
    "toroid_pending_abort": (_E, [_P]),
    "toroid_pending_free": (None, [_P]),
    "toroid_group_start": (_E, [_P]),
    "toroid_group_end": (_E, [_P]),
    "toroid_group_end_async": (_E, [_P, _PP]),
    "toroid_all_reduce_init": (_E, [_P, _P, _P, c_size_t, _E, _E, _PP]),
    "toroid_request_run": (_E, [_P]),
    "toroid_request_free": (None, [_P]),
    "toroid_comm_stats": (_E, [_P, ctypes.POINTER(Stat), c_size_t, ctypes.POINTER(c_size_t)]),
    "toroid_comm_rank": (_E, [_P, ctypes.POINTER(c_int)]),
    "toroid_comm_size": (_E, [_P, ctypes.POINTER(c_int)]),
    "toroid_comm_abort": (_E, [_P]),
    "toroid_comm_dump": (_E, [_P, ctypes.c_char_p, c_size_t]),
    "toroid_comm_destroy": (_E, [_P]),
    "toroid_all_reduce": (_E, [_P, _P, _P, c_size_t, _E, _E]),
    "toroid_all_reduce_wire": (_E, [_P, _P, _P, c_size_t, _E, _E, _E]),
    "toroid_reduce_scatter": (_E, [_P, _P, _P, c_size_t, _E, _E]),
    "toroid_all_gather": (_E, [_P, _P, _P, c_size_t, _E]),
    "toroid_broadcast": (_E, [_P, _P, _P, c_size_t, _E, c_int]),
    # Device memory on a CUDA stream (the last argument): Comm.*_stream_ptr.
    "toroid_all_reduce_stream": (_E, [_P, _P, _P, c_size_t, _E, _E, _P]),
    "toroid_broadcast_stream": (_E, [_P, _P, _P, c_size_t, _E, c_int, _P]),
    "toroid_all_gather_stream": (_E, [_P, _P, _P, c_size_t, _E, _P]),
    "toroid_reduce_scatter_stream": (_E, [_P, _P, _P, c_size_t, _E, _E, _P]),
    "toroid_all_reduce_stream_async": (_E, [_P, _P, _P, c_size_t, _E, _E, _P, _PP]),
    "toroid_broadcast_stream_async": (_E, [_P, _P, _P, c_size_t, _E, c_int, _P, _PP]),
    "toroid_all_gather_stream_async": (_E, [_P, _P, _P, c_size_t, _E, _P, _PP]),
    "toroid_reduce_scatter_stream_async": (_E, [_P, _P, _P, c_size_t, _E, _E, _P, _PP]),
    "toroid_reduce_stream": (_E, [_P, _P, _P, c_size_t, _E, _E, c_int, _P]),
    "toroid_all_to_all_stream": (_E, [_P, _P, _P, c_size_t, _E, _P]),
    "toroid_send_stream": (_E, [_P, _P, c_size_t, _E, c_int, _P]),
    "toroid_recv_stream": (_E, [_P, _P, c_size_t, _E, c_int, _P]),
    "toroid_reduce": (_E, [_P, _P, _P, c_size_t, _E, _E, c_int]),
    "toroid_all_to_all": (_E, [_P, _P, _P, c_size_t, _E]),
    "toroid_barrier": (_E, [_P]),
    "toroid_send": (_E, [_P, _P, c_size_t, _E, c_int]),
    "toroid_recv": (_E, [_P, _P, c_size_t, _E, c_int]),
    "toroid_recv_any": (_E, [_P, _P, c_size_t, _E, ctypes.POINTER(c_int)]),
    "toroid_all_reduce_async": (_E, [_P, _P, _P, c_size_t, _E, _E, _PP]),
    "toroid_all_reduce_wire_async": (_E, [_P, _P, _P, c_size_t, _E, _E, _E, _PP]),
    "toroid_reduce_scatter_async": (_E, [_P, _P, _P, c_size_t, _E, _E, _PP]),
    "toroid_all_gather_async": (_E, [_P, _P, _P, c_size_t, _E, _PP]),
    "toroid_broadcast_async": (_E, [_P, _P, _P, c_size_t, _E, c_int, _PP]),
    "toroid_reduce_async": (_E, [_P, _P, _P, c_size_t, _E, _E, c_int, _PP]),
    "toroid_all_to_all_async": (_E, [_P, _P, _P, c_size_t, _E, _PP]),
    "toroid_barrier_async": (_E, [_P, _PP]),
    "toroid_send_async": (_E, [_P, _P, c_size_t, _E, c_int, _PP]),
    "toroid_recv_async": (_E, [_P, _P, c_size_t, _E, c_int, _PP]),
    "toroid_recv_any_async": (_E, [_P, _P, c_size_t, _E, _PP]),
    "toroid_work_wait": (_E, [_P, c_int64]),
    "toroid_work_test": (_E, [_P, ctypes.POINTER(c_int)]),
    "toroid_work_free": (None, [_P]),
    "toroid_work_source": (_E, [_P, ctypes.POINTER(c_int)]),
    "toroid_get_error_string": (c_char_p, [_E]),
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
            for name, (restype, argtypes) in SIGNATURES.items():
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
