//! Generating `python/toroid/_abi.json`, the machine-readable description of the C ABI, from the
//! same source as `include/toroid.h` (the Rust items of `src/ffi`, parsed with `syn`; not the
//! generated header). Shared by `build.rs` (which writes the file) and `tests/header.rs` (which
//! checks that the committed file is what the source generates).
//!
//! What it describes, in the C spelling the header uses (`int`, `size_t`, `const char *`,
//! `toroid_comm **`, an enum by its typedef name): every exported function (`#[no_mangle]
//! extern "C"`: name, parameters, return type), every `#[repr(C)]` enum with its values, every
//! `#[repr(C)]` struct's fields in order, the opaque handle structs, the callback typedefs and
//! the `TOROID_*` constants; and, under `values`, the Rust enums whose numbers the ABI hands out
//! as plain ints (a `toroid_stat` row's `kind` and `algorithm`: `collective::CollKind` and
//! `collective::Algorithm`; their names come from `toroid_kind_name`/`toroid_algorithm_name`).
//! Functions are sorted by name, so moving one between files changes
//! nothing here. The Python binding (`python/toroid/_lib.py`) builds its ctypes declarations
//! from it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use syn::{Expr, Fields, FnArg, Item, Lit, Pat, ReturnType, Type, UnOp};

/// The Rust enums whose values the C ABI hands out as plain ints: (file, enum, key under
/// `values`).
const VALUE_ENUMS: [(&str, &str, &str); 2] =
    [("src/collective.rs", "CollKind", "kind"), ("src/collective.rs", "Algorithm", "algorithm")];

/// The description's text (JSON) for the crate at `crate_dir`.
pub fn generate(crate_dir: &Path) -> Result<String, String> {
    let mut files = Vec::new();
    rust_files(&crate_dir.join("src/ffi"), &mut files)?;
    files.sort();
    let mut abi = Abi::default();
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("reading {}: {e}", f.display()))?;
        let parsed = syn::parse_file(&text).map_err(|e| format!("parsing {}: {e}", f.display()))?;
        abi.items(&parsed.items).map_err(|e| format!("{}: {e}", f.display()))?;
    }
    for (file, name, key) in VALUE_ENUMS {
        let path = crate_dir.join(file);
        let text = std::fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        let parsed = syn::parse_file(&text).map_err(|e| format!("parsing {}: {e}", path.display()))?;
        let found = parsed.items.iter().find_map(|i| match i {
            Item::Enum(e) if e.ident == name => Some(e),
            _ => None,
        });
        let e = found.ok_or_else(|| format!("{file} has no enum {name}"))?;
        abi.values.insert(key.to_string(), variants(e)?);
    }
    Ok(abi.to_json())
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("listing {}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| format!("listing {}: {e}", dir.display()))?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// One parameter or field: its name and C type (`len` for a fixed-size array field).
struct Slot {
    name: String,
    ty: String,
    len: Option<u64>,
}

/// A function or callback: its C return type and parameters.
struct Signature {
    returns: String,
    params: Vec<Slot>,
}

#[derive(Default)]
struct Abi {
    functions: BTreeMap<String, Signature>,
    enums: BTreeMap<String, Vec<(String, i64)>>,
    structs: BTreeMap<String, Vec<Slot>>,
    opaque: Vec<String>,
    callbacks: BTreeMap<String, Signature>,
    constants: BTreeMap<String, (String, i64)>,
    values: BTreeMap<String, Vec<(String, i64)>>,
}

/// An enum's variants with their explicit values, in order.
fn variants(e: &syn::ItemEnum) -> Result<Vec<(String, i64)>, String> {
    let mut values = Vec::new();
    for v in &e.variants {
        let Some((_, expr)) = &v.discriminant else {
            return Err(format!("{}::{} has no explicit value", e.ident, v.ident));
        };
        values.push((v.ident.to_string(), int_of(expr)?));
    }
    Ok(values)
}

fn has_attr(attrs: &[syn::Attribute], name: &str, arg: Option<&str>) -> bool {
    attrs.iter().any(|a| {
        let text = quote_attr(a);
        text.starts_with(name) && arg.is_none_or(|x| text.contains(x))
    })
}

/// An attribute's path and arguments as text without spaces (`repr(C)`, `unsafe(no_mangle)`,
/// `cfg(test)`).
fn quote_attr(a: &syn::Attribute) -> String {
    let path = a.path().segments.iter().map(|s| s.ident.to_string()).collect::<Vec<_>>().join("::");
    match &a.meta {
        syn::Meta::List(l) => format!("{path}({})", l.tokens).replace(' ', ""),
        _ => path,
    }
}

fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    has_attr(attrs, "cfg", Some("test"))
}

impl Abi {
    fn items(&mut self, items: &[Item]) -> Result<(), String> {
        for item in items {
            match item {
                Item::Mod(m) if !is_test_only(&m.attrs) => {
                    if let Some((_, inner)) = &m.content {
                        self.items(inner)?;
                    }
                }
                Item::Fn(f) if f.sig.abi.is_some() && is_exported(&f.attrs) => {
                    let name = f.sig.ident.to_string();
                    let mut params = Vec::new();
                    for arg in &f.sig.inputs {
                        let FnArg::Typed(t) = arg else { return Err(format!("{name}: a `self` parameter")) };
                        let Pat::Ident(p) = &*t.pat else {
                            return Err(format!("{name}: a pattern parameter"));
                        };
                        params.push(Slot { name: p.ident.to_string(), ty: c_type(&t.ty)?, len: None });
                    }
                    let sig = Signature { returns: c_return(&f.sig.output)?, params };
                    if self.functions.insert(name.clone(), sig).is_some() {
                        return Err(format!("{name} is exported twice"));
                    }
                }
                Item::Enum(e) if has_attr(&e.attrs, "repr", Some("C")) && is_pub(&e.vis) => {
                    self.enums.insert(e.ident.to_string(), variants(e)?);
                }
                Item::Struct(s) if is_pub(&s.vis) && s.ident.to_string().starts_with("toroid_") => {
                    let name = s.ident.to_string();
                    if !has_attr(&s.attrs, "repr", Some("C")) {
                        // cbindgen declares a struct without a C layout as an opaque type.
                        self.opaque.push(name);
                        continue;
                    }
                    let Fields::Named(fields) = &s.fields else {
                        return Err(format!("{name}: not named fields"));
                    };
                    let mut slots = Vec::new();
                    for f in &fields.named {
                        let field = f.ident.as_ref().map(|i| i.to_string()).unwrap_or_default();
                        let (ty, len) = match &f.ty {
                            Type::Array(a) => (c_type(&a.elem)?, Some(int_of(&a.len)? as u64)),
                            t => (c_type(t)?, None),
                        };
                        slots.push(Slot { name: field, ty, len });
                    }
                    self.structs.insert(name, slots);
                }
                Item::Type(t) if is_pub(&t.vis) && t.ident.to_string().starts_with("toroid_") => {
                    self.callbacks.insert(t.ident.to_string(), callback(&t.ty)?);
                }
                Item::Const(c) if is_pub(&c.vis) && c.ident.to_string().starts_with("TOROID_") => {
                    self.constants.insert(c.ident.to_string(), (c_type(&c.ty)?, int_of(&c.expr)?));
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn to_json(&self) -> String {
        let mut o = String::from("{\n");
        o.push_str("  \"generated\": \"by build.rs (build_support/abi.rs) from src/ffi; do not edit\",\n");
        o.push_str("  \"constants\": {");
        let consts: Vec<String> = self
            .constants
            .iter()
            .map(|(k, (ty, v))| format!("\n    {}: {{\"type\": {}, \"value\": {v}}}", q(k), q(ty)))
            .collect();
        o.push_str(&consts.join(","));
        o.push_str("\n  },\n  \"enums\": {");
        o.push_str(&enum_table(&self.enums));
        o.push_str("\n  },\n  \"values\": {");
        o.push_str(&enum_table(&self.values));
        let mut opaque = self.opaque.clone();
        opaque.sort();
        let opaque: Vec<String> = opaque.iter().map(|s| q(s)).collect();
        let _ = write!(o, "\n  }},\n  \"opaque\": [{}],\n  \"structs\": {{", opaque.join(", "));
        let structs: Vec<String> = self
            .structs
            .iter()
            .map(|(k, fs)| format!("\n    {}: [{}\n    ]", q(k), slots(fs, "      ")))
            .collect();
        o.push_str(&structs.join(","));
        o.push_str("\n  },\n  \"callbacks\": {");
        o.push_str(&signatures(&self.callbacks));
        o.push_str("\n  },\n  \"functions\": {");
        o.push_str(&signatures(&self.functions));
        o.push_str("\n  }\n}\n");
        o
    }
}

/// Enums as JSON members `"name": {"VARIANT": value, ...}`, one a line.
fn enum_table(m: &BTreeMap<String, Vec<(String, i64)>>) -> String {
    let all: Vec<String> = m
        .iter()
        .map(|(k, vs)| {
            let vals: Vec<String> = vs.iter().map(|(n, v)| format!("{}: {v}", q(n))).collect();
            format!("\n    {}: {{{}}}", q(k), vals.join(", "))
        })
        .collect();
    all.join(",")
}

fn signatures(m: &BTreeMap<String, Signature>) -> String {
    let all: Vec<String> = m
        .iter()
        .map(|(k, s)| {
            format!(
                "\n    {}: {{\"returns\": {}, \"params\": [{}{}]}}",
                q(k),
                q(&s.returns),
                slots(&s.params, "      "),
                if s.params.is_empty() { "" } else { "\n    " }
            )
        })
        .collect();
    all.join(",")
}

fn slots(s: &[Slot], indent: &str) -> String {
    let all: Vec<String> = s
        .iter()
        .map(|p| match p.len {
            Some(n) => {
                format!("\n{indent}{{\"name\": {}, \"type\": {}, \"len\": {n}}}", q(&p.name), q(&p.ty))
            }
            None => format!("\n{indent}{{\"name\": {}, \"type\": {}}}", q(&p.name), q(&p.ty)),
        })
        .collect();
    all.join(",")
}

/// A JSON string (the names and C types here are plain ASCII; quotes and backslashes escaped
/// all the same).
fn q(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

fn is_pub(v: &syn::Visibility) -> bool {
    matches!(v, syn::Visibility::Public(_))
}

fn is_exported(attrs: &[syn::Attribute]) -> bool {
    has_attr(attrs, "unsafe", Some("no_mangle")) || has_attr(attrs, "no_mangle", None)
}

fn int_of(e: &Expr) -> Result<i64, String> {
    match e {
        Expr::Lit(l) => match &l.lit {
            Lit::Int(i) => i.base10_parse::<i64>().map_err(|e| e.to_string()),
            _ => Err("a non-integer literal".into()),
        },
        Expr::Unary(u) if matches!(u.op, UnOp::Neg(_)) => Ok(-int_of(&u.expr)?),
        Expr::Paren(p) => int_of(&p.expr),
        Expr::Group(g) => int_of(&g.expr),
        _ => Err("a value that is not an integer literal".into()),
    }
}

fn c_return(r: &ReturnType) -> Result<String, String> {
    match r {
        ReturnType::Default => Ok("void".into()),
        ReturnType::Type(_, t) => c_type(t),
    }
}

/// `Option<unsafe extern "C" fn(..) -> R>` (a callback typedef) as a signature.
fn callback(t: &Type) -> Result<Signature, String> {
    let Type::Path(p) = t else { return Err("a callback type that is not Option<fn>".into()) };
    let last = p.path.segments.last().ok_or("an empty path")?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return Err("a callback type that is not Option<fn>".into());
    };
    let Some(syn::GenericArgument::Type(Type::BareFn(f))) = args.args.first() else {
        return Err("a callback type that is not Option<fn>".into());
    };
    let mut params = Vec::new();
    for (i, a) in f.inputs.iter().enumerate() {
        let name = a.name.as_ref().map_or(format!("arg{i}"), |(n, _)| n.to_string());
        params.push(Slot { name, ty: c_type(&a.ty)?, len: None });
    }
    Ok(Signature { returns: c_return(&f.output)?, params })
}

/// The C spelling of a Rust type of the ABI, as the header spells it (`const T *`, `T **`).
fn c_type(t: &Type) -> Result<String, String> {
    match t {
        Type::Ptr(p) => {
            let inner = c_type(&p.elem)?;
            Ok(if inner.ends_with('*') {
                format!("{inner}*")
            } else if p.const_token.is_some() {
                format!("const {inner} *")
            } else {
                format!("{inner} *")
            })
        }
        Type::Path(p) => {
            let ident = p.path.segments.last().ok_or("an empty path")?.ident.to_string();
            let c = match ident.as_str() {
                "c_int" | "i32" => "int",
                "c_uint" | "u32" => "unsigned int",
                "c_char" => "char",
                "c_void" => "void",
                "i8" => "int8_t",
                "u8" => "uint8_t",
                "i16" => "int16_t",
                "u16" => "uint16_t",
                "i64" => "int64_t",
                "u64" => "uint64_t",
                "usize" => "size_t",
                "isize" => "ptrdiff_t",
                "bool" => "bool",
                "f32" => "float",
                "f64" => "double",
                // The integers C passes as enums (cbindgen.toml renames them the same way).
                "RawDatatype" => "toroid_datatype",
                "RawRedop" => "toroid_redop",
                "RawResult" => "toroid_result",
                other if other.starts_with("toroid_") => other,
                other => return Err(format!("no C spelling for the Rust type `{other}`")),
            };
            Ok(c.to_string())
        }
        Type::Paren(p) => c_type(&p.elem),
        Type::Group(g) => c_type(&g.elem),
        _ => Err("a Rust type with no C spelling here".into()),
    }
}
