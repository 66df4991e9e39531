//! Communicator features: async work in issue order, split, send/recv, stores, drop.

mod util;

use std::sync::Arc;
use std::time::Duration;

use toroid::rendezvous::{FileStore, Store};
use toroid::{Communicator, ReduceOp};

#[test]
fn async_work_completes_in_issue_order_with_correct_results() {
    util::run_threads(3, &util::test_config(30.0), |comm| {
        let n = comm.size() as f64;
        let r = comm.rank() as f64;
        // Several operations in flight, mixed with blocking calls that must queue behind them.
        let works: Vec<_> = (0..8)
            .map(|k| comm.all_reduce_async(vec![r + k as f64; 10_000 + k], ReduceOp::Sum).unwrap())
            .collect();
        let mut blocking = vec![1i32; 5];
        comm.all_reduce(&mut blocking, ReduceOp::Sum).unwrap();
        assert_eq!(blocking, vec![3; 5]);
        let bcast = comm.broadcast_async(vec![r as f32; 4099], 2).unwrap();
        for (k, w) in works.into_iter().enumerate() {
            let v = w.wait().unwrap();
            let want = (0..comm.size()).map(|x| x as f64 + k as f64).sum::<f64>();
            assert_eq!(v.len(), 10_000 + k);
            assert!(v.iter().all(|x| *x == want), "work {k}: {} != {want} (n = {n})", v[0]);
        }
        assert!(bcast.wait().unwrap().iter().all(|x| *x == 2.0));
        let b = comm.barrier_async().unwrap();
        b.wait_timeout(Duration::from_secs(10)).unwrap();
        assert!(b.test() && b.error().is_none());
    });
}

/// A wait on work the worker has not started runs it (and the queued work before it) on the
/// waiting thread: several threads of each rank wait on works of one queue at once, in orders
/// that differ between ranks and between runs, while the worker takes what nobody waits on.
/// Every operation must still run once, in issue order on every rank (a different order
/// mismatches the ranks' collectives: an error, or wrong sums below), with exact results.
#[test]
fn waits_on_queued_work_run_it_in_issue_order_from_any_thread() {
    util::run_threads(3, &util::test_config(30.0), |comm| {
        let r = comm.rank();
        for round in 0..20usize {
            let works: Vec<_> = (0..12usize)
                .map(|k| {
                    let len = 1 + (k * 977 + round * 131) % 5000;
                    comm.all_reduce_async(vec![(r * 100 + k + round) as u64; len], ReduceOp::Sum).unwrap()
                })
                .collect();
            let want = |k: usize| (0..comm.size()).map(|x| (x * 100 + k + round) as u64).sum::<u64>();
            // Three waiters split the works by k mod 3, each in its own order (rank and round
            // dependent); a blocking call issued meanwhile queues behind them all.
            let mut parts: Vec<Vec<(usize, toroid::Work<Vec<u64>>)>> =
                vec![Vec::new(), Vec::new(), Vec::new()];
            for (k, w) in works.into_iter().enumerate() {
                parts[k % 3].push((k, w));
            }
            std::thread::scope(|s| {
                for (i, mut part) in parts.into_iter().enumerate() {
                    if (i + r + round) % 2 == 1 {
                        part.reverse();
                    }
                    s.spawn(move || {
                        for (k, w) in part {
                            let v = w.wait().unwrap();
                            assert!(
                                v.iter().all(|x| *x == want(k)),
                                "round {round} work {k}: {} != {}",
                                v[0],
                                want(k)
                            );
                        }
                    });
                }
                let mut x = [r as u64 + round as u64];
                comm.all_reduce(&mut x, ReduceOp::Max).unwrap();
                assert_eq!(x[0], (comm.size() - 1 + round) as u64);
            });
        }
    });
}

#[test]
fn async_reduce_scatter_and_all_gather_round_trip() {
    util::run_threads(4, &util::test_config(30.0), |comm| {
        let n = comm.size();
        let r = comm.rank();
        let piece = 1000;
        let input: Vec<i64> = (0..n * piece).map(|i| (i * (r + 1)) as i64).collect();
        let rs = comm.reduce_scatter_async(input, ReduceOp::Sum).unwrap().wait().unwrap();
        let tri = (n * (n + 1) / 2) as i64;
        for k in 0..piece {
            let i = r * piece + k;
            assert_eq!(rs[i], i as i64 * tri);
        }
        // all-gather the reduced pieces back into a full vector.
        let ag = comm.all_gather_async(rs).unwrap().wait().unwrap();
        for (i, v) in ag.iter().enumerate() {
            assert_eq!(*v, i as i64 * tri);
        }
    });
}

#[test]
fn dropping_a_work_handle_does_not_cancel_or_free_early() {
    util::run_threads(2, &util::test_config(30.0), |comm| {
        for _ in 0..20 {
            drop(comm.all_reduce_async(vec![1.0f32; 100_000], ReduceOp::Sum).unwrap());
        }
        // Ordering: this blocking call runs after all 20 dropped ones.
        let mut x = [comm.rank() as u64];
        comm.all_reduce(&mut x, ReduceOp::Max).unwrap();
        assert_eq!(x[0], 1);
    });
}

#[test]
fn split_into_even_and_odd_and_excluded() {
    util::run_threads(7, &util::test_config(30.0), |comm| {
        let r = comm.rank();
        // Rank 6 opts out; the rest split by parity, ordered by descending rank.
        let color = if r == 6 { None } else { Some((r % 2) as u32) };
        let sub = comm.split(color, -(r as i64)).unwrap();
        match sub {
            None => assert_eq!(r, 6),
            Some(sub) => {
                let members: Vec<usize> = (0..6).filter(|x| x % 2 == r % 2).rev().collect();
                assert_eq!(sub.size(), members.len());
                assert_eq!(sub.rank(), members.iter().position(|m| *m == r).unwrap());
                let mut v = vec![r as u32; 4099];
                sub.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert!(v.iter().all(|x| *x as usize == members.iter().sum::<usize>()));
                // The parent keeps working alongside.
            }
        }
        let mut one = [1u8];
        comm.all_reduce(&mut one, ReduceOp::Sum).unwrap();
        assert_eq!(one[0], 7);
    });
}

#[test]
fn send_recv_pairs_in_a_ring_and_back_to_back() {
    util::run_threads(5, &util::test_config(30.0), |comm| {
        let n = comm.size();
        let r = comm.rank();
        let next = (r + 1) % n;
        let prev = (r + n - 1) % n;
        let big: Vec<f64> = (0..1 << 20).map(|i| (i * 31 + r) as f64).collect();
        let mut got = vec![0f64; 1 << 20];
        // Even ranks send first, odd ranks receive first: no cycle of blocked senders.
        if r % 2 == 0 {
            comm.send(&big, next).unwrap();
            comm.recv(&mut got, prev).unwrap();
        } else {
            comm.recv(&mut got, prev).unwrap();
            comm.send(&big, next).unwrap();
        }
        assert!(got.iter().enumerate().all(|(i, v)| *v == (i * 31 + prev) as f64));
        // Several small messages to one peer arrive in order.
        if r == 0 {
            for k in 0..10u32 {
                comm.send(&[k; 3], 1).unwrap();
            }
        } else if r == 1 {
            for k in 0..10u32 {
                let mut b = [0u32; 3];
                comm.recv(&mut b, 0).unwrap();
                assert_eq!(b, [k; 3]);
            }
        }
        comm.barrier().unwrap();
    });
}

/// Every other rank sends rank 0 one message, joins an all-reduce, then sends two more; rank 0
/// receives each round from any source: every rank shows up once in the first round and twice
/// in the second, its messages in the order it sent them, every element as sent. Senders start
/// at staggered times, so arrival order is not rank order; a sender that is already in the
/// all-reduce has that collective's frame at the head of its link, which must not be taken for
/// a send.
fn recv_any_case(n: usize, shm: bool) {
    let cfg = toroid::Config { shm_disable: !shm, ..util::test_config(30.0) };
    util::run_threads(n, &cfg, move |comm| {
        const LEN: usize = 3000;
        let msg = |from: usize, k: usize| -> Vec<u64> {
            (0..LEN).map(|i| util::data::mix((from * 1_000_003 + k * 7919 + i) as u64)).collect()
        };
        let r = comm.rank();
        let mut v = [1u32];
        if r == 0 {
            let mut seen = vec![0usize; n];
            let mut buf = vec![0u64; LEN];
            for round in [1, 3] {
                while seen[1..].iter().any(|s| *s < round) {
                    let from = comm.recv_any(&mut buf).unwrap();
                    assert!(from > 0 && from < n, "sender {from}");
                    assert!(seen[from] < round, "rank {from} sent more than {round} messages so far");
                    assert_eq!(buf, msg(from, seen[from]), "message {} from rank {from}", seen[from]);
                    seen[from] += 1;
                }
                if round == 1 {
                    comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                }
            }
        } else {
            std::thread::sleep(Duration::from_millis(util::data::mix(r as u64) % 30));
            comm.send(&msg(r, 0), 0).unwrap();
            comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            comm.send(&msg(r, 1), 0).unwrap();
            comm.send(&msg(r, 2), 0).unwrap();
        }
        assert_eq!(v[0], n as u32);
        comm.barrier().unwrap();
    });
}

#[test]
fn recv_from_any_source_takes_every_sender_once_in_order() {
    for n in [2, 3, 5] {
        recv_any_case(n, true);
        recv_any_case(n, false);
    }
}

#[test]
fn recv_from_any_source_times_out_naming_the_wait() {
    // Rank 0's deadline comes first (the others' would otherwise race it with their own).
    let timeout = |r: usize| util::test_config(if r == 0 { 1.0 } else { 20.0 });
    util::run_threads_with(3, timeout, |comm| {
        if comm.rank() == 0 {
            let t = std::time::Instant::now();
            let e = comm.recv_any(&mut [0u8; 4]).unwrap_err();
            assert!(matches!(e, toroid::Error::Timeout(_)), "{e}");
            assert!(e.to_string().contains("any source"), "{e}");
            assert!(t.elapsed() >= Duration::from_millis(900), "{:?}", t.elapsed());
        } else {
            // Nobody sends; the others learn of rank 0's failure at their next call.
            assert!(comm.barrier().is_err());
        }
    });
}

#[test]
fn send_recv_size_mismatch_is_an_error() {
    util::run_threads(2, &util::test_config(10.0), |comm| {
        let e = if comm.rank() == 0 {
            comm.send(&[1u8; 10], 1).err().or_else(|| comm.barrier().err())
        } else {
            let mut b = [0u8; 12];
            comm.recv(&mut b, 0).err()
        };
        let e = e.expect("an error");
        assert!(e.to_string().contains("mismatch") || e.to_string().contains("abort"), "{e}");
    });
}

#[test]
fn communicators_meet_through_a_file_store() {
    let dir = std::env::temp_dir().join(format!("toroid-filestore-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store: Arc<dyn Store> = Arc::new(FileStore::new(&dir).unwrap());
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let comm = Communicator::with_store(r, 3, store, &util::test_config(20.0)).unwrap();
                let mut v = [r as u32 + 1];
                comm.all_reduce(&mut v, ReduceOp::Prod).unwrap();
                assert_eq!(v[0], 6);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn two_communicators_on_one_store_are_independent() {
    util::run_threads(3, &util::test_config(20.0), |comm| {
        let mut v = [comm.rank() as i32];
        comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], 3);
        assert_eq!(comm.topology().hosts, 1);
        assert_eq!(comm.topology().local_size, 3);
    });
}

#[test]
fn hooks_run_in_issue_order_around_their_operation() {
    use std::sync::Mutex;
    use toroid::internals::comm::{Hooks, RawOp};
    use toroid::internals::memory::{RawBufMut, RawBufs};
    use toroid::{DataType, OpKind};
    util::run_threads(2, &util::test_config(30.0), |comm| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut buf = vec![1u32; 4099];
        let addr = buf.as_ptr() as usize;
        // An async operation queued first, then one with hooks: `before` runs after the first and
        // sees the input (1), `after` sees the sum (2) before the work reports completion.
        let first = comm.all_reduce_async(vec![0u8; 10], ReduceOp::Sum).unwrap();
        let (l1, l2) = (log.clone(), log.clone());
        let hooks = Hooks {
            // SAFETY (test): `buf` outlives the wait below and nothing else touches it.
            before: Some(Box::new(move || {
                l1.lock().unwrap().push(("before", unsafe { *(addr as *const u32) }))
            })),
            after: Some(Box::new(move || {
                l2.lock().unwrap().push(("after", unsafe { *(addr as *const u32) }))
            })),
            worker_only: false,
        };
        let op = RawOp::new(
            OpKind::AllReduce(ReduceOp::Sum),
            DataType::U32,
            RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(&mut buf))),
        );
        // SAFETY: `buf` stays alive and untouched until the wait returns.
        let w = unsafe { comm.submit_raw_with_hooks(op, None, hooks) }.unwrap();
        w.wait_timeout(Duration::from_secs(20)).unwrap();
        first.wait().unwrap();
        assert_eq!(*log.lock().unwrap(), vec![("before", 1), ("after", 2)]);
        assert!(buf.iter().all(|x| *x == 2));
    });
}

/// A wait that finds its job not yet started runs it on the waiting thread, hooks and all
/// (a group's pack, an in-place layout's move), unless the hooks are the worker's only (a device
/// job's): those never run on the waiter.
#[test]
fn a_waiter_runs_a_hooked_job_unless_its_hooks_are_the_workers() {
    use std::sync::Mutex;
    use toroid::internals::comm::Hooks;
    util::run_threads(2, &util::test_config(30.0), |comm| {
        let me = std::thread::current().id();
        let mut on_waiter = [0usize; 2];
        for round in 0..100 {
            let worker_only = round % 2 == 1;
            let ran = Arc::new(Mutex::new(None));
            let r = ran.clone();
            let hooks = Hooks {
                before: Some(Box::new(move || *r.lock().unwrap() = Some(std::thread::current().id()))),
                after: None,
                worker_only,
            };
            // SAFETY: a barrier has no buffers.
            let w = unsafe { comm.submit_raw_with_hooks(util::barrier_op(), None, hooks) }.unwrap();
            w.wait().unwrap();
            let thread = ran.lock().unwrap().expect("the hook did not run");
            on_waiter[usize::from(worker_only)] += usize::from(thread == me);
        }
        assert_eq!(on_waiter[1], 0, "a worker-only hook ran on the waiting thread");
        // (the worker takes a job left more than 20 us: a busy machine can delay a waiter past
        // that now and then, not in most of 50 rounds)
        assert!(on_waiter[0] >= 25, "a waiter ran only {} of 50 hooked jobs itself", on_waiter[0]);
    });
}

#[test]
fn a_wait_past_its_deadline_returns_timeout_and_aborts() {
    let gate = Arc::new(std::sync::Barrier::new(2));
    util::run_threads(2, &util::test_config(30.0), move |comm| {
        if comm.rank() == 0 {
            // Rank 1 never joins this all-reduce.
            let w = comm.all_reduce_async(vec![1.0f32; 100], ReduceOp::Sum).unwrap();
            let e = w.wait_timeout(Duration::from_millis(100)).unwrap_err();
            assert!(matches!(e, toroid::Error::Timeout(_)), "{e}");
            assert!(comm.is_aborted());
            assert!(matches!(comm.barrier(), Err(toroid::Error::Aborted(_))));
        }
        gate.wait();
        if comm.rank() == 1 {
            assert!(comm.barrier().is_err());
        }
    });
}

#[test]
fn reduce_accepts_no_output_on_non_roots() {
    use toroid::{CallOptions, DataType, OpKind};
    util::run_threads(3, &util::test_config(20.0), |comm| {
        let input: Vec<i64> = (0..1000).map(|i| i * (comm.rank() as i64 + 1)).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&input);
        let kind = OpKind::Reduce(ReduceOp::Sum, 1);
        if comm.rank() == 1 {
            let mut out = vec![0i64; 1000];
            comm.run_bytes(
                kind,
                DataType::I64,
                Some(bytes),
                Some(bytemuck::cast_slice_mut(&mut out)),
                CallOptions::default(),
            )
            .unwrap();
            assert!(out.iter().enumerate().all(|(i, v)| *v == 6 * i as i64));
        } else {
            // Only the input: a non-root has nothing to receive.
            comm.run_bytes(kind, DataType::I64, Some(bytes), None, CallOptions::default()).unwrap();
        }
    });
}

/// `TOROID_AUTH_TOKEN`: processes sharing a token connect (also their sub-communicators) and
/// compute; every element of the result is checked.
#[test]
fn ranks_sharing_an_auth_token_work_in_processes() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("authenticated communicator");
        let (r, n) = (comm.rank() as i64, comm.size() as i64);
        let mut v: Vec<i64> = (0..4099).map(|i| i * 31 + r * 1_000_003).collect();
        comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        for (i, x) in v.iter().enumerate() {
            assert_eq!(*x, n * (i as i64 * 31) + 1_000_003 * n * (n - 1) / 2, "element {i}");
        }
        let sub = comm.split(Some((r % 2) as u32), r).unwrap().expect("member of a half");
        let mut w = vec![r; 7];
        sub.all_reduce(&mut w, ReduceOp::Max).unwrap();
        let top = (0..n).filter(|x| x % 2 == r % 2).max().unwrap();
        assert_eq!(w, vec![top; 7]);
        return;
    }
    for tcp_only in ["0", "1"] {
        let env = [
            ("TOROID_AUTH_TOKEN", "shared secret"),
            ("TOROID_SHM_DISABLE", tcp_only),
            ("TOROID_TIMEOUT", "30"),
        ];
        let out = util::launch("ranks_sharing_an_auth_token_work_in_processes", 3, &env, 120);
        util::assert_success(&out, &format!("3 ranks with a token (TOROID_SHM_DISABLE={tcp_only})"));
    }
}

/// A rank with another token never joins: it gets an error naming TOROID_AUTH_TOKEN, rank 0
/// times out waiting for it (and logs the rejected connection), nobody hangs. Rank 1 waits for
/// rank 0 (on one host set-up links rank 0 with each rank, for the shared window): it fails when
/// rank 0 gives up, or at its own deadline.
#[test]
fn a_rank_with_another_token_is_refused() {
    let store: Arc<dyn Store> = Arc::new(toroid::rendezvous::MemStore::new());
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let store = store.clone();
            let mut cfg = util::test_config(3.0);
            cfg.auth_token = Some(toroid::AuthToken::new(if r == 2 { b"intruder" } else { b"team" }));
            std::thread::spawn(move || Communicator::with_store(r, 3, store, &cfg).map(|_| ()))
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().expect("no panic")).collect();
    let msg = |r: usize| results[r].as_ref().expect_err("must fail").to_string();
    assert!(msg(2).contains("TOROID_AUTH_TOKEN"), "{}", msg(2));
    assert!(msg(0).contains("never connected") || msg(0).contains("deadline"), "rank 0: {}", msg(0));
    let m1 = msg(1);
    assert!(
        m1.contains("never connected")
            || m1.contains("deadline")
            || m1.contains("rank 0 closed its connection"),
        "rank 1: {m1}"
    );
}
