//! The health of a communicator, as one document: every rank alive, stopped or dead, the
//! operation it is in and how long it has waited there, the stall report's verdict, and the
//! ranks ranked by how late they enter collectives (stragglers). Built from every rank's
//! answer to the control plane (`comm::health` asks), rendered as JSON or Prometheus text.
//!
//! NCCL's RAS answers "which rank is missing" from its own keep-alives and can report a job
//! healthy while every rank waits on one that skipped a collective (NVIDIA/nccl#1730). Here the
//! verdict comes from what the ranks themselves say they are doing (their flight records), so a
//! stuck job is told as stuck: the ranks inside collective `#T`, and the one that never entered
//! it.
//!
//! **Stragglers.** For every collective sequence number that two or more ranks hold a record
//! of (the last [`super::recorder::SNAPSHOT_TAIL`] operations of each, plus the running one), a
//! rank's lateness is when it issued the call minus when the first rank issued it. A rank that
//! has not yet entered the collective the others wait in is late by at least the time since
//! the first entered; that counts too, so a stuck job ranks its culprit first. Ranks are ranked
//! by mean lateness.
//!
//! **Clocks.** Records carry each rank's wall clock. The asker notes its own clock before
//! asking and after the answer; a rank whose clock differs from the asker's by more than half
//! that round trip is shifted by the difference (Cristian's method, error within half the
//! round trip); within it the clocks are taken as one (the same host).
//!
//! Pure logic: no I/O, no clock of its own, so every case is a unit test.

use std::fmt::Write as _;

use super::report::{PeerAnswer, Report};
use super::snapshot::{OpRecord, OpState, Snapshot};
use crate::collective::CollKind;

/// What asking one rank gave, and when (the asker's clock, ns since the Unix epoch).
#[derive(Debug, Clone)]
pub struct Asked {
    /// The rank asked.
    pub rank: usize,
    /// Its answer.
    pub answer: PeerAnswer,
    /// The asker's clock just before asking.
    pub sent_ns: u64,
    /// The asker's clock once the answer was in (or the asking ended).
    pub got_ns: u64,
}

/// Whether a rank answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// It answered.
    Alive,
    /// Its process is there (the kernel took the connection) but it did not answer in time:
    /// stopped (`SIGSTOP`, a debugger) or hung.
    Stopped,
    /// Its process is gone: nothing listens at its address.
    Dead,
    /// It could not be asked (no status entry, a network error, a bad answer).
    Unknown,
}

impl Liveness {
    /// The lower-case name used in both renderings.
    pub fn name(self) -> &'static str {
        match self {
            Liveness::Alive => "alive",
            Liveness::Stopped => "stopped",
            Liveness::Dead => "dead",
            Liveness::Unknown => "unknown",
        }
    }
}

/// One rank in the document.
#[derive(Debug, Clone)]
pub struct RankHealth {
    /// Its rank.
    pub rank: usize,
    /// Whether it answered.
    pub liveness: Liveness,
    /// Why it is not alive (empty when it is).
    pub why: String,
    /// Its process id (0: unknown).
    pub pid: u32,
    /// Operations it completed.
    pub completed: u64,
    /// The operation it is in (running, or the one it failed in), if any.
    pub op: Option<OpRecord>,
    /// How long it has been inside `op` (ns, by its own clock), 0 without one.
    pub waited_ns: u64,
    /// The verdict names it as a cause (dead, stopped, behind, disagreeing).
    pub named: bool,
    /// Its clock minus the asker's (ns), as estimated.
    pub clock_offset_ns: i64,
}

/// One rank's lateness over the collectives it shares with the others.
#[derive(Debug, Clone, PartialEq)]
pub struct Straggler {
    /// The rank.
    pub rank: usize,
    /// Collectives its lateness was measured over.
    pub ops: usize,
    /// Mean and largest lateness (ns).
    pub mean_late_ns: u64,
    /// See `mean_late_ns`.
    pub max_late_ns: u64,
}

/// The health of one communicator.
#[derive(Debug, Clone)]
pub struct Health {
    /// The communicator's id.
    pub comm_id: u64,
    /// Its size.
    pub size: usize,
    /// One per rank, by rank.
    pub ranks: Vec<RankHealth>,
    /// The stall report's one-line conclusion.
    pub verdict: String,
    /// Every rank alive and none named by the verdict.
    pub healthy: bool,
    /// Ranks with a measured lateness, latest first.
    pub stragglers: Vec<Straggler>,
    /// How long the asking took (ns).
    pub asked_ns: u64,
}

/// The estimated clock offset of a rank's snapshot against the asker's (see the module).
fn offset(s: &Snapshot, sent_ns: u64, got_ns: u64) -> i64 {
    if got_ns < sent_ns {
        return 0;
    }
    let mid = sent_ns + (got_ns - sent_ns) / 2;
    let off = s.taken_ns as i128 - mid as i128;
    let half = ((got_ns - sent_ns) / 2) as i128;
    if off.abs() <= half { 0 } else { off.clamp(i64::MIN as i128, i64::MAX as i128) as i64 }
}

fn shift(t: u64, off: i64) -> u64 {
    (t as i128 - off as i128).clamp(0, u64::MAX as i128) as u64
}

impl Health {
    /// The health of a communicator of `size` ranks with id `comm_id` from the answers of its
    /// ranks (a rank missing from `asked` is unknown).
    pub fn build(comm_id: u64, size: usize, asked: &[Asked]) -> Health {
        let answers: Vec<(usize, PeerAnswer)> =
            asked.iter().filter(|a| a.rank < size).map(|a| (a.rank, a.answer.clone())).collect();
        let report = Report::from_answers(size, &answers, None);
        let mut ranks: Vec<RankHealth> = (0..size)
            .map(|rank| RankHealth {
                rank,
                liveness: Liveness::Unknown,
                why: "not asked".into(),
                pid: 0,
                completed: 0,
                op: None,
                waited_ns: 0,
                named: report.named().contains(&rank),
                clock_offset_ns: 0,
            })
            .collect();
        let mut snaps: Vec<(usize, &Snapshot, i64)> = Vec::new();
        for a in asked.iter().filter(|a| a.rank < size) {
            let h = &mut ranks[a.rank];
            match &a.answer {
                PeerAnswer::Report(s) => {
                    let off = offset(s, a.sent_ns, a.got_ns);
                    let op = s.current();
                    h.liveness = Liveness::Alive;
                    h.why.clear();
                    h.pid = s.pid;
                    h.completed = s.completed;
                    h.waited_ns = op.map_or(0, |o| {
                        let since = if o.started_ns > 0 { o.started_ns } else { o.issued_ns };
                        let until = if o.state == OpState::Failed { o.ended_ns } else { s.taken_ns };
                        until.saturating_sub(since)
                    });
                    h.op = op;
                    h.clock_offset_ns = off;
                    snaps.push((a.rank, s, off));
                }
                PeerAnswer::Dead(w) => (h.liveness, h.why) = (Liveness::Dead, w.clone()),
                PeerAnswer::Silent => {
                    (h.liveness, h.why) =
                        (Liveness::Stopped, "took the connection, did not answer in time".into())
                }
                PeerAnswer::Failed(w) => (h.liveness, h.why) = (Liveness::Unknown, w.clone()),
            }
        }
        let healthy = ranks.iter().all(|r| r.liveness == Liveness::Alive && !r.named);
        let asked_ns = match (asked.iter().map(|a| a.sent_ns).min(), asked.iter().map(|a| a.got_ns).max()) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => 0,
        };
        Health {
            comm_id,
            size,
            ranks,
            verdict: report.conclusion().to_string(),
            healthy,
            stragglers: stragglers(size, &snaps),
            asked_ns,
        }
    }

    /// The JSON document (one object; see `docs/OBSERVABILITY.md` §8).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let ms = |ns: u64| ns as f64 / 1e6;
        let ranks: Vec<serde_json::Value> = self
            .ranks
            .iter()
            .map(|r| {
                let mut v = json!({ "rank": r.rank, "state": r.liveness.name(), "named": r.named });
                if !r.why.is_empty() {
                    v["why"] = json!(r.why);
                }
                if r.liveness == Liveness::Alive {
                    v["pid"] = json!(r.pid);
                    v["completed"] = json!(r.completed);
                    v["clock_offset_ms"] = json!(r.clock_offset_ns as f64 / 1e6);
                    v["op"] = match &r.op {
                        None => serde_json::Value::Null,
                        Some(o) => json!({
                            "kind": o.fp.kind.name(),
                            "seq": o.fp.seq,
                            "state": o.state.name(),
                            "count": o.fp.count,
                            "dtype": o.fp.dtype.to_string(),
                            "phase": o.phase.name(),
                            "step": o.step,
                            "waiting_on": o.waiting_on,
                            "bytes": o.bytes,
                            "waited_s": r.waited_ns as f64 / 1e9,
                        }),
                    };
                }
                v
            })
            .collect();
        let stragglers: Vec<serde_json::Value> = self
            .stragglers
            .iter()
            .map(|s| {
                json!({ "rank": s.rank, "ops": s.ops, "mean_late_ms": ms(s.mean_late_ns),
                        "max_late_ms": ms(s.max_late_ns) })
            })
            .collect();
        json!({
            "comm_id": format!("{:#018x}", self.comm_id),
            "size": self.size,
            "healthy": self.healthy,
            "verdict": self.verdict,
            "asked_ms": ms(self.asked_ns),
            "ranks": ranks,
            "stragglers": stragglers,
        })
    }

    /// Prometheus text exposition lines for this communicator (without the `# HELP`/`# TYPE`
    /// header, which [`prometheus_header`] writes once for any number of communicators).
    pub fn to_prometheus(&self) -> String {
        let mut p = String::new();
        let c = format!("comm=\"{:#018x}\"", self.comm_id);
        let _ = writeln!(p, "toroid_comm_healthy{{{c}}} {}", u8::from(self.healthy));
        for r in &self.ranks {
            let l = format!("{c},rank=\"{}\"", r.rank);
            for s in [Liveness::Alive, Liveness::Stopped, Liveness::Dead, Liveness::Unknown] {
                let _ = writeln!(
                    p,
                    "toroid_rank_state{{{l},state=\"{}\"}} {}",
                    s.name(),
                    u8::from(r.liveness == s)
                );
            }
            let _ = writeln!(p, "toroid_rank_named{{{l}}} {}", u8::from(r.named));
            if r.liveness == Liveness::Alive {
                let _ = writeln!(p, "toroid_rank_completed_total{{{l}}} {}", r.completed);
                let _ = writeln!(p, "toroid_rank_wait_seconds{{{l}}} {}", r.waited_ns as f64 / 1e9);
                if let Some(o) = &r.op {
                    let _ =
                        writeln!(p, "toroid_rank_op_seq{{{l},kind=\"{}\"}} {}", o.fp.kind.name(), o.fp.seq);
                }
            }
        }
        for s in &self.stragglers {
            let _ = writeln!(
                p,
                "toroid_rank_lateness_seconds{{{c},rank=\"{}\"}} {}",
                s.rank,
                s.mean_late_ns as f64 / 1e9
            );
        }
        p
    }
}

/// The `# HELP` and `# TYPE` lines of every metric [`Health::to_prometheus`] writes.
pub fn prometheus_header() -> &'static str {
    "# HELP toroid_comm_healthy 1 when every rank answered and the verdict names none.\n\
     # TYPE toroid_comm_healthy gauge\n\
     # HELP toroid_rank_state 1 for the rank's state (alive, stopped, dead, unknown).\n\
     # TYPE toroid_rank_state gauge\n\
     # HELP toroid_rank_named 1 when the verdict names the rank as a cause.\n\
     # TYPE toroid_rank_named gauge\n\
     # HELP toroid_rank_completed_total Operations the rank completed.\n\
     # TYPE toroid_rank_completed_total counter\n\
     # HELP toroid_rank_wait_seconds How long the rank has been inside its current operation.\n\
     # TYPE toroid_rank_wait_seconds gauge\n\
     # HELP toroid_rank_op_seq Sequence number of the operation the rank is in.\n\
     # TYPE toroid_rank_op_seq gauge\n\
     # HELP toroid_rank_lateness_seconds Mean delay of the rank's entry into recent collectives after the first rank's.\n\
     # TYPE toroid_rank_lateness_seconds gauge\n"
}

/// The straggler ranking (see the module).
fn stragglers(size: usize, snaps: &[(usize, &Snapshot, i64)]) -> Vec<Straggler> {
    // seq -> (rank, issued on the asker's clock) of every rank that issued collective `seq`.
    let mut by_seq: std::collections::BTreeMap<u64, Vec<(usize, u64)>> = Default::default();
    for &(rank, s, off) in snaps {
        for r in s.records.iter().filter(|r| r.fp.kind != CollKind::PointToPoint && r.issued_ns > 0) {
            by_seq.entry(r.fp.seq).or_default().push((rank, shift(r.issued_ns, off)));
        }
    }
    // The collective the others wait in: the lowest sequence number some rank is running.
    let target = snaps
        .iter()
        .filter_map(|(_, s, _)| s.running())
        .filter(|r| r.fp.kind != CollKind::PointToPoint)
        .map(|r| r.fp.seq)
        .min();
    let mut sum = vec![0u128; size];
    let mut max = vec![0u64; size];
    let mut ops = vec![0usize; size];
    for (seq, mut entries) in by_seq {
        entries.sort_unstable();
        entries.dedup_by_key(|e| e.0);
        let Some(first) = entries.iter().map(|e| e.1).min() else { continue };
        let mut late: Vec<(usize, u64)> = entries.iter().map(|&(r, t)| (r, t - first)).collect();
        if Some(seq) == target {
            // Ranks that have not entered it yet: late by at least the time until they were asked.
            for &(rank, s, off) in snaps {
                let holds = entries.iter().any(|e| e.0 == rank);
                let past = s.records.iter().any(|r| r.fp.kind != CollKind::PointToPoint && r.fp.seq >= seq);
                if !holds && !past {
                    late.push((rank, shift(s.taken_ns, off).saturating_sub(first)));
                }
            }
        }
        if late.len() < 2 {
            continue;
        }
        for (r, l) in late {
            if r < size {
                sum[r] += l as u128;
                max[r] = max[r].max(l);
                ops[r] += 1;
            }
        }
    }
    let mut out: Vec<Straggler> = (0..size)
        .filter(|&r| ops[r] > 0)
        .map(|r| Straggler {
            rank: r,
            ops: ops[r],
            mean_late_ns: (sum[r] / ops[r] as u128).min(u64::MAX as u128) as u64,
            max_late_ns: max[r],
        })
        .collect();
    out.sort_by(|a, b| b.mean_late_ns.cmp(&a.mean_late_ns).then(a.rank.cmp(&b.rank)));
    out
}

#[cfg(test)]
mod tests;
