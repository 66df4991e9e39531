//! The vocabulary every rank must agree on: what a call is ([`OpKind`], [`CollKind`]), which
//! algorithm runs it ([`Algorithm`]), its per-call options and buffers, and the
//! [`Fingerprint`] that every frame and every shared-window slot carries, with its one wire
//! encoding ([`Fingerprint::encode`] / [`Fingerprint::decode`]).
//!
//! This module is a leaf: it depends only on [`crate::dtype`], so the transport layer (which
//! checks fingerprints) and the algorithm layer (which chooses algorithms) both use it without
//! importing each other.

use std::fmt;
use std::time::Duration;

use crate::dtype::{DataType, ReduceOp};

/// Options of one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// Deadline of this call (default: the communicator's timeout).
    pub timeout: Option<Duration>,
    /// Force an algorithm (must be able to run the collective).
    pub algorithm: Option<Algorithm>,
    /// Type a float all-reduce travels in (`BF16` or `F16`; the buffer's own type: not
    /// compressed); `None`: the communicator's `TOROID_WIRE_DTYPE`.
    pub wire: Option<DataType>,
}

/// What an operation does (the internal form of every collective call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// all_reduce
    AllReduce(ReduceOp),
    /// reduce_scatter (output = this rank's piece)
    ReduceScatter(ReduceOp),
    /// all_gather
    AllGather,
    /// broadcast from root
    Broadcast(usize),
    /// reduce to root
    Reduce(ReduceOp, usize),
    /// all_to_all
    AllToAll,
    /// all_to_all with a block of its own size for each pair of ranks (the sizes travel beside
    /// the buffers: `RawOp::splits`)
    AllToAllV,
    /// barrier
    Barrier,
    /// send to peer
    Send(usize),
    /// receive from peer
    Recv(usize),
    /// receive from whichever peer sends first (the rank is reported back)
    RecvAny,
    /// sends and receives that run side by side (a group's `Send`s and `Recv`s; they travel
    /// beside the buffers: `RawOp::batch`), each on the wire as if alone
    SendRecv,
    /// the all-gather inside `split`
    SplitExchange,
    /// the cost model's link measurements (output: the probe results as 6 f64)
    Probe,
}

impl OpKind {
    /// The collective kind carried in fingerprints.
    pub fn coll(self) -> CollKind {
        match self {
            OpKind::AllReduce(_) => CollKind::AllReduce,
            OpKind::ReduceScatter(_) => CollKind::ReduceScatter,
            OpKind::AllGather => CollKind::AllGather,
            OpKind::Broadcast(_) => CollKind::Broadcast,
            OpKind::Reduce(..) => CollKind::Reduce,
            OpKind::AllToAll => CollKind::AllToAll,
            OpKind::AllToAllV => CollKind::AllToAllV,
            OpKind::Barrier => CollKind::Barrier,
            OpKind::Send(_) | OpKind::Recv(_) | OpKind::RecvAny | OpKind::SendRecv => CollKind::PointToPoint,
            OpKind::SplitExchange => CollKind::Split,
            OpKind::Probe => CollKind::Probe,
        }
    }
}

/// What kind of operation a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CollKind {
    /// all_reduce
    AllReduce = 1,
    /// reduce_scatter
    ReduceScatter = 2,
    /// all_gather
    AllGather = 3,
    /// broadcast
    Broadcast = 4,
    /// reduce
    Reduce = 5,
    /// all_to_all
    AllToAll = 6,
    /// barrier
    Barrier = 7,
    /// send / recv between two ranks
    PointToPoint = 8,
    /// the internal exchange that creates sub-communicators
    Split = 9,
    /// the link measurements of the cost model
    Probe = 10,
    /// all_to_all_v (blocks of any sizes)
    AllToAllV = 11,
}

impl CollKind {
    const ALL: [CollKind; 11] = [
        CollKind::AllReduce,
        CollKind::ReduceScatter,
        CollKind::AllGather,
        CollKind::Broadcast,
        CollKind::Reduce,
        CollKind::AllToAll,
        CollKind::Barrier,
        CollKind::PointToPoint,
        CollKind::Split,
        CollKind::Probe,
        CollKind::AllToAllV,
    ];

    /// The snake_case name used in logs and errors.
    pub const fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "all_reduce",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::AllGather => "all_gather",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
            CollKind::AllToAll => "all_to_all",
            CollKind::Barrier => "barrier",
            CollKind::PointToPoint => "send/recv",
            CollKind::Split => "split",
            CollKind::Probe => "probe",
            CollKind::AllToAllV => "all_to_all_v",
        }
    }

    /// The kind with wire id `v`.
    pub fn from_u8(v: u8) -> Option<CollKind> {
        CollKind::ALL.iter().copied().find(|k| *k as u8 == v)
    }
}

/// What every rank taking part in one operation must agree on. Carried in every frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    /// Sequence number: per communicator for collectives, per pair of ranks for send/recv.
    pub seq: u64,
    /// Which operation.
    pub kind: CollKind,
    /// Element type.
    pub dtype: DataType,
    /// Reduction (`Sum` where none applies).
    pub op: ReduceOp,
    /// Element count as the operation's signature defines it.
    pub count: u64,
    /// Root rank, or -1.
    pub root: i32,
    /// Algorithm id (ranks that picked different algorithms must not exchange data).
    pub algo: u8,
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{} ({} x {}", self.kind.name(), self.seq, self.count, self.dtype)?;
        if matches!(self.kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce) {
            write!(f, ", {}", self.op)?;
        }
        if self.root >= 0 {
            write!(f, ", root {}", self.root)?;
        }
        write!(f, ", algorithm {})", Algorithm::name_of(self.algo))
    }
}

/// Bytes of an encoded [`Fingerprint`] (the last 28 bytes of every frame header; see
/// `docs/reference/wire-format.md`, "Frames").
pub const FINGERPRINT_LEN: usize = 28;

impl Fingerprint {
    /// The wire form (little-endian):
    /// `coll u8 | dtype u8 | op u8 | algo u8 | seq u64 | count u64 | root i32 | 0 u32`.
    pub fn encode(&self) -> [u8; FINGERPRINT_LEN] {
        let mut b = [0u8; FINGERPRINT_LEN];
        b[0] = self.kind as u8;
        b[1] = self.dtype as u8;
        b[2] = self.op as u8;
        b[3] = self.algo;
        b[4..12].copy_from_slice(&self.seq.to_le_bytes());
        b[12..20].copy_from_slice(&self.count.to_le_bytes());
        b[20..24].copy_from_slice(&self.root.to_le_bytes());
        b
    }

    /// Decodes the wire form; the error names the fields that are not valid.
    pub fn decode(b: &[u8; FINGERPRINT_LEN]) -> Result<Fingerprint, String> {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        match (CollKind::from_u8(b[0]), DataType::from_u8(b[1]), ReduceOp::from_u8(b[2])) {
            (Some(kind), Some(dtype), Some(op)) => Ok(Fingerprint {
                seq: word(4),
                kind,
                dtype,
                op,
                count: word(12),
                root: i32::from_le_bytes([b[20], b[21], b[22], b[23]]),
                algo: b[3],
            }),
            _ => Err(format!("undecodable fingerprint fields {:?}", &b[0..3])),
        }
    }
}

/// An algorithm, as carried in frame headers and named in `TOROID_ALGO`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Algorithm {
    /// Ring: reduce-scatter then all-gather (all_reduce), or one of the two phases.
    Ring = 1,
    /// Recursive doubling with MPICH's fold for any rank count (small all_reduce).
    Doubling = 2,
    /// Pipelined chain (large broadcast and reduce).
    Chain = 3,
    /// Binomial tree (small broadcast and reduce).
    Tree = 4,
    /// Pairwise exchange (all_to_all).
    Pairwise = 5,
    /// Dissemination (barrier).
    Dissemination = 6,
    /// Direct point-to-point (send/recv).
    Direct = 7,
    /// Recursive halving-doubling, Rabenseifner (small and medium all_reduce).
    HalvingDoubling = 8,
    /// Hierarchical ring (Tencent): reduce per host, ring among hosts' roots, broadcast per host.
    HierarchicalRing = 9,
    /// 2D torus (Sony): reduce-scatter along rows, all-reduce along columns, all-gather along rows.
    Torus2d = 10,
    /// Direct loads and stores in a shared window (every rank on one host; see [`intra`]).
    ShmDirect = 11,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 11] = [
        Algorithm::Ring,
        Algorithm::Doubling,
        Algorithm::Chain,
        Algorithm::Tree,
        Algorithm::Pairwise,
        Algorithm::Dissemination,
        Algorithm::Direct,
        Algorithm::HalvingDoubling,
        Algorithm::HierarchicalRing,
        Algorithm::Torus2d,
        Algorithm::ShmDirect,
    ];

    /// The name used in `TOROID_ALGO`, logs and the benchmark.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Doubling => "rd",
            Algorithm::Chain => "chain",
            Algorithm::Tree => "tree",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Dissemination => "dissemination",
            Algorithm::Direct => "direct",
            Algorithm::HalvingDoubling => "hd",
            Algorithm::HierarchicalRing => "hring",
            Algorithm::Torus2d => "torus2d",
            Algorithm::ShmDirect => "shm_direct",
        }
    }

    /// The name of the algorithm with wire id `id` (for messages about a peer's choice).
    pub fn name_of(id: u8) -> &'static str {
        Algorithm::ALL.iter().find(|a| **a as u8 == id).map_or("unknown", |a| a.name())
    }

    /// Parses a name (case-insensitive; `doubling` is accepted for `rd`).
    pub fn parse(s: &str) -> Option<Algorithm> {
        let s = s.trim().to_ascii_lowercase();
        if s == "doubling" || s == "recursive_doubling" {
            return Some(Algorithm::Doubling);
        }
        if s == "shm" || s == "shmdirect" || s == "shm-direct" {
            return Some(Algorithm::ShmDirect);
        }
        Algorithm::ALL.iter().copied().find(|a| a.name() == s)
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The buffers of a collective: in place (`sendbuf == recvbuf` in C) or not.
#[derive(Debug)]
pub enum Bufs<'a> {
    /// One buffer is both input and output.
    InPlace(&'a mut [u8]),
    /// Separate input and output.
    OutOfPlace {
        /// Input.
        send: &'a [u8],
        /// Output.
        recv: &'a mut [u8],
    },
}

impl Bufs<'_> {
    /// The input bytes.
    pub fn input(&self) -> &[u8] {
        match self {
            Bufs::InPlace(b) => b,
            Bufs::OutOfPlace { send, .. } => send,
        }
    }

    /// The output bytes' length.
    pub fn output_len(&self) -> usize {
        match self {
            Bufs::InPlace(b) => b.len(),
            Bufs::OutOfPlace { recv, .. } => recv.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_round_trip_and_bad_fields_are_named() {
        let fp = Fingerprint {
            seq: u64::MAX - 3,
            kind: CollKind::Broadcast,
            dtype: DataType::BF16,
            op: ReduceOp::Max,
            count: 1 << 40,
            root: 7,
            algo: Algorithm::Chain as u8,
        };
        assert_eq!(Fingerprint::decode(&fp.encode()), Ok(fp));
        let none = Fingerprint { root: -1, ..fp };
        assert_eq!(Fingerprint::decode(&none.encode()), Ok(none));
        let mut b = fp.encode();
        b[1] = 200;
        assert!(Fingerprint::decode(&b).unwrap_err().contains("undecodable"));
    }

    #[test]
    fn algorithm_names_parse_back() {
        for a in Algorithm::ALL {
            assert_eq!(Algorithm::parse(a.name()), Some(a));
            assert_eq!(Algorithm::name_of(a as u8), a.name());
        }
        assert_eq!(Algorithm::parse("doubling"), Some(Algorithm::Doubling));
        assert_eq!(Algorithm::parse("nope"), None);
    }
}
