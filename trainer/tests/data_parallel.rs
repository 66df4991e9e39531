//! The data-parallel contract, end to end with real processes started by `toroid-run`:
//!
//! - N ranks (2 and 3) with per-rank batch b reach the same parameters after k steps as one
//!   process with batch N*b on the same examples (frozen BN, so a rank's gradient does not
//!   depend on how the batch is split), and so does one process accumulating N passes of b;
//! - with ordinary (per-rank) batch norm, all ranks still hold bit-identical parameters;
//! - resuming from a checkpoint continues exactly where a straight run goes;
//! - the CLI's parameter count and its errors for missing data.
//!
//! Data: the real Fashion-MNIST from Debian's `dataset-fashion-mnist` (found with `dpkg -L`),
//! a few hundred examples, a ResNet-18 of width 1/8 at 16x16: each run takes seconds.

mod util;

use std::collections::HashMap;
use std::process::Command;

use candle_core::Device;
use toroid_train::model::{Arch, BnMode, ModelConfig, ResNet, Stem};
use util::{common, max_diff, out_dir, params, run, toroid_run};

fn initial_params() -> HashMap<String, Vec<f32>> {
    let cfg = ModelConfig {
        arch: Arch::ResNet18,
        width: 0.125,
        in_channels: 1,
        num_classes: 10,
        stem: Stem::Small,
        bn: BnMode::Frozen,
        zero_init_residual: true,
    };
    let m = ResNet::new(cfg, 0, &Device::Cpu).unwrap();
    m.params
        .iter()
        .map(|p| (p.name.clone(), p.var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

fn contract(n: usize) {
    let b = 4;
    let steps = "5";
    let multi = out_dir(&format!("multi{n}"));
    let single = out_dir(&format!("single{n}"));
    let accum = out_dir(&format!("accum{n}"));
    let global = (n * b).to_string();
    run(n, &common(&multi, &["--frozen-bn", "--batch", &global, "--max-steps", steps]));
    run(1, &common(&single, &["--frozen-bn", "--batch", &global, "--max-steps", steps]));
    run(
        1,
        &common(
            &accum,
            &["--frozen-bn", "--batch", &global, "--max-micro-batch", &b.to_string(), "--max-steps", steps],
        ),
    );
    let (pm, ps, pa) = (params(&multi), params(&single), params(&accum));
    let moved = max_diff(&ps, &{
        let mut init = initial_params();
        for (k, v) in &ps {
            init.entry(k.clone()).or_insert_with(|| v.clone());
        }
        init
    });
    let d_multi = max_diff(&pm, &ps);
    let d_accum = max_diff(&pa, &ps);
    eprintln!(
        "{n} ranks: parameters moved up to {moved:.3e}; multi-rank vs one rank {d_multi:.3e}; accumulation vs one rank {d_accum:.3e}"
    );
    // Training moved the weights by orders of magnitude more than the runs differ: only float
    // summation order separates them.
    assert!(moved > 1e-2, "training did not move the parameters ({moved})");
    assert!(d_multi < 2e-5, "{n} ranks differ from one rank by {d_multi}");
    assert!(d_accum < 2e-5, "gradient accumulation differs from one pass by {d_accum}");
    for d in [multi, single, accum] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn two_ranks_equal_one_rank_with_twice_the_batch() {
    contract(2);
}

#[test]
fn three_ranks_equal_one_rank_with_three_times_the_batch() {
    contract(3);
}

/// With per-rank batch statistics the ranks' gradients differ before the all-reduce, yet the
/// parameters must stay identical: the trainer checks a hash every step (--check-every 1) and
/// each rank prints its final hash, which must agree across ranks. BN (rather than frozen BN)
/// must also give different parameters from the frozen run, so it was really in effect.
#[test]
fn ranks_stay_identical_with_batch_norm() {
    let out = out_dir("bn");
    let o = run(3, &common(&out, &["--batch", "12", "--max-steps", "6"]));
    let text = String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout);
    let hashes: Vec<&str> = text.lines().filter_map(|l| l.split("parameter hash ").nth(1)).collect();
    assert_eq!(hashes.len(), 3, "expected one hash per rank:\n{text}");
    assert!(hashes.iter().all(|h| *h == hashes[0]), "{hashes:?}");
    let bn = params(&out);
    let frozen = out_dir("bn-frozen");
    run(1, &common(&frozen, &["--frozen-bn", "--batch", "12", "--max-steps", "6"]));
    assert!(max_diff(&bn, &params(&frozen)) > 1e-3);
    // The checkpoint holds the BN running statistics, averaged over ranks and updated.
    let rv = &bn["layer1.0.bn1.running_var"];
    assert!(rv.iter().any(|v| (v - 1.0).abs() > 1e-3));
    let _ = std::fs::remove_dir_all(out);
    let _ = std::fs::remove_dir_all(frozen);
}

/// Two epochs straight, or one epoch, a checkpoint, and a resumed second epoch: same weights.
#[test]
fn resume_continues_exactly() {
    let straight = out_dir("straight");
    let resumed = out_dir("resumed");
    let base = ["--train-limit", "96", "--batch", "16"];
    let two = [&base[..], &["--epochs", "2"]].concat();
    run(2, &common(&straight, &two));
    run(2, &common(&resumed, &base));
    let resume_from = resumed.display().to_string();
    run(2, &common(&resumed, &[&two[..], &["--resume", &resume_from]].concat()));
    let (ps, pr) = (params(&straight), params(&resumed));
    assert_eq!(max_diff(&ps, &pr), 0.0);
    let csv = std::fs::read_to_string(resumed.join("epochs.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}"); // header, epoch 0, epoch 1
    let _ = std::fs::remove_dir_all(straight);
    let _ = std::fs::remove_dir_all(resumed);
}

#[test]
fn print_params_and_clear_errors() {
    let train = env!("CARGO_BIN_EXE_toroid-train");
    let o = Command::new(train).args(["--model", "resnet50", "--print-params"]).output().unwrap();
    assert!(o.status.success());
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(stdout.lines().last(), Some("25557032"));

    let o = Command::new(train).args(["--data", "/nonexistent/data", "--epochs", "1"]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("does not exist") && !err.contains("panicked"), "{err}");

    // A malformed IDX file: a directory with the right names and a truncated image file.
    let dir = out_dir("malformed");
    std::fs::create_dir_all(&dir).unwrap();
    let mut img = vec![0u8, 0, 8, 3, 0, 0, 0, 10, 0, 0, 0, 28, 0, 0, 0, 28];
    img.extend(vec![0u8; 100]);
    std::fs::write(dir.join("train-images-idx3-ubyte"), &img).unwrap();
    std::fs::write(
        dir.join("train-labels-idx1-ubyte"),
        [0u8, 0, 8, 1, 0, 0, 0, 10, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    )
    .unwrap();
    let o = Command::new(train).args(["--data", dir.to_str().unwrap()]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("truncated") && err.contains("train-images-idx3-ubyte"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The batch-size schedule end to end: the global batch follows the schedule, per-rank batches
/// and accumulation realise it, and the learning rate follows the batch (linear scaling). Also
/// exercises LARS, Nesterov and label smoothing.
#[test]
fn batch_schedule_drives_batch_and_learning_rate() {
    let out = out_dir("schedule");
    let args = common(
        &out,
        &[
            "--train-limit",
            "96",
            "--epochs",
            "3",
            "--batch-schedule",
            "0:8,1:16,2:32",
            "--max-micro-batch",
            "8",
            "--lr",
            "0.05",
            "--lr-ref-batch",
            "8",
            "--lars",
            "--nesterov",
            "--label-smoothing",
            "0.1",
        ],
    );
    run(2, &args);
    let csv = std::fs::read_to_string(out.join("epochs.csv")).unwrap();
    let rows: Vec<Vec<f64>> =
        csv.lines().skip(1).map(|l| l.split(',').map(|f| f.parse().unwrap()).collect()).collect();
    let batches: Vec<f64> = rows.iter().map(|r| r[2]).collect();
    let lrs: Vec<f64> = rows.iter().map(|r| r[3]).collect();
    let steps: Vec<f64> = rows.iter().map(|r| r[1]).collect();
    assert_eq!(batches, vec![8.0, 16.0, 32.0]);
    assert_eq!(lrs, vec![0.05, 0.1, 0.2]);
    // 96 examples: 12, then 6, then 3 steps (batch 32 on 2 ranks = 2 passes of 8 per rank).
    assert_eq!(steps, vec![12.0, 18.0, 21.0]);
    assert!(rows.iter().all(|r| r[4].is_finite()));
    let _ = std::fs::remove_dir_all(out);
}

/// An ImageFolder data set (RGB PNGs of two sizes, resized to the input size) trains and
/// evaluates end to end on 2 ranks.
#[test]
fn image_folder_trains_end_to_end() {
    let root = out_dir("folder-data");
    for split in ["train", "val"] {
        for (c, class) in ["circles", "squares"].iter().enumerate() {
            let dir = root.join(split).join(class);
            std::fs::create_dir_all(&dir).unwrap();
            for i in 0..12u32 {
                let side = if i % 2 == 0 { 20 } else { 24 };
                let img = image::RgbImage::from_fn(side, side, |x, y| {
                    let on = if c == 0 {
                        (x as i32 - 10).pow(2) + (y as i32 - 10).pow(2) < 36
                    } else {
                        x > 5 && x < 15
                    };
                    image::Rgb(if on { [250, 200, (i * 10) as u8] } else { [10, 20, 30] })
                });
                img.save(dir.join(format!("{i}.png"))).unwrap();
            }
        }
    }
    let out = out_dir("folder-out");
    let train = env!("CARGO_BIN_EXE_toroid-train");
    let o = Command::new(toroid_run())
        .args(["-n", "2", "--timeout", "300", "--"])
        .arg(train)
        .args([
            "--data",
            root.to_str().unwrap(),
            "--model",
            "resnet18",
            "--width",
            "0.125",
            "--input-size",
            "16",
        ])
        .args(["--batch", "8", "--epochs", "2", "--lr", "0.05", "--lr-ref-batch", "8", "--workers", "2"])
        .args(["--shuffle-buffer", "8", "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("24 images in 2 classes"), "{err}");
    let csv = std::fs::read_to_string(out.join("epochs.csv")).unwrap();
    let last: Vec<f64> = csv.lines().last().unwrap().split(',').map(|f| f.parse().unwrap()).collect();
    assert!((0.0..=1.0).contains(&last[7]), "test accuracy {}", last[7]);
    assert!(out.join("curves.png").exists() && out.join("checkpoint.safetensors").exists());
    let _ = std::fs::remove_dir_all(root);
    let _ = std::fs::remove_dir_all(out);
}
