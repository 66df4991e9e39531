//! The layering of `src/` as a test: the map in `docs/ARCHITECTURE.md` says, in its module
//! table, which top-level modules each module may import; this test reads that table, builds
//! the real module graph from every `crate::` and `super::` path in `src/` (use lines and
//! inline paths alike; root re-exports such as `crate::Communicator` count as their module),
//! and fails on:
//!
//! 1. an edge the table does not allow, a module the table does not list, or a cycle between
//!    top-level modules;
//! 2. `libc` named outside `src/sys/` (the OS layer wraps every call);
//! 3. an environment read (`env::var`, `env::vars`, `var_os`, `getenv`) outside
//!    `src/config.rs` / `src/config/` (the one reader of the environment);
//! 4. `cudarc` named outside the CUDA layer `src/gpu/cuda.rs` (every raw CUDA call in one place).
//!
//! Comments and string literals are ignored. The checks are pure functions of file texts, so
//! the tests at the bottom plant a violation of each kind in a copy of the real tree and show
//! that each check fails on it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One source file: its path relative to the crate root and its text.
struct Source {
    path: String,
    text: String,
}

/// A finding: where, and what is wrong.
type Finding = String;

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read_tree(dir: &Path, out: &mut Vec<Source>) {
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).expect("src/ is readable").map(|e| e.expect("entry").path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            read_tree(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let rel = p.strip_prefix(crate_dir()).expect("under the crate").to_string_lossy().into_owned();
            out.push(Source { path: rel, text: std::fs::read_to_string(&p).expect("source is UTF-8") });
        }
    }
}

fn sources() -> Vec<Source> {
    let mut v = Vec::new();
    read_tree(&crate_dir().join("src"), &mut v);
    assert!(v.len() > 50, "found only {} files under src/", v.len());
    v
}

fn map_text() -> String {
    std::fs::read_to_string(crate_dir().join("docs/ARCHITECTURE.md")).expect("docs/ARCHITECTURE.md")
}

/// The text with comments and string/char literals blanked (lengths and line breaks kept, so
/// line numbers stay right).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut String, s: &[u8]| {
        for &c in s {
            out.push(if c == b'\n' { '\n' } else { ' ' });
        }
    };
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            let end = rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(b"/*") {
            let end = rest.windows(2).position(|w| w == b"*/").map_or(rest.len(), |p| p + 2);
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(b"r#\"") || rest.starts_with(b"r\"") || rest.starts_with(b"br\"") {
            // Raw string: r"..." or r#"..."# (one level of hashes is all this tree uses).
            let hashes =
                rest.iter().skip_while(|&&c| c == b'b' || c == b'r').take_while(|&&c| c == b'#').count();
            let start = rest.iter().position(|&c| c == b'"').unwrap_or(0) + 1;
            let close: Vec<u8> = std::iter::once(b'"').chain(std::iter::repeat_n(b'#', hashes)).collect();
            let end = rest[start..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(rest.len(), |p| start + p + close.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != b'"' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'\'' && rest.len() > 2 && (rest[1] == b'\\' || rest.get(2) == Some(&b'\'')) {
            // A char literal ('x', '\n', '\''), not a lifetime.
            let end = if rest[1] == b'\\' {
                rest[2..].iter().position(|&c| c == b'\'').map_or(rest.len(), |p| p + 3)
            } else {
                3
            };
            blank(&mut out, &rest[..end]);
            i += end;
        } else {
            let ch = text[i..].chars().next().expect("in bounds");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

/// The top-level module a file belongs to (`src/comm/enqueue/mod.rs` -> `comm`), and its module path
/// (`["comm", "enqueue"]`; `mod.rs` names its folder). `None` for the crate root and binaries.
fn module_of(path: &str) -> Option<(String, Vec<String>)> {
    let rel = path.strip_prefix("src/")?;
    if rel == "lib.rs" || rel.starts_with("bin/") {
        return None;
    }
    let mut parts: Vec<String> = rel.trim_end_matches(".rs").split('/').map(str::to_string).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    Some((parts[0].clone(), parts))
}

/// The names `src/lib.rs` re-exports at the crate root, with the module each comes from
/// (`Communicator` -> `comm`).
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let code = code_only(lib);
    let mut map = BTreeMap::new();
    for stmt in code.split(';') {
        let s = stmt.trim();
        let Some(rest) = s.strip_prefix("pub use ") else { continue };
        let rest = rest.trim_start_matches("crate::");
        let Some((module, items)) = rest.split_once("::") else { continue };
        for item in items.trim_matches(|c| c == '{' || c == '}' || char::is_whitespace(c)).split(',') {
            let name = item.split_whitespace().last().unwrap_or("").trim();
            if !name.is_empty() {
                map.insert(name.to_string(), module.trim().to_string());
            }
        }
    }
    map
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every top-level module a file's code names, with the line of each mention: `crate::x`,
/// `crate::{x, y::z}`, and `super::` chains that climb out of the file's top-level module.
fn mentions(src: &Source, roots: &BTreeMap<String, String>) -> Vec<(String, usize)> {
    let Some((_, module_path)) = module_of(&src.path) else { return Vec::new() };
    let code = code_only(&src.text);
    let resolve = |name: &str| -> String { roots.get(name).cloned().unwrap_or_else(|| name.to_string()) };
    let mut found = Vec::new();
    let line_of = |pos: usize| code[..pos].matches('\n').count() + 1;
    let bytes = code.as_bytes();
    let mut search = 0;
    while let Some(off) = code[search..].find("crate::") {
        let pos = search + off;
        search = pos + 7;
        if pos > 0 && (is_ident(bytes[pos - 1] as char) || bytes[pos - 1] == b'$') {
            continue;
        }
        let after = &code[pos + 7..];
        if let Some(group) = after.strip_prefix('{') {
            // crate::{a, b::c, d::{e, f}}: the first segment of each top-level item.
            let mut depth = 0;
            let mut item_start = true;
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && is_ident(c) => {
                        let name: String = group[k..].chars().take_while(|&c| is_ident(c)).collect();
                        if name != "self" {
                            found.push((resolve(&name), line_of(pos)));
                        }
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name: String = after.chars().take_while(|&c| is_ident(c)).collect();
            if !name.is_empty() {
                found.push((resolve(&name), line_of(pos)));
            }
        }
    }
    // super::super::x from src/a/b.rs (module path [a, b]) climbs to the root and names x.
    let mut search = 0;
    while let Some(off) = code[search..].find("super::") {
        let pos = search + off;
        search = pos + 7;
        if pos > 0 && is_ident(bytes[pos - 1] as char) {
            continue;
        }
        let mut k = 0;
        let mut rest = &code[pos..];
        while let Some(r) = rest.strip_prefix("super::") {
            k += 1;
            rest = r;
        }
        search = pos + 7 * k;
        // A file's own module is its path; `super` from a file is its parent.
        if k >= module_path.len() {
            let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            if !name.is_empty() {
                found.push((resolve(&name), line_of(pos)));
            }
        }
    }
    found
}

/// The module table of the map: module -> the modules it may import. Rows look like
/// ``| `comm` | what it owns | algorithm config | `src/comm/mod.rs` |``: the first cell names
/// the module, the third lists what it may import (names, `(none)` for none).
fn allowed_edges(map: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut table = BTreeMap::new();
    // The table whose header names a "may import" column, up to the first line that is not a row.
    let rows = map
        .lines()
        .skip_while(|l| !(l.starts_with('|') && l.contains("may import")))
        .take_while(|l| l.starts_with('|'));
    for line in rows {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // ["", module, owns, imports, entry, ""]
        if cells.len() < 6 || !cells[1].starts_with('`') || !cells[1].ends_with('`') {
            continue;
        }
        let name = cells[1].trim_matches('`').to_string();
        if !name.chars().all(is_ident) {
            continue;
        }
        // Names separated by spaces or commas, backticked or not; "(none)" for none.
        let imports: BTreeSet<String> = cells[3]
            .split(|c: char| !is_ident(c))
            .filter(|w| !w.is_empty() && *w != "none")
            .map(str::to_string)
            .collect();
        table.insert(name, imports);
    }
    table
}

/// The real graph: (from, to) -> the first place it happens.
fn module_graph(files: &[Source]) -> BTreeMap<(String, String), String> {
    let lib = files.iter().find(|s| s.path == "src/lib.rs").map(|s| s.text.as_str()).unwrap_or("");
    let roots = root_reexports(lib);
    let mut edges = BTreeMap::new();
    for f in files {
        let Some((top, _)) = module_of(&f.path) else { continue };
        for (to, line) in mentions(f, &roots) {
            if to != top {
                edges.entry((top.clone(), to)).or_insert_with(|| format!("{}:{line}", f.path));
            }
        }
    }
    edges
}

/// Check 1: every edge allowed, every module listed, no cycle.
fn check_edges(files: &[Source], map: &str) -> Vec<Finding> {
    let table = allowed_edges(map);
    let mut out = Vec::new();
    if table.len() < 10 {
        out.push(format!(
            "docs/ARCHITECTURE.md: found {} module rows in its table; expected every top-level module",
            table.len()
        ));
        return out;
    }
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(&f.path)).map(|(t, _)| t).collect();
    for m in &modules {
        if !table.contains_key(m) {
            out.push(format!("src/{m}: module missing from the table of docs/ARCHITECTURE.md"));
        }
    }
    for m in table.keys() {
        if !modules.contains(m) {
            out.push(format!("docs/ARCHITECTURE.md lists `{m}`, which is not a module of src/"));
        }
    }
    for (m, imports) in &table {
        for i in imports.iter().filter(|i| !modules.contains(*i)) {
            out.push(format!("docs/ARCHITECTURE.md: `{m}` may import `{i}`, which is not a module of src/"));
        }
    }
    let graph = module_graph(files);
    for ((from, to), at) in &graph {
        if !modules.contains(to) {
            continue; // an external item reached through the root (crate::x as a macro, etc.)
        }
        if !table.get(from).is_some_and(|allowed| allowed.contains(to)) {
            out.push(format!("{at}: `{from}` imports `{to}`, which docs/ARCHITECTURE.md does not allow"));
        }
    }
    // Cycles in the real graph (depth-first search, reporting each back edge's cycle once).
    let mut adj: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in graph.keys() {
        if modules.contains(to) {
            adj.entry(from.as_str()).or_default().push(to.as_str());
        }
    }
    fn visit<'a>(
        n: &'a str,
        adj: &BTreeMap<&'a str, Vec<&'a str>>,
        state: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
        cycles: &mut BTreeSet<Vec<String>>,
    ) {
        state.insert(n, 1);
        stack.push(n);
        for &m in adj.get(n).map(Vec::as_slice).unwrap_or(&[]) {
            match state.get(m).copied().unwrap_or(0) {
                0 => visit(m, adj, state, stack, cycles),
                1 => {
                    let from = stack.iter().position(|&s| s == m).unwrap_or(0);
                    let mut cyc: Vec<String> = stack[from..].iter().map(|s| s.to_string()).collect();
                    let min = cyc.iter().enumerate().min_by_key(|(_, s)| s.as_str()).map_or(0, |(i, _)| i);
                    cyc.rotate_left(min);
                    cycles.insert(cyc);
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n, 2);
    }
    let mut state = BTreeMap::new();
    let mut cycles = BTreeSet::new();
    for &n in adj.keys() {
        if !state.contains_key(n) {
            visit(n, &adj, &mut state, &mut Vec::new(), &mut cycles);
        }
    }
    for c in cycles {
        let at: Vec<String> = c
            .iter()
            .zip(c.iter().cycle().skip(1))
            .map(|(a, b)| graph.get(&(a.clone(), b.clone())).cloned().unwrap_or_default())
            .collect();
        out.push(format!("module cycle {} -> {} (at {})", c.join(" -> "), c[0], at.join(", ")));
    }
    out
}

/// The lines of a file's code (comments and strings blanked) that contain one of `needles`
/// as a path start (not preceded by an identifier character).
fn lines_naming(f: &Source, needles: &[&str]) -> Vec<usize> {
    let code = code_only(&f.text);
    let mut lines = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let hit = needles.iter().any(|needle| {
            // Every needle starts with an identifier character: a match counts when no other
            // identifier character runs into it (`mylibc::` is not `libc::`).
            line.match_indices(needle).any(|(p, _)| !line[..p].chars().next_back().is_some_and(is_ident))
        });
        if hit {
            lines.push(n + 1);
        }
    }
    lines
}

/// Check 2: `libc` only under `src/sys/`.
fn check_libc(files: &[Source]) -> Vec<Finding> {
    files
        .iter()
        .filter(|f| !f.path.starts_with("src/sys/"))
        .flat_map(|f| {
            lines_naming(f, &["libc::", "use libc", "extern crate libc"])
                .into_iter()
                .map(move |l| format!("{}:{l}: libc outside src/sys/ (add a safe wrapper to sys)", f.path))
        })
        .collect()
}

/// Check 3: environment reads only in config.
fn check_env(files: &[Source]) -> Vec<Finding> {
    files
        .iter()
        .filter(|f| f.path != "src/config.rs" && !f.path.starts_with("src/config/"))
        .flat_map(|f| {
            lines_naming(f, &["env::var", "env::vars", "var_os(", "getenv"]).into_iter().map(move |l| {
                format!("{}:{l}: environment read outside src/config (read it in config)", f.path)
            })
        })
        .collect()
}

/// Check 4: `cudarc` only in the CUDA layer.
fn check_cuda(files: &[Source]) -> Vec<Finding> {
    files
        .iter()
        .filter(|f| f.path != "src/gpu/cuda.rs" && !f.path.starts_with("src/gpu/cuda/"))
        .flat_map(|f| {
            lines_naming(f, &["cudarc::", "use cudarc"])
                .into_iter()
                .map(move |l| format!("{}:{l}: cudarc outside the CUDA layer src/gpu/cuda.rs", f.path))
        })
        .collect()
}

fn report(what: &str, findings: Vec<Finding>) {
    assert!(findings.is_empty(), "{what}:\n  {}", findings.join("\n  "));
}

#[test]
fn every_module_edge_is_one_the_map_allows_and_none_forms_a_cycle() {
    let files = sources();
    let graph = module_graph(&files);
    println!("{} files, {} edges between top-level modules", files.len(), graph.len());
    report("module edges against docs/ARCHITECTURE.md", check_edges(&files, &map_text()));
}

#[test]
fn only_sys_names_libc() {
    report("libc outside src/sys/", check_libc(&sources()));
}

#[test]
fn only_config_reads_the_environment() {
    report("environment reads outside src/config", check_env(&sources()));
}

#[test]
fn only_the_cuda_layer_names_cudarc() {
    report("cudarc outside src/gpu/cuda.rs", check_cuda(&sources()));
}

// -- Each check fails on a planted violation (in a copy of the real tree) ------------------

/// The real tree with one line appended to `path`.
fn planted(path: &str, line: &str) -> Vec<Source> {
    let mut files = sources();
    let f = files.iter_mut().find(|f| f.path == path).unwrap_or_else(|| panic!("{path} exists"));
    f.text.push('\n');
    f.text.push_str(line);
    f.text.push('\n');
    files
}

#[test]
fn a_planted_forbidden_edge_fails_the_edge_check() {
    // The transport layer never imports an algorithm (inline path, not a use line).
    let files = planted("src/transport/mod.rs", "fn _planted() { let _ = crate::algorithm::dispatch::run; }");
    let found = check_edges(&files, &map_text());
    println!("{found:#?}");
    assert!(found.iter().any(|f| f.contains("`transport` imports `algorithm`")), "{found:?}");
}

#[test]
fn a_planted_back_edge_fails_as_a_cycle() {
    // A `use` through a root re-export: crate::Communicator is comm.
    let files = planted("src/gpu/mod.rs", "use crate::Communicator as _Planted;");
    let found = check_edges(&files, &map_text());
    println!("{found:#?}");
    assert!(found.iter().any(|f| f.contains("`gpu` imports `comm`")), "{found:?}");
    assert!(
        found.iter().any(|f| f.starts_with("module cycle") && f.contains("comm") && f.contains("gpu")),
        "{found:?}"
    );
}

#[test]
fn a_planted_super_path_out_of_the_module_counts() {
    let files = planted(
        "src/transport/tcp/mod.rs",
        "fn _planted() { let _ = super::super::tuning::CostModel::default; }",
    );
    let found = check_edges(&files, &map_text());
    assert!(found.iter().any(|f| f.contains("`transport` imports `tuning`")), "{found:?}");
}

#[test]
fn a_planted_libc_call_fails_the_libc_check() {
    let files = planted("src/comm/mod.rs", "fn _planted() -> i32 { unsafe { libc::getpid() } }");
    let found = check_libc(&files);
    println!("{found:#?}");
    assert!(found.iter().any(|f| f.starts_with("src/comm/mod.rs:")), "{found:?}");
}

#[test]
fn a_planted_environment_read_fails_the_env_check() {
    let files =
        planted("src/transport/mod.rs", "fn _planted() -> bool { std::env::var_os(\"X\").is_some() }");
    let found = check_env(&files);
    println!("{found:#?}");
    assert!(found.iter().any(|f| f.starts_with("src/transport/mod.rs:")), "{found:?}");
}

#[test]
fn a_planted_cudarc_call_fails_the_cuda_check() {
    let files = planted("src/gpu/mod.rs", "fn _planted() { let _ = cudarc::driver::result::init; }");
    let found = check_cuda(&files);
    assert!(found.iter().any(|f| f.starts_with("src/gpu/mod.rs:")), "{found:?}");
}

#[test]
fn comments_and_strings_are_not_code() {
    let s = Source {
        path: "src/comm/x.rs".into(),
        text: "// libc::getpid\n/* crate::algorithm */ let s = \"crate::tuning env::var\";\nlet c = '\"'; let t = crate::dtype::X;\n"
            .into(),
    };
    let m = mentions(&s, &BTreeMap::new());
    assert_eq!(m, vec![("dtype".to_string(), 3)]);
    assert!(lines_naming(&s, &["libc::", "env::var"]).is_empty());
}
