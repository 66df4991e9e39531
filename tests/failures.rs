//! Failure handling: a rank killed mid-collective, mismatched collectives, deadlines, abort,
//! bad arguments. Every case must end in a clear error on every rank, never a hang.

mod util;

use std::time::{Duration, Instant};

use toroid::{CallOptions, Communicator, DataType, Error, OpKind, ReduceOp};

fn kind(e: &Error) -> &'static str {
    match e {
        Error::System(_) => "system",
        Error::Internal(_) => "internal",
        Error::InvalidArgument(_) => "invalid_argument",
        Error::InvalidUsage(_) => "invalid_usage",
        Error::Remote(_) => "remote",
        Error::Timeout(_) => "timeout",
        Error::Aborted(_) => "aborted",
        Error::Unsupported(_) => "unsupported",
    }
}

const KILL_TIMEOUT_S: u64 = 10;

#[test]
fn killed_rank_turns_into_errors_on_every_other_rank() {
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
                println!("ERROR {} after {} ms: {e}", kind(&e), start.elapsed().as_millis());
                // A later call fails fast.
                let t = Instant::now();
                let again = comm.barrier().unwrap_err();
                println!("LATER {} in {} us", kind(&again), t.elapsed().as_micros());
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "no error within 60 s");
        }
    }
    let n = 4;
    let mut children = util::spawn_ranks("killed_rank_turns_into_errors_on_every_other_rank", n, |_| {
        vec![("TOROID_TIMEOUT".into(), KILL_TIMEOUT_S.to_string())]
    });
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let deadline = Instant::now() + Duration::from_secs(KILL_TIMEOUT_S + 20);
    let statuses: Vec<_> = children.iter_mut().map(|c| util::wait_until(c, deadline)).collect();
    let outputs: Vec<String> = children
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
        })
        .collect();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(statuses[2].and_then(|s| s.signal()), Some(libc::SIGKILL), "rank 2 should die by SIGKILL");
    for r in [0, 1, 3] {
        let out = &outputs[r];
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r} did not exit cleanly:\n{out}");
        let line = out
            .lines()
            .find_map(|l| l.find("ERROR ").map(|i| &l[i..]))
            .unwrap_or_else(|| panic!("rank {r} saw no error:\n{out}"));
        // The error arrives well within the timeout: from the dead peer's closed sockets, not
        // from a deadline.
        let ms: u64 = line.split(" after ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
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
            let opts = CallOptions { timeout: Some(Duration::from_millis(500)), algorithm: None };
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
