//! RDMA between hosts (`TOROID_RDMA`), over the in-process fake of the verbs
//! (`TOROID_RDMA=fake`: ranks are threads of this process, hosts are host identities): every
//! collective gives the reference result on every element with the links between hosts on
//! RDMA and those inside a host on shared memory; a rank that cannot use RDMA keeps TCP with
//! everyone while the others use RDMA among themselves; ranks in different processes find they
//! cannot pair and keep TCP; a peer that goes away is an error within seconds, not at the
//! deadline; a mismatch and an abort reach every rank through the RDMA links; a link on demand
//! moves to RDMA without waiting for the accepting rank's engine.
//!
//! No RDMA hardware ran any of this: the verbs are the fake's (src/transport/rdma/fake.rs), which
//! the library has only with the cargo feature `rdma-fake`; Cargo.toml's dev-dependency on the
//! package itself turns it on for the tests.
#![cfg(feature = "rdma-fake")]

mod util;

use std::time::{Duration, Instant};

use toroid::{Communicator, Config, RdmaMode, ReduceOp};

/// A mesh (every link made at set-up), the host `host`, RDMA as `rdma`.
fn config(host: usize, rdma: RdmaMode) -> Config {
    Config {
        connect_lazy: false,
        host_id: Some(format!("rdma-test-host-{host}")),
        rdma,
        cost_model: Some("default".into()),
        ..util::test_config(60.0)
    }
}

#[test]
fn collectives_between_hosts_over_rdma_match_the_reference() {
    if util::is_child() {
        return;
    }
    // (ranks, hosts, links on demand): rank r lives on host r % hosts.
    for (n, hosts, lazy) in
        [(2usize, 2usize, false), (3, 3, false), (5, 2, false), (4, 2, false), (5, 3, true)]
    {
        util::run_threads_with(
            n,
            move |r| Config { connect_lazy: lazy, ..config(r % hosts, RdmaMode::Fake) },
            move |comm: Communicator| {
                let r = comm.rank();
                let kinds = |comm: &Communicator| -> Vec<(usize, &'static str)> {
                    comm.connected_peers()
                        .into_iter()
                        .filter_map(|p| Some((p, comm.transport_to(p)?)))
                        .collect()
                };
                let bad = util::cases::run_matrix(&comm, n == 4);
                assert!(bad.is_empty(), "{n} ranks on {hosts} hosts, rank {r}: {bad:?}");
                let linked = kinds(&comm);
                // On demand, the matrix (broadcast and reduce from the last rank, all-to-all)
                // linked every pair too.
                assert_eq!(linked.len(), n - 1, "{n} ranks, lazy {lazy}: rank {r} linked {linked:?}");
                for (p, kind) in linked {
                    let want = if p % hosts == r % hosts { "shm" } else { "rdma" };
                    assert_eq!(kind, want, "{n} ranks, lazy {lazy}: rank {r} to {p}");
                }
            },
        );
    }
}

#[test]
fn a_rank_without_rdma_keeps_tcp_and_the_others_use_rdma_among_themselves() {
    if util::is_child() {
        return;
    }
    let n = 4;
    for lazy in [false, true] {
        util::run_threads_with(
            n,
            move |r| Config {
                connect_lazy: lazy,
                ..config(r, if r == 2 { RdmaMode::Off } else { RdmaMode::Fake })
            },
            move |comm: Communicator| {
                let r = comm.rank();
                for p in (0..n).filter(|&p| p != r) {
                    let want = if p == 2 || r == 2 { "tcp" } else { "rdma" };
                    assert_eq!(comm.transport_to(p), Some(want), "rank {r} to {p}");
                }
                for (seed, count) in [(1u64, 1usize), (2, 4099), (3, 1 << 20)] {
                    let mut v: Vec<f64> = (0..count).map(|i| value(seed, r, i)).collect();
                    comm.all_reduce(&mut v, ReduceOp::Sum).expect("all-reduce");
                    for (i, got) in v.iter().enumerate() {
                        // Integers in f64: the sum is exact whatever the order.
                        let want: f64 = (0..n).map(|q| value(seed, q, i)).sum();
                        assert_eq!(*got, want, "rank {r}, element {i} of {count}");
                    }
                }
                for p in comm.connected_peers() {
                    let want = if p == 2 || r == 2 { "tcp" } else { "rdma" };
                    assert_eq!(comm.transport_to(p), Some(want), "lazy {lazy}: rank {r} linked to {p}");
                }
            },
        );
    }
}

/// An integer-valued input of `rank` at `i`.
fn value(seed: u64, rank: usize, i: usize) -> f64 {
    let x = (seed ^ (rank as u64) << 40 ^ i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((x >> 44) as i64 - (1 << 19)) as f64
}

#[test]
fn a_peer_that_goes_away_is_an_error_within_seconds() {
    if util::is_child() {
        return;
    }
    let n = 2;
    let deadline_s = 60.0;
    util::run_threads_with(
        n,
        |r| Config { timeout: Duration::from_secs_f64(deadline_s), ..config(r, RdmaMode::Fake) },
        move |comm: Communicator| {
            assert_eq!(comm.transport_to(1 - comm.rank()), Some("rdma"));
            let mut v = vec![1f32; 1 << 16];
            comm.all_reduce(&mut v, ReduceOp::Sum).expect("first all-reduce");
            if comm.rank() == 1 {
                // Rank 1 leaves without taking part in the next call.
                drop(comm);
                return;
            }
            let t = Instant::now();
            let e = comm.all_reduce(&mut v, ReduceOp::Sum).expect_err("the peer is gone");
            let took = t.elapsed();
            assert!(took < Duration::from_secs(20), "failed only after {took:?}: {e}");
            assert!(e.to_string().contains("rank 1"), "{e}");
        },
    );
}

#[test]
fn ranks_in_different_processes_cannot_share_the_fake_and_keep_tcp() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("communicator from toroid-run's environment");
        let peer = 1 - comm.rank();
        let mut v: Vec<f64> = (0..10_000).map(|i| value(9, comm.rank(), i)).collect();
        comm.all_reduce(&mut v, ReduceOp::Sum).expect("all-reduce over TCP");
        let ok = v.iter().enumerate().all(|(i, x)| *x == value(9, 0, i) + value(9, 1, i));
        println!(
            "link to {peer}: {:?}, sums {}",
            comm.transport_to(peer),
            if ok { "right" } else { "WRONG" }
        );
        return;
    }
    for connect in ["mesh", "lazy"] {
        let env = [("TOROID_RDMA", "fake"), ("TOROID_CONNECT", connect), ("TOROID_TIMEOUT", "60")];
        let out = util::launch_with(
            "ranks_in_different_processes_cannot_share_the_fake_and_keep_tcp",
            2,
            &["--emulate-hosts", "2"],
            &env,
            120,
        );
        util::assert_success(&out, &format!("2 processes with TOROID_RDMA=fake, TOROID_CONNECT={connect}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            stdout.lines().filter(|l| l.contains("Some(\"tcp\"), sums right")).count(),
            2,
            "{connect}: {stdout}"
        );
        assert!(stderr.contains("another process's fake fabric"), "{connect}: the WARN says why: {stderr}");
    }
}

#[test]
fn a_mismatch_and_an_abort_reach_every_rank_over_rdma() {
    if util::is_child() {
        return;
    }
    // Mismatched counts: both ranks name the mismatch, within seconds.
    util::run_threads_with(
        3,
        |r| config(r, RdmaMode::Fake),
        |comm: Communicator| {
            assert_eq!(comm.transport_to((comm.rank() + 1) % 3), Some("rdma"));
            let count = if comm.rank() == 1 { 200 } else { 100 };
            let mut buf = vec![1.0f32; count];
            let t = Instant::now();
            let e = comm.all_reduce(&mut buf, ReduceOp::Sum).expect_err("mismatch");
            assert!(t.elapsed() < Duration::from_secs(10), "after {:?}: {e}", t.elapsed());
            let msg = e.to_string();
            assert!(msg.contains("mismatch") || msg.contains("abort"), "rank {}: {msg}", comm.rank());
            assert!(comm.is_aborted());
        },
    );
    // An abort while the peer has not joined: the abort frame travels over RDMA.
    util::run_threads_with(
        2,
        |r| config(r, RdmaMode::Fake),
        |comm: Communicator| {
            let comm = std::sync::Arc::new(comm);
            if comm.rank() == 0 {
                let c2 = comm.clone();
                let aborter = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(200));
                    c2.abort();
                });
                let e = comm.barrier().expect_err("aborted");
                assert!(matches!(e, toroid::Error::Aborted(_)), "{e}");
                aborter.join().expect("aborter");
            } else {
                std::thread::sleep(Duration::from_millis(600));
                let t = Instant::now();
                let e = match comm.barrier() {
                    Err(e) => e,
                    Ok(()) => comm.barrier().expect_err("the abort behind the first barrier"),
                };
                assert!(t.elapsed() < Duration::from_secs(10), "after {:?}: {e}", t.elapsed());
                assert!(e.to_string().contains("abort"), "{e}");
            }
        },
    );
}

#[test]
fn a_link_on_demand_moves_to_rdma_while_the_accepting_rank_is_busy() {
    if util::is_child() {
        return;
    }
    // Rank 2 dials rank 0 for a send while rank 0's thread is not inside toroid at all (its
    // engine runs nothing), then waits in a receive from rank 1: the accepting half of the
    // exchange runs in rank 0's control thread, so the send lands in the RDMA ring without
    // waiting for rank 0's engine.
    util::run_threads_with(
        3,
        |r| Config { connect_lazy: true, ..config(r, RdmaMode::Fake) },
        |comm: Communicator| match comm.rank() {
            0 => {
                std::thread::sleep(Duration::from_millis(1500));
                let mut from1 = [0u32; 4];
                comm.recv(&mut from1, 1).expect("from rank 1");
                assert_eq!(from1, [1; 4]);
                let mut from2 = [0u32; 4];
                comm.recv(&mut from2, 2).expect("from rank 2");
                assert_eq!(from2, [2; 4]);
                assert_eq!(comm.transport_to(2), Some("rdma"));
            }
            1 => {
                std::thread::sleep(Duration::from_millis(1500));
                comm.send(&[1u32; 4], 0).expect("to rank 0");
            }
            _ => {
                let t = Instant::now();
                comm.send(&[2u32; 4], 0).expect("to rank 0");
                let took = t.elapsed();
                assert!(took < Duration::from_millis(1000), "the send waited {took:?} for rank 0's engine");
                assert_eq!(comm.transport_to(0), Some("rdma"));
            }
        },
    );
}
