//! Striped connections (`TOROID_NSOCKS`; `src/transport/tcp/striped.rs`): with several TCP
//! connections per pair of ranks every collective still delivers every element exactly (the
//! correctness matrix on random data, checked against the independent reference, on 3, 4 and 5
//! ranks), ranks that ask for different numbers agree on the larger, and the per-flow cap of
//! the emulated cluster (`TOROID_TEST_FLOW_RATE`) is set on every connection. The same holds
//! with progress threads (`TOROID_NTHREADS`; `src/transport/tcp/progress.rs`), whatever mix of
//! ranks with and without them.

mod util;

use toroid::{Communicator, Config};

fn striped(nsocks: usize) -> Config {
    Config { nsocks, shm_disable: true, ..util::test_config(120.0) }
}

fn assert_striped(comm: &Communicator) {
    let me = comm.rank();
    for p in (0..comm.size()).filter(|&p| p != me) {
        assert_eq!(comm.transport_to(p), Some("tcp-striped"), "rank {me} to {p}");
    }
}

#[test]
fn every_collective_is_exact_over_three_lanes_on_3_4_and_5_ranks() {
    for n in [3, 4, 5] {
        util::run_threads(n, &striped(3), move |comm| {
            assert_striped(&comm);
            // The large cases (1 Mi elements: every frame spans many chunks and every lane)
            // on 4 ranks; the small ones everywhere.
            let failures = util::cases::run_matrix(&comm, n == 4);
            assert!(failures.is_empty(), "{n} ranks, rank {}: {failures:#?}", comm.rank());
        });
    }
}

/// Threads of this process named as progress threads are (`toroid-progress-<i>`).
fn progress_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("toroid-progress"))
        .count()
}

#[test]
fn every_collective_is_exact_with_progress_threads_on_any_mix_of_ranks() {
    // Threads per rank: some ranks with, some without (what a rank does with its bytes is its
    // own business: the stream on the wire is the same).
    let threads = [2, 0, 1, 3, 1];
    for (n, nsocks) in [(3, 3), (4, 2), (5, 1)] {
        util::run_threads_with(
            n,
            move |r| Config { nthreads: threads[r], ..striped(nsocks) },
            move |comm| {
                let me = comm.rank();
                let want = if nsocks > 1 { "tcp-striped" } else { "tcp" };
                for p in (0..n).filter(|&p| p != me) {
                    assert_eq!(comm.transport_to(p), Some(want), "rank {me} to {p}");
                }
                let failures = util::cases::run_matrix(&comm, n == 4);
                assert!(failures.is_empty(), "{n} ranks, {nsocks} lanes, rank {me}: {failures:#?}");
                // Every rank's links are open: each rank with threads started all of its own
                // (the ranks are threads of this process; no other test starts any).
                comm.barrier().expect("barrier");
                let want: usize = threads[..n].iter().sum();
                assert_eq!(progress_threads(), want, "{n} ranks, rank {me}");
                comm.barrier().expect("barrier");
            },
        );
    }
}

#[test]
fn ranks_asking_for_different_lanes_agree_on_the_larger() {
    // Rank 0 asks for 2, rank 1 leaves it to the link (1 on loopback), rank 2 asks for 4.
    let asks = [2, 0, 4];
    util::run_threads_with(
        3,
        move |r| striped(asks[r]),
        |comm| {
            assert_striped(&comm);
            let failures = util::cases::run_matrix(&comm, false);
            assert!(failures.is_empty(), "rank {}: {failures:#?}", comm.rank());
        },
    );
}

#[test]
fn the_test_flow_cap_paces_every_connection() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("communicator");
        assert_striped(&comm);
        // Each rank sends 16 MiB over 2 lanes capped at 40 Mbit/s each (10 MB/s together):
        // about 1.7 s; uncapped loopback takes milliseconds.
        let mut buf = vec![1.0f32; 4 << 20];
        let t = std::time::Instant::now();
        comm.all_reduce(&mut buf, toroid::ReduceOp::Sum).expect("all_reduce");
        let took = t.elapsed();
        assert!(buf.iter().all(|v| *v == 2.0), "wrong sum");
        println!("capped all_reduce of 2 MiB took {took:.2?}");
        assert!(took.as_secs_f64() > 0.8, "the cap did not slow the transfer: {took:?}");
        return;
    }
    let env = [("TOROID_NSOCKS", "2"), ("TOROID_SHM_DISABLE", "1"), ("TOROID_TEST_FLOW_RATE", "40mbit")];
    let out = util::launch("the_test_flow_cap_paces_every_connection", 2, &env, 120);
    util::assert_success(&out, "TOROID_TEST_FLOW_RATE=40mbit");
}
