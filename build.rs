//! Generates `include/toroid.h` from `src/ffi` with cbindgen (rewriting the file only when its
//! text changed, so a clean checkout stays clean) and `toroid.pc` for pkg-config next to the
//! built library (`target/<profile>/toroid.pc`).

#[path = "build_support/header.rs"]
#[allow(dead_code)] // `compare` is for tests/header.rs
mod header;

use std::path::{Path, PathBuf};

fn main() {
    let crate_dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    for p in ["src/ffi", "cbindgen.toml", "build_support", "toroid.pc.in"] {
        println!("cargo:rerun-if-changed={p}");
    }
    let text = match header::generate(&crate_dir) {
        Ok(t) => t,
        Err(e) => panic!("generating include/toroid.h: {e}"),
    };
    let path = crate_dir.join("include/toroid.h");
    if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
        std::fs::create_dir_all(crate_dir.join("include")).expect("creating include/");
        std::fs::write(&path, &text).expect("writing include/toroid.h");
    }
    write_pkg_config(&crate_dir);
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
