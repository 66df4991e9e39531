"""Checks the ctypes declarations of toroid._lib against include/toroid.h.

`parse(text)` reads cbindgen's C output with a small parser: comments, the preprocessor
(#ifdef/#ifndef/#if defined/#else/#endif, object-like #defines), `typedef enum`/`enum` blocks
with their values, structs (with fields, or opaque), function-pointer typedefs, plain typedefs
and function prototypes. Anything else it meets is a HeaderParseError, so a change in cbindgen's
output fails loudly instead of being skipped.

`compare(header, lib)` maps every C type to the ctype `_lib` must declare for it (the rules are
in the comment above `_lib.SIGNATURES`) and returns one line per difference; [] means equal.
"""

from __future__ import annotations

import ast
import ctypes
import re
from dataclasses import dataclass, field
from typing import Optional


class HeaderParseError(ValueError):
    """The header holds something this parser does not understand."""


@dataclass(frozen=True)
class CType:
    """A C type: its base name (qualifiers and struct/enum/union tags dropped) and pointer depth."""

    base: str
    pointers: int = 0

    def __str__(self) -> str:
        return self.base + (" " + "*" * self.pointers if self.pointers else "")


@dataclass
class Param:
    name: str
    type: CType
    array: int = 0  # N for a struct field `T name[N]`, else 0


@dataclass
class Function:
    name: str
    ret: CType
    params: list


@dataclass
class Header:
    enums: dict = field(default_factory=dict)  # name -> {enumerator: value} (in order)
    structs: dict = field(default_factory=dict)  # name -> [Param] (fields, in order)
    opaque: set = field(default_factory=set)  # struct names declared without a body
    callbacks: dict = field(default_factory=dict)  # typedef name -> Function
    aliases: dict = field(default_factory=dict)  # typedef name -> CType
    functions: dict = field(default_factory=dict)  # name -> Function
    defines: dict = field(default_factory=dict)  # name -> int, or the raw text if not an integer


# ---- lexing and the preprocessor ---------------------------------------------------------

_COMMENT_OR_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|/\*.*?\*/|//[^\n]*', re.S)


def strip_comments(text: str) -> str:
    """The text without comments (a block comment keeps its newlines, strings are kept)."""

    def repl(m: re.Match) -> str:
        s = m.group(0)
        if s.startswith("/*"):
            return " " + "\n" * s.count("\n")
        if s.startswith("//"):
            return " "
        return s

    return _COMMENT_OR_STRING.sub(repl, text)


def _condition(expr: str, defined: set) -> bool:
    """An #if expression made of defined(X), !, &&, ||, 0 and 1; anything else is an error."""
    e = re.sub(r"defined\s*\(\s*(\w+)\s*\)|defined\s+(\w+)", lambda m: "1" if (m.group(1) or m.group(2)) in defined else "0", expr)
    e = e.replace("&&", " and ").replace("||", " or ").replace("!", " not ")
    if not re.fullmatch(r"[\s01()]*(?:(?:and|or|not)[\s01()]*)*", e):
        raise HeaderParseError(f"unsupported #if expression: {expr!r}")
    try:
        return bool(eval(e, {"__builtins__": {}}, {}))  # only 0, 1, and/or/not, parentheses
    except SyntaxError:
        raise HeaderParseError(f"unsupported #if expression: {expr!r}") from None


def preprocess(text: str, defined: Optional[set] = None) -> tuple[str, dict]:
    """(the code a C compiler would see, the object-like #defines) with `defined` predefined
    (default: nothing, so `__cplusplus` blocks are dropped)."""
    defined = set(defined or ())
    defines: dict = {}
    text = strip_comments(text).replace("\\\n", " ")
    out, stack = [], []  # stack: [this branch active, some branch taken]
    for n, line in enumerate(text.split("\n"), 1):
        s = line.strip()
        active = all(a for a, _ in stack)
        if not s.startswith("#"):
            if active:
                out.append(line)
            continue
        m = re.match(r"#\s*(\w+)\s*(.*)$", s)
        if not m:
            raise HeaderParseError(f"line {n}: bad directive {s!r}")
        d, rest = m.group(1), m.group(2).strip()
        if d in ("ifdef", "ifndef"):
            c = (rest in defined) == (d == "ifdef")
            stack.append([c, c])
        elif d == "if":
            c = _condition(rest, defined)
            stack.append([c, c])
        elif d in ("elif", "else"):
            if not stack:
                raise HeaderParseError(f"line {n}: #{d} without #if")
            c = (not stack[-1][1]) and (d == "else" or _condition(rest, defined))
            stack[-1] = [c, stack[-1][1] or c]
        elif d == "endif":
            if not stack:
                raise HeaderParseError(f"line {n}: #endif without #if")
            stack.pop()
        elif d == "define" and active:
            dm = re.match(r"(\w+)(\()?\s*(.*)$", rest)
            if not dm:
                raise HeaderParseError(f"line {n}: bad #define {rest!r}")
            defined.add(dm.group(1))
            if not dm.group(2) and dm.group(3):  # object-like with a value
                defines[dm.group(1)] = _int_or_text(dm.group(3), {})
        elif d == "undef" and active:
            defined.discard(rest)
            defines.pop(rest, None)
        elif d in ("include", "pragma", "error", "warning", "line", "define", "undef"):
            if d == "error" and active:
                raise HeaderParseError(f"line {n}: #error {rest}")
        else:
            raise HeaderParseError(f"line {n}: unsupported directive #{d}")
    if stack:
        raise HeaderParseError("unterminated #if")
    return "\n".join(out), defines


# ---- declarations ----------------------------------------------------------------------------

_QUALIFIERS = {"const", "volatile", "restrict", "__restrict", "struct", "enum", "union", "extern"}
_BUILTIN_WORDS = {"void", "char", "short", "int", "long", "float", "double", "signed", "unsigned", "_Bool", "bool"}


def _int_value(expr: str, known: dict) -> int:
    """An integer constant expression: literals (with U/L suffixes), names already known,
    + - * << >> | & ~ and parentheses."""
    e = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr.strip())
    try:
        tree = ast.parse(e, mode="eval")
    except SyntaxError:
        raise HeaderParseError(f"not an integer constant: {expr!r}") from None

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name) and n.id in known and isinstance(known[n.id], int):
            return known[n.id]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd, ast.Invert)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else (~v if isinstance(n.op, ast.Invert) else v)
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
               ast.BitOr: lambda a, b: a | b, ast.BitAnd: lambda a, b: a & b}
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.left), ev(n.right))
        raise HeaderParseError(f"not an integer constant: {expr!r}")

    return ev(tree)


def _int_or_text(text: str, known: dict):
    try:
        return _int_value(text, known)
    except HeaderParseError:
        return text.strip()


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside (), {} and []."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth < 0:
                raise HeaderParseError(f"unbalanced brackets in {text[:80]!r}")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise HeaderParseError(f"unbalanced brackets in {text[:80]!r}")
    parts.append("".join(cur))
    return parts


def parse_type(text: str) -> CType:
    """A type without a declarator name: "const struct toroid_config *" -> toroid_config, 1."""
    if "[" in text or "(" in text:
        raise HeaderParseError(f"unsupported type {text.strip()!r}")
    tokens = re.findall(r"\w+|\*|\S", text)
    bad = [t for t in tokens if not (t == "*" or re.fullmatch(r"\w+", t))]
    if bad:
        raise HeaderParseError(f"unsupported type {text.strip()!r}")
    words = [t for t in tokens if t != "*" and t not in _QUALIFIERS]
    if not words:
        raise HeaderParseError(f"no type in {text.strip()!r}")
    if len(words) > 1 and not all(w in _BUILTIN_WORDS for w in words):
        raise HeaderParseError(f"unsupported type {text.strip()!r}")
    return CType(" ".join(words), tokens.count("*"))


def parse_param(text: str, index: int) -> Param:
    """A declaration "type name" (or an unnamed "type")."""
    s = " ".join(text.split())
    m = re.match(r"^(.*?)(\w+)$", s)
    if m and m.group(1).strip() and m.group(2) not in _BUILTIN_WORDS | _QUALIFIERS:
        rest = m.group(1)
        if re.search(r"\w|\*", rest) and not re.fullmatch(r"\s*(?:const|volatile|struct|enum|union)\s*", rest):
            return Param(m.group(2), parse_type(rest))
    return Param(f"#{index}", parse_type(s))


def parse_params(text: str) -> list:
    s = " ".join(text.split())
    if s in ("", "void"):
        return []
    return [parse_param(p, i) for i, p in enumerate(_split_top(s, ","), 1)]


def _enum_body(body: str, known: dict) -> dict:
    values, nxt = {}, 0
    for entry in _split_top(body, ","):
        entry = entry.strip()
        if not entry:
            continue  # a trailing comma
        m = re.fullmatch(r"(\w+)\s*(?:=\s*(.+))?", entry, re.S)
        if not m:
            raise HeaderParseError(f"bad enumerator {entry!r}")
        v = _int_value(m.group(2), {**known, **values}) if m.group(2) else nxt
        values[m.group(1)] = v
        nxt = v + 1
    return values


def _struct_body(body: str) -> list:
    """Fields; a fixed-size array field `T name[N]` becomes (name, T, N) -> ctypes `T * N`."""
    fields = []
    for i, f in enumerate(_split_top(body, ";"), 1):
        if f.strip():
            if "," in f:
                raise HeaderParseError(f"several fields in one declaration: {f.strip()!r}")
            m = re.fullmatch(r"(.*?)\[\s*(\d+)\s*\]\s*", f, re.S)
            if m:
                p = parse_param(m.group(1), i)
                fields.append(Param(p.name, p.type, int(m.group(2))))
            else:
                fields.append(parse_param(f, i))
    return fields


def _unwrap_extern_c(code: str) -> str:
    """`extern "C" { ... }` outside #ifdef __cplusplus replaced by its contents."""
    while True:
        m = re.search(r'extern\s+"C"\s*\{', code)
        if not m:
            return code
        depth = 1
        for i in range(m.end(), len(code)):
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            if depth == 0:
                break
        else:
            raise HeaderParseError('unterminated extern "C" block')
        code = code[:m.start()] + " " + code[m.end():i] + " " + code[i + 1:]


def parse(text: str) -> Header:
    """The declarations of a C header (see the module docs)."""
    code, defines = preprocess(text)
    h = Header(defines=defines)
    known = {k: v for k, v in defines.items() if isinstance(v, int)}
    code = _unwrap_extern_c(code)
    statements = _split_top(code, ";")
    if statements[-1].strip():
        raise HeaderParseError(f"declaration without ';': {statements[-1].strip()[:80]!r}")
    for raw in statements[:-1]:
        s = " ".join(raw.split())
        if not s:
            continue
        m = re.fullmatch(r"(typedef )?enum (\w*) ?\{(.*)\} ?(\w*)", s)
        if m:
            name = m.group(4) if m.group(1) else m.group(2)
            if not name or (not m.group(1) and m.group(4)):
                raise HeaderParseError(f"unsupported enum declaration {s[:80]!r}")
            h.enums[name] = _enum_body(m.group(3), known)
            known.update(h.enums[name])
            continue
        m = re.fullmatch(r"(typedef )?struct (\w*) ?\{(.*)\} ?(\w*)", s)
        if m:
            name = m.group(4) if m.group(1) else m.group(2)
            if not name or (not m.group(1) and m.group(4)):
                raise HeaderParseError(f"unsupported struct declaration {s[:80]!r}")
            h.structs[name] = _struct_body(m.group(3))
            continue
        m = re.fullmatch(r"(?:typedef )?struct (\w+)(?: (\w+))?", s)
        if m:
            if m.group(2) not in (None, m.group(1)):
                raise HeaderParseError(f"struct typedef under another name: {s!r}")
            h.opaque.add(m.group(1))
            continue
        m = re.fullmatch(r"typedef (.+?)\( ?\* ?(\w+) ?\) ?\((.*)\)", s)
        if m:
            h.callbacks[m.group(2)] = Function(m.group(2), parse_type(m.group(1)), parse_params(m.group(3)))
            continue
        if s.startswith("typedef "):
            p = parse_param(s[len("typedef "):], 0)
            if p.name.startswith("#"):
                raise HeaderParseError(f"typedef without a name: {s!r}")
            if p.type.base != p.name:  # `typedef enum x x;` and the like name the same type
                h.aliases[p.name] = p.type
            continue
        m = re.fullmatch(r"(.+?)\b(\w+) ?\((.*)\)", s)
        if m and "{" not in s and "=" not in s:
            h.functions[m.group(2)] = Function(m.group(2), parse_type(m.group(1)), parse_params(m.group(3)))
            continue
        raise HeaderParseError(f"unrecognised declaration: {s[:120]!r}")
    for name in h.structs:
        h.opaque.discard(name)  # a forward declaration of a struct defined later
    return h


# ---- C types to ctypes -----------------------------------------------------------------

_BUILTINS = {
    "int": ctypes.c_int, "signed int": ctypes.c_int, "unsigned int": ctypes.c_uint, "unsigned": ctypes.c_uint,
    "short": ctypes.c_short, "unsigned short": ctypes.c_ushort, "long": ctypes.c_long,
    "unsigned long": ctypes.c_ulong, "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong,
    "char": ctypes.c_char, "signed char": ctypes.c_byte, "unsigned char": ctypes.c_ubyte,
    "float": ctypes.c_float, "double": ctypes.c_double, "bool": ctypes.c_bool, "_Bool": ctypes.c_bool,
    "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "int16_t": ctypes.c_int16, "uint16_t": ctypes.c_uint16,
    "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t, "ssize_t": ctypes.c_ssize_t, "ptrdiff_t": ctypes.c_ssize_t,
    "intptr_t": ctypes.c_ssize_t, "uintptr_t": ctypes.c_size_t,
}


class MappingError(ValueError):
    pass


def _pointer(t, n: int):
    for _ in range(n):
        t = ctypes.POINTER(t)
    return t


def to_ctypes(t: CType, header: Header, lib, _seen: tuple = ()):
    """The ctype `_lib` must declare for the C type `t` (the rules above _lib.SIGNATURES)."""
    base, n = t.base, t.pointers
    if base in header.aliases:
        if base in _seen:
            raise MappingError(f"typedef cycle through {base}")
        a = header.aliases[base]
        return to_ctypes(CType(a.base, a.pointers + n), header, lib, _seen + (base,))
    if base in header.enums:
        return _pointer(ctypes.c_int, n)
    if base in header.opaque:
        if n == 0:
            raise MappingError(f"opaque struct {base} by value")
        return _pointer(ctypes.c_void_p, n - 1)
    if base in header.structs:
        cls = lib.STRUCTS.get(base)
        if cls is None:
            raise MappingError(f"struct {base} has no ctypes class in STRUCTS")
        return _pointer(cls, n)
    if base in header.callbacks:
        fn = lib.CALLBACKS.get(base)
        if fn is None:
            raise MappingError(f"callback {base} has no CFUNCTYPE in CALLBACKS")
        return _pointer(fn, n)
    if base == "void":
        return None if n == 0 else _pointer(ctypes.c_void_p, n - 1)
    if base == "char" and n >= 1:
        return _pointer(ctypes.c_char_p, n - 1)
    if base in _BUILTINS:
        return _pointer(_BUILTINS[base], n)
    raise MappingError(f"unknown C type {base}")


def ctype_name(t) -> str:
    if t is None:
        return "None"
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return f"POINTER({ctype_name(t._type_)})"
    return getattr(t, "__name__", repr(t))


def _compare_function(what: str, f: Function, restype, argtypes, header: Header, lib) -> list[str]:
    diffs = []
    try:
        want = to_ctypes(f.ret, header, lib)
        if want is not restype:
            diffs.append(f"{what}: returns {f.ret} (ctypes {ctype_name(want)}) in the header, {ctype_name(restype)} in Python")
    except MappingError as e:
        diffs.append(f"{what}: return type: {e}")
    argtypes = list(argtypes or [])
    if len(argtypes) != len(f.params):
        diffs.append(f"{what}: {len(f.params)} arguments in the header "
                     f"({', '.join(str(p.type) for p in f.params)}), {len(argtypes)} in Python")
        return diffs
    for i, (p, got) in enumerate(zip(f.params, argtypes), 1):
        try:
            want = to_ctypes(p.type, header, lib)
        except MappingError as e:
            diffs.append(f"{what} argument {i} ({p.name}): {e}")
            continue
        if want is not got:
            diffs.append(f"{what} argument {i} ({p.name}): {p.type} (ctypes {ctype_name(want)}) in the header, "
                         f"{ctype_name(got)} in Python")
    return diffs


def compare(header: Header, lib) -> list[str]:
    """Every difference between the header and `lib`'s tables (SIGNATURES, ENUMS, STRUCTS,
    OPAQUE, CALLBACKS, CONSTANTS), one line each."""
    diffs = []
    # functions
    for name, f in header.functions.items():
        if name not in lib.SIGNATURES:
            diffs.append(f"function {name}: in the header, missing in _lib.SIGNATURES")
            continue
        restype, argtypes = lib.SIGNATURES[name]
        diffs += _compare_function(f"function {name}", f, restype, argtypes, header, lib)
    diffs += [f"function {n}: in _lib.SIGNATURES, not in the header" for n in lib.SIGNATURES if n not in header.functions]
    # enums
    for name, values in header.enums.items():
        cls = lib.ENUMS.get(name)
        if cls is None:
            diffs.append(f"enum {name}: in the header, missing in _lib.ENUMS")
            continue
        py = {m.name: int(m.value) for m in cls}
        for c_name, v in values.items():
            member = c_name[len("TOROID_"):] if c_name.startswith("TOROID_") else c_name
            if member not in py:
                diffs.append(f"enum {name}: {c_name} = {v} in the header, missing in {cls.__name__}")
            elif py[member] != v:
                diffs.append(f"enum {name}: {c_name} is {v} in the header, {cls.__name__}.{member} is {py[member]}")
        c_members = {(c[len("TOROID_"):] if c.startswith("TOROID_") else c) for c in values}
        diffs += [f"enum {name}: {cls.__name__}.{m} = {v} in Python, not in the header" for m, v in py.items() if m not in c_members]
    diffs += [f"enum {n}: in _lib.ENUMS, not in the header" for n in lib.ENUMS if n not in header.enums]
    # structs
    for name, fields in header.structs.items():
        cls = lib.STRUCTS.get(name)
        if cls is None:
            diffs.append(f"struct {name}: in the header, missing in _lib.STRUCTS")
            continue
        py = list(cls._fields_)
        c_names, py_names = [f.name for f in fields], [f[0] for f in py]
        if c_names != py_names:
            diffs.append(f"struct {name}: fields {c_names} in the header, {py_names} in {cls.__name__}")
            continue
        for f, (fname, got) in zip(fields, py):
            try:
                want = to_ctypes(f.type, header, lib)
                if f.array:
                    want = want * f.array  # ctypes caches array types: `is` still compares
            except MappingError as e:
                diffs.append(f"struct {name} field {fname}: {e}")
                continue
            if want is not got:
                diffs.append(f"struct {name} field {fname}: {f.type} (ctypes {ctype_name(want)}) in the header, "
                             f"{ctype_name(got)} in {cls.__name__}")
    diffs += [f"struct {n}: in _lib.STRUCTS, not in the header" for n in lib.STRUCTS if n not in header.structs]
    # opaque handles
    diffs += [f"opaque struct {n}: in the header, missing in _lib.OPAQUE" for n in sorted(header.opaque) if n not in lib.OPAQUE]
    diffs += [f"opaque struct {n}: in _lib.OPAQUE, not in the header" for n in lib.OPAQUE if n not in header.opaque]
    # callbacks
    for name, f in header.callbacks.items():
        fn = lib.CALLBACKS.get(name)
        if fn is None:
            diffs.append(f"callback {name}: in the header, missing in _lib.CALLBACKS")
            continue
        diffs += _compare_function(f"callback {name}", f, fn._restype_, fn._argtypes_, header, lib)
    diffs += [f"callback {n}: in _lib.CALLBACKS, not in the header" for n in lib.CALLBACKS if n not in header.callbacks]
    # constants (integer #defines; the include guard and other empty ones are not constants)
    for name, v in header.defines.items():
        if name not in lib.CONSTANTS:
            diffs.append(f"constant {name} = {v!r}: in the header, missing in _lib.CONSTANTS")
        elif lib.CONSTANTS[name] != v:
            diffs.append(f"constant {name}: {v!r} in the header, {lib.CONSTANTS[name]!r} in Python")
    diffs += [f"constant {n}: in _lib.CONSTANTS, not in the header" for n in lib.CONSTANTS if n not in header.defines]
    return diffs
