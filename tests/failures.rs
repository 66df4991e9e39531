//! Failure handling: a rank killed mid-collective, mismatched collectives, deadlines, abort,
//! bad arguments. Every case must end in a clear error on every rank, never a hang.

mod util;

use std::time::{Duration, Instant};

use toroid::{CallOptions, Communicator, DataType, Error, OpKind, ReduceOp};

const KILL_TIMEOUT_S: u64 = 10;

#[test]
fn killed_rank_turns_into_errors_on_every_other_rank() {
    killed_rank("killed_rank_turns_into_errors_on_every_other_rank", &[]);
}

#[test]
fn killed_rank_turns_into_errors_on_every_other_rank_with_progress_threads() {
    // Over TCP with two lanes per pair, every byte moved by progress threads.
    let env = [("TOROID_NTHREADS", "2"), ("TOROID_NSOCKS", "2"), ("TOROID_SHM_DISABLE", "1")];
    killed_rank("killed_rank_turns_into_errors_on_every_other_rank_with_progress_threads", &env);
}

/// Rank 2 of 4 dies by SIGKILL inside a large all-reduce: the others get an error from its
/// closed connections well before their deadline, and later calls fail fast.
fn killed_rank(test: &str, env: &[(&str, &str)]) {
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let mut buf = vec![1.0f32; 4 << 20];
        if comm.rank() == 2 {
            // Die mid-collective: a thread kills the process while the main thread is inside a
            // large all-reduce.
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
                // A later call fails fast.
                let t = Instant::now();
                let again = comm.barrier().unwrap_err();
                println!("LATER {} in {} us", again.category(), t.elapsed().as_micros());
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "no error within 60 s");
        }
    }
    let n = 4;
    let children = util::spawn_ranks(test, n, |_| {
        let mut vars = vec![("TOROID_TIMEOUT".to_string(), KILL_TIMEOUT_S.to_string())];
        vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        vars
    });
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let deadline = Instant::now() + Duration::from_secs(KILL_TIMEOUT_S + 20);
    let (statuses, outputs) = util::wait_all(children, deadline);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(statuses[2].and_then(|s| s.signal()), Some(libc::SIGKILL), "rank 2 should die by SIGKILL");
    for r in [0, 1, 3] {
        let out = &outputs[r];
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r} did not exit cleanly:\n{out}");
        let (line, ms) = util::error_line(out).unwrap_or_else(|| panic!("rank {r} saw no error:\n{out}"));
        // The error arrives well within the timeout: from the dead peer's closed sockets, not
        // from a deadline.
        assert!(ms < KILL_TIMEOUT_S * 1000, "rank {r} waited {ms} ms: {line}");
        assert!(line.starts_with("ERROR remote") || line.starts_with("ERROR aborted"), "rank {r}: {line}");
        assert!(out.contains("LATER aborted"), "rank {r}: later calls must fail fast:\n{out}");
    }
    for pid in pids {
        assert!(!util::alive(pid), "process {pid} still running");
    }
}

#[test]
fn mismatched_count_is_an_error_naming_the_mismatch_on_both_ranks() {
    util::run_threads(2, &util::test_config(20.0), |comm| {
        let count = if comm.rank() == 0 { 100 } else { 200 };
        let mut buf = vec![1.0f32; count];
        let e = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("mismatch") && msg.contains("100 x float") && msg.contains("200 x float"),
            "rank {}: {msg}",
            comm.rank()
        );
        // The structured facts: which collective failed and which peer disagreed.
        let seq = e.seq().expect("the failed collective's sequence number");
        assert!(msg.contains(&format!("all_reduce #{seq}")), "rank {}: seq {seq} not in {msg}", comm.rank());
        assert_eq!(e.peer(), Some(1 - comm.rank()), "rank {}: {msg}", comm.rank());
        assert!(comm.is_aborted());
    });
}

#[test]
fn mismatched_op_is_an_error_on_every_rank() {
    util::run_threads(3, &util::test_config(20.0), |comm| {
        let op = if comm.rank() == 1 { ReduceOp::Max } else { ReduceOp::Sum };
        let mut buf = vec![1i64; 1000];
        let e = comm.all_reduce(&mut buf, op).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("mismatch") && msg.contains("max") && msg.contains("sum"),
            "rank {}: {msg}",
            comm.rank()
        );
    });
}

#[test]
fn mismatched_collective_kind_is_an_error() {
    util::run_threads(2, &util::test_config(20.0), |comm| {
        let mut buf = vec![1u8; 64];
        let r = if comm.rank() == 0 {
            comm.broadcast(&mut buf, 0)
        } else {
            comm.all_reduce(&mut buf, ReduceOp::Sum)
        };
        // The broadcast root only sends, so it may finish; the error reaches it at its next call.
        let e = match r {
            Err(e) => e,
            Ok(()) => comm.barrier().unwrap_err(),
        };
        let msg = e.to_string();
        assert!(msg.contains("mismatch") && msg.contains("all_reduce"), "rank {}: {msg}", comm.rank());
    });
}

#[test]
fn deadline_names_the_missing_rank_and_the_late_rank_fails_fast() {
    util::run_threads(2, &util::test_config(30.0), |comm| {
        let mut buf = vec![0f64; 16];
        if comm.rank() == 0 {
            let opts = CallOptions { timeout: Some(Duration::from_millis(500)), algorithm: None, wire: None };
            let t = Instant::now();
            let e = comm
                .run_bytes(
                    OpKind::AllReduce(ReduceOp::Sum),
                    DataType::F64,
                    None,
                    Some(bytemuck::cast_slice_mut(&mut buf)),
                    opts,
                )
                .unwrap_err();
            let waited = t.elapsed();
            assert!(matches!(e, Error::Timeout(_)), "{e}");
            assert!(e.to_string().contains("rank 1"), "{e}");
            assert!(waited >= Duration::from_millis(500) && waited < Duration::from_secs(3), "{waited:?}");
        } else {
            std::thread::sleep(Duration::from_secs(2));
            let t = Instant::now();
            // Rank 0's data frame may already be here (it was sent before the deadline), so this
            // call can still complete with both contributions; the abort that follows it in the
            // stream fails the next call at the latest.
            let e = match comm.all_reduce(&mut buf, ReduceOp::Sum) {
                Err(e) => e,
                Ok(()) => comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err(),
            };
            assert!(t.elapsed() < Duration::from_secs(5), "late rank waited {:?}", t.elapsed());
            assert!(matches!(e, Error::Remote(_) | Error::Aborted(_)), "{e}");
            assert!(e.to_string().contains("rank 0"), "{e}");
        }
    });
}

#[test]
fn abort_from_another_thread_unblocks_a_waiting_collective() {
    util::run_threads(2, &util::test_config(60.0), |comm| {
        let comm = std::sync::Arc::new(comm);
        if comm.rank() == 0 {
            let c2 = comm.clone();
            let aborter = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                let t = Instant::now();
                c2.abort();
                assert!(t.elapsed() < Duration::from_millis(100), "abort blocked for {:?}", t.elapsed());
            });
            let t = Instant::now();
            // Rank 1 never joins this one: only the abort can end it.
            let e = comm.barrier().unwrap_err();
            assert!(matches!(e, Error::Aborted(_)), "{e}");
            assert!(t.elapsed() < Duration::from_secs(5));
            aborter.join().unwrap();
            assert!(matches!(comm.barrier(), Err(Error::Aborted(_))));
        } else {
            // Rank 1 joins late. Rank 0's barrier frame went out before the abort, so the first
            // barrier can complete; the abort frame behind it fails the next call at the latest.
            std::thread::sleep(Duration::from_millis(600));
            let e = match comm.barrier() {
                Err(e) => e,
                Ok(()) => comm.barrier().unwrap_err(),
            };
            assert!(matches!(e, Error::Remote(_) | Error::Aborted(_)), "{e}");
            assert!(e.to_string().contains("abort"), "{e}");
        }
    });
}

#[test]
fn bad_arguments_fail_locally_and_leave_the_communicator_usable() {
    util::run_threads(3, &util::test_config(20.0), |comm| {
        let mut a = vec![1.0f32; 10];
        let mut b = vec![0.0f32; 11];
        assert!(matches!(comm.all_reduce_into(&a, &mut b, ReduceOp::Sum), Err(Error::InvalidArgument(_))));
        assert!(matches!(comm.reduce_scatter(&a, &mut b, ReduceOp::Sum), Err(Error::InvalidArgument(_))));
        assert!(matches!(comm.broadcast(&mut a, 7), Err(Error::InvalidArgument(_))));
        assert!(matches!(comm.send(&a, comm.rank()), Err(Error::InvalidArgument(_))));
        let mut ints = vec![3i32; 8];
        let e = comm.all_reduce(&mut ints, ReduceOp::Avg).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("avg"), "{e}");
        assert!(!comm.is_aborted());
        comm.all_reduce(&mut ints, ReduceOp::Sum).unwrap();
        assert_eq!(ints, vec![9; 8]);
        assert_eq!(comm.last_error().map(|s| s.contains("avg")), Some(true));
    });
}

#[test]
fn a_mismatched_frame_never_lands_in_the_receive_buffer() {
    // Small frames are staged with their header, large ones have the header read alone: in
    // neither case may a byte of a frame that fails its check reach the caller's buffer. Over
    // shared memory (ranks as threads of one host) and over TCP.
    for shm_disable in [false, true] {
        for n in [100usize, 300_000] {
            let cfg = toroid::Config { shm_disable, ..util::test_config(20.0) };
            util::run_threads(2, &cfg, move |comm| {
                if comm.rank() == 0 {
                    let mut buf = vec![7.0f32; n];
                    let e = comm.recv(&mut buf, 1).unwrap_err();
                    assert!(e.to_string().contains("mismatch"), "{e}");
                    let touched = buf.iter().filter(|x| **x != 7.0).count();
                    assert_eq!(touched, 0, "{touched} of {n} elements overwritten (shm off: {shm_disable})");
                } else {
                    // One element more: the fingerprint differs. The send may complete; the
                    // error then reaches this rank at its next call.
                    let e = match comm.send(&vec![9.0f32; n + 1], 0) {
                        Err(e) => e,
                        Ok(()) => comm.barrier().unwrap_err(),
                    };
                    assert!(
                        matches!(e, Error::Remote(_) | Error::Aborted(_) | Error::InvalidUsage(_)),
                        "{e}"
                    );
                }
            });
        }
    }
}

#[test]
fn a_panic_inside_an_operation_aborts_the_communicator_which_stays_destroyable() {
    use toroid::internals::comm::Hooks;
    util::run_threads(2, &util::test_config(20.0), |comm| {
        if comm.rank() == 0 {
            // (not the worker's only: a wait may run it, and catch its panic, on this thread)
            let hooks = Hooks {
                before: Some(Box::new(|| panic!("injected fault"))),
                after: None,
                worker_only: false,
            };
            // SAFETY: a barrier has no buffers.
            let work = unsafe { comm.submit_raw_with_hooks(util::barrier_op(), None, hooks) }.unwrap();
            let t = Instant::now();
            let e = work.wait().unwrap_err();
            assert!(
                matches!(&e, Error::Internal(m) if m.contains("panic") && m.contains("injected fault")),
                "{e}"
            );
            assert!(comm.is_aborted());
            assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
            // Later calls fail fast instead of queueing behind a "running" operation forever.
            assert!(matches!(comm.barrier(), Err(Error::Aborted(_))));
            assert!(matches!(comm.barrier_async().map(|_| ()), Err(Error::Aborted(_))));
            comm.destroy().unwrap();
        } else {
            // The peer's links closed with a reason: this rank learns of it at once.
            let t = Instant::now();
            let e = comm.barrier().unwrap_err();
            assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
            assert!(matches!(e, Error::Remote(_) | Error::Aborted(_)), "{e}");
        }
    });
}

#[test]
fn destroy_reports_how_many_queued_operations_failed() {
    // Set by rank 0 once destroy has begun (a flag with a deadline: a failing rank 0 must not
    // leave rank 1 waiting forever).
    let gate = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    util::run_threads(2, &util::test_config(20.0), move |comm| {
        if comm.rank() == 0 {
            let works: Vec<_> =
                (0..3).map(|_| comm.all_reduce_async(vec![1u32; 1000], ReduceOp::Sum).unwrap()).collect();
            drop(works);
            let destroyer = std::thread::spawn(move || comm.destroy());
            // Rank 1 leaves once destroy has had time to begin: all three fail meanwhile.
            std::thread::sleep(Duration::from_millis(200));
            gate.store(true, std::sync::atomic::Ordering::Release);
            let e = destroyer.join().unwrap().unwrap_err();
            assert!(e.to_string().contains("3 operations still queued"), "{e}");
        } else {
            let until = Instant::now() + Duration::from_secs(20);
            while !gate.load(std::sync::atomic::Ordering::Acquire) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            drop(comm);
        }
    });
}

#[test]
fn a_forked_child_cannot_use_the_communicator_and_does_not_hide_its_parents_death() {
    forked_child("a_forked_child_cannot_use_the_communicator_and_does_not_hide_its_parents_death", &[]);
}

#[test]
fn a_forked_child_of_a_rank_with_progress_threads_drops_its_communicator_at_once() {
    // The threads stayed in the parent: the child's drop must not wait for them.
    let env = [("TOROID_NTHREADS", "2"), ("TOROID_NSOCKS", "2"), ("TOROID_SHM_DISABLE", "1")];
    forked_child("a_forked_child_of_a_rank_with_progress_threads_drops_its_communicator_at_once", &env);
}

/// Rank 1 of 3 forks, then dies: the child cannot use the communicator, drops it at once, and
/// holds on for a while; the others learn of rank 1's death at once all the same.
fn forked_child(test: &str, env: &[(&str, &str)]) {
    const CHILD_HOLDS_S: u64 = 6;
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let mut buf = vec![1i32; 1 << 16];
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        if comm.rank() == 1 {
            // SAFETY: the child runs only the code below and leaves with _exit.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0);
            if pid == 0 {
                let e = comm.barrier().unwrap_err();
                println!("CHILD {} {}", e.category(), std::process::id());
                let w = comm.all_reduce_async(vec![0u8; 4], ReduceOp::Sum).map(|_| ());
                println!("CHILD-ASYNC {}", w.err().map_or("ok", |e| e.category()));
                let t = Instant::now();
                drop(comm); // must neither hang nor close anything of the parent's
                println!("CHILD-DROPPED in {} ms", t.elapsed().as_millis());
                std::thread::sleep(Duration::from_secs(CHILD_HOLDS_S));
                // SAFETY: ends the child without the test harness.
                unsafe { libc::_exit(0) };
            }
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: kill(2) on our own pid.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let start = Instant::now();
        loop {
            if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
                println!("ERROR {} after {} ms: {e}", e.category(), start.elapsed().as_millis());
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "no error within 60 s");
        }
    }
    let n = 3;
    let children = util::spawn_ranks(test, n, |_| {
        let mut vars = vec![("TOROID_TIMEOUT".to_string(), "20".to_string())];
        vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        vars
    });
    let deadline = Instant::now() + Duration::from_secs(40);
    let (_, outputs) = util::wait_all(children, deadline);
    let child = outputs[1]
        .lines()
        .find_map(|l| l.find("CHILD ").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("{}", outputs[1]));
    assert!(child.starts_with("CHILD invalid_usage"), "{child}");
    assert!(outputs[1].contains("CHILD-ASYNC invalid_usage"), "{}", outputs[1]);
    let dropped_ms: u64 = outputs[1]
        .lines()
        .find_map(|l| l.split("CHILD-DROPPED in ").nth(1))
        .and_then(|rest| rest.trim_end_matches(" ms").parse().ok())
        .unwrap_or_else(|| panic!("the child never finished dropping its communicator:\n{}", outputs[1]));
    assert!(dropped_ms < 1000, "the child's drop took {dropped_ms} ms");
    let child_pid: i32 = child.split(' ').nth(2).unwrap().parse().unwrap();
    for r in [0, 2] {
        let out = &outputs[r];
        let (line, ms) = util::error_line(out).unwrap_or_else(|| panic!("rank {r}:\n{out}"));
        // The child still held copies of the dead rank's sockets for CHILD_HOLDS_S seconds:
        // the error must come from the death, not from the child's exit or the timeout.
        assert!(ms < 3000, "rank {r} learnt of the death only after {ms} ms: {line}");
    }
    // SAFETY: kill(2) on the child we were told about (it has exited by now, normally).
    unsafe { libc::kill(child_pid, libc::SIGKILL) };
}
