//! Grouped sends and receives (`Group::send` / `Group::recv`, NCCL's grouped `ncclSend` /
//! `ncclRecv`): every rank sends MiBs to both neighbours before it receives anything, which
//! the same blocking calls one by one cannot complete (each send waits for a receiver that is
//! itself sending), on 2 to 6 ranks in threads and in processes over TCP and shared memory.
//! Checked against what every rank derives from the sender's seed, every element: several
//! messages to one peer arrive in order (an empty one among them), types differ per message, a
//! collective in the group gives its own result, and grouped sends pair with single receives.
//! A group whose receive disagrees with its sender's size, and one whose peer never sends, fail
//! with an error, not a hang, and so do the groups of the neighbours of a rank that is gone.

mod util;

use std::time::{Duration, Instant};

use toroid::{Communicator, Error, ReduceOp};
use util::data::mix;

/// Element `i` of message `m` from rank `src` to rank `dst`.
fn val(src: usize, dst: usize, m: usize, i: usize) -> u64 {
    mix(((src as u64) << 48) ^ ((dst as u64) << 36) ^ ((m as u64) << 28) ^ i as u64)
}

/// Elements of message `m` from `src`: message 0 is MiBs (more than any link buffers) and
/// differs in length per rank, so a receive of the wrong message is caught; 1 is empty.
fn len(src: usize, m: usize) -> usize {
    match m {
        0 => (1 << 19) + 1031 * src,
        1 => 0,
        _ => 17 + 311 * m + 7 * src,
    }
}

fn f32s(src: usize, dst: usize, m: usize) -> Vec<f32> {
    (0..len(src, m)).map(|i| (val(src, dst, m, i) % 1_000_000) as f32).collect()
}

fn u64s(src: usize, dst: usize, m: usize) -> Vec<u64> {
    (0..len(src, m)).map(|i| val(src, dst, m, i)).collect()
}

/// Both neighbours, every send added to the group before any receive.
fn exchange(comm: Communicator) {
    let (n, me) = (comm.size(), comm.rank());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let to_next = (f32s(me, next, 0), f32s(me, next, 1), u64s(me, next, 2));
    let to_prev = u64s(me, prev, 0);
    let mut from_prev = (vec![0f32; len(prev, 0)], vec![0f32; len(prev, 1)], vec![0u64; len(prev, 2)]);
    let mut from_next = vec![0u64; len(next, 0)];
    let mut sum = vec![me as u64 + 1; 1000];
    for round in 0..3 {
        let mut g = comm.group();
        g.send(&to_next.0, next).send(&to_next.1, next).send(&to_next.2, next);
        if n > 2 {
            g.send(&to_prev, prev);
        }
        g.all_reduce(&mut sum, ReduceOp::Sum);
        g.recv(&mut from_prev.0, prev).recv(&mut from_prev.1, prev).recv(&mut from_prev.2, prev);
        if n > 2 {
            g.recv(&mut from_next, next);
        }
        g.run().unwrap_or_else(|e| panic!("rank {me} of {n}, round {round}: {e}"));
        assert_eq!(from_prev.0, f32s(prev, me, 0), "rank {me} of {n}: message 0 from {prev}");
        assert_eq!(from_prev.2, u64s(prev, me, 2), "rank {me} of {n}: message 2 from {prev}");
        if n > 2 {
            assert_eq!(from_next, u64s(next, me, 0), "rank {me} of {n}: message from {next}");
        }
        let want = (n * (n + 1) / 2) as u64 * (n as u64).pow(round);
        assert!(sum.iter().all(|x| *x == want), "rank {me} of {n}, round {round}: all-reduce");
        from_prev.0.fill(0.0);
        from_prev.2.fill(0);
        from_next.fill(0);
    }
    // Grouped sends pair with single receives (small messages: a lone send needs no receiver
    // to complete), and single sends with a grouped receive.
    let small: Vec<Vec<u64>> = (3..6).map(|m| u64s(me, next, m)).collect();
    let mut g = comm.group();
    for s in &small {
        g.send(s, next);
    }
    g.run().expect("grouped sends");
    for m in 3..6 {
        let mut got = vec![0u64; len(prev, m)];
        comm.recv(&mut got, prev).expect("single receive");
        assert_eq!(got, u64s(prev, me, m), "rank {me} of {n}: message {m} from {prev}, single receive");
    }
    for s in &small {
        comm.send(s, next).expect("single send");
    }
    let mut got: Vec<Vec<u64>> = (3..6).map(|m| vec![0u64; len(prev, m)]).collect();
    let mut g = comm.group();
    for r in got.iter_mut() {
        g.recv(r, prev);
    }
    g.run().expect("grouped receives");
    for (k, r) in got.iter().enumerate() {
        assert_eq!(*r, u64s(prev, me, k + 3), "rank {me} of {n}: message {} from {prev}, grouped", k + 3);
    }
}

#[test]
fn grouped_sends_and_receives_complete_where_calls_one_by_one_would_wait() {
    if util::is_child() {
        return;
    }
    for n in 2..=6 {
        util::run_threads(n, &util::test_config(60.0), exchange);
    }
}

#[test]
fn grouped_sends_and_receives_in_processes_over_tcp_and_shared_memory() {
    if util::is_child() {
        exchange(Communicator::from_env().expect("communicator from toroid-run's environment"));
        println!("exchange passed");
        return;
    }
    for (n, env) in
        [(3, vec![]), (4, vec![("TOROID_SHM_DISABLE", "1")]), (2, vec![("TOROID_CONNECT", "lazy")])]
    {
        let mut env = env;
        env.push(("TOROID_TIMEOUT", "60"));
        let out =
            util::launch("grouped_sends_and_receives_in_processes_over_tcp_and_shared_memory", n, &env, 300);
        util::assert_success(&out, &format!("{n} ranks {env:?}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let passed = stdout.lines().filter(|l| l.contains("exchange passed")).count();
        assert_eq!(passed, n, "{n} ranks {env:?}: every rank must pass:\n{stdout}");
    }
}

#[test]
fn a_grouped_receive_of_the_wrong_size_or_from_a_silent_peer_fails() {
    if util::is_child() {
        return;
    }
    // Rank 1 expects one element less than rank 0 sends: rank 1's group fails (it sees the
    // frame's count), rank 0's (whose own receive matched) or its next call fails with rank 1's
    // abort; neither hangs.
    util::run_threads(2, &util::test_config(5.0), |comm| {
        let me = comm.rank();
        let out = vec![7u32; 100];
        let mut back = vec![0u32; if me == 1 { 99 } else { 100 }];
        let t = Instant::now();
        let mut g = comm.group();
        g.send(&out, 1 - me).recv(&mut back, 1 - me);
        let result = g.run();
        assert!(me == 0 || result.is_err(), "sizes that differ must fail");
        let err = result.and_then(|_| comm.barrier()).expect_err("rank 1's abort must reach rank 0");
        assert!(t.elapsed() < Duration::from_secs(5 + 5), "rank {me} took {:?}", t.elapsed());
        assert!(comm.is_aborted(), "rank {me}: {err}");
        if me == 1 {
            assert!(err.to_string().contains("99 x uint32"), "{err}");
        }
    });
    // Rank 0's group also receives from rank 2, which sends nothing (and stays alive): rank 0
    // times out naming rank 2, after its exchange with rank 1 completed.
    util::run_threads(3, &util::test_config(3.0), |comm| {
        let me = comm.rank();
        let out = vec![me as u8 + 1; 10];
        let (mut a, mut b) = (vec![0u8; 10], vec![0u8; 10]);
        match me {
            0 => {
                let t = Instant::now();
                let mut g = comm.group();
                g.send(&out, 1).recv(&mut a, 1).recv(&mut b, 2);
                let err = g.run().expect_err("a receive nobody sends to must time out");
                assert!(t.elapsed() < Duration::from_secs(3 + 5), "took {:?}", t.elapsed());
                assert!(matches!(err, Error::Timeout(_)) && err.to_string().contains("rank 2"), "{err}");
                assert_eq!(a, vec![2u8; 10], "the exchange with rank 1");
            }
            1 => {
                let mut g = comm.group();
                g.send(&out, 0).recv(&mut a, 0);
                g.run().expect("rank 1's exchange with rank 0");
                assert_eq!(a, vec![1u8; 10]);
                std::thread::sleep(Duration::from_secs(5)); // (alive, as rank 2, until rank 0 fails)
            }
            _ => std::thread::sleep(Duration::from_secs(5)),
        }
    });
}

#[test]
fn a_rank_that_dies_during_a_group_fails_its_peers_groups_with_an_error() {
    if util::is_child() {
        return;
    }
    // Every rank sends 4 MiB to each neighbour before receiving; rank 2 is gone instead (its
    // communicator dropped: its links close, as when its process dies). Ranks 0 and 1, both
    // its neighbours with 3 ranks, fail within the timeout naming rank 2, and do not hang.
    util::run_threads(3, &util::test_config(30.0), |comm| {
        let (n, me) = (comm.size(), comm.rank());
        if me == 2 {
            drop(comm);
            return;
        }
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let out = vec![me as f32; 1 << 20];
        let (mut a, mut b) = (vec![0f32; 1 << 20], vec![0f32; 1 << 20]);
        let t = Instant::now();
        let mut g = comm.group();
        g.send(&out, next).send(&out, prev).recv(&mut a, prev).recv(&mut b, next);
        let err = g.run().expect_err("a group with a dead peer must fail");
        assert!(t.elapsed() < Duration::from_secs(30), "rank {me} took {:?}", t.elapsed());
        assert!(err.to_string().contains("rank 2"), "rank {me}: {err}");
        assert!(comm.is_aborted(), "rank {me}: {err}");
    });
}
