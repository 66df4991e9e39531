//! Every collective, on real data, checked element by element against an independent
//! reference: world sizes 1..=9, counts {0, 1, 7, 4099, 1<<20}, every op, several element
//! types, in place and out of place, every algorithm; as threads and as real processes.

mod util;

use std::time::Instant;

use toroid::{Communicator, Config};
use util::cases::run_matrix;

#[test]
fn all_collectives_as_threads() {
    if util::is_child() {
        return;
    }
    for n in 1..=5 {
        let cfg = util::test_config(60.0);
        util::run_threads(n, &cfg, |comm| {
            let failures = run_matrix(&comm, false);
            assert!(failures.is_empty(), "{}", failures.join("\n"));
        });
    }
}

#[test]
fn all_collectives_in_processes() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("communicator from toroid-run's environment");
        let failures = run_matrix(&comm, true);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        return;
    }
    // One host (shared memory: rings between every pair and the shared window)...
    for n in 1..=9 {
        let t = Instant::now();
        let out = util::launch("all_collectives_in_processes", n, &[("TOROID_TIMEOUT", "60")], 600);
        util::assert_success(&out, &format!("{n} ranks"));
        let report = String::from_utf8_lossy(&out.stdout);
        let line = report.lines().find(|l| l.contains("cases in")).unwrap_or("(no report)");
        println!("{line} (job {:.1?})", t.elapsed());
    }
    // ... TCP only, and two emulated hosts (shared memory within, TCP across, no window).
    type Variant<'a> = (&'a str, usize, &'a [(&'a str, &'a str)], &'a [&'a str]);
    let variants: [Variant<'_>; 3] = [
        ("TCP only", 3, &[("TOROID_SHM_DISABLE", "1")], &[]),
        ("2 hosts", 4, &[], &["--emulate-hosts", "2"]),
        ("2 hosts", 7, &[], &["--emulate-hosts", "2"]),
    ];
    for (what, n, env, opts) in variants {
        let t = Instant::now();
        let mut env = env.to_vec();
        env.push(("TOROID_TIMEOUT", "60"));
        let out = util::launch_with("all_collectives_in_processes", n, opts, &env, 600);
        util::assert_success(&out, &format!("{n} ranks, {what}"));
        let report = String::from_utf8_lossy(&out.stdout);
        let line = report.lines().find(|l| l.contains("cases in")).unwrap_or("(no report)");
        println!("{what}: {line} (job {:.1?})", t.elapsed());
    }
}

/// The all-to-all keeps up to `WINDOW` (8) steps in flight and opens step `s` once step
/// `s - WINDOW` is complete; the matrix above (at most 9 ranks) never slides that window. Here
/// it slides at 10, 13 and 19 ranks, over shared memory, TCP set up as a mesh and TCP on demand,
/// with blocks of several frames (64 KiB frames, blocks of 200,003 bytes) and one-byte blocks:
/// every byte of every block, out of place and in place, against what its sender put there.
#[test]
fn all_to_all_slides_its_window_of_steps_in_flight() {
    if util::is_child() {
        return;
    }
    for (n, shm_disable, connect_lazy) in [(10, false, true), (13, true, false), (19, true, true)] {
        let cfg = Config { shm_disable, connect_lazy, segment_size: 64 << 10, ..util::test_config(60.0) };
        util::run_threads(n, &cfg, move |comm| {
            let (me, n) = (comm.rank(), comm.size());
            // Byte `i` of the block rank `from` sends to rank `to`.
            let byte = |from: usize, to: usize, i: usize| {
                util::data::mix(((from * 64 + to) as u64) << 32 | i as u64) as u8
            };
            for (block, in_place) in [(200_003, false), (1, false), (70_001, true)] {
                let send: Vec<u8> = (0..n * block).map(|k| byte(me, k / block, k % block)).collect();
                let got = if in_place {
                    let mut buf = send.clone();
                    comm.all_to_all_in_place(&mut buf).expect("all_to_all_in_place");
                    buf
                } else {
                    let mut recv = vec![0u8; n * block];
                    comm.all_to_all(&send, &mut recv).expect("all_to_all");
                    recv
                };
                for (k, &b) in got.iter().enumerate() {
                    let (from, i) = (k / block, k % block);
                    assert_eq!(
                        b,
                        byte(from, me, i),
                        "{n} ranks (shm {}, lazy {connect_lazy}), block {block}, in place {in_place}: \
                         rank {me} byte {i} of the block from rank {from}",
                        !shm_disable
                    );
                }
            }
        });
    }
}

/// An all-to-all-v whose two ends disagree on a block's size is an error at the receiving end,
/// within the timeout, which leaves that block as it was (a frame's header is checked before
/// any of its bytes is copied) and aborts the communicator: the next collective fails on every
/// rank, so no rank goes on with a result its peers do not share.
#[test]
fn all_to_all_v_whose_ends_disagree_fails_every_rank() {
    if util::is_child() {
        return;
    }
    let cfg = util::test_config(20.0);
    util::run_threads(3, &cfg, |comm| {
        let (me, n) = (comm.rank(), comm.size());
        // Rank 0 sends rank 1 five elements; rank 1 expects four, as from everyone else.
        let sends: Vec<usize> = (0..n).map(|j| if me == 0 && j == 1 { 5 } else { 4 }).collect();
        let recvs = vec![4usize; n];
        let send = vec![me as u32 + 1; sends.iter().sum()];
        let mut recv = vec![u32::MAX; 4 * n];
        let t = Instant::now();
        let first = comm.all_to_all_v(&send, &sends, &mut recv, &recvs);
        if me == 1 {
            let e = first.as_ref().expect_err("rank 1 received a block of the wrong size");
            assert!(e.to_string().contains("frame of 20 bytes"), "{e}");
            assert!(recv[..4].iter().all(|&x| x == u32::MAX), "the mismatched block was written: {recv:?}");
        }
        let then = comm.barrier();
        assert!(first.is_err() || then.is_err(), "rank {me}: no error after the mismatch");
        assert!(t.elapsed().as_secs_f64() < 15.0, "rank {me}: {:?} to fail", t.elapsed());
    });
}
