//! Generates `include/toroid.h` from `src/ffi` with cbindgen (rewriting the file only when its
//! text changed, so a clean checkout stays clean), the machine-readable description of the same
//! ABI that the Python binding reads (`python/toroid/_abi.json`, from the same source with `syn`;
//! see `build_support/abi.rs`), and `toroid.pc` for pkg-config next to the
//! built library (`target/<profile>/toroid.pc`).

#[path = "build_support/abi.rs"]
mod abi;
#[path = "build_support/header.rs"]
#[allow(dead_code)] // `compare` is for tests/header.rs
mod header;

use std::path::{Path, PathBuf};

fn main() {
    let crate_dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    // src/collective.rs: the kinds and algorithms of python/toroid/_abi.json's `values`.
    for p in ["src/ffi", "src/collective.rs", "cbindgen.toml", "build_support", "toroid.pc.in"] {
        println!("cargo:rerun-if-changed={p}");
    }
    let text = match header::generate(&crate_dir) {
        Ok(t) => t,
        Err(e) => panic!("generating include/toroid.h: {e}"),
    };
    write_if_changed(&crate_dir.join("include/toroid.h"), &text);
    let abi = match abi::generate(&crate_dir) {
        Ok(t) => t,
        Err(e) => panic!("generating python/toroid/_abi.json: {e}"),
    };
    write_if_changed(&crate_dir.join("python/toroid/_abi.json"), &abi);
    write_pkg_config(&crate_dir);
}

/// Writes `text` to `path` unless it already holds exactly that (a clean checkout stays clean,
/// and an unchanged file keeps its timestamp).
fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        }
        std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    }
}

/// `target/<profile>/toroid.pc` from `toroid.pc.in`, pointing at this checkout's header and at
/// the library built beside it. OUT_DIR is `target/<profile>/build/toroid-<hash>/out`.
fn write_pkg_config(crate_dir: &Path) {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let Some(profile_dir) = out_dir.ancestors().nth(3) else { return };
    let template = std::fs::read_to_string(crate_dir.join("toroid.pc.in")).expect("reading toroid.pc.in");
    let text = template
        .replace("@PREFIX@", &crate_dir.display().to_string())
        .replace("@LIBDIR@", &profile_dir.display().to_string())
        .replace("@INCLUDEDIR@", &crate_dir.join("include").display().to_string())
        .replace("@VERSION@", &std::env::var("CARGO_PKG_VERSION").unwrap_or_default());
    let pc = profile_dir.join("toroid.pc");
    if std::fs::read_to_string(&pc).ok().as_deref() != Some(text.as_str()) {
        // Best effort: a read-only target directory must not fail the build.
        let _ = std::fs::write(pc, text);
    }
}
