//! Shared memory between ranks of one host: chosen automatically, correct, off with
//! `TOROID_SHM_DISABLE=1`, mixed with TCP across (emulated) hosts, a too-small `/dev/shm` falls
//! back to TCP with a WARN line, and nothing is left in `/dev/shm` after set-up, after a normal
//! exit or after a `kill -9` of a rank in the middle of a collective.
//!
//! Segment names carry the creating process's pid (`toroid-<pid>-...`), so the checks look for
//! names of the ranks this test started and are not confused by other jobs on the machine.

mod util;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use toroid::{Algorithm, CallOptions, Communicator, DataType, Error, OpKind, ReduceOp};

/// Names in /dev/shm created by any of `pids`.
fn names_of(pids: &[u32]) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return Vec::new() };
    dir.flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| pids.iter().any(|p| n.starts_with(&format!("toroid-{p}-"))))
        .collect()
}

/// Every rank's pid, on every rank.
fn job_pids(comm: &Communicator) -> Vec<u32> {
    let mut pids = vec![0u32; comm.size()];
    let me = comm.rank();
    let mine = [std::process::id()];
    comm.all_gather(&mine, &mut pids).expect("all_gather of pids");
    let _ = me;
    pids
}

/// A few collectives with exact integer-valued floats, checked on every rank.
fn exercise(comm: &Communicator, algo: Option<Algorithm>) {
    let n = comm.size();
    let r = comm.rank();
    let opts = CallOptions { timeout: None, algorithm: algo, wire: None };
    let tri = (n * (n - 1) / 2) as f32;
    for count in [1usize, 1000, 300_000] {
        let mut buf: Vec<f32> = (0..count).map(|i| (r + i % 3) as f32).collect();
        comm.run_bytes(
            OpKind::AllReduce(ReduceOp::Sum),
            DataType::F32,
            None,
            Some(bytemuck::cast_slice_mut(&mut buf)),
            opts,
        )
        .unwrap();
        for (i, v) in buf.iter().enumerate() {
            assert_eq!(*v, tri + (n * (i % 3)) as f32, "all_reduce[{i}] of {count} with {algo:?}");
        }
        let mut b: Vec<f32> = (0..count).map(|i| if r == n - 1 { i as f32 } else { -1.0 }).collect();
        let bopts = CallOptions { algorithm: algo.filter(|a| *a == Algorithm::ShmDirect), ..opts };
        comm.run_bytes(
            OpKind::Broadcast(n - 1),
            DataType::F32,
            None,
            Some(bytemuck::cast_slice_mut(&mut b)),
            bopts,
        )
        .unwrap();
        assert!(b.iter().enumerate().all(|(i, v)| *v == i as f32), "broadcast of {count}");
        let input: Vec<i64> = (0..n * count).map(|i| (i as i64) * (r as i64 + 1)).collect();
        let mut out = vec![0i64; count];
        comm.reduce_scatter(&input, &mut out, ReduceOp::Sum).unwrap();
        let sum_r = (n * (n + 1) / 2) as i64;
        assert!(out.iter().enumerate().all(|(k, v)| *v == (r * count + k) as i64 * sum_r), "reduce_scatter");
        let mut all = vec![0i64; n * count];
        comm.all_gather(&out, &mut all).unwrap();
        assert!(all.iter().enumerate().all(|(i, v)| *v == i as i64 * sum_r), "all_gather");
    }
}

/// Outputs too large for the cache (streaming stores) through every window collective.
fn exercise_large(comm: &Communicator) {
    let n = comm.size();
    let r = comm.rank();
    let count = 6 << 20;
    let tri = (n * (n - 1) / 2) as f32;
    let input: Vec<f32> = (0..count).map(|i| (r + i % 5) as f32).collect();
    let mut out = vec![0f32; count];
    comm.all_reduce_into(&input, &mut out, ReduceOp::Sum).unwrap();
    assert!(out.iter().enumerate().all(|(i, v)| *v == tri + (n * (i % 5)) as f32), "large all_reduce_into");
    let mut buf = input.clone();
    comm.all_reduce(&mut buf, ReduceOp::Avg).unwrap();
    let ok = buf.iter().enumerate().all(|(i, v)| (*v - (tri / n as f32 + (i % 5) as f32)).abs() < 1e-4);
    assert!(ok, "large in-place avg");
    let mut rs = vec![0f32; count / n];
    comm.reduce_scatter(&input[..count / n * n], &mut rs, ReduceOp::Max).unwrap();
    let base = r * (count / n);
    assert!(
        rs.iter().enumerate().all(|(k, v)| *v == (n - 1 + (base + k) % 5) as f32),
        "large reduce_scatter"
    );
    let mut all = vec![0f32; count / n * n];
    comm.all_gather(&rs, &mut all).unwrap();
    assert!(all.iter().enumerate().all(|(i, v)| *v == (n - 1 + i % 5) as f32), "large all_gather");
    let mut b: Vec<f32> = if r == 0 { input.clone() } else { vec![0.0; count] };
    comm.broadcast(&mut b, 0).unwrap();
    assert!(b.iter().enumerate().all(|(i, v)| *v == (i % 5) as f32), "large broadcast");
}

#[test]
fn same_host_ranks_use_shared_memory_and_the_window() {
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let me = comm.rank();
        for p in (0..comm.size()).filter(|&p| p != me) {
            assert_eq!(comm.transport_to(p), Some("shm"), "rank {me} to {p}");
        }
        assert!(comm.has_shared_window());
        assert_eq!(
            comm.algorithm_for(OpKind::AllReduce(ReduceOp::Sum), 1 << 20, &CallOptions::default()),
            Algorithm::ShmDirect
        );
        // The names went away right after set-up, while every rank still runs.
        let pids = job_pids(&comm);
        assert_eq!(names_of(&pids), Vec::<String>::new(), "segment names left after set-up");
        exercise(&comm, None);
        exercise(&comm, Some(Algorithm::Ring));
        exercise(&comm, Some(Algorithm::ShmDirect));
        exercise_large(&comm);
        comm.barrier().unwrap();
        println!("PIDS {pids:?}");
        return;
    }
    for n in [2, 4] {
        let out = util::launch(
            "same_host_ranks_use_shared_memory_and_the_window",
            n,
            &[("TOROID_TIMEOUT", "60")],
            180,
        );
        util::assert_success(&out, &format!("{n} ranks"));
        let text = String::from_utf8_lossy(&out.stdout);
        let pids: Vec<u32> = text
            .lines()
            .find_map(|l| l.split("PIDS ").nth(1))
            .map(|s| {
                s.trim_matches(|c| c == '[' || c == ']').split(", ").filter_map(|p| p.parse().ok()).collect()
            })
            .expect("pids reported");
        assert_eq!(pids.len(), n);
        assert_eq!(names_of(&pids), Vec::<String>::new(), "segment names left after exit");
    }
}

#[test]
fn shm_disable_falls_back_to_tcp() {
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let me = comm.rank();
        for p in (0..comm.size()).filter(|&p| p != me) {
            assert_eq!(comm.transport_to(p), Some("tcp"), "rank {me} to {p}");
        }
        assert!(!comm.has_shared_window());
        let mut buf = vec![1.0f32; 1 << 16];
        let opts = CallOptions { timeout: None, algorithm: Some(Algorithm::ShmDirect), wire: None };
        let e = comm
            .run_bytes(
                OpKind::AllReduce(ReduceOp::Sum),
                DataType::F32,
                None,
                Some(bytemuck::cast_slice_mut(&mut buf)),
                opts,
            )
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("shm_direct"), "{e}");
        assert!(!comm.is_aborted());
        exercise(&comm, None);
        return;
    }
    let out = util::launch("shm_disable_falls_back_to_tcp", 3, &[("TOROID_SHM_DISABLE", "1")], 120);
    util::assert_success(&out, "TOROID_SHM_DISABLE=1");
}

#[test]
fn emulated_hosts_use_shared_memory_within_and_tcp_across() {
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let me = comm.rank();
        let host = |r: usize| usize::from(r >= 3);
        for p in (0..comm.size()).filter(|&p| p != me) {
            let want = if host(p) == host(me) { "shm" } else { "tcp" };
            assert_eq!(comm.transport_to(p), Some(want), "rank {me} to {p}");
        }
        assert!(!comm.has_shared_window(), "the window needs every rank on one host");
        exercise(&comm, None);
        exercise(&comm, Some(Algorithm::Ring));
        return;
    }
    let name = "emulated_hosts_use_shared_memory_within_and_tcp_across";
    let mut children = util::spawn_ranks(name, 5, |r| {
        vec![
            ("TOROID_HOST_ID".into(), format!("host{}", usize::from(r >= 3))),
            ("TOROID_TIMEOUT".into(), "60".into()),
        ]
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    for (r, c) in children.iter_mut().enumerate() {
        let status = util::wait_until(c, deadline);
        assert_eq!(status.map(|s| s.success()), Some(true), "rank {r}");
    }
}

const KILL_TIMEOUT_S: u64 = 20;

/// Rank 2 kills itself (SIGKILL) inside a large all-reduce; the others must fail fast and
/// cleanly, and no segment name of any rank may remain.
fn kill_case(algo: &str) {
    let name = "killed_rank_leaves_nothing_in_dev_shm";
    let children = util::spawn_ranks(name, 4, |_| {
        vec![
            ("TOROID_TIMEOUT".into(), KILL_TIMEOUT_S.to_string()),
            ("TOROID_ALGO".into(), algo.to_string()),
            ("KILL_TEST_ALGO".into(), algo.to_string()),
        ]
    });
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let deadline = Instant::now() + Duration::from_secs(KILL_TIMEOUT_S + 30);
    let (statuses, outputs) = util::wait_all(children, deadline);
    use std::os::unix::process::ExitStatusExt;
    if std::env::var_os("KILL_TEST_DEBUG").is_some() {
        for (r, o) in outputs.iter().enumerate() {
            println!("--- rank {r} ({:?}):\n{o}", statuses[r]);
        }
    }
    assert_eq!(statuses[2].and_then(|s| s.signal()), Some(libc::SIGKILL), "{algo}: rank 2:\n{}", outputs[2]);
    for r in [0, 1, 3] {
        let out = &outputs[r];
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "{algo}: rank {r}:\n{out}");
        let (line, ms) =
            util::error_line(out).unwrap_or_else(|| panic!("{algo}: rank {r} saw no error:\n{out}"));
        assert!(ms < 5000, "{algo}: rank {r} took {ms} ms to notice: {line}");
        assert!(out.contains(&format!("ALGO {algo}")), "{algo}: rank {r} ran another algorithm:\n{out}");
    }
    assert_eq!(names_of(&pids), Vec::<String>::new(), "{algo}: segment names left in /dev/shm");
}

#[test]
fn killed_rank_leaves_nothing_in_dev_shm() {
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let algo = std::env::var("KILL_TEST_ALGO").unwrap();
        let mut buf = vec![1.0f32; 4 << 20];
        let chosen =
            comm.algorithm_for(OpKind::AllReduce(ReduceOp::Sum), buf.len() * 4, &CallOptions::default());
        println!("ALGO {chosen}");
        assert!(comm.transport_to((comm.rank() + 1) % comm.size()) == Some("shm"));
        let _ = algo;
        comm.barrier().unwrap();
        if comm.rank() == 2 {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: kill(2) on our own pid; no memory is involved.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            });
        }
        let start = Instant::now();
        loop {
            if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
                println!("ERROR after {} ms: {e}", start.elapsed().as_millis());
                assert!(matches!(e, Error::Remote(_) | Error::Aborted(_)), "{e}");
                let again = comm.barrier().unwrap_err();
                assert!(matches!(again, Error::Aborted(_)), "{again}");
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "no error within 60 s");
        }
    }
    kill_case("shm_direct");
    kill_case("ring");
}

#[test]
fn window_mismatch_is_an_error_on_every_rank() {
    util::run_threads(3, &util::test_config(20.0), |comm| {
        assert!(comm.has_shared_window());
        let count = if comm.rank() == 1 { 300 } else { 100 };
        let mut buf = vec![1.0f32; count];
        let e = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("mismatch") || msg.contains("abort"), "rank {}: {msg}", comm.rank());
        if comm.rank() == 1 {
            assert!(msg.contains("300 x float") && msg.contains("100 x float"), "{msg}");
        }
        assert!(comm.is_aborted());
    });
}

#[test]
fn a_barrier_in_the_window_waits_for_everyone_and_finds_a_mismatch() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Nobody leaves a barrier before the last rank has entered it: the counter each rank bumps
    // before entering reads 4 to everyone after it (rank 3 enters 200 ms late).
    let entered = Arc::new(AtomicUsize::new(0));
    let e = entered.clone();
    util::run_threads(4, &util::test_config(20.0), move |comm| {
        assert!(comm.has_shared_window());
        for round in 1..=3usize {
            if comm.rank() == 3 {
                std::thread::sleep(Duration::from_millis(200));
            }
            e.fetch_add(1, Ordering::SeqCst);
            comm.barrier().unwrap();
            assert_eq!(
                e.load(Ordering::SeqCst),
                4 * round,
                "rank {} left barrier {round} early",
                comm.rank()
            );
            comm.barrier().unwrap();
        }
    });
    // One rank's all-reduce against the others' barrier: an error on every rank, not a hang.
    util::run_threads(3, &util::test_config(20.0), |comm| {
        let e = if comm.rank() == 2 {
            let mut v = vec![1.0f32; 10];
            comm.all_reduce(&mut v, ReduceOp::Sum).unwrap_err()
        } else {
            comm.barrier().unwrap_err()
        };
        let msg = e.to_string();
        assert!(msg.contains("mismatch") || msg.contains("abort"), "rank {}: {msg}", comm.rank());
    });
}

/// Runs the child body of `test` as `n` ranks under `toroid-run` inside a private mount namespace
/// whose /dev/shm is a fresh tmpfs of `size`; returns (job output, what /dev/shm held after).
fn run_with_small_dev_shm(test: &str, n: usize, size: &str) -> Option<(std::process::Output, String)> {
    let probe = Command::new("unshare").args(["-m", "true"]).stderr(Stdio::null()).status();
    if !probe.is_ok_and(|s| s.success()) {
        println!("skipped: cannot create a mount namespace (unshare -m needs CAP_SYS_ADMIN)");
        return None;
    }
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "mount -t tmpfs -o size={size} toroid-test /dev/shm || exit 90; \
         {run} -n {n} --timeout 120 --grace 2 --env {child}=1 --env TOROID_TIMEOUT=60 -- {exe} \
         --exact {test} --nocapture --test-threads=1; rc=$?; echo LEFT:$(ls -A /dev/shm); exit $rc",
        run = env!("CARGO_BIN_EXE_toroid-run"),
        child = util::CHILD_VAR,
        exe = exe.display(),
    );
    let out =
        Command::new("unshare").args(["-m", "sh", "-c", &script]).stdin(Stdio::null()).output().unwrap();
    if out.status.code() == Some(90) {
        println!("skipped: cannot mount a tmpfs on /dev/shm");
        return None;
    }
    let left = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("LEFT:").map(str::trim).map(String::from))
        .unwrap_or_default();
    Some((out, left))
}

#[test]
fn small_dev_shm_falls_back_to_tcp_with_a_warning() {
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        exercise(&comm, None);
        // Every pair exchanges directly once, so every link exists (a pair of one host gets its
        // segment, or fails to, when its link opens).
        let (r, n) = (comm.rank(), comm.size());
        for p in (0..n).filter(|p| *p != r) {
            let mut got = [0u32; 4];
            if r < p {
                comm.send(&[r as u32; 4], p).unwrap();
                comm.recv(&mut got, p).unwrap();
            } else {
                comm.recv(&mut got, p).unwrap();
                comm.send(&[r as u32; 4], p).unwrap();
            }
            assert_eq!(got, [p as u32; 4]);
        }
        let kinds: Vec<_> = (0..n).map(|p| comm.transport_to(p).unwrap_or("-")).collect();
        println!("\nKINDS rank {r} links {} window {}", kinds.join(","), comm.has_shared_window());
        return;
    }
    let test = "small_dev_shm_falls_back_to_tcp_with_a_warning";
    // 1 MiB: not even one pair segment (two 512 KiB rings) fits; 5 MiB: set-up's three pairs of
    // rank 0 fit, the window (two 512 KiB regions per rank) does not, and two of the three other
    // pairs fit when they first exchange.
    for (size, some_shm) in [("1m", false), ("5m", true)] {
        let Some((out, left)) = run_with_small_dev_shm(test, 4, size) else { return };
        util::assert_success(&out, &format!("/dev/shm of {size}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("WARN")
                && stderr.contains("not shared memory")
                && stderr.contains("No space left"),
            "{size}: no WARN about the full /dev/shm:\n{stderr}"
        );
        assert!(stderr.contains("no shared-memory window"), "{size}: no WARN about the window:\n{stderr}");
        assert!(stderr.contains("--shm-size"), "{size}: the WARN should say what to do:\n{stderr}");
        let kinds: Vec<&str> = stdout.lines().filter_map(|l| l.split("KINDS ").nth(1)).collect();
        assert_eq!(kinds.len(), 4, "{size}: every rank reports its links:\n{stdout}");
        assert!(kinds.iter().all(|k| k.ends_with("window false")), "{size}: a window cannot fit: {kinds:?}");
        assert_eq!(kinds.iter().any(|k| k.contains("shm")), some_shm, "{size}: links {kinds:?}");
        assert!(kinds.iter().any(|k| k.contains("tcp")), "{size}: links {kinds:?}");
        assert_eq!(left, "", "{size}: files left in the small /dev/shm");
    }
}
