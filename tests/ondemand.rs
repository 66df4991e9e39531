//! Connections on demand (`TOROID_CONNECT=lazy`): all-reduces give the reference result on
//! every element and open exactly the links their algorithm needs; a receive from any source
//! and sends between any pair still find each other; a rank that dies is reported on every
//! rank, including those that never linked to it.

mod util;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use toroid::{Algorithm, Communicator, Config, DataType, ReduceOp};
use util::cases::{Case, Coll, check};

/// TCP only (threads of one process share a host, and shared memory would link them all at
/// set-up), no probe unless asked, links on demand.
fn lazy_config(algo: &str, shape: Option<(usize, usize)>, probe: bool) -> Config {
    Config {
        shm_disable: true,
        connect_lazy: true,
        algo: Some(algo.into()),
        torus_shape: shape,
        cost_model: (!probe).then(|| "default".to_string()),
        ..util::test_config(60.0)
    }
}

/// Ring neighbours of position `i` in a ring of `len`.
fn ring_neighbours(i: usize, len: usize) -> Vec<usize> {
    if len < 2 { Vec::new() } else { vec![(i + len - 1) % len, (i + 1) % len] }
}

/// The peers each algorithm exchanges with, derived from its paper's schedule (not from
/// toroid's code).
fn expected_peers(algo: Algorithm, rank: usize, n: usize, shape: (usize, usize)) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    match algo {
        Algorithm::Ring => out.extend(ring_neighbours(rank, n)),
        Algorithm::Torus2d => {
            // Rank order: rank = y * X + x; rows of X, columns of Y.
            let (x_len, y_len) = shape;
            let (x, y) = (rank % x_len, rank / x_len);
            out.extend(ring_neighbours(x, x_len).into_iter().map(|xx| y * x_len + xx));
            out.extend(ring_neighbours(y, y_len).into_iter().map(|yy| yy * x_len + x));
        }
        Algorithm::HalvingDoubling | Algorithm::Doubling => {
            // MPICH: the first 2 * rem ranks fold in pairs, the p = 2^k others exchange with
            // the rank differing in one bit of their virtual rank.
            let p = if n == 0 { 0 } else { 1 << (usize::BITS - 1 - n.leading_zeros()) };
            let rem = n - p;
            let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
            if rank < 2 * rem {
                out.insert(rank ^ 1);
            }
            let virt = if rank < 2 * rem { (rank % 2 == 1).then_some(rank / 2) } else { Some(rank - rem) };
            if let Some(v) = virt {
                let mut bit = 1;
                while bit < p {
                    out.insert(real(v ^ bit));
                    bit <<= 1;
                }
            }
        }
        _ => unreachable!("not tested here"),
    }
    out.remove(&rank);
    out
}

fn shape_for(n: usize) -> (usize, usize) {
    match n {
        6 => (3, 2),
        8 => (4, 2),
        9 => (3, 3),
        12 => (4, 3),
        n => (n, 1),
    }
}

fn algo_name(a: Algorithm) -> &'static str {
    match a {
        Algorithm::Ring => "ring",
        Algorithm::Torus2d => "torus2d",
        Algorithm::HalvingDoubling => "hd",
        Algorithm::Doubling => "rd",
        _ => unreachable!(),
    }
}

#[test]
fn all_reduces_on_demand_match_the_reference_and_open_only_their_links() {
    if util::is_child() {
        return;
    }
    let algos = [Algorithm::Ring, Algorithm::Torus2d, Algorithm::HalvingDoubling, Algorithm::Doubling];
    for n in [2usize, 3, 5, 6, 8, 9, 12] {
        for algo in algos {
            let shape = shape_for(n);
            let cfg = lazy_config(algo_name(algo), Some(shape), false);
            util::run_threads(n, &cfg, move |comm| {
                let r = comm.rank();
                assert!(comm.connects_on_demand());
                // No link at set-up but those a peer already opened for the first all-reduce.
                let want = expected_peers(algo, r, n, shape);
                let early: BTreeSet<usize> = comm.connected_peers().into_iter().collect();
                assert!(
                    early.is_subset(&want),
                    "rank {r}: linked at set-up to {early:?}, needs only {want:?}"
                );
                for (id, (dtype, op, count, in_place)) in [
                    (DataType::F32, ReduceOp::Sum, 4099, true),
                    (DataType::I64, ReduceOp::Max, 1000, false),
                    (DataType::F64, ReduceOp::Sum, 1 << 16, false),
                    (DataType::U8, ReduceOp::Sum, 7, true),
                ]
                .into_iter()
                .enumerate()
                {
                    let case = Case { coll: Coll::AllReduce, dtype, op, count, in_place, algo: Some(algo) };
                    check(&comm, 31_000 + id as u64, &case)
                        .unwrap_or_else(|e| panic!("{n} ranks, {algo:?}: {e}"));
                }
                let got: BTreeSet<usize> = comm.connected_peers().into_iter().collect();
                assert_eq!(got, want, "{n} ranks, {algo:?}, shape {shape:?}: rank {r}'s links");
            });
        }
    }
}

#[test]
fn the_probe_adds_only_its_own_pair() {
    if util::is_child() {
        return;
    }
    // 8 ranks on a 4 x 2 torus with the cost model's probe (ranks 0 and 1 of this host) and
    // the calibration's all-reduce (the forced algorithm): X + Y - 2 = 4 links at most per rank,
    // plus the probe's.
    let n = 8;
    let cfg = lazy_config("torus2d", Some((4, 2)), true);
    util::run_threads(n, &cfg, move |comm| {
        let r = comm.rank();
        let mut want = expected_peers(Algorithm::Torus2d, r, n, (4, 2));
        if r < 2 {
            want.insert(1 - r);
        }
        let got: BTreeSet<usize> = comm.connected_peers().into_iter().collect();
        assert_eq!(got, want, "rank {r} after set-up");
        assert!(got.len() <= 4 + 2 - 2 + 1);
        let mut v = vec![r as f32; 100];
        comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert!(v.iter().all(|x| *x == 28.0));
        assert_eq!(comm.connected_peers().into_iter().collect::<BTreeSet<_>>(), want);
    });
}

#[test]
fn every_collective_and_point_to_point_pattern_finds_its_peers() {
    if util::is_child() {
        return;
    }
    for n in [3usize, 5, 6] {
        let cfg = Config { algo: None, ..lazy_config("ring", None, false) };
        util::run_threads(n, &cfg, move |comm| {
            let r = comm.rank();
            // Collectives whose algorithms use other peers than the all-reduce's.
            let mut cases = Vec::new();
            for root in [0, n - 1] {
                cases.push(Case {
                    coll: Coll::Broadcast(root),
                    dtype: DataType::F32,
                    op: ReduceOp::Sum,
                    count: 5000,
                    in_place: true,
                    algo: None,
                });
                cases.push(Case {
                    coll: Coll::Reduce(root),
                    dtype: DataType::I32,
                    op: ReduceOp::Sum,
                    count: 300,
                    in_place: false,
                    algo: None,
                });
            }
            cases.push(Case {
                coll: Coll::AllGather,
                dtype: DataType::F64,
                op: ReduceOp::Sum,
                count: 99,
                in_place: false,
                algo: None,
            });
            cases.push(Case {
                coll: Coll::ReduceScatter,
                dtype: DataType::F32,
                op: ReduceOp::Sum,
                count: 1000,
                in_place: false,
                algo: None,
            });
            cases.push(Case {
                coll: Coll::AllToAll,
                dtype: DataType::I64,
                op: ReduceOp::Sum,
                count: 40,
                in_place: false,
                algo: None,
            });
            for (id, c) in cases.iter().enumerate() {
                check(&comm, 32_000 + id as u64, c).unwrap_or_else(|e| panic!("{n} ranks: {e}"));
            }
            comm.barrier().unwrap();
            // Every rank sends to every other (lower ranks first, then higher: both the rank
            // that dials and the one that waits start the pair), then a receive from any source.
            for p in 0..n {
                if p == r {
                    continue;
                }
                let mine = [(r * 100 + p) as i32; 3];
                let mut theirs = [0i32; 3];
                if r < p {
                    comm.send(&mine, p).unwrap();
                    comm.recv(&mut theirs, p).unwrap();
                } else {
                    comm.recv(&mut theirs, p).unwrap();
                    comm.send(&mine, p).unwrap();
                }
                assert_eq!(theirs, [(p * 100 + r) as i32; 3]);
            }
            if r == 0 {
                let mut seen = BTreeSet::new();
                for _ in 1..n {
                    let mut b = [0u64; 2];
                    let from = comm.recv_any(&mut b).unwrap();
                    assert_eq!(b, [from as u64; 2]);
                    seen.insert(from);
                }
                assert_eq!(seen.len(), n - 1);
            } else {
                comm.send(&[r as u64; 2], 0).unwrap();
            }
            comm.barrier().unwrap();
        });
    }
}

#[test]
fn a_receive_from_any_source_before_any_link_exists() {
    if util::is_child() {
        return;
    }
    // The highest rank receives from any source first thing: lower ranks would wait for it to
    // dial, so it dials them all; the lowest rank's message must get through.
    let n = 4;
    let cfg = lazy_config("ring", None, false);
    util::run_threads(n, &cfg, move |comm| {
        let r = comm.rank();
        if r == n - 1 {
            let mut b = [0u32; 1];
            let from = comm.recv_any(&mut b).unwrap();
            assert_eq!((from, b[0]), (0, 77));
        } else if r == 0 {
            comm.send(&[77u32], n - 1).unwrap();
        }
        comm.barrier().unwrap();
    });
}

#[test]
fn a_dead_rank_is_reported_on_every_rank_with_links_on_demand() {
    const TIMEOUT_S: u64 = 20;
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let mut buf = vec![1.0f32; 1 << 20];
        // Links first: one all-reduce completes everywhere.
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        println!("PEERS {:?}", comm.connected_peers());
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
                println!("ERROR {} after {} ms: {e}", e.category(), start.elapsed().as_millis());
                let t = Instant::now();
                let again = comm.barrier().unwrap_err();
                println!("LATER {} in {} us", again.category(), t.elapsed().as_micros());
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "no error within 60 s");
        }
    }
    // 8 ranks on a 4 x 2 torus: rank 2 links to 1 and 3 (its row ring's neighbours) and 6 (its
    // column); ranks 0, 4, 5 and 7 never link to it and must learn of its death through the
    // others.
    let n = 8;
    let children = util::spawn_ranks("a_dead_rank_is_reported_on_every_rank_with_links_on_demand", n, |_| {
        [
            ("TOROID_TIMEOUT", TIMEOUT_S.to_string()),
            ("TOROID_SHM_DISABLE", "1".into()),
            ("TOROID_CONNECT", "lazy".into()),
            ("TOROID_ALGO", "torus2d".into()),
            ("TOROID_TORUS_SHAPE", "4x2".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    });
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let deadline = Instant::now() + Duration::from_secs(TIMEOUT_S + 30);
    let (statuses, outputs) = util::wait_all(children, deadline);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(statuses[2].and_then(|s| s.signal()), Some(libc::SIGKILL), "rank 2 should die by SIGKILL");
    for r in (0..n).filter(|r| *r != 2) {
        let out = &outputs[r];
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r} did not exit cleanly:\n{out}");
        let (line, ms) = util::error_line(out).unwrap_or_else(|| panic!("rank {r} saw no error:\n{out}"));
        // From the dead peer's closed sockets and the abort frames, not from a deadline.
        assert!(ms < TIMEOUT_S * 1000 / 2, "rank {r} waited {ms} ms: {line}");
        assert!(line.starts_with("ERROR remote") || line.starts_with("ERROR aborted"), "rank {r}: {line}");
        assert!(out.contains("LATER aborted"), "rank {r}: later calls must fail fast:\n{out}");
        let peers: Vec<usize> = out
            .lines()
            .find_map(|l| l.split("PEERS [").nth(1))
            .map(|l| l.trim_end_matches(']').split(", ").filter_map(|x| x.parse().ok()).collect())
            .unwrap_or_else(|| panic!("rank {r} printed no peers:\n{out}"));
        assert_eq!(peers.contains(&2), [1, 3, 6].contains(&r), "rank {r}: peers {peers:?}");
    }
    for pid in pids {
        assert!(!util::alive(pid), "process {pid} still running");
    }
}

#[test]
fn a_rank_waiting_for_a_dead_peer_to_connect_fails_within_seconds() {
    const TIMEOUT_S: u64 = 60;
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        if comm.rank() == 1 {
            // Dies before it ever dials rank 0.
            // SAFETY: kill(2) on our own pid; no memory is involved.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let start = Instant::now();
        let mut b = [0u8; 4];
        let e = comm.recv(&mut b, 1).unwrap_err();
        println!("ERROR {} after {} ms: {e}", e.category(), start.elapsed().as_millis());
        return;
    }
    let children =
        util::spawn_ranks("a_rank_waiting_for_a_dead_peer_to_connect_fails_within_seconds", 2, |_| {
            vec![
                ("TOROID_TIMEOUT".into(), TIMEOUT_S.to_string()),
                ("TOROID_SHM_DISABLE".into(), "1".into()),
                ("TOROID_CONNECT".into(), "lazy".into()),
                ("TOROID_COST_MODEL".into(), "default".into()),
            ]
        });
    let (statuses, outputs) = util::wait_all(children, Instant::now() + Duration::from_secs(TIMEOUT_S + 20));
    let out = &outputs[0];
    assert_eq!(statuses[0].map(|s| s.success()), Some(true), "rank 0:\n{out}");
    let (line, ms) = util::error_line(out).unwrap_or_else(|| panic!("rank 0 saw no error:\n{out}"));
    assert!(ms < 10_000, "rank 0 waited {ms} ms: {line}");
    assert!(line.contains("rank 1") && line.contains("gone"), "{line}");
}

#[test]
fn split_children_connect_on_demand_too() {
    if util::is_child() {
        return;
    }
    // 6 ranks split into evens and odds; each child (3 ranks) runs a ring all-reduce and links
    // only its two ring neighbours, while the parent keeps the links its split exchange used.
    let n = 6;
    let cfg = lazy_config("ring", None, false);
    util::run_threads(n, &cfg, move |comm| {
        let r = comm.rank();
        let child = comm.split(Some((r % 2) as u32), r as i64).unwrap().expect("a member");
        assert!(child.connects_on_demand());
        // At most the ring neighbours (a neighbour may have dialed during set-up).
        assert!(child.connected_peers().len() <= 2);
        let mut v = vec![r as i64; 1000];
        child.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let want: i64 = (0..n).filter(|p| p % 2 == r % 2).map(|p| p as i64).sum();
        assert!(v.iter().all(|x| *x == want), "rank {r}");
        assert_eq!(child.connected_peers().len(), 2, "rank {r}");
        for p in 0..child.size() {
            if p != child.rank() {
                assert_eq!(child.transport_to(p), Some("tcp"));
            }
        }
    });
}

#[test]
fn ranks_that_link_their_pairs_differently_all_fail_at_once_naming_toroid_connect() {
    if util::is_child() {
        return;
    }
    use std::sync::Arc;
    use toroid::rendezvous::{MemStore, Store};
    // One rank with the full mesh among ranks on demand: rank 0 itself, or another. With a
    // deadline of a minute, an error that only came from waiting would name no TOROID_CONNECT.
    for mesh_rank in [0usize, 2] {
        let n = 3;
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let store = store.clone();
                let cfg = Config { connect_lazy: r != mesh_rank, ..lazy_config("ring", None, false) };
                std::thread::spawn(move || Communicator::with_store(r, n, store, &cfg).map(|_| ()))
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let got = h.join().expect("no panic");
            let e = got.expect_err("a rank with another TOROID_CONNECT must fail set-up");
            assert!(
                matches!(e, toroid::Error::InvalidUsage(_)) && e.to_string().contains("TOROID_CONNECT"),
                "mesh rank {mesh_rank}, rank {r}: {e}"
            );
        }
    }
}
