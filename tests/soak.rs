//! The soak: long runs of random collectives across real processes, every element verified
//! bit for bit, and create/destroy in a loop under valgrind.
//!
//! - `soak_shm_3_and_4_ranks`, `soak_tcp_3_and_4_ranks`: jobs of 3 and of 4 rank processes run
//!   `TOROID_SOAK_OPS` operations each (default 150, so 300 per test) drawn from a
//!   shared seed: all_reduce (auto, ring, rd, hd, hring, and shm_direct when every rank shares
//!   the window), reduce_scatter, all_gather, broadcast, reduce (chain, tree), all_to_all and
//!   send/recv pairs, of every integer type (sum and prod wrap, min and max), 0 to
//!   `TOROID_SOAK_MAX_BYTES` per rank (default 1 MiB; odd counts included), in place or not.
//!   Each rank checks its whole output against the reference it computes locally from the
//!   seeds of all ranks (`util/data.rs`), so a wrong byte anywhere is a corruption.
//! - `create_destroy_under_valgrind` (in CI: about 10 s on 2 cores): 2 ranks under valgrind,
//!   each creating and destroying a communicator `TOROID_SOAK_CYCLES` times (default 20) with
//!   one verified all-reduce each: no invalid access, no definite or indirect leak.
//!
//! Every job is bounded and its processes, process groups and shared-memory names are cleaned
//! up by `util/job.rs`, also when an assertion fails.

#[path = "util/job.rs"]
mod job;
#[path = "util/random_ops.rs"]
mod random_ops;
mod util;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use job::{Job, event, now_ms};
use random_ops::Rng;
use toroid::rendezvous::{Store, TcpStore};
use toroid::{Communicator, ReduceOp};

fn var<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A soak rank: `SOAK_OPS` random operations, each verified; a corruption is counted and the
/// run goes on (the communicator is still in step), an error ends it.
fn soak_rank() {
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => return event("SETUP_ERROR", &e.to_string()),
    };
    let seed: u64 = var("SOAK_SEED", 1);
    let ops: u64 = var("SOAK_OPS", 150);
    let max_bytes: usize = var("SOAK_MAX_BYTES", 1 << 20);
    let window = comm.has_shared_window();
    let mut rng = Rng::new(seed);
    let (mut verified, mut corrupt) = (0u64, 0u64);
    let mut per_label: BTreeMap<String, u64> = BTreeMap::new();
    for i in 0..ops {
        let op = random_ops::draw(&mut rng, comm.size(), max_bytes, window);
        match random_ops::run(&comm, seed.wrapping_mul(1 << 24) + i, &op) {
            Ok(()) => {
                verified += 1;
                *per_label.entry(op.label()).or_default() += 1;
            }
            Err(e) if !comm.is_aborted() => {
                corrupt += 1;
                event("CORRUPT", &e);
            }
            Err(e) => return event("ERROR", &format!("after {i} ops: {e}")),
        }
    }
    let labels: Vec<String> = per_label.iter().map(|(k, v)| format!("{k}={v}")).collect();
    event("DONE", &format!("verified={verified} corrupt={corrupt} window={window} {}", labels.join(",")));
}

/// Runs one soak job of `n` ranks; returns (operations verified on every rank, corruptions).
fn soak_job(test: &str, n: usize, tcp: bool, seed: u64) -> (u64, u64, String) {
    let ops: u64 = var("TOROID_SOAK_OPS", 150);
    let max_bytes: usize = var("TOROID_SOAK_MAX_BYTES", 1 << 20);
    let mut env = vec![
        ("TOROID_TIMEOUT".to_string(), "120".to_string()),
        ("SOAK_SEED".to_string(), seed.to_string()),
        ("SOAK_OPS".to_string(), ops.to_string()),
        ("SOAK_MAX_BYTES".to_string(), max_bytes.to_string()),
    ];
    if tcp {
        env.push(("TOROID_SHM_DISABLE".into(), "1".into()));
    }
    let mut job = Job::spawn(test, n, &env, |_| vec![]);
    let all: Vec<usize> = (0..n).collect();
    // Bounded: a generous multiple of what the operations take on 2 loaded cores.
    let bound = Instant::now() + Duration::from_secs(60 + ops * max_bytes as u64 / (1 << 20) / 2);
    let hung = job.wait_exit(&all, bound);
    let mut verified = Vec::new();
    let mut corrupt = 0u64;
    let mut detail = String::new();
    for r in 0..n {
        let done = job.ranks[r].event("DONE");
        let field = |name: &str| {
            done.as_ref()
                .and_then(|e| e.detail.split(' ').find_map(|f| f.strip_prefix(name)?.parse::<u64>().ok()))
        };
        match (field("verified="), field("corrupt=")) {
            (Some(v), Some(c)) => {
                verified.push(v);
                corrupt += c;
                if r == 0 {
                    detail = done.map(|e| e.detail).unwrap_or_default();
                }
            }
            _ => {
                let (procs, shm) = job.finish();
                panic!(
                    "{test}: rank {r} of {n} did not finish (hung: {hung:?}, seed {seed}, {procs} processes and {shm} shm names left):\n{}",
                    job.ranks[r].output()
                );
            }
        }
    }
    for r in 0..n {
        for e in job.ranks[r].events().into_iter().filter(|e| e.name == "CORRUPT").take(3) {
            println!("CORRUPTION rank {r}: {}", e.detail);
        }
    }
    let (procs, shm) = job.finish();
    assert_eq!((procs, shm), (0, 0), "{test}: processes and shm names left behind");
    assert!(hung.is_empty(), "{test}: ranks {hung:?} hung");
    // Every rank verified every operation it took part in.
    let min = verified.iter().copied().min().unwrap_or(0);
    (min, corrupt, detail)
}

fn soak(test: &str, tcp: bool) {
    let seed: u64 = var("TOROID_SOAK_SEED", now_ms());
    let mut total = 0;
    let mut corrupt = 0;
    for n in [3, 4] {
        let t = Instant::now();
        let (v, c, detail) = soak_job(test, n, tcp, seed + n as u64);
        println!(
            "SOAK | {} ranks | {} | verified {v} | corruptions {c} | {:.1} s | seed {} | {detail}",
            n,
            if tcp { "tcp" } else { "shm" },
            t.elapsed().as_secs_f64(),
            seed + n as u64
        );
        total += v;
        corrupt += c;
    }
    let ops: u64 = var("TOROID_SOAK_OPS", 150);
    assert_eq!(corrupt, 0, "{test}: corruptions (seed {seed})");
    assert_eq!(total, 2 * ops, "{test}: not every operation was verified on every rank");
}

#[test]
fn soak_shm_3_and_4_ranks() {
    if util::is_child() {
        return soak_rank();
    }
    soak("soak_shm_3_and_4_ranks", false);
}

#[test]
fn soak_tcp_3_and_4_ranks() {
    if util::is_child() {
        return soak_rank();
    }
    soak("soak_tcp_3_and_4_ranks", true);
}

/// One rank of the valgrind loop: one store for the whole process, `cycles` communicators
/// created on it, each running one verified all-reduce and destroyed.
fn cycle_rank() {
    let rank: usize = var("TOROID_RANK", 0);
    let addr = std::env::var("TOROID_STORE_ADDR").unwrap_or_default();
    let cycles: i64 = var("SOAK_CYCLES", 20);
    let timeout = Duration::from_secs(240);
    let store: Arc<dyn Store> =
        match if rank == 0 { TcpStore::serve(&addr, timeout) } else { TcpStore::connect(&addr, timeout) } {
            Ok(s) => Arc::new(s),
            Err(e) => return event("SETUP_ERROR", &e.to_string()),
        };
    let cfg = util::test_config(240.0);
    for i in 0..cycles {
        let comm = match Communicator::with_store(rank, 2, store.clone(), &cfg) {
            Ok(c) => c,
            Err(e) => return event("SETUP_ERROR", &format!("cycle {i}: {e}")),
        };
        let mut v: Vec<i64> = (0..1001).map(|k| k * (rank as i64 + 1) + i).collect();
        if let Err(e) = comm.all_reduce(&mut v, ReduceOp::Sum) {
            return event("ERROR", &format!("cycle {i}: {e}"));
        }
        if v.iter().enumerate().any(|(k, x)| *x != 3 * k as i64 + 2 * i) {
            return event("CORRUPT", &format!("cycle {i}"));
        }
        // Rank 0 serves the store: it must not go before rank 1 has created its last one.
        if i == cycles - 1 && comm.barrier().is_err() {
            return event("ERROR", "final barrier");
        }
        drop(comm);
    }
    event("DONE", &cycles.to_string());
}

#[test]
fn create_destroy_under_valgrind() {
    if util::is_child() {
        return cycle_rank();
    }
    let cycles: u32 = var("TOROID_SOAK_CYCLES", 20);
    let exe = std::env::current_exe().unwrap();
    let port = util::free_port();
    let children: Vec<_> = (0..2)
        .map(|r| {
            std::process::Command::new("valgrind")
                .args([
                    "--error-exitcode=99",
                    "--leak-check=full",
                    "--show-leak-kinds=definite,indirect",
                    "--errors-for-leak-kinds=definite,indirect",
                    "--fair-sched=yes",
                ])
                .arg(&exe)
                .args(["--exact", "create_destroy_under_valgrind", "--nocapture", "--test-threads=1"])
                .env(util::CHILD_VAR, "1")
                .env("TOROID_RANK", r.to_string())
                .env("TOROID_WORLD_SIZE", "2")
                .env("TOROID_STORE_ADDR", format!("127.0.0.1:{port}"))
                .env("SOAK_CYCLES", cycles.to_string())
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("valgrind runs (apt-get install valgrind)")
        })
        .collect();
    let t = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(500);
    let (statuses, outputs) = util::wait_all(children, deadline);
    for r in 0..2 {
        let out = &outputs[r];
        assert!(statuses[r].is_some(), "rank {r} under valgrind did not finish in time:\n{out}");
        assert!(out.contains("@@ DONE"), "rank {r} did not finish its cycles:\n{out}");
        let summary = out.lines().find(|l| l.contains("ERROR SUMMARY:")).unwrap_or("");
        // The leak check ran: either nothing was left or a leak summary was printed.
        let leaks = out
            .lines()
            .find(|l| l.contains("definitely lost:") || l.contains("All heap blocks were freed"))
            .unwrap_or_else(|| panic!("rank {r}: no leak summary from valgrind:\n{out}"));
        let clip = |l: &str| l.split_once("== ").map_or(l, |(_, t)| t).trim().to_string();
        println!(
            "VALGRIND | rank {r} | {cycles} create/destroy cycles | {} | {}",
            clip(summary),
            clip(leaks)
        );
        assert_eq!(statuses[r].and_then(|s| s.code()), Some(0), "rank {r}: valgrind found errors:\n{out}");
        assert!(summary.contains("ERROR SUMMARY: 0 errors"), "rank {r}:\n{out}");
        for kind in ["definitely lost", "indirectly lost"] {
            assert!(
                !out.lines().any(|l| l.contains(kind) && !l.contains(&format!("{kind}: 0 bytes"))),
                "rank {r}: {kind}:\n{out}"
            );
        }
    }
    println!("VALGRIND | {:.1} s", t.elapsed().as_secs_f64());
}
