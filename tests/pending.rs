//! Non-blocking creation (`with_store_async`): ranks that poll while a late rank joins, then
//! all-reduce random data checked against a sum computed here; a set-up that cannot complete
//! (a rank that never comes) aborted, and dropped, within a fraction of a second; the
//! communicator handed out once. (Shrink's non-blocking form is tested in `shrink.rs`, the C
//! forms in `ffi_tests/pending.c`.)

mod util;

use std::sync::Arc;
use std::time::{Duration, Instant};

use toroid::rendezvous::{MemStore, Store};
use toroid::{Communicator, Error, ReduceOp};

const COUNT: usize = 5000;

fn input(r: usize, i: usize) -> i64 {
    (util::data::mix(((r as u64) << 32) ^ i as u64 ^ 0x77) >> 26) as i64
}

#[test]
fn ranks_poll_while_a_late_rank_joins_then_all_reduce() {
    const N: usize = 3;
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let threads: Vec<_> = (0..N)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                if r == N - 1 {
                    std::thread::sleep(Duration::from_millis(400));
                }
                let start = Instant::now();
                let pending = Communicator::with_store_async(r, N, store, &util::test_config(30.0))
                    .expect("with_store_async");
                let mut polls = 0u32;
                while !pending.is_done() {
                    polls += 1;
                    assert!(start.elapsed() < Duration::from_secs(30), "rank {r}: not done");
                    std::thread::sleep(Duration::from_millis(1));
                }
                let comm = pending.wait().unwrap_or_else(|e| panic!("rank {r}: {e}"));
                let again = pending.wait().expect_err("a second wait handed out a communicator");
                assert!(matches!(again, Error::InvalidUsage(_)), "{again}");
                pending.abort(); // a no-op once taken: the communicator stays usable
                drop(pending);
                assert_eq!((comm.rank(), comm.size()), (r, N));
                let mut v: Vec<i64> = (0..COUNT).map(|i| input(r, i)).collect();
                comm.all_reduce(&mut v, ReduceOp::Sum).expect("all-reduce");
                for (i, got) in v.iter().enumerate() {
                    let want: i64 = (0..N).map(|s| input(s, i)).sum();
                    assert_eq!(*got, want, "rank {r}, element {i}");
                }
                polls
            })
        })
        .collect();
    let polls: Vec<u32> = threads.into_iter().map(|t| t.join().expect("rank thread")).collect();
    // Ranks 0 and 1 started 400 ms before rank 2: they polled while it was missing.
    assert!(polls[0] > 10 && polls[1] > 10, "polls {polls:?}");
}

/// A creation whose other rank never comes: started, checked not done, then stopped by `stop`
/// (abort or drop), which must return within a second.
fn stopped_while_waiting(stop: impl FnOnce(toroid::PendingComm) -> Option<Error>) -> Option<Error> {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let pending =
        Communicator::with_store_async(0, 2, store, &util::test_config(60.0)).expect("with_store_async");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!pending.is_done(), "a creation missing a rank finished");
    let t = Instant::now();
    let err = stop(pending);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "stopping took {took:?}");
    err
}

#[test]
fn a_creation_missing_a_rank_is_aborted_at_once() {
    let err = stopped_while_waiting(|p| {
        p.abort();
        assert!(p.is_done());
        p.wait().err()
    });
    let err = err.expect("an aborted creation gave a communicator");
    assert!(matches!(err, Error::Aborted(_)), "{err}");
    assert!(err.to_string().contains("aborted by its caller"), "{err}");
}

#[test]
fn dropping_a_pending_creation_aborts_it() {
    assert!(
        stopped_while_waiting(|p| {
            drop(p);
            None
        })
        .is_none()
    );
}
