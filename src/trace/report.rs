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
    /// The ranks the conclusion names as the cause (dead, stopped, behind, disagreeing, not
    /// asked), sorted.
    named: Vec<usize>,
}

impl Report {
    #[cfg(test)]
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
        let mut all = Vec::with_capacity(others.len() + 1);
        all.push((own.rank as usize, PeerAnswer::Report(own.clone())));
        all.extend(others.iter().cloned());
        Report::from_answers(size, &all, closed)
    }

    /// The report of a communicator of `size` ranks from every rank's answer, as an observer
    /// outside it sees them (`toroid-run --status`); ranks with no answer are reported as not
    /// asked. `closed` as in [`Report::build_after_close`].
    pub fn from_answers(size: usize, answers: &[(usize, PeerAnswer)], closed: Option<usize>) -> Report {
        let mut views: Vec<View> = vec![View::Unknown("no answer".into()); size];
        for (r, a) in answers {
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
            let named =
                (0..size).filter(|&r| !matches!(views[r], View::Known { .. } | View::Exited(_))).collect();
            return Report { rows, conclusion: parts.join("; "), informative, named };
        }
        let mut blamed = vec![false; size];
        let conclusion = conclude(&views, &mut blamed);
        let named = (0..size).filter(|&r| blamed[r]).collect();
        Report { rows, conclusion, informative: true, named }
    }

    /// The ranks the conclusion names as the cause, sorted (none when every rank is only slow
    /// or idle).
    pub fn named(&self) -> &[usize] {
        &self.named
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
    let cur = s.current();
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

/// The conclusion; marks in `blamed` (one per rank, all false on entry) the ranks it names.
fn conclude(views: &[View], blamed: &mut [bool]) -> String {
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
            for &r in &groups[minor].1 {
                blamed[r] = true;
            }
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
mod tests;
