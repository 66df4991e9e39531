//! `--wire bf16 --error-feedback` end to end, with real processes started by `toroid-run`: the
//! same 5 steps on 2 ranks with f32 gradients, bf16 gradients, and bf16 with error feedback.
//! bf16 halves the bytes all-reduced; every run's ranks end on the same parameter hash (the
//! compressed all-reduce gives every rank the same bits; the trainer checks the hash every step
//! too); rounding changes the model a little, and error feedback changes it again; `--wire` with
//! `--bmuf` and `--error-feedback` without a narrow wire are refused.

mod util;

use std::process::Command;

use util::{common, max_diff, out_dir, params, run};

/// The ranks' final parameter hashes, from the log.
fn hashes(log: &str) -> Vec<String> {
    log.lines().filter_map(|l| l.split("parameter hash ").nth(1)).map(str::to_string).collect()
}

/// Bytes all-reduced, from the last row of steps.csv.
fn bytes(dir: &std::path::Path) -> f64 {
    let text = std::fs::read_to_string(dir.join("steps.csv")).unwrap();
    let mut lines = text.lines();
    let col = lines.next().unwrap().split(',').position(|h| h == "bytes").unwrap();
    lines.last().unwrap().split(',').nth(col).unwrap().parse().unwrap()
}

#[test]
fn bf16_gradients_halve_the_bytes_and_keep_the_ranks_identical() {
    let base = ["--batch", "8", "--max-steps", "5", "--lr", "0.02"];
    let runs = [
        ("f32", &[][..]),
        ("bf16", &["--wire", "bf16"][..]),
        ("bf16-ef", &["--wire", "bf16", "--error-feedback"][..]),
    ];
    let mut dirs = vec![];
    for (name, extra) in runs {
        let dir = out_dir(&format!("wire-{name}"));
        let o = run(2, &common(&dir, &[&base[..], extra].concat()));
        let log = String::from_utf8_lossy(&o.stderr).into_owned();
        let h = hashes(&log);
        assert_eq!(h.len(), 2, "{name}: {log}");
        assert_eq!(h[0], h[1], "{name}: the ranks' parameters differ");
        if name != "f32" {
            assert!(log.contains("on the wire as bfloat16"), "{name}: {log}");
        }
        dirs.push(dir);
    }
    let (f32_bytes, bf16_bytes, ef_bytes) = (bytes(&dirs[0]), bytes(&dirs[1]), bytes(&dirs[2]));
    assert!(f32_bytes > 0.0);
    assert_eq!(bf16_bytes * 2.0, f32_bytes);
    assert_eq!(ef_bytes, bf16_bytes);
    let (p32, p16, pef) = (params(&dirs[0]), params(&dirs[1]), params(&dirs[2]));
    let (d16, def, d16ef) = (max_diff(&p32, &p16), max_diff(&p32, &pef), max_diff(&p16, &pef));
    eprintln!(
        "max |difference| after 5 steps: f32 vs bf16 {d16:.3e}, f32 vs bf16+EF {def:.3e}, bf16 vs bf16+EF {d16ef:.3e}"
    );
    assert!(d16 > 0.0 && d16ef > 0.0, "bf16 rounding or error feedback changed nothing");
    assert!(d16 < 2e-3 && def < 2e-3, "bf16 gradients moved the model too far from f32's");
}

#[test]
fn wire_flags_that_cannot_work_are_refused() {
    let dir = out_dir("wire-refused");
    for extra in
        [&["--error-feedback"][..], &["--wire", "bf16", "--bmuf", "tau=2,eta=auto,zeta=1,nesterov=false"][..]]
    {
        let o = Command::new(env!("CARGO_BIN_EXE_toroid-train")).args(common(&dir, extra)).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("--wire"), "{extra:?} was accepted: {err}");
    }
}
