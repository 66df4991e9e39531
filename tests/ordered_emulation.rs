//! The stream-ordered kernels on the CPU (no GPU, no NVRTC needed): the CUDA C of
//! `src/gpu/ordered_kernels.rs` and `src/gpu/signal.rs`, exactly as the library hands it to
//! NVRTC, compiled by the host's C++ compiler with CUDA's built-ins emulated
//! (`tests/ordered_emulation/shim.h`) and run as 2, 3 and 5 ranks, each a process, by
//! `tests/ordered_emulation/driver.cpp`: every collective's every element against a reference,
//! graph-style replays, a mismatched call and a missing rank. What this cannot show (the GPU's
//! memory model, launches, IPC) is for `scripts/gpu-check.sh`.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;

use toroid::internals::gpu::ordered_kernels;

/// A temporary directory, removed when dropped (also when a check fails).
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds the driver into `dir`: its path.
fn build(dir: &TempDir) -> PathBuf {
    let dir = &dir.0;
    std::fs::create_dir_all(dir).expect("a temporary directory");
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/ordered_emulation");
    let src = format!(
        "#include \"{}\"\n{}\n#include \"{}\"\n",
        here.join("shim.h").display(),
        ordered_kernels::source(),
        here.join("driver.cpp").display()
    );
    let file = dir.join("emulation.cpp");
    std::fs::write(&file, src).expect("writing the source");
    let exe = dir.join("driver");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-w", "-o"])
        .arg(&exe)
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("{cxx} (a C++20 compiler: build-essential) cannot run: {e}"));
    assert!(
        out.status.success(),
        "compiling the emulated kernels:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

#[test]
fn the_ordered_kernels_give_every_element_on_emulated_ranks() {
    let dir = TempDir(std::env::temp_dir().join(format!("toroid-ordered-emulation-{}", std::process::id())));
    let exe = build(&dir);
    for n in [2, 3, 5] {
        let out = Command::new(&exe).arg(n.to_string()).output().expect("running the driver");
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{n} ranks:\n{text}");
        assert!(
            text.contains(&format!("ordered kernels on {n} emulated ranks: all checks passed")),
            "{text}"
        );
    }
}
