//! `toroid-bench` end to end: every `--collective` value it accepts, on 2, 3 and 4 ranks under
//! `toroid-run`, with every value checked (`-c 1`), sizes and counts in nccl-tests' convention,
//! and the JSON output's bandwidths against the times.

mod bench_check;

use std::process::Command;
use std::time::Duration;

use bench_check::{BENCH, Expect, TOROID_RUN, TempDir, assert_bench_ok, float_rows, run_bounded};

/// Upper bound on one toroid-bench job.
const LIMIT: Duration = Duration::from_secs(90);
const SIZES: [usize; 3] = [4096, 16384, 65536];

/// The `--collective` values in `toroid-bench --help` ("[possible values: a, b, ...]").
fn collectives() -> Vec<String> {
    let out = Command::new(BENCH).arg("--help").output().expect("run toroid-bench --help");
    assert!(out.status.success(), "toroid-bench --help: {}", String::from_utf8_lossy(&out.stderr));
    let help = String::from_utf8(out.stdout).unwrap();
    let at = help.find("--collective").expect("--collective in --help");
    let rest = &help[at..];
    let list =
        rest.split("[possible values: ").nth(1).and_then(|s| s.split(']').next()).expect("possible values");
    list.split(',').map(|s| s.trim().to_string()).collect()
}

/// nccl-tests' bus bandwidth factor.
fn bus_factor(collective: &str, n: usize) -> f64 {
    let n = n as f64;
    match collective {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "reduce_scatter" | "all_gather" | "all_to_all" => (n - 1.0) / n,
        "broadcast" | "reduce" => 1.0,
        other => panic!("no bus factor for '{other}'"),
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()) + 1e-12
}

#[test]
fn every_collective_is_correct_on_2_3_and_4_ranks() {
    let all = collectives();
    for known in ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"] {
        assert!(all.iter().any(|c| c == known), "'{known}' missing from {all:?}");
    }
    let dir = TempDir::new("bench-cli");
    for n in [2usize, 3, 4] {
        for c in &all {
            let what = format!("{c} on {n} ranks");
            let json = dir.join(&format!("{c}-{n}.json"));
            let rooted = c == "broadcast" || c == "reduce";
            // Rooted collectives from the last rank, not the default 0.
            let root = if rooted { (n - 1).to_string() } else { "-1".to_string() };
            let mut cmd = Command::new(TOROID_RUN);
            bench_check::clean_launcher_env(&mut cmd);
            cmd.args(["-n", &n.to_string(), "--timeout", "80", "--grace", "2", "--no-prefix", "--", BENCH])
                .args([
                    "--collective",
                    c,
                    "-b",
                    "4K",
                    "-e",
                    "64K",
                    "-f",
                    "4",
                    "-n",
                    "2",
                    "-w",
                    "1",
                    "-c",
                    "1",
                ])
                .arg("-J")
                .arg(&json);
            if rooted {
                cmd.args(["-r", &root]);
            }
            let job = run_bounded(&what, &mut cmd, &dir, LIMIT);
            let redop =
                if matches!(c.as_str(), "all_reduce" | "reduce_scatter" | "reduce") { "sum" } else { "none" };
            let want = Expect { ranks: n, redop, root: &root, rows: float_rows(c, n, &SIZES) };
            let rows = assert_bench_ok(&what, &job, &want);

            // The JSON file has the same rows with full precision: algbw = size / time and
            // busbw = algbw x nccl-tests' factor, wrong = 0.
            let text = std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{what}: JSON file: {e}"));
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["ranks"], n, "{what}");
            let results = v["results"].as_array().unwrap();
            assert_eq!(results.len(), rows.len(), "{what}: {text}");
            for (r, row) in results.iter().zip(&rows) {
                assert_eq!(
                    (r["size"].as_u64(), r["count"].as_u64()),
                    (Some(row.size as u64), Some(row.count as u64))
                );
                for side in ["out_of_place", "in_place"] {
                    let p = &r[side];
                    let (t, alg, bus) = (
                        p["time_us"].as_f64().unwrap(),
                        p["algbw"].as_f64().unwrap(),
                        p["busbw"].as_f64().unwrap(),
                    );
                    assert_eq!(p["wrong"], 0, "{what} {side}: {p}");
                    assert!(t > 0.0, "{what} {side}: {p}");
                    assert!(
                        close(alg, row.size as f64 / 1e9 / (t * 1e-6)),
                        "{what} {side}: algbw {alg} for {} B in {t} us",
                        row.size
                    );
                    assert!(close(bus, alg * bus_factor(c, n)), "{what} {side}: busbw {bus} for algbw {alg}");
                }
            }
        }
    }
}

#[test]
fn sizes_below_one_element_per_rank_are_skipped() {
    // 8 bytes of floats on 3 ranks: 2 elements, no whole element per rank for all_gather; 12
    // bytes: 3 elements, one per rank.
    let dir = TempDir::new("bench-tiny");
    let mut cmd = Command::new(TOROID_RUN);
    bench_check::clean_launcher_env(&mut cmd);
    cmd.args(["-n", "3", "--timeout", "80", "--grace", "2", "--no-prefix", "--", BENCH]).args([
        "--collective",
        "all_gather",
        "-b",
        "8",
        "-e",
        "12",
        "-i",
        "4",
        "-n",
        "1",
        "-w",
        "0",
        "-c",
        "1",
    ]);
    let job = run_bounded("all_gather of 8 and 12 bytes on 3 ranks", &mut cmd, &dir, LIMIT);
    let want = Expect { ranks: 3, redop: "none", root: "-1", rows: vec![(12, 1)] };
    assert_bench_ok("tiny all_gather", &job, &want);
}

#[test]
fn stats_flag_prints_rank_0s_table_after_the_unchanged_rows() {
    let dir = TempDir::new("bench-stats");
    let args = ["--collective", "all_reduce", "-b", "4096", "-e", "16384", "-n", "3", "-w", "1", "-c", "1"];
    let run = |stats: bool| {
        let mut cmd = Command::new(TOROID_RUN);
        bench_check::clean_launcher_env(&mut cmd);
        cmd.args(["-n", "2", "--timeout", "80", "--grace", "2", "--no-prefix", "--", BENCH]).args(args);
        if stats {
            cmd.arg("--stats");
        }
        run_bounded(&format!("all_reduce stats {stats}"), &mut cmd, &dir, LIMIT)
    };
    let want =
        Expect { ranks: 2, redop: "sum", root: "-1", rows: vec![(4096, 1024), (8192, 2048), (16384, 4096)] };
    let (plain, with) = (run(false), run(true));
    assert_bench_ok("all_reduce without --stats", &plain, &want);
    assert_bench_ok("all_reduce with --stats", &with, &want);
    assert!(!plain.stdout.contains("Statistics"), "a table without --stats:\n{}", plain.stdout);
    let lines: Vec<&str> = with.stdout.lines().collect();
    let at = lines.iter().position(|l| l.starts_with("# Statistics of rank 0")).unwrap_or_else(|| {
        panic!("no statistics table with --stats:\n{}", with.stdout);
    });
    assert_eq!(lines.iter().filter(|l| l.starts_with("# Statistics")).count(), 1, "printed once, by rank 0");
    assert!(
        lines[..at].iter().any(|l| l.starts_with("# Avg bus bandwidth")),
        "the table follows the results"
    );
    let table = &lines[at + 1..];
    assert!(table[0].starts_with("# collective") && table[0].contains("count"), "{}", with.stdout);
    // One all_reduce row per size class measured (4K, 8K, 16K), each with a positive count.
    for class in ["4K", "8K", "16K"] {
        let row = table
            .iter()
            .find(|l| {
                let f: Vec<&str> = l.trim_start_matches('#').split_whitespace().collect();
                f.first() == Some(&"all_reduce") && f.get(2) == Some(&class)
            })
            .unwrap_or_else(|| panic!("no all_reduce row of size {class}:\n{}", with.stdout));
        let count: u64 = row.split_whitespace().nth(4).and_then(|c| c.parse().ok()).unwrap_or(0);
        assert!(count > 0, "{row}");
    }
    assert!(table.iter().all(|l| l.starts_with('#')), "every table line is a comment:\n{}", with.stdout);
}

#[test]
fn device_buffers_run_on_a_gpu_and_are_refused_with_a_message_without_one() {
    let dir = TempDir::new("bench-device");
    let run = |what: &str, extra: &[&str]| {
        let mut cmd = Command::new(TOROID_RUN);
        bench_check::clean_launcher_env(&mut cmd);
        cmd.args(["-n", "2", "--timeout", "80", "--grace", "2", "--no-prefix", "--", BENCH])
            .args(["--device", "0", "-b", "4096", "-e", "16384", "-n", "2", "-w", "1", "-c", "1"])
            .args(extra);
        run_bounded(what, &mut cmd, &dir, LIMIT)
    };
    // Only the size sweep runs on device memory.
    let calls = run("device with calls", &["--calls", "2"]);
    assert_eq!(calls.status.code(), Some(2), "--device --calls: {}", calls.stderr);
    assert!(calls.stderr.contains("--device runs the size sweep only"), "{}", calls.stderr);
    let job = run("device all_reduce", &[]);
    if device_0_usable() {
        let want = Expect {
            ranks: 2,
            redop: "sum",
            root: "-1",
            rows: vec![(4096, 1024), (8192, 2048), (16384, 4096)],
        };
        assert_bench_ok("all_reduce on device memory", &job, &want);
        assert!(job.stdout.contains("# buffers in memory of CUDA device 0"), "{}", job.stdout);
        let rows: Vec<&str> =
            job.stdout.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).collect();
        assert!(rows.iter().all(|l| l.ends_with("ipc") || l.ends_with("staged")), "{}", job.stdout);
    } else {
        eprintln!(
            "no usable CUDA device 0 here: checking that --device is refused with a message (the GPU run is scripts/gpu-check.sh's)"
        );
        assert_eq!(job.status.code(), Some(2), "--device without CUDA: {}\n{}", job.stdout, job.stderr);
        // Without a driver the message says so; with a driver but no device, the driver's error.
        let want = if driver_present() { "CUDA" } else { "CUDA is not available" };
        assert!(job.stderr.contains(want), "{}", job.stderr);
    }
}

#[cfg(feature = "cuda")]
fn driver_present() -> bool {
    toroid::internals::gpu::driver_available().is_ok()
}

/// A driver, and a device 0 it can open with the staging buffers a rank makes.
#[cfg(feature = "cuda")]
fn device_0_usable() -> bool {
    driver_present() && toroid::internals::gpu::staged::DeviceCollectives::on_device(0).is_ok()
}

#[cfg(not(feature = "cuda"))]
fn driver_present() -> bool {
    false
}

#[cfg(not(feature = "cuda"))]
fn device_0_usable() -> bool {
    false
}
