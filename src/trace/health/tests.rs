//! Unit tests of the health document ([`super`]): the fault matrix (stopped, dead, slow,
//! skipped a collective) on hand-built answers, the straggler ranking, clock offsets and both
//! renderings.

use super::*;
use crate::collective::Fingerprint;
use crate::dtype::{DataType, ReduceOp};
use crate::trace::Phase;

const MS: u64 = 1_000_000;
const SEC: u64 = 1_000 * MS;

fn rec(seq: u64, state: OpState, issued_ns: u64) -> OpRecord {
    OpRecord {
        fp: Fingerprint {
            seq,
            kind: CollKind::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            count: 1024,
            root: -1,
            algo: 1,
        },
        state,
        phase: Phase::ReduceScatter,
        peer: -1,
        waiting_on: -1,
        step: 2,
        issued_ns,
        started_ns: issued_ns,
        ended_ns: if state == OpState::Done { issued_ns + MS } else { 0 },
        bytes: 4096,
    }
}

/// Rank `rank` of 4 issued all_reduce 1..=done, collective `s` at `100 s + s x 100 ms +
/// delay(s)`, and (with `running`) is inside `done + 1`, issued likewise. Its clock reads
/// `skew` ahead; it was asked at 200 s.
fn snap(rank: u32, done: u64, running: bool, delay: impl Fn(u64) -> u64, skew: u64) -> Snapshot {
    let at = |s: u64| skew + 100 * SEC + s * 100 * MS + delay(s);
    let mut records: Vec<OpRecord> = (1..=done).map(|s| rec(s, OpState::Done, at(s))).collect();
    if running {
        records.push(OpRecord { waiting_on: 3, ..rec(done + 1, OpState::Running, at(done + 1)) });
    }
    Snapshot {
        rank,
        size: 4,
        comm_id: 9,
        pid: 10 + rank,
        taken_ns: skew + 200 * SEC,
        completed: done,
        records,
    }
}

fn asked(rank: usize, answer: PeerAnswer) -> Asked {
    // Asked around 200 s on the asker's clock, a 2 ms round trip.
    Asked { rank, answer, sent_ns: 200 * SEC - MS, got_ns: 200 * SEC + MS }
}

fn report(s: Snapshot) -> PeerAnswer {
    PeerAnswer::Report(s)
}

#[test]
fn a_job_between_collectives_is_healthy() {
    let all: Vec<Asked> = (0..4).map(|r| asked(r, report(snap(r as u32, 6, false, |_| 0, 0)))).collect();
    let h = Health::build(9, 4, &all);
    assert!(h.healthy, "{}", h.verdict);
    assert!(h.ranks.iter().all(|r| r.liveness == Liveness::Alive && r.op.is_none() && !r.named));
    assert_eq!(h.ranks[2].pid, 12);
    assert_eq!(h.ranks[2].completed, 6);
    // Nobody is late: every lateness is zero.
    assert!(h.stragglers.iter().all(|s| s.mean_late_ns == 0 && s.ops == 6), "{:?}", h.stragglers);
}

#[test]
fn a_slow_rank_is_the_first_straggler() {
    // Rank 2 sleeps 30 ms before every call, rank 1 3 ms; all are inside #7 now.
    let delay = |r: usize| move |_s: u64| [0, 3 * MS, 30 * MS, 0][r];
    let all: Vec<Asked> = (0..4).map(|r| asked(r, report(snap(r as u32, 6, true, delay(r), 0)))).collect();
    let h = Health::build(9, 4, &all);
    assert_eq!(h.stragglers[0].rank, 2, "{:?}", h.stragglers);
    assert_eq!(h.stragglers[0].mean_late_ns, 30 * MS);
    assert_eq!(h.stragglers[0].ops, 7);
    assert_eq!(h.stragglers[1].rank, 1);
    assert_eq!(h.stragglers[1].mean_late_ns, 3 * MS);
    // Slow is not stuck: every rank is alive and inside the same collective.
    assert!(h.healthy, "{}", h.verdict);
    assert!(h.verdict.starts_with("no rank is missing"), "{}", h.verdict);
    let w = h.ranks[0].waited_ns;
    assert_eq!(w, 200 * SEC - (100 * SEC + 7 * 100 * MS));
}

#[test]
fn a_rank_that_skipped_a_collective_is_named_and_ranked_first() {
    // Ranks 0, 1, 3 are inside #7; rank 2 completed #6 long ago and never entered #7.
    let all: Vec<Asked> = (0..4).map(|r| asked(r, report(snap(r as u32, 6, r != 2, |_| 0, 0)))).collect();
    let h = Health::build(9, 4, &all);
    assert!(!h.healthy);
    assert!(h.ranks[2].named && !h.ranks[0].named && !h.ranks[3].named);
    assert!(h.verdict.contains("rank 2 never entered all_reduce #7"), "{}", h.verdict);
    assert_eq!(h.stragglers[0].rank, 2, "{:?}", h.stragglers);
    // Its lateness at #7 counts from the first entry until it was asked.
    assert_eq!(h.stragglers[0].max_late_ns, 200 * SEC - (100 * SEC + 700 * MS));
    assert_eq!(h.ranks[0].op.map(|o| o.fp.seq), Some(7));
    assert_eq!(h.ranks[2].op, None);
}

#[test]
fn stopped_and_dead_ranks_are_told_apart() {
    let mut all: Vec<Asked> = (0..2).map(|r| asked(r, report(snap(r as u32, 6, true, |_| 0, 0)))).collect();
    all.push(asked(2, PeerAnswer::Silent));
    all.push(asked(3, PeerAnswer::Dead("nothing listens at 127.0.0.1:9 any more".into())));
    let h = Health::build(9, 4, &all);
    assert!(!h.healthy);
    let states: Vec<Liveness> = h.ranks.iter().map(|r| r.liveness).collect();
    assert_eq!(states, [Liveness::Alive, Liveness::Alive, Liveness::Stopped, Liveness::Dead]);
    assert!(h.ranks[2].named && h.ranks[3].named && !h.ranks[0].named);
    assert!(h.verdict.contains("rank 3 died"), "{}", h.verdict);
    assert!(h.verdict.contains("rank 2 is not answering"), "{}", h.verdict);
}

#[test]
fn a_rank_not_asked_is_unknown() {
    let all: Vec<Asked> = (0..3).map(|r| asked(r, report(snap(r as u32, 2, false, |_| 0, 0)))).collect();
    let h = Health::build(9, 4, &all);
    assert_eq!(h.ranks[3].liveness, Liveness::Unknown);
    assert!(!h.healthy);
}

#[test]
fn a_skewed_clock_is_corrected() {
    // Rank 3's clock runs 5 s ahead (another host); it is not late.
    let all: Vec<Asked> = (0..4)
        .map(|r| asked(r, report(snap(r as u32, 6, false, |_| 0, if r == 3 { 5 * SEC } else { 0 }))))
        .collect();
    let h = Health::build(9, 4, &all);
    assert_eq!(h.ranks[3].clock_offset_ns, 5 * SEC as i64);
    assert_eq!(h.ranks[0].clock_offset_ns, 0);
    assert!(h.stragglers.iter().all(|s| s.mean_late_ns == 0), "{:?}", h.stragglers);
}

#[test]
fn both_renderings_carry_the_verdict() {
    let mut all: Vec<Asked> = (0..3).map(|r| asked(r, report(snap(r as u32, 6, true, |_| 0, 0)))).collect();
    all.push(asked(3, PeerAnswer::Dead("gone \"quoted\"\n".into())));
    let h = Health::build(9, 4, &all);
    let text = h.to_json().to_string();
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    assert_eq!(v["size"], 4);
    assert_eq!(v["healthy"], false);
    assert_eq!(v["ranks"][3]["state"], "dead");
    assert_eq!(v["ranks"][3]["why"], "gone \"quoted\"\n");
    assert_eq!(v["ranks"][0]["op"]["seq"], 7);
    assert_eq!(v["ranks"][0]["op"]["kind"], "all_reduce");
    assert_eq!(v["comm_id"], "0x0000000000000009");
    let p = h.to_prometheus();
    assert!(p.contains("toroid_rank_state{comm=\"0x0000000000000009\",rank=\"3\",state=\"dead\"} 1"), "{p}");
    assert!(p.contains("toroid_rank_state{comm=\"0x0000000000000009\",rank=\"3\",state=\"alive\"} 0"), "{p}");
    assert!(p.contains("toroid_comm_healthy{comm=\"0x0000000000000009\"} 0"), "{p}");
    // Every sample line names a metric the header declares.
    for line in p.lines() {
        let metric = line.split('{').next().unwrap_or("");
        assert!(prometheus_header().contains(&format!("# TYPE {metric} ")), "{metric}");
    }
}
