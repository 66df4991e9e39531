//! Helpers shared by the integration tests: the data, the launcher, running the trainer, and
//! reading parameters back from its checkpoints.

#![allow(dead_code)] // each test file uses its own subset

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Where dpkg says Fashion-MNIST's training images are.
pub fn fashion_mnist() -> PathBuf {
    let out = Command::new("dpkg").args(["-L", "dataset-fashion-mnist"]).output();
    let listing =
        out.ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let Some(listing) = listing else {
        panic!(
            "these tests need Fashion-MNIST: apt-get install dataset-fashion-mnist (CI installs it in .ci/run)"
        )
    };
    let file = listing
        .lines()
        .find(|l| l.ends_with("train-images-idx3-ubyte.gz"))
        .expect("dpkg -L lists no train-images-idx3-ubyte.gz");
    Path::new(file).parent().unwrap().to_path_buf()
}

/// The `toroid-run` launcher of the root package, built by this same cargo invocation when the
/// whole workspace is tested; built here otherwise.
pub fn toroid_run() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf(); // target/<profile>
    let bin = profile_dir.join("toroid-run");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "toroid", "--bin", "toroid-run"]).current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let st = cmd.status().expect("cannot run cargo to build toroid-run");
        assert!(st.success(), "building toroid-run failed");
    }
    assert!(bin.exists(), "no toroid-run at {}", bin.display());
    bin
}

pub fn out_dir(name: &str) -> OutDir {
    let d = std::env::temp_dir().join(format!("toroid-train-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    OutDir(d)
}

/// A test's output directory, removed when dropped (also when the test panics).
#[derive(Debug)]
pub struct OutDir(PathBuf);

impl std::ops::Deref for OutDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for OutDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for OutDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Common flags: tiny model, no augmentation (so the same example is the same tensor on any
/// rank), constant LR, momentum and weight decay on, identity check every step. A flag given in
/// `extra` replaces the default one.
pub fn common(out: &Path, extra: &[&str]) -> Vec<String> {
    let data = fashion_mnist().display().to_string();
    let out = out.display().to_string();
    let defaults: [(&str, Option<&str>); 22] = [
        ("--model", Some("resnet18")),
        ("--width", Some("0.125")),
        ("--stem", Some("small")),
        ("--input-size", Some("16")),
        ("--crop-pad", Some("0")),
        ("--no-flip", None),
        ("--train-limit", Some("240")),
        ("--epochs", Some("1")),
        ("--lr", Some("0.2")),
        ("--lr-ref-batch", Some("12")),
        ("--decay", Some("none")),
        ("--momentum", Some("0.9")),
        ("--weight-decay", Some("1e-3")),
        ("--check-every", Some("1")),
        ("--no-eval", None),
        ("--no-plot", None),
        ("--log-every", Some("1")),
        ("--data", Some(&data)),
        ("--out", Some(&out)),
        ("--seed", Some("0")),
        ("--workers", Some("1")),
        ("--prefetch", Some("4")),
    ];
    let mut v: Vec<String> = vec![];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            v.push(flag.to_string());
            v.extend(value.map(str::to_string));
        }
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

pub fn run(ranks: usize, args: &[String]) -> Output {
    let train = env!("CARGO_BIN_EXE_toroid-train");
    let t = Instant::now();
    let out = if ranks == 1 {
        Command::new(train).args(args).output().unwrap()
    } else {
        Command::new(toroid_run())
            .args(["-n", &ranks.to_string(), "--timeout", "300", "--"])
            .arg(train)
            .args(args)
            .output()
            .unwrap()
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{ranks} rank(s) failed ({:?}):\n{err}", out.status);
    assert!(t.elapsed() < Duration::from_secs(300));
    out
}

pub fn params(dir: &Path) -> HashMap<String, Vec<f32>> {
    let (_, tensors) = toroid_train::checkpoint::load(dir).unwrap();
    tensors.into_iter().map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

/// Largest |a - b| over all parameters (not momentum, not BN buffers).
pub fn max_diff(a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut d = 0f32;
    for (k, va) in a {
        if k.starts_with("momentum.") || k.contains("running_") {
            continue;
        }
        let vb = &b[k];
        assert_eq!(va.len(), vb.len(), "{k}");
        for (x, y) in va.iter().zip(vb) {
            d = d.max((x - y).abs());
        }
    }
    d
}
