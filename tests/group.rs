//! Grouped collectives (`Communicator::group`): a group of many small all-reduces of mixed
//! types and ops, with other collectives between them, gives every element what the calls one
//! by one give (checked against an independent reference), on 1 to 5 ranks; consecutive small
//! all-reduces run as one packed all-reduce (counted in the statistics); a rank whose group
//! differs makes every rank fail within the timeout instead of hanging. A persistent all-reduce
//! (`Communicator::all_reduce_init`) started many times gives every start its own sum, and so
//! does an all-reduce plan (`AllReducePlan`) started asynchronously on owned buffers.

mod util;

use std::time::{Duration, Instant};

use toroid::internals::collective::CollKind;
use toroid::internals::comm::AllReducePlan;
use toroid::{Communicator, Group, ReduceOp};
use util::data::mix;

/// A small integer, different per (rank, call, element), so that float sums are exact.
fn val(rank: usize, call: usize, i: usize) -> i64 {
    (mix(((rank as u64) << 40) ^ ((call as u64) << 20) ^ i as u64) % 201) as i64 - 100
}

fn all_reduces(comm: &Communicator) -> u64 {
    comm.stats().cells().iter().filter(|c| c.kind == CollKind::AllReduce).map(|c| c.count).sum()
}

/// Lengths of the small calls: pseudo-random below 700 elements, with some empty.
fn len_of(call: usize) -> usize {
    if call % 17 == 5 { 0 } else { (mix(call as u64 + 99) % 700) as usize }
}

fn mixed_group(comm: Communicator) {
    let (n, me) = (comm.size(), comm.rank());
    // 60 in-place f32 sums, a broadcast after the 30th; 10 out-of-place i64 maxima; one f32
    // average too large to pack; 5 f64 minima; an all-gather and a reduce-scatter.
    let mut sums: Vec<Vec<f32>> =
        (0..60).map(|c| (0..len_of(c)).map(|i| val(me, c, i) as f32).collect()).collect();
    let mut bcast: Vec<u8> = (0..333).map(|i| val(me, 1000, i) as u8).collect();
    let max_in: Vec<Vec<i64>> =
        (60..70).map(|c| (0..len_of(c)).map(|i| val(me, c, i) << 33).collect()).collect();
    let mut max_out: Vec<Vec<i64>> = max_in.iter().map(|v| vec![0; v.len()]).collect();
    let big_len = Group::FUSE_EACH / 4 + 5;
    let mut big: Vec<f32> = (0..big_len).map(|i| val(me, 2000, i) as f32).collect();
    let mut mins: Vec<Vec<f64>> =
        (70..75).map(|c| (0..len_of(c)).map(|i| val(me, c, i) as f64 / 4.0).collect()).collect();
    let gather_in: Vec<u32> = (0..37).map(|i| val(me, 3000, i) as u32).collect();
    let mut gather_out = vec![0u32; 37 * n];
    let scatter_in: Vec<i32> = (0..41 * n).map(|i| val(me, 4000, i) as i32).collect();
    let mut scatter_out = vec![0i32; 41];

    let before = all_reduces(&comm);
    let mut g = comm.group();
    let (first, second) = sums.split_at_mut(30);
    for s in first {
        g.all_reduce(s, ReduceOp::Sum);
    }
    g.broadcast(&mut bcast, n - 1);
    for s in second {
        g.all_reduce(s, ReduceOp::Sum);
    }
    for (i, o) in max_in.iter().zip(max_out.iter_mut()) {
        g.all_reduce_into(i, o, ReduceOp::Max);
    }
    g.all_reduce(&mut big, ReduceOp::Avg);
    for m in mins.iter_mut() {
        g.all_reduce(m, ReduceOp::Min);
    }
    g.all_gather(&gather_in, &mut gather_out);
    g.reduce_scatter(&scatter_in, &mut scatter_out, ReduceOp::Sum);
    assert_eq!(g.len(), 60 + 1 + 10 + 1 + 5 + 2);
    g.run().expect("group");
    // Packs: sums 0-29, sums 30-59, the maxima, the minima; the large average alone.
    if n > 1 {
        assert_eq!(all_reduces(&comm) - before, 5, "76 all-reduces should run as 5");
    }

    for (c, s) in sums.iter().enumerate() {
        for (i, x) in s.iter().enumerate() {
            let want: i64 = (0..n).map(|r| val(r, c, i)).sum();
            assert_eq!(*x, want as f32, "rank {me}: sum call {c} element {i}");
        }
    }
    for (i, x) in bcast.iter().enumerate() {
        assert_eq!(*x, val(n - 1, 1000, i) as u8, "rank {me}: broadcast element {i}");
    }
    for (k, o) in max_out.iter().enumerate() {
        for (i, x) in o.iter().enumerate() {
            let want = (0..n).map(|r| val(r, 60 + k, i) << 33).max().unwrap();
            assert_eq!(*x, want, "rank {me}: max call {} element {i}", 60 + k);
        }
        assert!(max_in[k].iter().enumerate().all(|(i, x)| *x == val(me, 60 + k, i) << 33), "input kept");
    }
    for (i, x) in big.iter().enumerate() {
        let want = (0..n).map(|r| val(r, 2000, i)).sum::<i64>() as f64 / n as f64;
        assert!((*x as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "rank {me}: avg element {i}");
    }
    for (k, m) in mins.iter().enumerate() {
        for (i, x) in m.iter().enumerate() {
            let want = (0..n).map(|r| val(r, 70 + k, i) as f64 / 4.0).fold(f64::INFINITY, f64::min);
            assert_eq!(*x, want, "rank {me}: min call {} element {i}", 70 + k);
        }
    }
    for (i, x) in gather_out.iter().enumerate() {
        assert_eq!(*x, val(i / 37, 3000, i % 37) as u32, "rank {me}: all-gather element {i}");
    }
    for (i, x) in scatter_out.iter().enumerate() {
        let want: i64 = (0..n).map(|r| val(r, 4000, me * 41 + i)).sum();
        assert_eq!(*x as i64, want, "rank {me}: reduce-scatter element {i}");
    }
}

#[test]
fn a_mixed_group_gives_what_the_calls_one_by_one_give() {
    if util::is_child() {
        return;
    }
    for n in 1..=5 {
        util::run_threads(n, &util::test_config(60.0), mixed_group);
    }
}

#[test]
fn a_group_in_processes_over_tcp_and_shared_memory() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("communicator from toroid-run's environment");
        mixed_group(comm);
        println!("group passed");
        return;
    }
    for (n, env) in [(3, vec![]), (4, vec![("TOROID_SHM_DISABLE", "1")])] {
        let mut env = env;
        env.push(("TOROID_TIMEOUT", "60"));
        let out = util::launch("a_group_in_processes_over_tcp_and_shared_memory", n, &env, 300);
        util::assert_success(&out, &format!("{n} ranks {env:?}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let passed = stdout.lines().filter(|l| l.contains("group passed")).count();
        assert_eq!(passed, n, "{n} ranks {env:?}: every rank must pass:\n{stdout}");
    }
}

#[test]
fn ranks_whose_groups_differ_all_fail_within_the_timeout() {
    if util::is_child() {
        return;
    }
    util::run_threads(3, &util::test_config(5.0), |comm| {
        let me = comm.rank();
        // Rank 1 packs one more all-reduce than the others.
        let calls = if me == 1 { 11 } else { 10 };
        let mut bufs: Vec<Vec<f32>> = (0..calls).map(|c| vec![c as f32; 64]).collect();
        let mut g = comm.group();
        for b in bufs.iter_mut() {
            g.all_reduce(b, ReduceOp::Sum);
        }
        let t = Instant::now();
        let err = g.run().expect_err("groups that differ must fail");
        assert!(t.elapsed() < Duration::from_secs(5 + 5), "rank {me} took {:?}", t.elapsed());
        assert!(comm.is_aborted(), "rank {me}: {err}");
    });
}

#[test]
fn a_persistent_all_reduce_started_many_times_gives_each_start_its_sum() {
    if util::is_child() {
        return;
    }
    for n in [1, 2, 3, 5] {
        util::run_threads(n, &util::test_config(60.0), |comm| {
            let (n, me) = (comm.size(), comm.rank());
            // Set-up checks what a call checks: an average of integers is refused.
            let mut ints = vec![0i32; 8];
            assert!(comm.all_reduce_init(&mut ints, ReduceOp::Avg).is_err());
            for len in [0, 1, 1000, Group::FUSE_EACH / 8 + 3] {
                let mut buf = vec![0f64; len];
                let mut req = comm.all_reduce_init(&mut buf, ReduceOp::Sum).expect("init");
                assert!(req.algorithm().is_some());
                for step in 0..12 {
                    for (i, x) in req.buffer().iter_mut().enumerate() {
                        *x = val(me, 5000 + step, i) as f64;
                    }
                    req.start().expect("start");
                    for (i, x) in req.buffer().iter().enumerate() {
                        let want: i64 = (0..n).map(|r| val(r, 5000 + step, i)).sum();
                        assert_eq!(*x, want as f64, "rank {me}: {len} elements, start {step}, element {i}");
                    }
                }
            }
        });
    }
}

#[test]
fn an_all_reduce_plan_started_async_gives_each_start_its_sum_in_issue_order() {
    if util::is_child() {
        return;
    }
    for n in [1, 2, 3] {
        util::run_threads(n, &util::test_config(60.0), |comm| {
            let (n, me) = (comm.size(), comm.rank());
            let mut ints = vec![0i32; 8];
            assert!(AllReducePlan::new(&comm, &mut ints, ReduceOp::Avg).is_err());
            let sum = |call: usize, i: usize| (0..n).map(|r| val(r, call, i)).sum::<i64>() as f64;
            for len in [0, 1000, Group::FUSE_EACH / 8 + 3] {
                let plan = AllReducePlan::new(&comm, &mut vec![0f64; len], ReduceOp::Sum).expect("plan");
                assert!(plan.algorithm().is_some());
                // A buffer of another length or type is refused, and leaves the communicator usable.
                assert!(plan.start_async(&comm, vec![0f64; len + 1]).is_err());
                assert!(plan.start_async(&comm, vec![0f32; len]).is_err());
                for step in 0..6 {
                    // Two starts in flight with a plain async all-reduce between them.
                    let fill = |k: usize| -> Vec<f64> {
                        (0..len).map(|i| val(me, 6000 + 3 * step + k, i) as f64).collect()
                    };
                    let a = plan.start_async(&comm, fill(0)).expect("start");
                    let plain = comm.all_reduce_async(fill(1), ReduceOp::Sum).expect("async");
                    let b = plan.start_async(&comm, fill(2)).expect("start");
                    let bufs =
                        [a.wait().expect("wait"), plain.wait().expect("wait"), b.wait().expect("wait")];
                    for (k, buf) in bufs.iter().enumerate() {
                        for (i, x) in buf.iter().enumerate() {
                            assert_eq!(
                                *x,
                                sum(6000 + 3 * step + k, i),
                                "rank {me}: {len}, start {step}.{k}, element {i}"
                            );
                        }
                    }
                }
            }
        });
    }
}
