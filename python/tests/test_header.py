"""toroid._lib's ctypes declarations against include/toroid.h (parsed by header_check.py), and
proof that the check fails: altered copies of the header, and of _lib's tables, must each be
reported with the difference they contain."""

import ctypes
import pathlib
import re
import types

import pytest

import header_check as hc
from toroid import _lib

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "toroid.h"
TEXT = HEADER.read_text()


def diffs_of(text: str, lib=_lib) -> list[str]:
    return hc.compare(hc.parse(text), lib)


def test_python_binding_matches_header():
    diffs = diffs_of(TEXT)
    assert diffs == [], "include/toroid.h and python/toroid/_lib.py differ:\n" + "\n".join(diffs)


def test_parser_reads_every_declaration():
    """Cross-check of the parser with crude independent scans of the header: every name followed
    by '(' is a function, every `TOROID_X = n` an enumerator, every typedef'd struct is found."""
    h = hc.parse(TEXT)
    code = hc.strip_comments(TEXT)
    assert set(h.functions) == set(re.findall(r"\b(toroid_\w+)\s*\(", code))
    assert len(h.functions) >= 30
    enumerators = {k: v for values in h.enums.values() for k, v in values.items()}
    assert enumerators == {k: int(v) for k, v in re.findall(r"\b(TOROID_\w+)\s*=\s*(-?\d+)", code)}
    assert set(h.structs) | h.opaque == set(re.findall(r"typedef struct (\w+)", code))
    assert set(h.callbacks) == set(re.findall(r"\(\*(\w+)\)", code))
    assert h.defines == {"TOROID_SPLIT_NOCOLOR": -1}
    # Every argument of every function was given a ctype (nothing unmapped).
    for f in h.functions.values():
        for p in f.params:
            hc.to_ctypes(p.type, h, _lib)


def test_library_exports_every_header_function():
    path = _lib.library_path()
    assert path, "libtoroid.so not found (build it: cargo build --lib)"
    lib = ctypes.CDLL(path)
    missing = [name for name in hc.parse(TEXT).functions if not hasattr(lib, name)]
    assert missing == [], f"{_lib.library_path()} lacks {missing}"


def mutate(old: str, new: str, text: str = TEXT) -> str:
    """`text` with `old` (which must occur exactly once) replaced by `new`."""
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in the header"
    return text.replace(old, new)


# (what, old text, new text, a piece of the difference that must be reported)
HEADER_MUTATIONS = [
    ("function removed", "enum toroid_result toroid_barrier_async(struct toroid_comm *comm, struct toroid_work **work);", "",
     "function toroid_barrier_async: in _lib.SIGNATURES, not in the header"),
    ("function added", "enum toroid_result toroid_barrier(struct toroid_comm *comm);",
     "enum toroid_result toroid_barrier(struct toroid_comm *comm);\nenum toroid_result toroid_comm_flush(struct toroid_comm *comm);",
     "function toroid_comm_flush: in the header, missing in _lib.SIGNATURES"),
    ("argument type", "toroid_result toroid_barrier(struct toroid_comm *comm);", "toroid_result toroid_barrier(int comm);",
     "function toroid_barrier argument 1 (comm): int (ctypes c_int) in the header, c_void_p in Python"),
    ("argument type size_t -> int", "size_t sendcount,\n                                     toroid_datatype dtype);",
     "int sendcount,\n                                     toroid_datatype dtype);",
     "function toroid_all_gather argument 4 (sendcount): int (ctypes c_int) in the header, c_ulong in Python"),
    ("argument added", "toroid_result toroid_barrier(struct toroid_comm *comm);",
     "toroid_result toroid_barrier(struct toroid_comm *comm, int64_t timeout_ms);",
     "function toroid_barrier: 2 arguments in the header"),
    ("argument removed", "enum toroid_result toroid_work_wait(struct toroid_work *work, int64_t timeout_ms);",
     "enum toroid_result toroid_work_wait(struct toroid_work *work);", "function toroid_work_wait: 1 arguments in the header"),
    ("pointer depth", "int key,\n                                     struct toroid_comm **out);",
     "int key,\n                                     struct toroid_comm *out);",
     "function toroid_comm_split argument 4 (out): toroid_comm * (ctypes c_void_p) in the header, POINTER(c_void_p) in Python"),
    ("struct pointer", "**out, const struct toroid_config *config);",
     "**out, const struct toroid_store_ops *config);",
     "function toroid_comm_init argument 2 (config): toroid_store_ops * (ctypes POINTER(StoreOps))"),
    ("return type", "const char *toroid_version(void);", "int toroid_version(void);",
     "function toroid_version: returns int (ctypes c_int) in the header, c_char_p in Python"),
    ("void return", "void toroid_work_free(struct toroid_work *work);",
     "enum toroid_result toroid_work_free(struct toroid_work *work);", "function toroid_work_free: returns toroid_result"),
    ("enum value", "TOROID_TIMEOUT = 6,", "TOROID_TIMEOUT = 9,",
     "enum toroid_result: TOROID_TIMEOUT is 9 in the header, Result.TIMEOUT is 6"),
    ("enum member added", "TOROID_FLOAT64 = 9,", "TOROID_FLOAT64 = 9,\n  TOROID_FLOAT8 = 10,",
     "enum toroid_datatype: TOROID_FLOAT8 = 10 in the header, missing in DataType"),
    ("enum member removed", "TOROID_AVG = 4,", "", "enum toroid_redop: ReduceOp.AVG = 4 in Python, not in the header"),
    ("implicit enum value", "TOROID_AVG = 4,", "TOROID_PREMUL_SUM, TOROID_AVG,",
     "enum toroid_redop: TOROID_AVG is 5 in the header, ReduceOp.AVG is 4"),
    ("struct field type", "int64_t timeout_ms;", "int timeout_ms;",
     "struct toroid_config field timeout_ms: int (ctypes c_int) in the header, c_long in Config"),
    ("struct field added", "const char *socket_ifname;", "const char *socket_ifname;\n  int nthreads;",
     "struct toroid_config: fields"),
    ("callback argument", "size_t *len,\n                                   int64_t timeout_ms);",
     "size_t *len,\n                                   int timeout_ms);",
     "callback toroid_store_get_fn argument 6 (timeout_ms): int (ctypes c_int) in the header, c_long in Python"),
    ("constant", "#define TOROID_SPLIT_NOCOLOR -1", "#define TOROID_SPLIT_NOCOLOR -2",
     "constant TOROID_SPLIT_NOCOLOR: -2 in the header, -1 in Python"),
    ("array field length", "uint64_t hist[32];", "uint64_t hist[16];",
     "struct toroid_stat field hist: uint64_t (ctypes c_ulong_Array_16) in the header, c_ulong_Array_32 in Stat"),
    ("array field type", "uint64_t hist[32];", "uint32_t hist[32];",
     "struct toroid_stat field hist: uint32_t (ctypes c_uint_Array_32) in the header, c_ulong_Array_32 in Stat"),
    ("new opaque handle", "typedef struct toroid_work toroid_work;",
     "typedef struct toroid_work toroid_work;\ntypedef struct toroid_event toroid_event;",
     "opaque struct toroid_event: in the header, missing in _lib.OPAQUE"),
]


@pytest.mark.parametrize("what,old,new,expected", HEADER_MUTATIONS, ids=[m[0] for m in HEADER_MUTATIONS])
def test_check_reports_an_altered_header(what, old, new, expected):
    diffs = diffs_of(mutate(old, new))
    assert any(expected in d for d in diffs), f"{what}: expected a difference containing {expected!r}, got {diffs}"


def altered_lib(**changes):
    """_lib's tables, copied, with `changes` applied (a table name -> a function of its copy)."""
    tables = {k: dict(getattr(_lib, k)) for k in ("SIGNATURES", "ENUMS", "STRUCTS", "CALLBACKS", "CONSTANTS")}
    tables["OPAQUE"] = tuple(_lib.OPAQUE)
    for name, change in changes.items():
        tables[name] = change(tables[name])
    return types.SimpleNamespace(**tables)


def _set(d, key, value):
    d = dict(d)
    d[key] = value
    return d


def _drop(d, key):
    d = dict(d)
    del d[key]
    return d


def _argtype(name, index, t):
    def change(sigs):
        restype, argtypes = sigs[name]
        argtypes = list(argtypes)
        argtypes[index] = t
        return _set(sigs, name, (restype, argtypes))

    return change


class _ResultMissingOne(__import__("enum").IntEnum):
    SUCCESS = 0
    SYSTEM_ERROR = 1
    INTERNAL_ERROR = 2
    INVALID_ARGUMENT = 3
    INVALID_USAGE = 4
    REMOTE_ERROR = 5
    TIMEOUT = 6
    ABORTED = 7


LIB_MUTATIONS = [
    ("function missing in Python", {"SIGNATURES": lambda s: _drop(s, "toroid_reduce_async")},
     "function toroid_reduce_async: in the header, missing in _lib.SIGNATURES"),
    ("argument type in Python", {"SIGNATURES": _argtype("toroid_reduce", 6, ctypes.c_int64)},
     "function toroid_reduce argument 7 (root): int (ctypes c_int) in the header, c_long in Python"),
    ("argument count in Python", {"SIGNATURES": lambda s: _set(s, "toroid_comm_abort", (ctypes.c_int, []))},
     "function toroid_comm_abort: 1 arguments in the header (toroid_comm *), 0 in Python"),
    ("return type in Python", {"SIGNATURES": lambda s: _set(s, "toroid_work_free", (ctypes.c_int, [ctypes.c_void_p]))},
     "function toroid_work_free: returns void (ctypes None) in the header, c_int in Python"),
    ("enum member missing in Python", {"ENUMS": lambda e: _set(e, "toroid_result", _ResultMissingOne)},
     "enum toroid_result: TOROID_UNSUPPORTED = 8 in the header, missing in _ResultMissingOne"),
    ("struct missing in Python", {"STRUCTS": lambda s: _drop(s, "toroid_store_ops")},
     "struct toroid_store_ops: in the header, missing in _lib.STRUCTS"),
    ("callback type in Python",
     {"CALLBACKS": lambda c: _set(c, "toroid_store_set_fn", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int))},
     "callback toroid_store_set_fn argument 4 (len): size_t (ctypes c_ulong) in the header, c_int in Python"),
    ("constant in Python", {"CONSTANTS": lambda c: _set(c, "TOROID_SPLIT_NOCOLOR", 0)},
     "constant TOROID_SPLIT_NOCOLOR: -1 in the header, 0 in Python"),
]


@pytest.mark.parametrize("what,changes,expected", LIB_MUTATIONS, ids=[m[0] for m in LIB_MUTATIONS])
def test_check_reports_an_altered_binding(what, changes, expected):
    assert diffs_of(TEXT, altered_lib()) == []  # the unaltered copy is equal
    diffs = diffs_of(TEXT, altered_lib(**changes))
    assert any(expected in d for d in diffs), f"{what}: expected a difference containing {expected!r}, got {diffs}"


@pytest.mark.parametrize("bad", [
    "enum toroid_result toroid_barrier(struct toroid_comm *comm) { return 0; }",
    "int toroid_table[4];",
    "#if SOME_MACRO > 2\n#endif",
    "#ifdef X\n",
    "typedef struct toroid_config (*toroid_factory)(int (*cb)(void));",
])
def test_parser_rejects_what_it_does_not_understand(bad):
    with pytest.raises(hc.HeaderParseError):
        hc.parse(TEXT.replace("#endif  /* TOROID_H */", bad + "\n#endif  /* TOROID_H */"))


def test_parser_reads_other_cbindgen_styles():
    """cbindgen's other enum form (`enum x {...}; typedef int32_t x;`), a #if defined() block,
    an extern "C" block outside #ifdef, implicit and expression values."""
    text = """
    #if defined(__cplusplus) || 0
    #error not C
    #else
    #define TOROID_FLAG (1 << 3)
    #endif
    enum toroid_mode { TOROID_A, TOROID_B = 4, TOROID_C, TOROID_D = TOROID_FLAG | 1 };
    typedef int32_t toroid_mode;
    struct toroid_thing;
    extern "C" {
    toroid_mode toroid_f(const struct toroid_thing *t, toroid_mode m, unsigned int n, const char *const *names);
    }
    """
    h = hc.parse(text)
    assert h.enums == {"toroid_mode": {"TOROID_A": 0, "TOROID_B": 4, "TOROID_C": 5, "TOROID_D": 9}}
    assert h.defines == {"TOROID_FLAG": 8}
    f = h.functions["toroid_f"]
    lib = types.SimpleNamespace(STRUCTS={}, CALLBACKS={})
    assert [hc.to_ctypes(p.type, h, lib) for p in f.params] == [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint, ctypes.POINTER(ctypes.c_char_p)]
    assert hc.to_ctypes(f.ret, h, lib) is ctypes.c_int32
