//! Generating `include/toroid.h` with cbindgen, shared by `build.rs` (which writes the file) and
//! `tests/header.rs` (which checks that the committed file is what the source generates).

use std::path::Path;

/// The header text that `src/ffi` generates under `cbindgen.toml`.
pub fn generate(crate_dir: &Path) -> Result<String, String> {
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .map_err(|e| format!("reading cbindgen.toml: {e}"))?;
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        // Only the C ABI module (and the modules it declares): the rest of the crate has public
        // constants that are no part of the C API.
        .with_src(crate_dir.join("src/ffi/mod.rs"))
        .generate()
        .map_err(|e| format!("cbindgen: {e}"))?;
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).map_err(|e| format!("cbindgen wrote invalid UTF-8: {e}"))
}

/// `Ok` when `committed` is exactly `generated`; otherwise the first line that differs.
pub fn compare(generated: &str, committed: &str) -> Result<(), String> {
    compare_file("include/toroid.h", generated, committed)
}

/// [`compare`] for the generated file `file` (named in the message).
pub fn compare_file(file: &str, generated: &str, committed: &str) -> Result<(), String> {
    if generated == committed {
        return Ok(());
    }
    let (g, c): (Vec<&str>, Vec<&str>) = (generated.lines().collect(), committed.lines().collect());
    let i = g.iter().zip(&c).position(|(a, b)| a != b).unwrap_or(g.len().min(c.len()));
    Err(format!(
        "{file} differs from what src/ffi generates, first at line {}:\n  generated: {:?}\n  committed: {:?}\n\
         ({} vs {} lines; run `cargo build` to regenerate it, then commit it)",
        i + 1,
        g.get(i).copied().unwrap_or("<end of file>"),
        c.get(i).copied().unwrap_or("<end of file>"),
        g.len(),
        c.len()
    ))
}
