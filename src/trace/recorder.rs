//! The flight recorder: per communicator, a fixed ring of the last operations (torch's flight
//! recorder keeps the same kind of ring per process group), and the live progress of the running
//! one, which the progress engine updates as it waits.
//!
//! The ring is preallocated (`TOROID_TRACE_BUFFER` records, 0 turns it off) and touched twice per
//! operation, at start and at end, under a mutex nobody holds for longer than copying a record:
//! a snapshot taken from another thread (the control thread answering a stall report while this
//! rank is blocked in a collective) never waits for the operation. What changes while an
//! operation runs (the phase, the step, the rank it waits on, the bytes moved) lives in
//! [`Progress`], a few atomics written with relaxed stores: the engine writes the awaited rank
//! only when it is about to sleep, and the bytes once per exchange, so a collective that does
//! not wait pays a handful of stores.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::snapshot::{OpRecord, OpState, Phase, PhaseSpan, Snapshot};
use super::stats::Stats;
use crate::collective::Fingerprint;

/// Records of ended operations a snapshot carries (before the running one).
pub const SNAPSHOT_TAIL: usize = 16;
/// Phase spans kept per operation (later phases are merged into the last one).
pub const MAX_SPANS: usize = 8;

/// Called with every operation that ended and its phases (the timeline).
pub type OnEnd = Box<dyn Fn(&OpRecord, &[PhaseSpan]) + Send + Sync>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here copies plain values: the state is consistent after a panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The live state of the running operation, shared with the progress engine.
#[derive(Debug)]
pub struct Progress {
    phase: AtomicU8,
    step: AtomicU32,
    waiting_on: AtomicI32,
    bytes: AtomicU64,
    /// Phase spans are kept (a timeline wants them): only then does a phase change read the
    /// clock and take the lock below.
    spans_on: AtomicBool,
    /// The phases of the running operation (written by its thread only).
    spans: Mutex<Spans>,
}

#[derive(Debug)]
struct Spans {
    list: [PhaseSpan; MAX_SPANS],
    len: usize,
}

const NO_SPAN: PhaseSpan = PhaseSpan { phase: Phase::None, start_ns: 0, end_ns: 0, bytes: 0 };

impl Default for Progress {
    fn default() -> Progress {
        Progress {
            phase: AtomicU8::new(Phase::None as u8),
            step: AtomicU32::new(0),
            waiting_on: AtomicI32::new(-1),
            bytes: AtomicU64::new(0),
            spans_on: AtomicBool::new(false),
            spans: Mutex::new(Spans { list: [NO_SPAN; MAX_SPANS], len: 0 }),
        }
    }
}

impl Progress {
    /// The engine is about to wait for `peer` (or stopped waiting: `None`) at `step`.
    #[inline]
    pub fn waiting(&self, peer: Option<usize>, step: usize) {
        self.waiting_on.store(peer.map_or(-1, |p| p as i32), Ordering::Relaxed);
        self.step.store(step as u32, Ordering::Relaxed);
    }

    /// `n` more bytes sent or received (only the running operation's thread calls it).
    #[inline]
    pub fn moved(&self, n: usize) {
        let b = self.bytes.load(Ordering::Relaxed);
        self.bytes.store(b.wrapping_add(n as u64), Ordering::Relaxed);
    }

    /// The algorithm enters `phase` (closing the phase before it).
    #[inline]
    pub fn phase(&self, phase: Phase) {
        if self.phase.swap(phase as u8, Ordering::Relaxed) == phase as u8 {
            return;
        }
        if self.spans_on.load(Ordering::Relaxed) {
            self.open_span(phase);
        }
    }

    fn open_span(&self, phase: Phase) {
        let now = super::now_ns();
        let bytes = self.bytes.load(Ordering::Relaxed);
        let mut s = lock(&self.spans);
        close_last(&mut s, now, bytes);
        if s.len < MAX_SPANS {
            let i = s.len;
            s.list[i] = PhaseSpan { phase, start_ns: now, end_ns: 0, bytes };
            s.len += 1;
        }
    }

    fn reset(&self) {
        self.phase.store(Phase::None as u8, Ordering::Relaxed);
        self.step.store(0, Ordering::Relaxed);
        self.waiting_on.store(-1, Ordering::Relaxed);
        self.bytes.store(0, Ordering::Relaxed);
        if self.spans_on.load(Ordering::Relaxed) {
            lock(&self.spans).len = 0;
        }
    }

    /// Copies the live fields into `r`.
    fn fill(&self, r: &mut OpRecord) {
        r.phase = Phase::from_u8(self.phase.load(Ordering::Relaxed)).unwrap_or(Phase::None);
        r.step = self.step.load(Ordering::Relaxed);
        r.waiting_on = self.waiting_on.load(Ordering::Relaxed);
        r.bytes = self.bytes.load(Ordering::Relaxed);
    }
}

/// Ends the open span (its `bytes` held the counter at its start; it becomes the difference).
fn close_last(s: &mut Spans, now: u64, bytes: u64) {
    if s.len > 0 {
        let last = &mut s.list[s.len - 1];
        if last.end_ns == 0 {
            last.end_ns = now.max(last.start_ns);
            last.bytes = bytes.saturating_sub(last.bytes);
        }
    }
}

/// The running operation, in atomics that its thread writes at start and a snapshot reads (a
/// reader that finds the same operation running before and after reading the live fields saw
/// one operation's fields).
#[derive(Debug, Default)]
struct Current {
    /// Its fingerprint's sequence number.
    seq: AtomicU64,
    /// Collective, type, reduction and algorithm, one byte each, then the root (i32).
    meta: AtomicU64,
    count: AtomicU64,
    peer: AtomicI32,
    issued_ns: AtomicU64,
    started_ns: AtomicU64,
    /// Whether an operation runs (cleared before the other fields change, set after).
    running: AtomicBool,
}

impl Current {
    fn set(&self, fp: &Fingerprint, peer: i32, issued_ns: u64, started_ns: u64) {
        let meta = u64::from(fp.kind as u8)
            | u64::from(fp.dtype as u8) << 8
            | u64::from(fp.op as u8) << 16
            | u64::from(fp.algo) << 24
            | u64::from(fp.root as u32) << 32;
        self.running.store(false, Ordering::Release);
        self.meta.store(meta, Ordering::Relaxed);
        self.count.store(fp.count, Ordering::Relaxed);
        self.peer.store(peer, Ordering::Relaxed);
        self.issued_ns.store(issued_ns, Ordering::Relaxed);
        self.started_ns.store(started_ns, Ordering::Relaxed);
        self.seq.store(fp.seq, Ordering::Relaxed);
        self.running.store(true, Ordering::Release);
    }

    /// The running operation as a record (its live fields not filled in), if one runs.
    fn get(&self) -> Option<OpRecord> {
        if !self.running.load(Ordering::Acquire) {
            return None;
        }
        let seq = self.seq.load(Ordering::Relaxed);
        let meta = self.meta.load(Ordering::Relaxed);
        let b = meta.to_le_bytes();
        let fp = Fingerprint::decode(&{
            let mut f = [0u8; crate::collective::FINGERPRINT_LEN];
            f[..4].copy_from_slice(&b[..4]);
            f[4..12].copy_from_slice(&seq.to_le_bytes());
            f[12..20].copy_from_slice(&self.count.load(Ordering::Relaxed).to_le_bytes());
            f[20..24].copy_from_slice(&b[4..8]);
            f
        })
        .ok()?;
        Some(OpRecord {
            fp,
            state: OpState::Running,
            peer: self.peer.load(Ordering::Relaxed),
            issued_ns: self.issued_ns.load(Ordering::Relaxed),
            started_ns: self.started_ns.load(Ordering::Relaxed),
            ..EMPTY
        })
    }
}

struct Ring {
    /// `capacity` slots, preallocated; ended operation `i` (counting from 0) lives at
    /// `i % capacity`.
    slots: Vec<OpRecord>,
    /// Operations ended so far.
    ended: u64,
    stats: Stats,
}

/// One communicator's flight recorder.
pub struct Recorder {
    rank: u32,
    size: u32,
    comm_id: u64,
    capacity: usize,
    ring: Mutex<Ring>,
    current: Current,
    progress: std::sync::Arc<Progress>,
    on_end: OnceLock<OnEnd>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder").field("rank", &self.rank).field("capacity", &self.capacity).finish()
    }
}

const EMPTY: OpRecord = OpRecord {
    fp: Fingerprint {
        seq: 0,
        kind: crate::collective::CollKind::Barrier,
        dtype: crate::dtype::DataType::U8,
        op: crate::dtype::ReduceOp::Sum,
        count: 0,
        root: -1,
        algo: 0,
    },
    state: OpState::Done,
    phase: Phase::None,
    peer: -1,
    waiting_on: -1,
    step: 0,
    issued_ns: 0,
    started_ns: 0,
    ended_ns: 0,
    bytes: 0,
};

impl Recorder {
    /// A recorder of the last `capacity` operations (0: records nothing, snapshots are empty).
    pub fn new(rank: usize, size: usize, comm_id: u64, capacity: usize) -> Recorder {
        Recorder {
            rank: rank as u32,
            size: size as u32,
            comm_id,
            capacity,
            ring: Mutex::new(Ring { slots: vec![EMPTY; capacity], ended: 0, stats: Stats::default() }),
            current: Current::default(),
            progress: Default::default(),
            on_end: OnceLock::new(),
        }
    }

    /// True when it records (a capacity above 0).
    #[inline]
    pub fn is_on(&self) -> bool {
        self.capacity > 0
    }

    /// The live progress the engine updates.
    pub fn progress(&self) -> std::sync::Arc<Progress> {
        self.progress.clone()
    }

    /// Installs the hook called with every ended operation and its phases (once; later calls
    /// are ignored). From then on phase changes are timed.
    pub fn set_on_end(&self, hook: OnEnd) {
        if self.on_end.set(hook).is_ok() {
            self.progress.spans_on.store(true, Ordering::Relaxed);
        }
    }

    /// An operation starts: `peer` is the other rank of a send or receive, `issued_ns` when the
    /// caller issued it (0: now).
    #[inline]
    pub fn start(&self, fp: &Fingerprint, peer: Option<usize>, issued_ns: u64) {
        if !self.is_on() {
            return;
        }
        self.progress.reset();
        let now = super::now_ns();
        let issued = if issued_ns == 0 { now } else { issued_ns };
        self.current.set(fp, peer.map_or(-1, |p| p as i32), issued, now);
    }

    /// The running operation ended (`ok`: successfully). Does nothing when none runs.
    pub fn end(&self, ok: bool) {
        if !self.is_on() {
            return;
        }
        let Some(mut r) = self.current.get() else { return };
        self.current.running.store(false, Ordering::Release);
        let now = super::now_ns();
        self.progress.fill(&mut r);
        r.waiting_on = -1;
        r.state = if ok { OpState::Done } else { OpState::Failed };
        r.ended_ns = now;
        {
            let mut ring = lock(&self.ring);
            let i = (ring.ended % self.capacity as u64) as usize;
            ring.slots[i] = r;
            ring.ended += 1;
            if ok {
                ring.stats.add(&r);
            }
        }
        if let Some(hook) = self.on_end.get() {
            let mut s = lock(&self.progress.spans);
            close_last(&mut s, now, r.bytes);
            let n = s.len;
            hook(&r, &s.list[..n]);
        }
    }

    /// What this rank tells a peer: the last [`SNAPSHOT_TAIL`] ended operations and the running
    /// one with its live progress. Never waits for the running operation.
    pub fn snapshot(&self) -> Snapshot {
        let mut records = Vec::with_capacity(SNAPSHOT_TAIL + 1);
        let completed = {
            let ring = lock(&self.ring);
            let cap = self.capacity as u64;
            for n in ring.ended.saturating_sub(cap.min(SNAPSHOT_TAIL as u64))..ring.ended {
                records.push(ring.slots[(n % cap) as usize]);
            }
            ring.ended
        };
        // The running operation, read twice around its live fields: the same one both times,
        // or none (it ended meanwhile: then it is in the ring, for the next snapshot).
        if let Some(mut run) = self.current.get() {
            self.progress.fill(&mut run);
            if self
                .current
                .get()
                .is_some_and(|again| again.fp.seq == run.fp.seq && again.fp.kind == run.fp.kind)
                && records.last().is_none_or(|last| last.fp != run.fp)
            {
                records.push(run);
            }
        }
        Snapshot {
            rank: self.rank,
            size: self.size,
            comm_id: self.comm_id,
            pid: std::process::id(),
            taken_ns: super::now_ns(),
            completed,
            records,
        }
    }

    /// The statistics so far.
    pub fn stats(&self) -> Stats {
        lock(&self.ring).stats.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::CollKind;
    use crate::dtype::{DataType, ReduceOp};

    fn fp(seq: u64) -> Fingerprint {
        Fingerprint {
            seq,
            kind: CollKind::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            count: 1024,
            root: -1,
            algo: 1,
        }
    }

    #[test]
    fn the_ring_keeps_the_last_operations_and_the_running_one_with_its_progress() {
        let r = Recorder::new(1, 4, 9, 5);
        for s in 1..=12 {
            r.start(&fp(s), None, 0);
            r.progress().moved(100);
            r.end(s != 7);
        }
        r.start(&fp(13), None, 0);
        let p = r.progress();
        p.phase(Phase::AllGather);
        p.moved(64);
        p.waiting(Some(3), 5);
        let snap = r.snapshot();
        let seqs: Vec<u64> = snap.records.iter().map(|x| x.fp.seq).collect();
        assert_eq!(seqs, vec![8, 9, 10, 11, 12, 13], "the ring holds 5 ended ones");
        assert_eq!(snap.completed, 12);
        let run = snap.running().unwrap();
        assert_eq!(
            (run.fp.seq, run.waiting_on, run.step, run.bytes, run.phase),
            (13, 3, 5, 64, Phase::AllGather)
        );
        assert_eq!(snap.last_ended().unwrap().fp.seq, 12);
        assert!(snap.records.iter().all(|x| x.state != OpState::Failed), "7 fell out of the ring");
        assert_eq!(r.stats().total_count(), 11, "failed operations are not in the statistics");
        r.end(true);
        assert!(r.snapshot().running().is_none());
    }

    #[test]
    fn a_recorder_of_capacity_zero_records_nothing() {
        let r = Recorder::new(0, 2, 1, 0);
        r.start(&fp(1), None, 0);
        r.end(true);
        assert!(r.snapshot().records.is_empty());
        assert_eq!(r.snapshot().completed, 0);
    }

    #[test]
    fn phases_become_spans_with_their_bytes() {
        let r = Recorder::new(0, 2, 1, 4);
        let got = std::sync::Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        r.set_on_end(Box::new(move |rec, spans| lock(&g).push((rec.fp.seq, spans.to_vec()))));
        r.start(&fp(1), None, 0);
        let p = r.progress();
        p.phase(Phase::ReduceScatter);
        p.moved(10);
        p.phase(Phase::AllGather);
        p.moved(32);
        r.end(true);
        let got = lock(&got);
        let (seq, spans) = &got[0];
        assert_eq!(*seq, 1);
        assert_eq!(
            spans.iter().map(|s| (s.phase, s.bytes)).collect::<Vec<_>>(),
            vec![(Phase::ReduceScatter, 10), (Phase::AllGather, 32)]
        );
        assert!(spans.iter().all(|s| s.end_ns >= s.start_ns && s.start_ns > 0));
        assert!(spans[0].end_ns <= spans[1].start_ns);
    }
}
