//! The committed `include/toroid.h` must be exactly what `src/ffi` generates
//! (`docs/reference/c-abi.md`: the header is generated and committed, and CI
//! fails when it drifts). `build.rs` rewrites the working-tree file on every build, so the check
//! compares the freshly generated text with the file *as committed* (`git show
//! HEAD:include/toroid.h`) as well as with the working-tree file. The same holds for the
//! machine-readable description of the ABI that `build.rs` writes beside it for the Python
//! binding, `python/toroid/_abi.json`, which must also describe exactly what the header declares.

#[path = "../build_support/abi.rs"]
mod abi;
#[path = "../build_support/header.rs"]
mod header;

use std::path::Path;
use std::process::Command;

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn generated() -> String {
    header::generate(crate_dir()).unwrap_or_else(|e| panic!("{e}"))
}

fn generated_abi() -> String {
    abi::generate(crate_dir()).unwrap_or_else(|e| panic!("{e}"))
}

fn committed(path: &str) -> String {
    let out = Command::new("git")
        .args(["show", &format!("HEAD:{path}")])
        .current_dir(crate_dir())
        .output()
        .expect("git runs (the drift check compares with the committed file)");
    assert!(out.status.success(), "{path} is not committed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("the file is UTF-8")
}

#[test]
fn abi_description_is_what_the_source_generates() {
    const PATH: &str = "python/toroid/_abi.json";
    let g = generated_abi();
    let file = std::fs::read_to_string(crate_dir().join(PATH)).expect("python/toroid/_abi.json exists");
    for (what, text) in [("working tree", file), ("HEAD", committed(PATH))] {
        if let Err(e) = header::compare_file(PATH, &g, &text) {
            panic!("{what}: {e}");
        }
    }
}

#[test]
fn abi_description_names_every_function_of_the_header() {
    let (h, a) = (generated(), generated_abi());
    // Every `toroid_x(` of the header (declarations only: comments mention functions too) is a
    // function of the description, and the other way round.
    let code: String = h
        .lines()
        .filter(|l| !l.trim_start().starts_with('*') && !l.trim_start().starts_with("/*"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut declared: Vec<&str> = code
        .match_indices("toroid_")
        .filter_map(|(i, _)| {
            let rest = &code[i..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))?;
            rest[end..].starts_with('(').then(|| &rest[..end])
        })
        .collect();
    declared.sort();
    declared.dedup();
    let functions = &a[a.find("\"functions\"").expect("a functions table")..];
    let mut described: Vec<&str> = functions
        .lines()
        .filter_map(|l| l.trim().strip_prefix('"')?.split('"').next())
        .filter(|n| n.starts_with("toroid_"))
        .collect();
    described.sort();
    assert!(declared.len() > 60, "{declared:?}");
    assert_eq!(declared, described);
    for needle in [
        "\"toroid_kind_name\": {\"returns\": \"const char *\"",
        "\"toroid_comm_split\": {\"returns\": \"toroid_result\"",
        "{\"name\": \"out\", \"type\": \"toroid_comm **\"}",
        "{\"name\": \"hist\", \"type\": \"uint64_t\", \"len\": 32}",
        "\"TOROID_AVG\": 4",
        "\"TOROID_SPLIT_NOCOLOR\": {\"type\": \"int\", \"value\": -1}",
    ] {
        assert!(a.contains(needle), "the description lacks {needle}");
    }
}

#[test]
fn working_tree_header_is_what_the_source_generates() {
    let file =
        std::fs::read_to_string(crate_dir().join("include/toroid.h")).expect("include/toroid.h exists");
    if let Err(e) = header::compare(&generated(), &file) {
        panic!("{e}");
    }
}

#[test]
fn committed_header_is_what_the_source_generates() {
    let out = Command::new("git")
        .args(["show", "HEAD:include/toroid.h"])
        .current_dir(crate_dir())
        .output()
        .expect("git runs (the drift check compares with the committed header)");
    assert!(
        out.status.success(),
        "include/toroid.h is not committed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let committed = String::from_utf8(out.stdout).expect("the header is UTF-8");
    if let Err(e) = header::compare(&generated(), &committed) {
        panic!("{e}");
    }
}

#[test]
fn comparison_fails_on_any_difference() {
    let g = generated();
    assert!(header::compare(&g, &g).is_ok());
    // A changed signature, a missing line, an extra line, a trailing newline.
    let changed = g.replacen("size_t count", "int count", 1);
    assert_ne!(changed, g);
    let e = header::compare(&g, &changed).unwrap_err();
    assert!(e.contains("first at line") && e.contains("int count"), "{e}");
    let missing: String =
        g.lines().filter(|l| !l.contains("toroid_barrier(")).map(|l| format!("{l}\n")).collect();
    assert!(header::compare(&g, &missing).is_err());
    assert!(header::compare(&g, &format!("{g}/* extra */\n")).is_err());
    assert!(header::compare(&g, g.trim_end()).is_err());
}

#[test]
fn header_declares_the_design_contract() {
    let g = generated();
    for needle in [
        "typedef struct toroid_comm toroid_comm;",
        "typedef struct toroid_work toroid_work;",
        "TOROID_SUCCESS = 0",
        "TOROID_UNSUPPORTED = 8",
        "TOROID_INT8 = 0",
        "TOROID_FLOAT64 = 9",
        "TOROID_SUM = 0",
        "TOROID_AVG = 4",
        "#ifndef TOROID_H",
        "size_t struct_size;",
    ] {
        assert!(g.contains(needle), "header lacks {needle:?}");
    }
    for f in [
        "toroid_comm_init_env",
        "toroid_comm_init",
        "toroid_comm_init_with_store",
        "toroid_comm_split",
        "toroid_comm_rank",
        "toroid_comm_size",
        "toroid_comm_abort",
        "toroid_comm_destroy",
        "toroid_all_reduce",
        "toroid_reduce_scatter",
        "toroid_all_gather",
        "toroid_broadcast",
        "toroid_reduce",
        "toroid_all_to_all",
        "toroid_barrier",
        "toroid_send",
        "toroid_recv",
        "toroid_all_reduce_async",
        "toroid_reduce_scatter_async",
        "toroid_all_gather_async",
        "toroid_broadcast_async",
        "toroid_reduce_async",
        "toroid_all_to_all_async",
        "toroid_all_to_all_v",
        "toroid_all_to_all_v_async",
        "toroid_barrier_async",
        "toroid_send_async",
        "toroid_recv_async",
        "toroid_work_wait",
        "toroid_work_test",
        "toroid_work_free",
        "toroid_get_error_string",
        "toroid_get_last_error",
        "toroid_version",
        "toroid_kind_name",
        "toroid_algorithm_name",
    ] {
        assert!(g.contains(&format!(" {f}(")) || g.contains(&format!("*{f}(")), "header lacks {f}");
    }
}
