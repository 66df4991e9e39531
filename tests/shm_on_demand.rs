//! Shared-memory pairs on demand (`TOROID_CONNECT=lazy`, the default): set-up maps only the
//! window and links only what its set-up runs over (rank 0 and each other rank); every other
//! pair of one host gets its segment when an operation first needs it, and then moves its
//! data through shared memory. Point-to-point and collectives without the window give the
//! reference result on every element, a rank with shared memory off keeps TCP with everyone,
//! the pairs' names never stay in the segment directory, and separate processes pair the same
//! way as threads.

mod util;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use toroid::{Communicator, Config, DataType, ReduceOp};
use util::cases::{Case, Coll, check};

/// One host, shared memory on, links on demand, no probe, in a segment directory of its own.
fn shm_config(dir: &Path, window: bool) -> Config {
    Config {
        connect_lazy: true,
        cost_model: Some("default".into()),
        shm_dir: dir.to_path_buf(),
        shm_ring_size: 64 * 1024,
        shm_chunk_size: if window { 64 * 1024 } else { 0 },
        ..util::test_config(60.0)
    }
}

fn fresh_dir(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("toroid-shm-on-demand-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn names_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

/// Deterministic bytes of message `tag` from rank `from` to rank `to`.
fn payload(tag: u64, from: usize, to: usize, len: usize) -> Vec<u64> {
    let mut x = tag ^ ((from as u64) << 32) ^ ((to as u64) << 16) ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect()
}

/// Every rank exchanges `len` words with both ring neighbours in one group (no order needed).
fn ring_exchange(comm: &Communicator, tag: u64, len: usize) {
    let (r, n) = (comm.rank(), comm.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let to_next = payload(tag, r, next, len);
    let to_prev = payload(tag + 1, r, prev, len);
    let mut from_prev = vec![0u64; len];
    let mut from_next = vec![0u64; len];
    let mut g = comm.group();
    g.send(&to_next, next).send(&to_prev, prev).recv(&mut from_prev, prev).recv(&mut from_next, next);
    g.run().expect("the ring exchange");
    assert!(from_prev == payload(tag, prev, r, len), "rank {r}: from rank {prev}");
    assert!(from_next == payload(tag + 1, next, r, len), "rank {r}: from rank {next}");
}

#[test]
fn a_pair_of_one_host_gets_its_segment_when_first_used() {
    if util::is_child() {
        return;
    }
    for n in [3usize, 5] {
        let dir = fresh_dir(&format!("first-use-{n}"));
        let cfg = shm_config(&dir, true);
        let d = dir.clone();
        util::run_threads(n, &cfg, move |comm| {
            let r = comm.rank();
            assert!(comm.has_shared_window());
            // Set-up linked only what the window's set-up runs over.
            let star: BTreeSet<usize> = if r == 0 { (1..n).collect() } else { BTreeSet::from([0]) };
            let early: BTreeSet<usize> = comm.connected_peers().into_iter().collect();
            assert_eq!(early, star, "rank {r} after set-up");
            // A barrier and a split's exchange on one host run in the window: they link nobody.
            comm.barrier().unwrap();
            let child = comm.split(Some(0), -(r as i64)).unwrap().expect("a member");
            assert_eq!(child.rank(), n - 1 - r);
            drop(child);
            assert_eq!(comm.connected_peers().into_iter().collect::<BTreeSet<_>>(), star, "rank {r}");
            // 5 x 64 KiB rings' worth each way: the rings wrap many times.
            ring_exchange(&comm, 1, 40_000);
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let got: BTreeSet<usize> = comm.connected_peers().into_iter().collect();
            let want: BTreeSet<usize> = star.iter().copied().chain([next, prev]).collect();
            assert_eq!(got, want, "rank {r}'s links after the exchange");
            for p in got {
                assert_eq!(comm.transport_to(p), Some("shm"), "rank {r} to rank {p}");
            }
            // Window collectives go on beside the pairs.
            let case = Case {
                coll: Coll::AllReduce,
                dtype: DataType::F32,
                op: ReduceOp::Sum,
                count: 100_003,
                in_place: false,
                algo: None,
            };
            check(&comm, 77, &case).unwrap_or_else(|e| panic!("{n} ranks: {e}"));
            ring_exchange(&comm, 3, 17);
            comm.barrier().unwrap();
            assert!(names_in(&d).is_empty(), "rank {r}: names left in {}: {:?}", d.display(), names_in(&d));
        });
        assert!(names_in(&dir).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn without_the_window_collectives_run_over_pairs_linked_on_demand() {
    if util::is_child() {
        return;
    }
    for n in [2usize, 3, 5] {
        let dir = fresh_dir(&format!("no-window-{n}"));
        let cfg = shm_config(&dir, false);
        util::run_threads(n, &cfg, move |comm| {
            let r = comm.rank();
            assert!(!comm.has_shared_window());
            for (id, (coll, dtype, op, count)) in [
                (Coll::AllReduce, DataType::F64, ReduceOp::Sum, 50_001),
                (Coll::AllReduce, DataType::I32, ReduceOp::Max, 7),
                (Coll::AllGather, DataType::U8, ReduceOp::Sum, 70_000),
                (Coll::Broadcast(n - 1), DataType::F32, ReduceOp::Sum, 30_000),
                (Coll::ReduceScatter, DataType::I64, ReduceOp::Sum, 9_000),
                (Coll::AllToAll, DataType::F32, ReduceOp::Sum, 3_000),
            ]
            .into_iter()
            .enumerate()
            {
                let case = Case { coll, dtype, op, count, in_place: false, algo: None };
                check(&comm, 500 + id as u64, &case).unwrap_or_else(|e| panic!("{n} ranks: {e}"));
            }
            let peers = comm.connected_peers();
            assert!(!peers.is_empty(), "rank {r} linked nobody");
            for p in peers {
                assert_eq!(comm.transport_to(p), Some("shm"), "rank {r} to rank {p}");
            }
        });
        assert!(names_in(&dir).is_empty(), "names left: {:?}", names_in(&dir));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_rank_with_shared_memory_off_keeps_tcp_with_everyone() {
    if util::is_child() {
        return;
    }
    let n = 4;
    let off = 2;
    let dir = fresh_dir("one-off");
    let d = dir.clone();
    util::run_threads_with(
        n,
        move |r| Config { shm_disable: r == off, ..shm_config(&d, true) },
        move |comm| {
            let r = comm.rank();
            // The window needs every rank: without rank 2's, collectives use the pairs.
            assert!(!comm.has_shared_window());
            ring_exchange(&comm, 9, 20_000);
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            for p in [next, prev] {
                let want = if r == off || p == off { "tcp" } else { "shm" };
                assert_eq!(comm.transport_to(p), Some(want), "rank {r} to rank {p}");
            }
            let case = Case {
                coll: Coll::AllReduce,
                dtype: DataType::I64,
                op: ReduceOp::Sum,
                count: 33_333,
                in_place: true,
                algo: None,
            };
            check(&comm, 91, &case).unwrap_or_else(|e| panic!("{e}"));
        },
    );
    assert!(names_in(&dir).is_empty(), "names left: {:?}", names_in(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn processes_pair_through_shared_memory_on_demand() {
    const TIMEOUT_S: u64 = 30;
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let (r, n) = (comm.rank(), comm.size());
        let linked: Vec<usize> = comm.connected_peers();
        println!("SETUP {linked:?}");
        ring_exchange(&comm, 40, 300_000);
        // Every pair, one at a time in rank order: the lower sends first.
        for p in (0..n).filter(|p| *p != r) {
            let mine = payload(60, r, p, 1000);
            let mut theirs = vec![0u64; 1000];
            if r < p {
                comm.send(&mine, p).unwrap();
                comm.recv(&mut theirs, p).unwrap();
            } else {
                comm.recv(&mut theirs, p).unwrap();
                comm.send(&mine, p).unwrap();
            }
            assert!(theirs == payload(60, p, r, 1000), "rank {r} from rank {p}");
        }
        let kinds: Vec<&str> = (0..n).filter(|p| *p != r).filter_map(|p| comm.transport_to(p)).collect();
        println!("KINDS {kinds:?}");
        comm.barrier().unwrap();
        println!("DONE");
        return;
    }
    let n = 4;
    let dir = fresh_dir("processes");
    let d = dir.to_string_lossy().into_owned();
    let children = util::spawn_ranks("processes_pair_through_shared_memory_on_demand", n, |_| {
        vec![
            ("TOROID_TIMEOUT".into(), TIMEOUT_S.to_string()),
            ("TOROID_CONNECT".into(), "lazy".into()),
            ("TOROID_COST_MODEL".into(), "default".into()),
            ("TOROID_SHM_DIR".into(), d.clone()),
            ("TOROID_SHM_RING_SIZE".into(), "64K".into()),
        ]
    });
    let (statuses, outputs) = util::wait_all(children, Instant::now() + Duration::from_secs(TIMEOUT_S + 30));
    for (r, out) in outputs.iter().enumerate() {
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r}:\n{out}");
        assert!(out.contains("DONE"), "rank {r}:\n{out}");
        let want_setup = if r == 0 { "SETUP [1, 2, 3]" } else { "SETUP [0]" };
        assert!(out.contains(want_setup), "rank {r} linked more at set-up:\n{out}");
        assert!(out.contains(r#"KINDS ["shm", "shm", "shm"]"#), "rank {r}:\n{out}");
    }
    assert!(names_in(&dir).is_empty(), "names left: {:?}", names_in(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_window_member_with_no_link_that_dies_is_found_within_seconds() {
    const TIMEOUT_S: u64 = 30;
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        assert!(comm.has_shared_window());
        let mut v = vec![1.0f32; 1000];
        // A window collective: it links nobody.
        comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        match comm.rank() {
            // Rank 2 dies; rank 1, which has no link to it (set-up linked only rank 0 with each
            // rank), waits in the window for the broadcast's root while rank 0, which could
            // tell from its link, is busy elsewhere.
            2 => {
                // SAFETY: kill(2) on our own pid; no memory is involved.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            1 => {
                println!("LINKED {:?}", comm.connected_peers());
                let start = Instant::now();
                let e = comm.broadcast(&mut v, 2).unwrap_err();
                println!("ERROR {} after {} ms: {e}", e.category(), start.elapsed().as_millis());
            }
            _ => {
                std::thread::sleep(Duration::from_secs(8));
                let _ = comm.broadcast(&mut v, 2);
            }
        }
        return;
    }
    let children =
        util::spawn_ranks("a_window_member_with_no_link_that_dies_is_found_within_seconds", 3, |_| {
            vec![
                ("TOROID_TIMEOUT".into(), TIMEOUT_S.to_string()),
                ("TOROID_CONNECT".into(), "lazy".into()),
                ("TOROID_COST_MODEL".into(), "default".into()),
            ]
        });
    let (statuses, outputs) = util::wait_all(children, Instant::now() + Duration::from_secs(TIMEOUT_S + 30));
    let out = &outputs[1];
    assert_eq!(statuses[1].map(|s| s.success()), Some(true), "rank 1:\n{out}");
    let linked =
        out.lines().find_map(|l| l.split("LINKED ").nth(1)).unwrap_or_else(|| panic!("rank 1:\n{out}"));
    assert!(!linked.contains('2'), "rank 1 should have no link to rank 2: {linked}");
    let (line, ms) = util::error_line(out).unwrap_or_else(|| panic!("rank 1 saw no error:\n{out}"));
    // Rank 0 comes after 8 s: an error before that is the gone check's.
    assert!(ms < 5_000, "rank 1 waited {ms} ms: {line}");
    assert!(line.contains("rank 2") && line.contains("gone"), "{line}");
}

#[test]
fn a_pair_opened_to_a_rank_that_failed_gets_its_reason() {
    if util::is_child() {
        return;
    }
    use std::sync::{Arc, Barrier};
    // No window, so set-up links nobody: rank 1 dials rank 0 only after rank 0 aborted. Rank
    // 0's control thread reads the offer, refuses it and sends its abort frame, so rank 1's
    // receive fails with rank 0's reason, not with a broken exchange.
    let dir = fresh_dir("failed-peer");
    let aborted = Arc::new(Barrier::new(2));
    let a = aborted.clone();
    util::run_threads(2, &shm_config(&dir, false), move |comm| {
        if comm.rank() == 0 {
            comm.abort();
            a.wait();
            // Stay until rank 1 is done: the control thread answers for this communicator.
            a.wait();
        } else {
            a.wait();
            let mut got = [0u32; 8];
            let r = comm.recv(&mut got, 0);
            a.wait();
            let msg = r.expect_err("a receive from a rank that aborted").to_string();
            assert!(msg.contains("rank 0 called abort"), "rank 1: {msg}");
        }
    });
    assert!(names_in(&dir).is_empty(), "names left: {:?}", names_in(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}
