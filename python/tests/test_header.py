"""toroid._lib's ctypes declarations come from python/toroid/_abi.json, the ABI description the
Rust build writes from src/ffi beside include/toroid.h (tests/header.rs checks that both files
are current). Here: the description, the header and the loaded library agree, every C type the
description uses has a ctypes type, and the name tables come from the library's name functions."""

import ctypes
import pathlib
import re

import pytest

from toroid import _lib

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "toroid.h"
# The header without its comments (they mention function names too).
CODE = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)


def test_every_header_function_is_described_and_bound():
    declared = set(re.findall(r"\b(toroid_\w+)\s*\(", CODE))
    assert len(declared) > 60
    assert declared == set(_lib.ABI["functions"])
    assert declared == set(_lib.SIGNATURES)


def test_header_enums_constants_and_types_are_described():
    enumerators = {k: int(v) for k, v in re.findall(r"\b(TOROID_\w+)\s*=\s*(-?\d+)", CODE)}
    described = {k: v for values in _lib.ABI["enums"].values() for k, v in values.items()}
    assert enumerators == described
    for c_name, py in [("toroid_result", _lib.Result), ("toroid_datatype", _lib.DataType),
                       ("toroid_redop", _lib.ReduceOp)]:
        assert {f"TOROID_{m.name}": int(m) for m in py} == _lib.ABI["enums"][c_name]
    defines = {k: int(v) for k, v in re.findall(r"#define (TOROID_\w+) (-?\d+)", CODE)}
    assert defines == {k: c["value"] for k, c in _lib.ABI["constants"].items()}
    assert _lib.SPLIT_NOCOLOR == defines["TOROID_SPLIT_NOCOLOR"]
    structs = set(re.findall(r"typedef struct (\w+)", CODE))
    assert structs == set(_lib.ABI["structs"]) | set(_lib.ABI["opaque"])
    assert set(re.findall(r"\(\*(\w+)\)", CODE)) == set(_lib.ABI["callbacks"])


def test_header_parameters_match_the_description():
    """Each declaration's parameter names, in order, are the description's (a crude scan: the
    last word of each comma-separated piece)."""
    for name, sig in _lib.ABI["functions"].items():
        m = re.search(r"\b" + name + r"\s*\(([^)]*)\)", CODE)
        assert m, name
        params = [p.strip() for p in m.group(1).split(",") if p.strip() and p.strip() != "void"]
        assert [re.findall(r"\w+", p)[-1] for p in params] == [p["name"] for p in sig["params"]], name


def test_structs_follow_the_description():
    for cls, c_name in [(_lib.Config, "toroid_config"), (_lib.StoreOps, "toroid_store_ops"),
                        (_lib.Stat, "toroid_stat")]:
        assert [f[0] for f in cls._fields_] == [f["name"] for f in _lib.ABI["structs"][c_name]]
    assert ctypes.sizeof(_lib.Stat) == 3 * 4 + 4 + 6 * 8 + 32 * 8  # padding after size_class
    assert ctypes.sizeof(_lib.Config) == 8 + 4 + 4 + 8 + 8 + 8 + 4 + 4  # encrypt, then padding


@pytest.mark.parametrize("c, expected", [
    ("int", ctypes.c_int),
    ("size_t", ctypes.c_size_t),
    ("toroid_datatype", ctypes.c_int),
    ("const char *", ctypes.c_char_p),
    ("void *", ctypes.c_void_p),
    ("const void *", ctypes.c_void_p),
    ("toroid_comm *", ctypes.c_void_p),
    ("toroid_comm **", ctypes.POINTER(ctypes.c_void_p)),
    ("const toroid_config *", ctypes.POINTER(_lib.Config)),
    ("size_t *", ctypes.POINTER(ctypes.c_size_t)),
    ("toroid_store_set_fn", _lib.STORE_SET),
    ("void", None),
])
def test_c_types_map_to_ctypes(c, expected):
    assert _lib.ctype(c) is expected


def test_an_unknown_c_type_is_refused():
    with pytest.raises(TypeError, match="long double"):
        _lib.ctype("long double")


def test_library_exports_every_function():
    path = _lib.library_path()
    assert path, "libtoroid.so not found (build it: cargo build --lib)"
    lib = ctypes.CDLL(path)
    missing = [name for name in _lib.ABI["functions"] if not hasattr(lib, name)]
    assert missing == [], f"{path} lacks {missing}"
    loaded = _lib.lib()
    for name, (restype, argtypes) in _lib.SIGNATURES.items():
        assert getattr(loaded, name).argtypes == argtypes, name


def test_name_tables_come_from_the_library():
    lib = _lib.lib()
    assert _lib.KIND_NAMES[1] == "all_reduce" and _lib.KIND_NAMES[8] == "send/recv"
    assert _lib.ALGORITHM_NAMES[1] == "ring" and "shm_direct" in _lib.ALGORITHM_NAMES.values()
    # Every value of the Rust enums (the description's `values`) has a name, and only those.
    assert set(_lib.KIND_NAMES) == set(_lib.ABI["values"]["kind"].values())
    assert set(_lib.ALGORITHM_NAMES) == set(_lib.ABI["values"]["algorithm"].values())
    for table, function in [(_lib.KIND_NAMES, lib.toroid_kind_name),
                            (_lib.ALGORITHM_NAMES, lib.toroid_algorithm_name)]:
        assert len(set(table.values())) == len(table)
        for v, name in table.items():
            assert function(v).decode() == name
        assert function(0) is None and function(-1) is None and function(1 << 20) is None


def test_itemsize_follows_the_type_names():
    sizes = {m.name: m.itemsize for m in _lib.DataType}
    assert sizes == {"INT8": 1, "UINT8": 1, "INT32": 4, "UINT32": 4, "INT64": 8, "UINT64": 8,
                     "FLOAT16": 2, "BFLOAT16": 2, "FLOAT32": 4, "FLOAT64": 8}
