//! The stall report: given every rank's flight-recorder snapshot (or why there is none), a
//! per-rank table and one line that names the rank the others wait on.
//!
//! The line is the point: it travels in the error every rank returns (an abort frame carries
//! it, so it must be short), and it must not blame in a circle (pytorch#83289: a barrier that
//! names whoever happened to be its neighbour). So blame goes to the rank that is *behind*,
//! never to the one that waits: the ranks inside collective `#T` wait; a rank that never
//! entered `#T` (idle after an earlier one, or in user code), a rank whose process is gone, or
//! one that does not answer (stopped) is the culprit. A rank inside the same collective as the
//! others and answering is at worst slow, and is not blamed. Ranks that issued different
//! operations at the same sequence number disagree, which is named before anything else.
//!
//! Pure logic: no I/O, no clock (the snapshots carry their times), so every case is a unit
//! test with hand-built snapshots.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use super::snapshot::{OpRecord, OpState, Snapshot};
use crate::collective::{CollKind, Fingerprint};

/// How long after its last operation a rank counts as between two collectives, not behind.
const IN_TRANSIT_NS: u64 = 1_000_000_000;

/// What asking one rank over the control plane gave (`comm::control`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerAnswer {
    /// Its snapshot.
    Report(Snapshot),
    /// Its process is gone (nothing listens at its address).
    Dead(String),
    /// It took the connection but did not answer within the grace: stopped or hung.
    Silent,
    /// Asking failed otherwise (a bad answer, a network error).
    Failed(String),
}

/// Where one rank is, as the report sees it.
// One per rank, built once per report: boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
enum View {
    Dead(String),
    /// Gone, but after this rank saw another one close first: most likely it failed with the
    /// others and exited before it was asked. Not a culprit.
    Exited(String),
    Silent,
    Unknown(String),
    Known {
        /// The operation it is in (running, or the one it failed in).
        cur: Option<OpRecord>,
        /// The last collective (not send/recv) it completed.
        last: Option<OpRecord>,
        /// The last operation of any kind it completed (what the table shows).
        last_any: Option<OpRecord>,
        /// Every record it holds, for matching sequence numbers.
        records: Vec<OpRecord>,
        taken_ns: u64,
        pid: u32,
    },
}

/// A stall report: one row per rank and one conclusion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    rows: Vec<String>,
    conclusion: String,
    /// The conclusion says something about the stall (false: no rank holds flight records and
    /// every rank answered, so there is nothing to tell).
    informative: bool,
}

impl Report {
    /// Builds the report from this rank's snapshot and every other rank's answer (ranks with no
    /// answer at all are reported as not asked).
    pub fn build(own: &Snapshot, others: &[(usize, PeerAnswer)]) -> Report {
        Report::build_after_close(own, others, None)
    }

    /// [`Report::build`] for a failure that began with `closed` closing its connection: of the
    /// ranks whose process is gone, that one died; the others (gone by the time they were
    /// asked) most likely failed because of it and exited, and are not blamed.
    pub fn build_after_close(
        own: &Snapshot,
        others: &[(usize, PeerAnswer)],
        closed: Option<usize>,
    ) -> Report {
        let size = (own.size as usize).max(own.rank as usize + 1);
        let mut views: Vec<View> = vec![View::Unknown("no answer".into()); size];
        views[own.rank as usize] = view_of(own);
        for (r, a) in others {
            if let Some(v) = views.get_mut(*r) {
                *v = match a {
                    PeerAnswer::Report(s) => view_of(s),
                    PeerAnswer::Dead(why) if closed.is_some_and(|c| c != *r) => View::Exited(why.clone()),
                    PeerAnswer::Dead(why) => View::Dead(why.clone()),
                    PeerAnswer::Silent => View::Silent,
                    PeerAnswer::Failed(why) => View::Unknown(why.clone()),
                };
            }
        }
        let rows = views.iter().enumerate().map(|(r, v)| row(r, v)).collect();
        // With the recorder off (`TOROID_TRACE_BUFFER=0`) snapshots hold no records: only who is
        // dead, stopped or unreachable can be told.
        let blind = views.iter().all(|v| match v {
            View::Known { records, .. } => records.is_empty(),
            _ => true,
        });
        if blind {
            let mut parts = Vec::new();
            for (what, pick) in [
                ("died", (|v: &View| matches!(v, View::Dead(_))) as fn(&View) -> bool),
                ("not answering (stopped or hung)", |v| matches!(v, View::Silent)),
                ("could not be asked", |v| matches!(v, View::Unknown(_))),
            ] {
                let list: Vec<usize> = (0..size).filter(|&r| pick(&views[r])).collect();
                if !list.is_empty() {
                    let is = if what.starts_with("not") { verb(list.len(), "is ", "are ") } else { "" };
                    parts.push(format!("{} {is}{what}", ranks(&list)));
                }
            }
            let informative = !parts.is_empty();
            parts.push("no flight records to compare (TOROID_TRACE_BUFFER=0)".into());
            return Report { rows, conclusion: parts.join("; "), informative };
        }
        Report { rows, conclusion: conclude(&views), informative: true }
    }

    /// False when the report has nothing to tell about a stall (the recorder is off and every
    /// rank answered): an error is then better left as it is.
    pub fn is_informative(&self) -> bool {
        self.informative
    }

    /// The one-line conclusion.
    pub fn conclusion(&self) -> &str {
        &self.conclusion
    }

    /// The per-rank table (one line per rank, with a header).
    pub fn table(&self) -> String {
        let mut t = format!("{:<6} {:<9} {:<34} {}\n", "rank", "state", "last completed", "current");
        for r in &self.rows {
            t.push_str(r);
            t.push('\n');
        }
        t
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stall report: {}\n{}", self.conclusion, self.table())
    }
}

fn view_of(s: &Snapshot) -> View {
    let cur = s.running().copied().or_else(|| {
        s.records
            .iter()
            .rev()
            .find(|r| r.state != OpState::Queued)
            .filter(|r| r.state == OpState::Failed)
            .copied()
    });
    let done = |r: &&OpRecord| r.state == OpState::Done;
    View::Known {
        cur,
        last: s.records.iter().rev().filter(done).find(|r| r.fp.kind != CollKind::PointToPoint).copied(),
        last_any: s.records.iter().rev().find(done).copied(),
        records: s.records.clone(),
        taken_ns: s.taken_ns,
        pid: s.pid,
    }
}

/// `all_reduce #812`, or `send/recv #3 with rank 2`.
fn name(r: &OpRecord) -> String {
    if r.fp.kind == CollKind::PointToPoint && r.peer >= 0 {
        format!("send/recv #{} with rank {}", r.fp.seq, r.peer)
    } else {
        format!("{} #{}", r.fp.kind.name(), r.fp.seq)
    }
}

/// What ranks must agree on, as words: `all_reduce 4096 x float sum`, `broadcast 8 x int32 root 1`.
fn signature(fp: &Fingerprint) -> String {
    let mut s = format!("{} {} x {}", fp.kind.name(), fp.count, fp.dtype);
    if matches!(fp.kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce) {
        let _ = write!(s, " {}", fp.op);
    }
    if fp.root >= 0 {
        let _ = write!(s, " root {}", fp.root);
    }
    s
}

fn same_call(a: &Fingerprint, b: &Fingerprint) -> bool {
    (a.kind, a.dtype, a.op, a.count, a.root, a.algo) == (b.kind, b.dtype, b.op, b.count, b.root, b.algo)
}

fn row(rank: usize, v: &View) -> String {
    let (state, last, cur) = match v {
        View::Dead(why) => ("dead".to_string(), "-".to_string(), format!("(process gone: {why})")),
        View::Exited(why) => (
            "gone".to_string(),
            "-".to_string(),
            format!("(process gone after the failure, it seems: {why})"),
        ),
        View::Silent => ("silent".into(), "-".into(), "(stopped or hung: no answer within the grace)".into()),
        View::Unknown(why) => ("unknown".into(), "-".into(), format!("(not asked: {why})")),
        View::Known { cur, last_any, taken_ns, pid, .. } => {
            let last = last_any.map_or("-".to_string(), |r| name(&r));
            let cur = match cur {
                None => format!("idle (pid {pid})"),
                Some(c) => {
                    let mut s = format!("{} ({})", name(c), signature(&c.fp));
                    let _ = write!(s, ", phase {}, step {}", c.phase.name(), c.step);
                    if c.waiting_on >= 0 {
                        let _ = write!(s, ", waiting on rank {}", c.waiting_on);
                    }
                    if c.started_ns > 0 && *taken_ns >= c.started_ns {
                        let _ = write!(s, " for {:.1} s", (*taken_ns - c.started_ns) as f64 / 1e9);
                    }
                    let _ = write!(s, ", {} bytes moved (pid {pid})", c.bytes);
                    s
                }
            };
            let state = cur_state(v);
            (state, last, cur)
        }
    };
    format!("{rank:<6} {state:<9} {last:<34} {cur}")
}

fn cur_state(v: &View) -> String {
    match v {
        View::Known { cur: Some(c), .. } => c.state.name().to_string(),
        View::Known { cur: None, .. } => "idle".into(),
        _ => String::new(),
    }
}

/// `rank 5`, `ranks 0-4, 6-7` (sorted, consecutive ranks as ranges).
pub fn ranks(list: &[usize]) -> String {
    let mut v = list.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { v[i].to_string() } else { format!("{}-{}", v[i], v[j]) });
        i = j + 1;
    }
    let word = if v.len() == 1 { "rank" } else { "ranks" };
    format!("{word} {}", parts.join(", "))
}

fn verb(n: usize, one: &'static str, many: &'static str) -> &'static str {
    if n == 1 { one } else { many }
}

fn conclude(views: &[View]) -> String {
    let known = |r: usize| match &views[r] {
        View::Known { cur, last, records, .. } => Some((cur, last, records)),
        _ => None,
    };
    // Every sequence number some rank is inside: the collectives in flight.
    let in_op: Vec<usize> = (0..views.len()).filter(|&r| known(r).is_some_and(|k| k.0.is_some())).collect();
    let cur_of = |r: usize| known(r).and_then(|k| *k.0);

    // 1. Disagreement: ranks whose records at the same collective sequence number differ.
    let mut seqs: Vec<u64> = in_op
        .iter()
        .filter_map(|&r| cur_of(r))
        .filter(|c| c.fp.kind != CollKind::PointToPoint)
        .map(|c| c.fp.seq)
        .collect();
    seqs.sort_unstable();
    seqs.dedup();
    for &seq in &seqs {
        // Group the ranks by what they issued at `seq` (any record of theirs that is not queued).
        let mut groups: Vec<(Fingerprint, Vec<usize>)> = Vec::new();
        for r in 0..views.len() {
            let Some((_, _, records)) = known(r) else { continue };
            let Some(rec) = records.iter().rev().find(|x| {
                x.fp.seq == seq && x.fp.kind != CollKind::PointToPoint && x.state != OpState::Queued
            }) else {
                continue;
            };
            match groups.iter_mut().find(|g| same_call(&g.0, &rec.fp)) {
                Some(g) => g.1.push(r),
                None => groups.push((rec.fp, vec![r])),
            }
        }
        if groups.len() > 1 {
            // The largest group is taken as right (ties: the one with the lowest rank).
            let major = (0..groups.len())
                .max_by_key(|&i| (groups[i].1.len(), usize::MAX - groups[i].1[0]))
                .unwrap_or(0);
            let minor = if major == 0 { 1 } else { 0 };
            return format!(
                "{} and {} disagree at #{seq}: {} vs {}",
                ranks(&groups[minor].1),
                ranks(&groups[major].1),
                signature(&groups[minor].0),
                signature(&groups[major].0)
            );
        }
    }

    // 2. The collective the slowest waiting rank is in: those not in it are behind.
    let target: Option<OpRecord> = in_op
        .iter()
        .filter_map(|&r| cur_of(r))
        .filter(|c| c.fp.kind != CollKind::PointToPoint)
        .min_by_key(|c| c.fp.seq);
    let mut dead = Vec::new();
    let mut silent = Vec::new();
    let mut unknown: Vec<(usize, String)> = Vec::new();
    // Grouped by where they were last seen, in the order of their lowest rank.
    let mut behind: Vec<(String, Vec<usize>)> = Vec::new();
    let mut unmatched: Vec<String> = Vec::new();
    let mut blamed = vec![false; views.len()];
    // Ranks that completed the collective before the one in flight less than a second ago are
    // between two collectives, not behind: they will wait too (a peer's death is seen at once,
    // while others are still in user code; a dump catches ranks on their way). A rank that
    // makes the others time out has been idle for the whole timeout.
    let mut transit = Vec::new();
    for (r, v) in views.iter().enumerate() {
        match v {
            View::Dead(_) => dead.push(r),
            View::Exited(_) => {}
            View::Silent => silent.push(r),
            View::Unknown(why) => unknown.push((r, why.clone())),
            View::Known { cur, last, last_any, taken_ns, .. } => {
                let Some(t) = target else { continue };
                let in_coll = cur.is_some_and(|c| c.fp.kind != CollKind::PointToPoint);
                let idle_ns = last_any.map_or(u64::MAX, |l| taken_ns.saturating_sub(l.ended_ns));
                let next = last.is_some_and(|l| l.fp.seq + 1 == t.fp.seq);
                if cur.is_none() && next && idle_ns < IN_TRANSIT_NS {
                    transit.push(r);
                } else if !in_coll && last.is_none_or(|l| l.fp.seq < t.fp.seq) {
                    let seen = match (cur, last_any) {
                        (Some(c), _) => format!("in {}", name(c)),
                        (None, Some(l)) => format!("last seen in {}", name(l)),
                        (None, None) => "it completed nothing".into(),
                    };
                    match behind.iter_mut().find(|b| b.0 == seen) {
                        Some(b) => b.1.push(r),
                        None => behind.push((seen, vec![r])),
                    }
                }
            }
        }
        blamed[r] = !matches!(v, View::Known { .. } | View::Exited(_));
    }
    for (_, list) in &behind {
        for &r in list {
            blamed[r] = true;
        }
    }
    // 3. Send/recv: a rank inside one with a peer that holds no record of the same pair and number.
    for &r in &in_op {
        let Some(c) = cur_of(r) else { continue };
        if c.fp.kind != CollKind::PointToPoint || c.peer < 0 {
            continue;
        }
        let p = c.peer as usize;
        let Some((_, _, records)) = (p < views.len()).then(|| known(p)).flatten() else { continue };
        let matched = records.iter().any(|x| {
            x.fp.kind == CollKind::PointToPoint
                && x.peer == r as i32
                && x.fp.seq == c.fp.seq
                && x.state != OpState::Queued
        });
        if !matched && !blamed[p] {
            unmatched.push(format!("rank {p} never posted its side of {} of rank {r}", name(&c)));
            blamed[p] = true;
        }
    }

    // A rank whose process is gone, that nobody waits on while the waits point elsewhere (at
    // a dead, stopped or missing rank), most likely failed with the others and exited before it
    // was asked: it is no culprit.
    let waited: Vec<usize> = in_op
        .iter()
        .filter_map(|&r| cur_of(r))
        .filter(|c| c.waiting_on >= 0)
        .map(|c| c.waiting_on as usize)
        .collect();
    let elsewhere = waited
        .iter()
        .any(|w| dead.contains(w) || silent.contains(w) || behind.iter().any(|b| b.1.contains(w)));
    if elsewhere {
        for d in dead.iter().filter(|d| !waited.contains(d)) {
            blamed[*d] = false;
        }
        dead.retain(|d| waited.contains(d));
    }
    let mut waiters: Vec<usize> = in_op.iter().copied().filter(|&r| !blamed[r]).collect();
    waiters.extend(transit);
    waiters.sort_unstable();
    let during = target.map(|t| format!(" during {}", name(&t))).unwrap_or_default();
    let mut parts = Vec::new();
    if !dead.is_empty() {
        parts.push(format!("{} died{during}", ranks(&dead)));
    }
    if !silent.is_empty() {
        parts.push(format!(
            "{} {} not answering (stopped or hung){during}",
            ranks(&silent),
            verb(silent.len(), "is", "are")
        ));
    }
    if let Some(t) = target {
        for (seen, list) in &behind {
            parts.push(format!("{} never entered {} ({seen})", ranks(list), name(&t)));
        }
    }
    parts.extend(unmatched);
    let n_blamed = blamed.iter().filter(|b| **b).count();
    if !parts.is_empty() && (!waiters.is_empty() || unknown.is_empty()) {
        // Ranks that could not be asked are not blamed when someone else explains the stall.
        let mut line = parts.join("; ");
        let n_named = n_blamed - unknown.len();
        if !waiters.is_empty() {
            let _ = write!(
                line,
                "; {} {} on {}",
                ranks(&waiters),
                verb(waiters.len(), "waits", "wait"),
                verb(n_named, "it", "them")
            );
        }
        return line;
    }
    if !unknown.is_empty() {
        let list: Vec<usize> = unknown.iter().map(|u| u.0).collect();
        let mut line = format!("{} could not be asked ({})", ranks(&list), unknown[0].1);
        if !waiters.is_empty() {
            let _ = write!(
                line,
                "; {} {} inside {}",
                ranks(&waiters),
                verb(waiters.len(), "is", "are"),
                during.trim_start_matches(" during ")
            );
        }
        return line;
    }
    match target {
        Some(t) => {
            // Everyone answers and is inside the same collective: slow, not missing. Name the
            // rank the others wait on if the waits agree (follow them to the end of the chain).
            let waited = waited_end(views, &in_op);
            let mut line = format!(
                "no rank is missing: {} {} inside {}",
                ranks(&in_op),
                verb(in_op.len(), "is", "are"),
                name(&t)
            );
            if let Some(w) = waited {
                let _ = write!(line, " (the waits lead to rank {w})");
            }
            line
        }
        None if !in_op.is_empty() => {
            let names: Vec<String> = in_op.iter().filter_map(|&r| cur_of(r)).map(|c| name(&c)).collect();
            format!(
                "no collective in flight; {} {} in send/recv ({})",
                ranks(&in_op),
                verb(in_op.len(), "is", "are"),
                names.join(", ")
            )
        }
        None => {
            let mut by_last: BTreeMap<String, Vec<usize>> = BTreeMap::new();
            for (r, v) in views.iter().enumerate() {
                if let View::Known { last_any, .. } = v {
                    by_last.entry(last_any.map_or("nothing yet".into(), |l| name(&l))).or_default().push(r);
                }
            }
            let parts: Vec<String> =
                by_last.iter().map(|(l, list)| format!("{} idle after {l}", ranks(list))).collect();
            format!("no operation in flight: {}", parts.join(", "))
        }
    }
}

/// Follows `waiting_on` from every rank in `in_op` to where the chain stops; the rank they all
/// reach, if one.
fn waited_end(views: &[View], in_op: &[usize]) -> Option<usize> {
    let next = |r: usize| match &views[r] {
        View::Known { cur: Some(c), .. } if c.waiting_on >= 0 && (c.waiting_on as usize) < views.len() => {
            Some(c.waiting_on as usize)
        }
        _ => None,
    };
    let mut end = None;
    for &start in in_op {
        let (mut r, mut hops) = (start, 0);
        while let Some(n) = next(r) {
            r = n;
            hops += 1;
            if hops > views.len() {
                return None; // a cycle: nobody to single out
            }
        }
        if hops == 0 {
            continue;
        }
        match end {
            None => end = Some(r),
            Some(e) if e != r => return None,
            _ => {}
        }
    }
    end
}

#[cfg(test)]
mod tests {
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
        let mut records: Vec<OpRecord> =
            (1..=done).map(|s| rec(s, CollKind::AllReduce, OpState::Done)).collect();
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
        let r =
            Report::build(&empty(0), &[(1, PeerAnswer::Report(empty(1))), (2, PeerAnswer::Report(empty(2)))]);
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
        let snaps: Vec<Snapshot> =
            (0..4).filter(|r| *r != 2).map(|r| snap(r, 4, 811, running(812, 2))).collect();
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
}
