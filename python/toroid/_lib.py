"""Loading libtoroid.so and declaring its C ABI for ctypes.

Nothing here is copied by hand from the C header: the functions' argument and result types, the
enums (toroid_result, toroid_datatype, toroid_redop), the structs, the callback types and the
constants all come from ``_abi.json``, the description of the ABI that the Rust build writes
from the same source as include/toroid.h (build.rs, build_support/abi.rs; a test checks that the
committed file is current). C types become ctypes through one table, ``_C_TYPES``, and
``ctype()``. The names of a toroid_stat row's kind and algorithm come from the library itself
(toroid_kind_name, toroid_algorithm_name).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import json
import os
import pathlib
import re
import threading

# The C ABI, as build.rs describes it (see python/toroid/_abi.json).
ABI = json.loads(pathlib.Path(__file__).with_name("_abi.json").read_text())

# C type -> ctypes, for the types that are neither pointers nor toroid's own (an enum is an int
# in the ABI; `void` as a result is None).
_C_TYPES = {
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "int8_t": ctypes.c_int8,
    "uint8_t": ctypes.c_uint8,
    "int16_t": ctypes.c_int16,
    "uint16_t": ctypes.c_uint16,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "ptrdiff_t": ctypes.c_ssize_t,
    "char": ctypes.c_char,
    "bool": ctypes.c_bool,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "void": None,
}
_STRUCTS: dict[str, type] = {}  # struct name -> its ctypes.Structure, filled below
_CALLBACKS: dict[str, type] = {}  # callback typedef -> its CFUNCTYPE, filled below


def ctype(c: str):
    """The ctypes type of the C type `c` as _abi.json spells it. `const` does not change it;
    `char *` is c_char_p; `void *` and a pointer to an opaque handle (toroid_comm *, ...) are
    c_void_p; any other `T *` is POINTER(T's ctype) (so toroid_comm ** is POINTER(c_void_p));
    an enum is c_int; a struct or callback typedef is its class below."""
    t = " ".join(c.replace("const ", "").split())
    if t == "char *":
        return ctypes.c_char_p
    if t == "void *":
        return ctypes.c_void_p
    if t.endswith("*"):
        inner = t[:-1].strip()
        if inner in ABI["opaque"]:
            return ctypes.c_void_p
        return ctypes.POINTER(ctype(inner))
    if t in ABI["enums"]:
        return ctypes.c_int
    for table in (_STRUCTS, _CALLBACKS, _C_TYPES):
        if t in table:
            return table[t]
    raise TypeError(f"_abi.json names the C type {c!r}, which toroid._lib has no ctypes type for")


def _signature(sig: dict):
    """(restype, argtypes) of a function or callback of _abi.json."""
    return ctype(sig["returns"]), [ctype(p["type"]) for p in sig["params"]]


def _members(enum_name: str) -> list[tuple[str, int]]:
    """The enumerators of a C enum, without the TOROID_ prefix."""
    return [(k.removeprefix("TOROID_"), v) for k, v in ABI["enums"][enum_name].items()]


class _Result(enum.IntEnum):
    """toroid_result."""


Result = _Result("Result", _members("toroid_result"), module=__name__, qualname="Result")
Result.__doc__ = _Result.__doc__


class _DataType(enum.IntEnum):
    """toroid_datatype."""

    @property
    def itemsize(self) -> int:
        # Every name ends with its width in bits (INT8 ... FLOAT64, BFLOAT16).
        return int(re.search(r"\d+$", self.name).group()) // 8

    @classmethod
    def of(cls, value) -> "DataType":
        """A DataType from a DataType, its name ("float32", "bfloat16", ...; short forms "bf16",
        "f16", "fp16", "f32", "f64" too) or its number."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            name = value.upper()
            try:
                return cls[_ALIASES.get(name, name)]
            except KeyError:
                raise ValueError(f"unknown toroid data type {value!r}") from None
        return cls(int(value))


DataType = _DataType("DataType", _members("toroid_datatype"), module=__name__, qualname="DataType")
DataType.__doc__ = _DataType.__doc__

_ALIASES = {"BF16": "BFLOAT16", "F16": "FLOAT16", "FP16": "FLOAT16", "HALF": "FLOAT16", "F32": "FLOAT32",
            "FP32": "FLOAT32", "F64": "FLOAT64", "FP64": "FLOAT64"}


class _ReduceOp(enum.IntEnum):
    """toroid_redop."""

    @classmethod
    def of(cls, value) -> "ReduceOp":
        """A ReduceOp from a ReduceOp, its name ("sum", "max", ...) or its number."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            known = _OPS_BY_NAME.get(value)  # (every call's path: a lookup, not a parse)
            if known is not None:
                return known
            names = {"product": "PROD", "mean": "AVG"}
            try:
                return cls[names.get(value.lower(), value.upper())]
            except KeyError:
                raise ValueError(f"unknown toroid reduction op {value!r}") from None
        return cls(int(value))


ReduceOp = _ReduceOp("ReduceOp", _members("toroid_redop"), module=__name__, qualname="ReduceOp")
ReduceOp.__doc__ = _ReduceOp.__doc__
_OPS_BY_NAME = {m.name.lower(): m for m in ReduceOp}

SPLIT_NOCOLOR = ABI["constants"]["TOROID_SPLIT_NOCOLOR"]["value"]
JOIN_TOKEN_MAX = ABI["constants"]["TOROID_JOIN_TOKEN_MAX"]["value"]


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

for _name, _sig in ABI["callbacks"].items():
    _restype, _argtypes = _signature(_sig)
    _CALLBACKS[_name] = ctypes.CFUNCTYPE(_restype, *_argtypes)
# Callback types of toroid_store_ops.
STORE_SET = _CALLBACKS["toroid_store_set_fn"]
STORE_GET = _CALLBACKS["toroid_store_get_fn"]


def _struct(c_name: str, py_name: str, doc: str) -> type:
    """The ctypes.Structure of a struct of _abi.json (fields in order; arrays by their length)."""
    fields = []
    for f in ABI["structs"][c_name]:
        t = ctype(f["type"])
        fields.append((f["name"], t * f["len"] if "len" in f else t))
    cls = type(py_name, (ctypes.Structure,), {"_fields_": fields, "__doc__": doc, "__module__": __name__})
    _STRUCTS[c_name] = cls
    return cls


StoreOps = _struct("toroid_store_ops", "StoreOps", "toroid_store_ops.")
Config = _struct("toroid_config", "Config", "toroid_config (second version: encrypt).")
Stat = _struct("toroid_stat", "Stat", "toroid_stat: one row of toroid_comm_stats (see Comm.stats).")
assert set(_STRUCTS) == set(ABI["structs"]), "_abi.json has a struct toroid._lib does not declare"

# function -> (restype, argtypes): every function of the ABI.
SIGNATURES = {name: _signature(sig) for name, sig in ABI["functions"].items()}

# toroid_stat.kind and .algorithm -> name, from toroid_kind_name and toroid_algorithm_name
# (src/collective.rs's names), read from the library on first use (module __getattr__).
_NAME_TABLES = {"KIND_NAMES": "toroid_kind_name", "ALGORITHM_NAMES": "toroid_algorithm_name"}


def __getattr__(name: str):
    function = _NAME_TABLES.get(name)
    if function is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    name_of = getattr(lib(), function)
    # The kinds and algorithms are u8 values in the Rust enums.
    table = {v: n.decode() for v in range(256) if (n := name_of(v))}
    globals()[name] = table
    return table


def _candidates() -> list[pathlib.Path]:
    """Where libtoroid.so may be, in order: TOROID_LIBRARY; the copy inside this package (an
    installed wheel or sdist puts it there); the cargo target directory of the checkout this
    package lives in (release or debug, the newest first); the system's library path."""
    env = os.environ.get("TOROID_LIBRARY")
    if env:
        return [pathlib.Path(env)]
    here = pathlib.Path(__file__).resolve().parent
    found = [here / "libtoroid.so"] if (here / "libtoroid.so").exists() else []
    repo = here.parent.parent
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", repo / "target"))
    built = [p for p in (target / "release" / "libtoroid.so", target / "debug" / "libtoroid.so") if p.exists()]
    built.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    found += built
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
                    "libtoroid.so not found: install the package (`pip install .` in the toroid "
                    "checkout), or build it there with `cargo build --release`, or set "
                    "TOROID_LIBRARY=/path/to/libtoroid.so"
                )
            loaded = ctypes.CDLL(str(candidates[0]))
            for name, (restype, argtypes) in SIGNATURES.items():
                fn = getattr(loaded, name)
                fn.restype = restype
                fn.argtypes = argtypes
            _bind_fastcall(loaded)
            _lib = loaded
        return _lib


# toroid._fastcall (python/toroid/_fastcall.c), the blocking all-reduce and broadcast without
# ctypes, bound to the loaded library; None where the extension was not built (a source
# checkout, a Python before 3.11, no C compiler at install): the callers then use ctypes.
FAST = None
# The same module where it also has the async calls, toroid_work_wait and toroid_work_free
# (bind_async); None where FAST is None.
FAST_ASYNC = None


def _bind_fastcall(loaded: ctypes.CDLL) -> None:
    global FAST, FAST_ASYNC
    if os.environ.get("TOROID_PYTHON_FASTCALL", "1") == "0":  # (docs/ENV.md; to rule it out)
        return
    try:
        from . import _fastcall
    except ImportError:
        return
    widths = bytearray(max(DataType) + 1)
    for t in DataType:
        widths[t] = t.itemsize
    address = ctypes.cast  # (the functions' addresses in the library just loaded)
    _fastcall.bind(address(loaded.toroid_all_reduce, ctypes.c_void_p).value,
                   address(loaded.toroid_broadcast, ctypes.c_void_p).value, bytes(widths))
    FAST = _fastcall
    if hasattr(_fastcall, "bind_async"):  # (an extension built from an older checkout lacks it)
        _fastcall.bind_async(address(loaded.toroid_all_reduce_async, ctypes.c_void_p).value,
                             address(loaded.toroid_broadcast_async, ctypes.c_void_p).value,
                             address(loaded.toroid_work_wait, ctypes.c_void_p).value,
                             address(loaded.toroid_work_free, ctypes.c_void_p).value)
        FAST_ASYNC = _fastcall


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
