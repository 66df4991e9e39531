//! Unit tests of the stall and failure reports ([`super`]).

use super::*;
use crate::dtype::{DataType, ReduceOp};
use crate::trace::Phase;

const SEC: u64 = 1_000_000_000;

fn fp(seq: u64, kind: CollKind, count: u64) -> Fingerprint {
    Fingerprint { seq, kind, dtype: DataType::F32, op: ReduceOp::Sum, count, root: -1, algo: 1 }
}

fn rec(seq: u64, kind: CollKind, state: OpState) -> OpRecord {
    OpRecord {
        fp: fp(seq, kind, 4096),
        state,
        phase: Phase::ReduceScatter,
        peer: -1,
        waiting_on: -1,
        step: 3,
        issued_ns: 10 * SEC,
        started_ns: 10 * SEC,
        ended_ns: 0,
        bytes: 1024,
    }
}

/// A rank that completed all_reduce 1..=done and is inside `cur` (if any).
fn snap(rank: u32, size: u32, done: u64, cur: Option<OpRecord>) -> Snapshot {
    let mut records: Vec<OpRecord> = (1..=done).map(|s| rec(s, CollKind::AllReduce, OpState::Done)).collect();
    records.extend(cur);
    Snapshot { rank, size, comm_id: 7, pid: 100 + rank, taken_ns: 14 * SEC, completed: done, records }
}

fn running(seq: u64, waiting_on: i32) -> Option<OpRecord> {
    Some(OpRecord { waiting_on, ..rec(seq, CollKind::AllReduce, OpState::Running) })
}

fn conclude_for(own: Snapshot, others: Vec<(usize, PeerAnswer)>) -> String {
    Report::build(&own, &others).conclusion().to_string()
}

fn reports(snaps: Vec<Snapshot>) -> (Snapshot, Vec<(usize, PeerAnswer)>) {
    let mut it = snaps.into_iter();
    let own = it.next().unwrap();
    (own, it.map(|s| (s.rank as usize, PeerAnswer::Report(s))).collect())
}

#[test]
fn without_records_only_dead_and_stopped_ranks_are_told() {
    let empty = |r| Snapshot { records: Vec::new(), ..snap(r, 3, 0, None) };
    let r = Report::build(&empty(0), &[(1, PeerAnswer::Report(empty(1))), (2, PeerAnswer::Silent)]);
    assert!(r.is_informative());
    assert_eq!(
        r.conclusion(),
        "rank 2 is not answering (stopped or hung); no flight records to compare (TOROID_TRACE_BUFFER=0)"
    );
    let r = Report::build(&empty(0), &[(1, PeerAnswer::Report(empty(1))), (2, PeerAnswer::Report(empty(2)))]);
    assert!(!r.is_informative());
}

#[test]
fn rank_lists_compress_into_ranges() {
    assert_eq!(ranks(&[5]), "rank 5");
    assert_eq!(ranks(&[7, 0, 1, 2, 3, 4, 6]), "ranks 0-4, 6-7");
    assert_eq!(ranks(&[1, 3]), "ranks 1, 3");
    assert_eq!(ranks(&[2, 2, 3]), "ranks 2-3");
}

#[test]
fn a_rank_that_never_entered_is_blamed_with_where_it_was_last_seen() {
    let mut snaps: Vec<Snapshot> = (0..8).map(|r| snap(r, 8, 811, running(812, 5))).collect();
    snaps[5] = snap(5, 8, 811, None);
    let (own, others) = reports(snaps);
    assert_eq!(
        conclude_for(own, others),
        "rank 5 never entered all_reduce #812 (last seen in all_reduce #811); ranks 0-4, 6-7 wait on it"
    );
}

#[test]
fn rank_zero_can_be_the_culprit() {
    let mut snaps: Vec<Snapshot> = (0..4).map(|r| snap(r, 4, 3, running(4, 0))).collect();
    snaps[0] = snap(0, 4, 3, None);
    let (own, others) = reports(snaps);
    assert_eq!(
        conclude_for(own, others),
        "rank 0 never entered all_reduce #4 (last seen in all_reduce #3); ranks 1-3 wait on it"
    );
}

#[test]
fn a_chain_of_waits_blames_its_end_not_the_middle() {
    // 0 waits on 1, 1 (in the same collective) waits on 2, 2 is idle: 2, not 1.
    let snaps = vec![snap(0, 3, 9, running(10, 1)), snap(1, 3, 9, running(10, 2)), snap(2, 3, 9, None)];
    let (own, others) = reports(snaps);
    assert_eq!(
        conclude_for(own, others),
        "rank 2 never entered all_reduce #10 (last seen in all_reduce #9); ranks 0-1 wait on it"
    );
    // The same when the first rank already moved on to the next collective.
    let snaps = vec![snap(0, 3, 10, running(11, 1)), snap(1, 3, 9, running(10, 2)), snap(2, 3, 9, None)];
    let (own, others) = reports(snaps);
    assert_eq!(
        conclude_for(own, others),
        "rank 2 never entered all_reduce #10 (last seen in all_reduce #9); ranks 0-1 wait on it"
    );
}

#[test]
fn a_rank_ahead_of_the_others_is_not_blamed() {
    // Rank 2 finished #10 (a broadcast root may) and idles; 0 and 1 are inside #10.
    let snaps = vec![snap(0, 3, 9, running(10, 1)), snap(1, 3, 9, running(10, 0)), snap(2, 3, 10, None)];
    let (own, others) = reports(snaps);
    let c = conclude_for(own, others);
    assert!(c.starts_with("no rank is missing: ranks 0-1 are inside all_reduce #10"), "{c}");
}

#[test]
fn several_missing_ranks_are_all_named() {
    let mut snaps: Vec<Snapshot> = (0..8).map(|r| snap(r, 8, 40, running(41, -1))).collect();
    snaps[2] = snap(2, 8, 40, None);
    snaps[3] = snap(3, 8, 40, None);
    snaps[6] = snap(6, 8, 39, None);
    let (own, mut others) = reports(snaps);
    others.retain(|(r, _)| *r != 7);
    others.push((7, PeerAnswer::Dead("connection refused".into())));
    assert_eq!(
        conclude_for(own, others),
        "rank 7 died during all_reduce #41; ranks 2-3 never entered all_reduce #41 (last seen in \
         all_reduce #40); rank 6 never entered all_reduce #41 (last seen in all_reduce #39); \
         ranks 0-1, 4-5 wait on them"
    );
}

#[test]
fn a_dead_rank_is_named_as_dead() {
    let snaps: Vec<Snapshot> = (0..4).filter(|r| *r != 2).map(|r| snap(r, 4, 811, running(812, 2))).collect();
    let (own, mut others) = reports(snaps);
    others.push((2, PeerAnswer::Dead("connection refused".into())));
    assert_eq!(conclude_for(own, others), "rank 2 died during all_reduce #812; ranks 0-1, 3 wait on it");
}

#[test]
fn a_rank_between_collectives_is_no_culprit() {
    let mut snaps: Vec<Snapshot> =
        (0..4).filter(|r| *r != 2).map(|r| snap(r, 4, 811, running(812, 2))).collect();
    // Rank 3 completed #811 a millisecond before the snapshot and is about to call #812.
    snaps[2] = snap(3, 4, 811, None);
    snaps[2].records.last_mut().unwrap().ended_ns = 14 * SEC - 1_000_000;
    let (own, mut others) = reports(snaps.clone());
    others.push((2, PeerAnswer::Dead("connection refused".into())));
    assert_eq!(conclude_for(own, others), "rank 2 died during all_reduce #812; ranks 0-1, 3 wait on it");
    // Idle for seconds, it is behind after all.
    snaps[2].records.last_mut().unwrap().ended_ns = 10 * SEC;
    let (own, mut others) = reports(snaps);
    others.push((2, PeerAnswer::Dead("connection refused".into())));
    assert_eq!(
        conclude_for(own, others),
        "rank 2 died during all_reduce #812; rank 3 never entered all_reduce #812 (last seen in \
         all_reduce #811); ranks 0-1 wait on them"
    );
}

#[test]
fn a_rank_that_exited_after_the_failure_is_no_culprit() {
    // Rank 3 failed with the others and exited before it was asked; the waits point at 0.
    let mut snaps: Vec<Snapshot> = (1..3).map(|r| snap(r, 4, 12, running(13, 0))).collect();
    snaps.push(snap(0, 4, 12, None));
    let (own, mut others) = reports(snaps);
    others.push((3, PeerAnswer::Dead("connection refused".into())));
    assert_eq!(
        conclude_for(own, others),
        "rank 0 never entered all_reduce #13 (last seen in all_reduce #12); ranks 1-2 wait on it"
    );
    // Two gone, one waited on: that one died.
    let snaps: Vec<Snapshot> = [1, 3].into_iter().map(|r| snap(r, 4, 12, running(13, 2))).collect();
    let (own, mut others) = reports(snaps);
    others.push((0, PeerAnswer::Dead("connection refused".into())));
    others.push((2, PeerAnswer::Dead("connection refused".into())));
    assert_eq!(conclude_for(own, others), "rank 2 died during all_reduce #13; ranks 1, 3 wait on it");
}

#[test]
fn after_a_closed_connection_only_that_rank_died() {
    let snaps: Vec<Snapshot> = [3].into_iter().map(|r| snap(r, 4, 12, running(13, 2))).collect();
    let (own, mut others) = reports(snaps);
    others.push((0, PeerAnswer::Dead("connection refused".into())));
    others.push((1, PeerAnswer::Dead("connection refused".into())));
    others.push((2, PeerAnswer::Dead("connection refused".into())));
    let r = Report::build_after_close(&own, &others, Some(2));
    assert_eq!(r.conclusion(), "rank 2 died during all_reduce #13; rank 3 waits on it");
    assert!(r.table().lines().nth(1).unwrap().starts_with("0      gone"), "{}", r.table());
}

#[test]
fn a_dump_that_catches_ranks_on_their_way_blames_nobody() {
    let mut snaps: Vec<Snapshot> = (0..4).map(|r| snap(r, 4, 5, None)).collect();
    for s in &mut snaps {
        s.records.last_mut().unwrap().ended_ns = 14 * SEC - 2_000_000;
    }
    snaps[0].records.push(rec(6, CollKind::Barrier, OpState::Running));
    let (own, others) = reports(snaps);
    assert_eq!(conclude_for(own, others), "no rank is missing: rank 0 is inside barrier #6");
}

#[test]
fn a_stopped_rank_is_named_as_not_answering() {
    let snaps: Vec<Snapshot> = (0..4).filter(|r| *r != 3).map(|r| snap(r, 4, 5, running(6, 3))).collect();
    let (own, mut others) = reports(snaps);
    others.push((3, PeerAnswer::Silent));
    assert_eq!(
        conclude_for(own, others),
        "rank 3 is not answering (stopped or hung) during all_reduce #6; ranks 0-2 wait on it"
    );
}

#[test]
fn different_collectives_at_the_same_number_disagree() {
    let mut snaps: Vec<Snapshot> = (0..8).map(|r| snap(r, 8, 39, running(40, -1))).collect();
    let mut b = rec(40, CollKind::Broadcast, OpState::Running);
    b.fp.root = 0;
    snaps[3] = snap(3, 8, 39, Some(b));
    let (own, others) = reports(snaps);
    assert_eq!(
        conclude_for(own, others),
        "rank 3 and ranks 0-2, 4-7 disagree at #40: broadcast 4096 x float root 0 vs all_reduce 4096 x float sum"
    );
}

#[test]
fn a_different_collective_that_already_completed_still_disagrees() {
    // The odd rank's broadcast (it was root) completed at once; it now idles.
    let mut snaps: Vec<Snapshot> = (0..4).map(|r| snap(r, 4, 39, running(40, 1))).collect();
    let mut s = snap(1, 4, 39, None);
    s.records.push(rec(40, CollKind::Broadcast, OpState::Done));
    snaps[1] = s;
    let (own, others) = reports(snaps);
    assert_eq!(
        conclude_for(own, others),
        "rank 1 and ranks 0, 2-3 disagree at #40: broadcast 4096 x float vs all_reduce 4096 x float sum"
    );
}

#[test]
fn a_different_count_disagrees_and_a_tie_keeps_the_lowest_rank_as_right() {
    let mut snaps: Vec<Snapshot> = (0..2).map(|r| snap(r, 2, 0, running(1, -1))).collect();
    snaps[1].records[0].fp.count = 100;
    let (own, others) = reports(snaps);
    assert_eq!(
        conclude_for(own, others),
        "rank 1 and rank 0 disagree at #1: all_reduce 100 x float sum vs all_reduce 4096 x float sum"
    );
}

#[test]
fn a_slow_rank_inside_the_same_collective_is_not_blamed() {
    let snaps: Vec<Snapshot> =
        (0..4).map(|r| snap(r, 4, 20, running(21, if r == 2 { -1 } else { 2 }))).collect();
    let (own, others) = reports(snaps);
    assert_eq!(
        conclude_for(own, others),
        "no rank is missing: ranks 0-3 are inside all_reduce #21 (the waits lead to rank 2)"
    );
}

#[test]
fn circular_waits_single_out_nobody() {
    let snaps = vec![snap(0, 2, 1, running(2, 1)), snap(1, 2, 1, running(2, 0))];
    let (own, others) = reports(snaps);
    assert_eq!(conclude_for(own, others), "no rank is missing: ranks 0-1 are inside all_reduce #2");
}

#[test]
fn a_rank_that_failed_in_the_collective_counts_as_inside_it() {
    let mut failed = rec(5, CollKind::AllReduce, OpState::Failed);
    failed.ended_ns = 13 * SEC;
    let snaps = vec![snap(0, 3, 4, Some(failed)), snap(1, 3, 4, running(5, 2)), snap(2, 3, 4, None)];
    let (own, others) = reports(snaps);
    assert_eq!(
        conclude_for(own, others),
        "rank 2 never entered all_reduce #5 (last seen in all_reduce #4); ranks 0-1 wait on it"
    );
}

#[test]
fn send_recv_is_matched_per_pair() {
    let p2p = |seq, peer, state| OpRecord { peer, ..rec(seq, CollKind::PointToPoint, state) };
    // Rank 0 receives #3 from rank 1, which sent only #2 and idles.
    let mut s1 = snap(1, 2, 0, None);
    s1.records.push(p2p(2, 0, OpState::Done));
    let own = snap(0, 2, 0, Some(p2p(3, 1, OpState::Running)));
    assert_eq!(
        conclude_for(own.clone(), vec![(1, PeerAnswer::Report(s1.clone()))]),
        "rank 1 never posted its side of send/recv #3 with rank 1 of rank 0; rank 0 waits on it"
    );
    // Once rank 1 is inside its side, nobody is blamed.
    s1.records.push(p2p(3, 0, OpState::Running));
    let c = conclude_for(own, vec![(1, PeerAnswer::Report(s1))]);
    assert!(c.starts_with("no collective in flight; ranks 0-1 are in send/recv"), "{c}");
}

#[test]
fn a_healthy_idle_job_says_so() {
    let snaps: Vec<Snapshot> = (0..4).map(|r| snap(r, 4, 7, None)).collect();
    let (own, others) = reports(snaps);
    assert_eq!(conclude_for(own, others), "no operation in flight: ranks 0-3 idle after all_reduce #7");
}

#[test]
fn ranks_that_could_not_be_asked_are_named_without_blame_for_others() {
    let snaps: Vec<Snapshot> = (0..3).map(|r| snap(r, 4, 7, running(8, -1))).collect();
    let (own, mut others) = reports(snaps);
    others.push((3, PeerAnswer::Failed("bad answer".into())));
    assert_eq!(
        conclude_for(own, others),
        "rank 3 could not be asked (bad answer); ranks 0-2 are inside all_reduce #8"
    );
}

#[test]
fn the_table_has_a_row_per_rank_with_the_live_state() {
    let snaps = vec![snap(0, 3, 9, running(10, 2)), snap(1, 3, 9, running(10, 2))];
    let (own, mut others) = reports(snaps);
    others.push((2, PeerAnswer::Silent));
    let t = Report::build(&own, &others).table();
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 4, "{t}");
    assert!(lines[1].starts_with("0      running   all_reduce #9"), "{t}");
    assert!(lines[1].contains("all_reduce #10 (all_reduce 4096 x float sum), phase reduce_scatter, step 3, waiting on rank 2 for 4.0 s"), "{t}");
    assert!(lines[3].starts_with("2      silent"), "{t}");
}
