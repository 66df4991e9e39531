//! Shrink with real processes: a rank killed (SIGKILL) in the middle of a loop of all-reduces,
//! the survivors shrink and all-reduce correctly on the new communicator, over shared memory and
//! over TCP; a healthy communicator shrunk without a rank that takes no part; survivors that
//! disagree on the failed ranks all fail within the timeout. The non-blocking form: polled until
//! done, then the same check; and aborted when it cannot complete (a survivor never shrinks).

mod util;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use toroid::{Communicator, ReduceOp};

const TIMEOUT_S: u64 = 10;
const N: usize = 4;
/// Elements of the check after the shrink.
const COUNT: usize = 10_000;

/// Parent rank `r`'s input: random 40-bit values, so that sums of a few stay exact in i64.
fn input(r: usize, i: usize) -> i64 {
    (util::data::mix(((r as u64) << 32) ^ i as u64 ^ 0x5b1) >> 24) as i64
}

/// All-reduces every parent rank's input on `comm` (the survivors `survivors`, in order) and
/// checks the sum against one computed here from the survivors' inputs.
fn check_sum(comm: &Communicator, parent_rank: usize, survivors: &[usize]) {
    assert_eq!(comm.size(), survivors.len());
    assert_eq!(survivors[comm.rank()], parent_rank, "new ranks follow the parent's order");
    let mut v: Vec<i64> = (0..COUNT).map(|i| input(parent_rank, i)).collect();
    comm.all_reduce(&mut v, ReduceOp::Sum).expect("all-reduce after the shrink");
    for (i, got) in v.iter().enumerate() {
        let want: i64 = survivors.iter().map(|r| input(*r, i)).sum();
        assert_eq!(*got, want, "element {i}");
    }
}

fn env(tcp: bool) -> Vec<(String, String)> {
    let mut e = vec![("TOROID_TIMEOUT".to_string(), TIMEOUT_S.to_string())];
    if tcp {
        e.push(("TOROID_SHM_DISABLE".into(), "1".into()));
    }
    e
}

/// How the survivors shrink.
#[derive(Clone, Copy, PartialEq)]
enum How {
    /// `shrink(&[2])`.
    Named,
    /// `shrink(&[])`: shrink finds the dead rank.
    Found,
    /// `shrink_async(&[2])`, polled until done.
    Polled,
}

/// Rank body: rank 2 dies mid-loop; the others see the error, shrink (`how`) and check an
/// all-reduce on the three of them.
fn killed_rank_body(how: How) {
    let comm = Communicator::from_env().expect("create");
    if comm.rank() == 2 {
        util::kill_self_after(Duration::from_millis(300));
    }
    let (err, ms) = util::all_reduce_until_error(&comm, 1 << 20);
    println!("ERROR {} after {ms} ms: {err}", err.category());
    let t = Instant::now();
    let failed: &[usize] = if how == How::Found { &[] } else { &[2] };
    let small = if how == How::Polled {
        let pending = comm.shrink_async(failed).expect("shrink_async");
        let mut polls = 0;
        while !pending.is_done() {
            polls += 1;
            assert!(t.elapsed() < Duration::from_secs(2 * TIMEOUT_S), "shrink not done");
            std::thread::sleep(Duration::from_millis(1));
        }
        println!("POLLED {polls} times");
        pending.wait()
    } else {
        comm.shrink(failed)
    };
    let small = small.unwrap_or_else(|e| panic!("rank {}: shrink: {e}", comm.rank()));
    println!("SHRUNK in {} ms to rank {} of {}", t.elapsed().as_millis(), small.rank(), small.size());
    check_sum(&small, comm.rank(), &[0, 1, 3]);
    println!("SUM OK");
}

fn killed_rank_case(test: &str, tcp: bool) {
    let children = util::spawn_ranks(test, N, |_| env(tcp));
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let deadline = Instant::now() + Duration::from_secs(3 * TIMEOUT_S + 30);
    let (statuses, outputs) = util::wait_all(children, deadline);
    assert_eq!(statuses[2].and_then(|s| s.signal()), Some(libc::SIGKILL), "rank 2 should die by SIGKILL");
    for r in [0, 1, 3] {
        let out = &outputs[r];
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r} did not exit cleanly:\n{out}");
        assert!(util::error_line(out).is_some(), "rank {r} saw no error:\n{out}");
        assert!(out.contains("SUM OK"), "rank {r}:\n{out}");
    }
    for pid in pids {
        assert!(!util::alive(pid), "process {pid} still running");
    }
}

#[test]
fn survivors_of_a_killed_rank_shrink_and_all_reduce_over_shm() {
    if util::is_child() {
        return killed_rank_body(How::Named);
    }
    killed_rank_case("survivors_of_a_killed_rank_shrink_and_all_reduce_over_shm", false);
}

#[test]
fn survivors_of_a_killed_rank_shrink_and_all_reduce_over_tcp() {
    if util::is_child() {
        return killed_rank_body(How::Named);
    }
    killed_rank_case("survivors_of_a_killed_rank_shrink_and_all_reduce_over_tcp", true);
}

#[test]
fn survivors_find_the_killed_rank_themselves() {
    if util::is_child() {
        return killed_rank_body(How::Found);
    }
    killed_rank_case("survivors_find_the_killed_rank_themselves", false);
}

#[test]
fn survivors_shrink_in_the_background_and_poll_until_done() {
    if util::is_child() {
        return killed_rank_body(How::Polled);
    }
    killed_rank_case("survivors_shrink_in_the_background_and_poll_until_done", false);
}

#[test]
fn a_background_shrink_that_cannot_complete_is_aborted_at_once() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("create");
        comm.barrier().expect("barrier");
        match comm.rank() {
            // Shrinks without rank 2, but rank 1 never does: rank 0 waits for it in the mesh.
            0 => {
                let pending = comm.shrink_async(&[2]).expect("shrink_async");
                std::thread::sleep(Duration::from_millis(500));
                assert!(!pending.is_done(), "a shrink missing a survivor finished");
                let t = Instant::now();
                pending.abort();
                let took = t.elapsed();
                assert!(pending.is_done());
                let err = pending.wait().expect_err("an aborted shrink gave a communicator");
                assert!(matches!(err, toroid::Error::Aborted(_)), "{err}");
                assert!(took < Duration::from_secs(1), "abort took {took:?}");
                println!("ABORTED in {} ms: {err}", took.as_millis());
                // The communicator's one shrink is spent.
                let again = comm.shrink(&[2]).expect_err("a second shrink");
                println!("AGAIN {again}");
            }
            // Alive, not shrinking, until rank 0 is done.
            _ => std::thread::sleep(Duration::from_secs(3)),
        }
        return;
    }
    let test = "a_background_shrink_that_cannot_complete_is_aborted_at_once";
    let children = util::spawn_ranks(test, 3, |_| env(false));
    let deadline = Instant::now() + Duration::from_secs(2 * TIMEOUT_S + 30);
    let (statuses, outputs) = util::wait_all(children, deadline);
    for (r, out) in outputs.iter().enumerate() {
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r} failed:\n{out}");
    }
    assert!(outputs[0].contains("ABORTED in") && outputs[0].contains("AGAIN"), "{}", outputs[0]);
}

#[test]
fn a_healthy_communicator_shrinks_without_a_rank_that_takes_no_part() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("create");
        let mut one = [1u32];
        comm.all_reduce(&mut one, ReduceOp::Sum).expect("all-reduce before");
        assert_eq!(one[0], N as u32);
        if comm.rank() == 3 {
            // Takes no part: it neither shrinks nor answers anyone, and may go away at once.
            println!("LEFT OUT");
            return;
        }
        let small = comm.shrink(&[3]).unwrap_or_else(|e| panic!("rank {}: shrink: {e}", comm.rank()));
        check_sum(&small, comm.rank(), &[0, 1, 2]);
        println!("SUM OK");
        return;
    }
    let test = "a_healthy_communicator_shrinks_without_a_rank_that_takes_no_part";
    let children = util::spawn_ranks(test, N, |_| env(false));
    let deadline = Instant::now() + Duration::from_secs(2 * TIMEOUT_S + 30);
    let (statuses, outputs) = util::wait_all(children, deadline);
    for (r, out) in outputs.iter().enumerate() {
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r} failed:\n{out}");
        assert!(out.contains(if r == 3 { "LEFT OUT" } else { "SUM OK" }), "rank {r}:\n{out}");
    }
}

#[test]
fn survivors_that_disagree_on_the_failed_ranks_all_fail_within_the_timeout() {
    const SHORT_S: u64 = 4;
    if util::is_child() {
        let comm = Communicator::from_env().expect("create");
        comm.barrier().expect("barrier");
        if comm.rank() == 3 {
            println!("LEFT OUT");
            // Alive but out of it, until the others are done.
            std::thread::sleep(Duration::from_secs(SHORT_S + 5));
            return;
        }
        // Ranks 0 and 1 leave out rank 3; rank 2 leaves out ranks 1 and 3.
        let failed: &[usize] = if comm.rank() == 2 { &[1, 3] } else { &[3] };
        let t = Instant::now();
        match comm.shrink(failed) {
            Ok(c) => panic!("rank {}: shrink succeeded into rank {} of {}", comm.rank(), c.rank(), c.size()),
            Err(e) => println!("ERROR {} after {} ms: {e}", e.category(), t.elapsed().as_millis()),
        }
        return;
    }
    let test = "survivors_that_disagree_on_the_failed_ranks_all_fail_within_the_timeout";
    let children = util::spawn_ranks(test, N, |_| vec![("TOROID_TIMEOUT".into(), SHORT_S.to_string())]);
    let deadline = Instant::now() + Duration::from_secs(3 * SHORT_S + 30);
    let (statuses, outputs) = util::wait_all(children, deadline);
    for r in 0..3 {
        let out = &outputs[r];
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r} did not exit cleanly:\n{out}");
        let (line, ms) = util::error_line(out).unwrap_or_else(|| panic!("rank {r} saw no error:\n{out}"));
        assert!(ms < (SHORT_S + 3) * 1000, "rank {r} took {ms} ms: {line}");
        assert!(line.contains("same failed ranks") || line.contains("disagree"), "rank {r}: {line}");
    }
}

/// Revoke, then shrink: ranks 0-2 wait in an all-reduce that rank 3 (busy in user code) never
/// enters; a watchdog thread of rank 0 revokes. Every waiting rank's call fails at once with the
/// revoke named, rank 3's next call fails too, every rank reports the communicator revoked,
/// and ranks 0-2 shrink without rank 3 and all-reduce exactly on the result.
fn revoke_then_shrink(tcp: bool) {
    let cfg = toroid::Config { shm_disable: tcp, ..util::test_config(30.0) };
    util::run_threads(4, &cfg, |comm| {
        let comm = std::sync::Arc::new(comm);
        let me = comm.rank();
        let mut v = vec![1i64; 1000];
        let t = Instant::now();
        let watchdog = (me == 0).then(|| {
            let c = comm.clone();
            std::thread::spawn(move || {
                // Once ranks 0-2 are inside the all-reduce (asked with the health query: a
                // rank still finishing set-up would see its set-up revoked instead).
                let until = Instant::now() + Duration::from_secs(20);
                loop {
                    let h = c.health(Duration::from_millis(500)).unwrap().to_json();
                    let inside = (0..3).all(|r| h["ranks"][r]["op"]["kind"] == "all_reduce");
                    if inside || Instant::now() > until {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let t = Instant::now();
                c.revoke();
                c.revoke(); // idempotent
                assert!(t.elapsed() < Duration::from_millis(100), "revoke blocked for {:?}", t.elapsed());
            })
        });
        if me == 3 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        // A rank whose peers' data for this all-reduce all went out before the revoke (rank 3,
        // entering late; or a rank that needs only rank 3's and pre-revoke data) completes it,
        // exactly; the abort frames behind that data fail its next call.
        let e = match comm.all_reduce(&mut v, ReduceOp::Sum) {
            Err(e) => e,
            Ok(()) => {
                assert!(v.iter().all(|&x| x == 4), "rank {me}: a completed all-reduce is exact");
                comm.all_reduce(&mut v, ReduceOp::Sum).expect_err("the revoke fails the next call")
            }
        };
        if me != 3 {
            assert!(t.elapsed() < Duration::from_secs(5), "rank {me} waited {:?}: {e}", t.elapsed());
        }
        assert!(e.to_string().contains("rank 0 revoked the communicator"), "rank {me}: {e}");
        assert!(comm.is_revoked(), "rank {me}");
        let again = comm.all_reduce(&mut v, ReduceOp::Sum).expect_err("revoked for good");
        assert!(again.to_string().contains("revoked"), "rank {me}: {again}");
        if let Some(w) = watchdog {
            w.join().unwrap();
        }
        // The health query still answers on a revoked communicator.
        let h = comm.health(Duration::from_secs(2)).unwrap();
        assert_eq!(h.ranks.len(), 4);
        if me == 3 {
            return;
        }
        let small = comm.shrink(&[3]).expect("shrink after the revoke");
        check_sum(&small, me, &[0, 1, 2]);
    });
}

#[test]
fn revoke_then_shrink_shm() {
    revoke_then_shrink(false);
}

#[test]
fn revoke_then_shrink_tcp() {
    revoke_then_shrink(true);
}
