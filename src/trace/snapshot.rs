//! The snapshot of one rank's flight recorder, as it travels between ranks in a stall report:
//! a few operation records and who took them, in one bounded little-endian encoding.
//!
//! ```text
//! snapshot: magic "TRSN" | version u16 | 0 u16 | rank u32 | size u32 | comm_id u64 | pid u32 |
//!           0 u32 | taken_ns u64 | completed u64 | n_records u16 | 0 u16 | 0 u32 | records...
//! record:   fingerprint (28 bytes, `Fingerprint::encode`) | state u8 | phase u8 | 0 u16 |
//!           peer i32 | waiting_on i32 | step u32 | 0 u32 | issued_ns u64 | started_ns u64 |
//!           ended_ns u64 | bytes u64                                    (80 bytes)
//! ```
//!
//! Times are nanoseconds since the Unix epoch (ranks on different hosts compare them only
//! roughly). Decoding checks every field and the length before it trusts anything: a snapshot
//! comes from the network.

use crate::collective::{FINGERPRINT_LEN, Fingerprint};

/// Bytes of one encoded [`OpRecord`].
pub const RECORD_LEN: usize = 80;
/// Bytes of the snapshot header.
pub const HEADER_LEN: usize = 56;
/// Records one snapshot carries at most (the tail of the ring plus the running and queued
/// operations): bounds what a peer's answer can make this rank allocate.
pub const MAX_RECORDS: usize = 64;
/// The largest encoded snapshot.
pub const MAX_ENCODED: usize = HEADER_LEN + MAX_RECORDS * RECORD_LEN;
const MAGIC: u32 = u32::from_le_bytes(*b"TRSN");
const VERSION: u16 = 1;

/// Where an operation is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpState {
    /// Issued (queued behind earlier work), not started.
    Queued = 1,
    /// Running: its phase, step, awaited peer and bytes are live.
    Running = 2,
    /// Completed successfully.
    Done = 3,
    /// Failed (the communicator aborted).
    Failed = 4,
}

impl OpState {
    /// The state with wire id `v`.
    pub fn from_u8(v: u8) -> Option<OpState> {
        [OpState::Queued, OpState::Running, OpState::Done, OpState::Failed]
            .into_iter()
            .find(|s| *s as u8 == v)
    }

    /// Lower-case name for reports.
    pub fn name(self) -> &'static str {
        match self {
            OpState::Queued => "queued",
            OpState::Running => "running",
            OpState::Done => "done",
            OpState::Failed => "failed",
        }
    }
}

/// The phase an algorithm is in (what the timeline draws as nested spans and the stall report
/// names). Algorithms set it through their `OpContext`; ids are stable (they travel in snapshots).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Phase {
    /// Not inside a named phase (set-up of the operation, or an algorithm with one phase).
    None = 0,
    /// A reduce-scatter phase.
    ReduceScatter = 1,
    /// An all-reduce phase (over a sub-group, as in the hierarchical and torus algorithms).
    AllReduce = 2,
    /// An all-gather phase.
    AllGather = 3,
    /// A broadcast or its pipelined chain.
    Broadcast = 4,
    /// A reduction towards a root.
    Reduce = 5,
    /// A pairwise or dissemination exchange (all-to-all, barrier).
    Exchange = 6,
    /// Copying through the shared window.
    Window = 7,
    /// Waiting for a message from any source.
    RecvAny = 8,
}

impl Phase {
    const ALL: [Phase; 9] = [
        Phase::None,
        Phase::ReduceScatter,
        Phase::AllReduce,
        Phase::AllGather,
        Phase::Broadcast,
        Phase::Reduce,
        Phase::Exchange,
        Phase::Window,
        Phase::RecvAny,
    ];

    /// The phase with wire id `v`.
    pub fn from_u8(v: u8) -> Option<Phase> {
        Phase::ALL.iter().copied().find(|p| *p as u8 == v)
    }

    /// The snake_case name used in reports and the timeline.
    pub fn name(self) -> &'static str {
        match self {
            Phase::None => "-",
            Phase::ReduceScatter => "reduce_scatter",
            Phase::AllReduce => "all_reduce",
            Phase::AllGather => "all_gather",
            Phase::Broadcast => "broadcast",
            Phase::Reduce => "reduce",
            Phase::Exchange => "exchange",
            Phase::Window => "window",
            Phase::RecvAny => "recv_any",
        }
    }
}

/// One phase of one operation, as the timeline draws it: the recorder keeps a few of these per
/// running operation (a fixed array, no allocation) and hands them over when it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhaseSpan {
    /// Which phase.
    pub phase: Phase,
    /// When it began and ended (ns since the Unix epoch).
    pub start_ns: u64,
    /// See `start_ns`.
    pub end_ns: u64,
    /// Bytes this rank sent and received during it.
    pub bytes: u64,
}

/// One operation as the flight recorder holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpRecord {
    /// What every rank must agree on (sequence number, kind, type, count, op, root, algorithm).
    pub fp: Fingerprint,
    /// Where it is in its life.
    pub state: OpState,
    /// The phase it is in (running) or ended in.
    pub phase: Phase,
    /// The other rank of a send or receive, else -1.
    pub peer: i32,
    /// The rank it waits for right now (running and blocked), else -1.
    pub waiting_on: i32,
    /// The step of the algorithm it is in (as on the wire).
    pub step: u32,
    /// When it was issued, started and ended (ns since the Unix epoch; 0: not yet).
    pub issued_ns: u64,
    /// See `issued_ns`.
    pub started_ns: u64,
    /// See `issued_ns`.
    pub ended_ns: u64,
    /// Bytes this rank has sent and received for it so far.
    pub bytes: u64,
}

impl OpRecord {
    /// The wire form (see the module's layout).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.fp.encode());
        out.push(self.state as u8);
        out.push(self.phase as u8);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.peer.to_le_bytes());
        out.extend_from_slice(&self.waiting_on.to_le_bytes());
        out.extend_from_slice(&self.step.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        for v in [self.issued_ns, self.started_ns, self.ended_ns, self.bytes] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// Decodes exactly [`RECORD_LEN`] bytes.
    pub fn decode(b: &[u8]) -> Result<OpRecord, String> {
        if b.len() != RECORD_LEN {
            return Err(format!("an operation record of {} bytes (expected {RECORD_LEN})", b.len()));
        }
        let mut f = [0u8; FINGERPRINT_LEN];
        f.copy_from_slice(&b[..FINGERPRINT_LEN]);
        let fp = Fingerprint::decode(&f)?;
        let state = OpState::from_u8(b[28]).ok_or_else(|| format!("unknown operation state {}", b[28]))?;
        let phase = Phase::from_u8(b[29]).ok_or_else(|| format!("unknown phase {}", b[29]))?;
        let i32_at = |i: usize| i32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Ok(OpRecord {
            fp,
            state,
            phase,
            peer: i32_at(32),
            waiting_on: i32_at(36),
            step: u32::from_le_bytes([b[40], b[41], b[42], b[43]]),
            issued_ns: u64_at(48),
            started_ns: u64_at(56),
            ended_ns: u64_at(64),
            bytes: u64_at(72),
        })
    }
}

/// What one rank tells about one communicator: who it is and its recent operations, oldest
/// first (the last completed ones, then the running one, then those queued behind it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Its rank in the communicator.
    pub rank: u32,
    /// The communicator's size.
    pub size: u32,
    /// The communicator's id.
    pub comm_id: u64,
    /// Its process id (for a human looking for it).
    pub pid: u32,
    /// When the snapshot was taken (ns since the Unix epoch).
    pub taken_ns: u64,
    /// Operations it completed since the communicator was created.
    pub completed: u64,
    /// At most [`MAX_RECORDS`] records, oldest first.
    pub records: Vec<OpRecord>,
}

impl Snapshot {
    /// The wire form; records beyond [`MAX_RECORDS`] are left out (the oldest first).
    pub fn encode(&self) -> Vec<u8> {
        let skip = self.records.len().saturating_sub(MAX_RECORDS);
        let records = &self.records[skip..];
        let mut out = Vec::with_capacity(HEADER_LEN + records.len() * RECORD_LEN);
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.rank.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.comm_id.to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.taken_ns.to_le_bytes());
        out.extend_from_slice(&self.completed.to_le_bytes());
        out.extend_from_slice(&(records.len() as u16).to_le_bytes());
        out.extend_from_slice(&[0; 6]);
        for r in records {
            r.encode(&mut out);
        }
        out
    }

    /// Decodes a snapshot, checking its magic, version, length and every record.
    pub fn decode(b: &[u8]) -> Result<Snapshot, String> {
        if b.len() < HEADER_LEN || b.len() > MAX_ENCODED {
            return Err(format!("a snapshot of {} bytes", b.len()));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        if u32_at(0) != MAGIC {
            return Err("not a snapshot (bad magic)".into());
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(format!("snapshot version {version} (this build reads {VERSION})"));
        }
        let n = u16::from_le_bytes([b[48], b[49]]) as usize;
        if n > MAX_RECORDS || b.len() != HEADER_LEN + n * RECORD_LEN {
            return Err(format!("a snapshot of {} bytes claiming {n} records", b.len()));
        }
        let records = b[HEADER_LEN..]
            .chunks_exact(RECORD_LEN)
            .map(OpRecord::decode)
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Snapshot {
            rank: u32_at(8),
            size: u32_at(12),
            comm_id: u64_at(16),
            pid: u32_at(24),
            taken_ns: u64_at(32),
            completed: u64_at(40),
            records,
        })
    }

    /// The last operation it completed (successfully or not).
    pub fn last_ended(&self) -> Option<&OpRecord> {
        self.records.iter().rev().find(|r| matches!(r.state, OpState::Done | OpState::Failed))
    }

    /// The operation it is running, if any.
    pub fn running(&self) -> Option<&OpRecord> {
        self.records.iter().find(|r| r.state == OpState::Running)
    }

    /// The operation the rank is in: the running one, else the last one issued if it failed
    /// (the communicator failed inside it).
    pub fn current(&self) -> Option<OpRecord> {
        self.running().copied().or_else(|| {
            self.records
                .iter()
                .rev()
                .find(|r| r.state != OpState::Queued)
                .filter(|r| r.state == OpState::Failed)
                .copied()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::CollKind;
    use crate::dtype::{DataType, ReduceOp};

    fn record(seq: u64, state: OpState) -> OpRecord {
        OpRecord {
            fp: Fingerprint {
                seq,
                kind: CollKind::AllReduce,
                dtype: DataType::F32,
                op: ReduceOp::Sum,
                count: 4096,
                root: -1,
                algo: 1,
            },
            state,
            phase: Phase::ReduceScatter,
            peer: -1,
            waiting_on: 5,
            step: 3,
            issued_ns: 10 + seq,
            started_ns: 20 + seq,
            ended_ns: 0,
            bytes: 1 << 20,
        }
    }

    fn snapshot(n: usize) -> Snapshot {
        Snapshot {
            rank: 2,
            size: 8,
            comm_id: 0xfeed,
            pid: 4242,
            taken_ns: 99,
            completed: 811,
            records: (0..n as u64)
                .map(|s| record(s, if s + 1 == n as u64 { OpState::Running } else { OpState::Done }))
                .collect(),
        }
    }

    #[test]
    fn a_snapshot_round_trips_field_by_field() {
        let s = snapshot(5);
        let b = s.encode();
        assert_eq!(b.len(), HEADER_LEN + 5 * RECORD_LEN);
        assert_eq!(Snapshot::decode(&b), Ok(s.clone()));
        assert_eq!(Snapshot::decode(&b).unwrap().running().map(|r| r.fp.seq), Some(4));
        assert_eq!(s.last_ended().map(|r| r.fp.seq), Some(3));
    }

    #[test]
    fn encoding_keeps_the_newest_records_within_the_bound() {
        let s = snapshot(MAX_RECORDS + 7);
        let d = Snapshot::decode(&s.encode()).unwrap();
        assert_eq!(d.records.len(), MAX_RECORDS);
        assert_eq!(d.records[0].fp.seq, 7);
    }

    #[test]
    fn every_malformed_snapshot_is_refused() {
        let good = snapshot(3).encode();
        assert!(Snapshot::decode(&good[..HEADER_LEN - 1]).is_err());
        assert!(Snapshot::decode(&good[..good.len() - 1]).is_err());
        let mut bad = good.clone();
        bad[0] ^= 1;
        assert!(Snapshot::decode(&bad).is_err());
        let mut bad = good.clone();
        bad[4] = 9;
        assert!(Snapshot::decode(&bad).is_err());
        let mut bad = good.clone();
        bad[48] = 200; // more records than the bound
        assert!(Snapshot::decode(&bad).is_err());
        let mut bad = good.clone();
        bad[HEADER_LEN + 28] = 0; // state
        assert!(Snapshot::decode(&bad).is_err());
        let mut bad = good.clone();
        bad[HEADER_LEN + 29] = 77; // phase
        assert!(Snapshot::decode(&bad).is_err());
        let mut bad = good;
        bad[HEADER_LEN] = 0; // collective kind
        assert!(Snapshot::decode(&bad).is_err());
        assert!(Snapshot::decode(&vec![0u8; MAX_ENCODED + 1]).is_err());
    }
}
