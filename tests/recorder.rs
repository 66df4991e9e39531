//! The flight recorder and the statistics through the public API, with ranks that are threads
//! of this process: what a rank blocked in a collective shows to another thread (the operation,
//! the rank it waits on), the bytes a ring moves, and exact counts per collective and size.

mod util;

use std::time::Duration;

use toroid::internals::collective::CollKind;
use toroid::internals::trace::{OpState, Phase};
use toroid::{Algorithm, CallOptions, Config, DataType, OpKind, ReduceOp};
use util::{run_threads, test_config};

fn ring_config() -> Config {
    Config { algo: Some("ring".into()), ..test_config(30.0) }
}

#[test]
fn a_rank_blocked_in_a_collective_shows_whom_it_waits_on() {
    // Rank 2 enters the all-reduce 1.5 s late; meanwhile rank 0's recorder, read from another
    // thread, shows the all-reduce running and rank 2 (its left neighbour on the ring) awaited.
    run_threads(3, &ring_config(), |comm| {
        let mut v = vec![comm.rank() as f32 + 1.0; 3000];
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        std::thread::scope(|s| {
            let seen = (comm.rank() == 0).then(|| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(700));
                    comm.flight_record()
                })
            });
            comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert!(v.iter().all(|x| *x == 6.0));
            if let Some(h) = seen {
                let snap = h.join().unwrap();
                let run = snap.running().unwrap_or_else(|| panic!("nothing running: {snap:?}"));
                assert_eq!(
                    (run.fp.kind, run.fp.count, run.fp.dtype),
                    (CollKind::AllReduce, 3000, DataType::F32)
                );
                assert_eq!(run.waiting_on, 2, "{run:?}");
                assert_eq!(run.phase, Phase::AllReduce);
                assert_eq!(snap.rank, 0);
                let last = snap.last_ended().unwrap();
                assert_eq!(last.state, OpState::Done);
                assert_eq!(last.fp.seq + 1, run.fp.seq);
                // Afterwards it is done, with its bytes: a ring all-reduce of 3 pieces of 4000
                // bytes receives and sends 4 pieces each.
                let after = comm.flight_record();
                let done = after.last_ended().unwrap();
                assert_eq!((done.fp.seq, done.state, done.waiting_on), (run.fp.seq, OpState::Done, -1));
                assert_eq!(done.bytes, 2 * 4 * 4000);
                assert!(done.ended_ns >= done.started_ns && done.started_ns >= done.issued_ns);
            }
        });
    });
}

#[test]
fn statistics_count_every_operation_by_kind_algorithm_and_size() {
    run_threads(3, &test_config(30.0), |comm| {
        let before = comm.stats().total_count();
        let mut a = vec![1.0f32; 1024];
        for _ in 0..5 {
            comm.all_reduce(&mut a, ReduceOp::Sum).unwrap();
        }
        let mut b = vec![7u8; 100_000];
        for _ in 0..3 {
            comm.broadcast(&mut b, 1).unwrap();
        }
        let forced = CallOptions { algorithm: Some(Algorithm::Ring), ..CallOptions::default() };
        let mut c = vec![0i64; 3 * 512];
        comm.run_bytes(
            OpKind::AllReduce(ReduceOp::Max),
            DataType::I64,
            None,
            Some(bytemuck::cast_slice_mut(&mut c)),
            forced,
        )
        .unwrap();
        let st = comm.stats();
        assert_eq!(st.total_count() - before, 9);
        let cell = |kind: CollKind, class: u8| {
            st.cells()
                .iter()
                .filter(|c| c.kind == kind && c.size_class == class)
                .map(|c| (c.count, c.bytes))
                .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
        };
        assert_eq!(cell(CollKind::AllReduce, 12), (5, 5 * 4096), "{st}");
        assert_eq!(cell(CollKind::Broadcast, 17), (3, 300_000), "{st}");
        let ring = st
            .cells()
            .iter()
            .find(|c| c.kind == CollKind::AllReduce && c.size_class == 14 && c.algo == Algorithm::Ring as u8);
        assert_eq!(ring.map(|c| (c.count, c.bytes)), Some((1, 12288)), "{st}");
        assert!(st.to_string().contains("broadcast"));
    });
}

#[test]
fn a_recorder_of_size_zero_records_nothing() {
    let cfg = Config { trace_buffer: 0, ..test_config(30.0) };
    run_threads(2, &cfg, |comm| {
        let mut a = vec![1.0f32; 64];
        comm.all_reduce(&mut a, ReduceOp::Sum).unwrap();
        assert!(comm.flight_record().records.is_empty());
        assert_eq!(comm.stats().total_count(), 0);
    });
}
