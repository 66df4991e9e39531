//! Collectives as schedules of exchanges over groups of ranks.
//!
//! Every algorithm is a free function over a [`OpContext`] (the peers, the operation's fingerprint
//! and deadline) and [`Scratch`] (buffers owned by the communicator and reused across calls, so
//! nothing is allocated per call once they have grown). Algorithms never name a transport; they
//! describe steps ("send piece a to the right neighbour, reduce piece b from the left one") and
//! [`Peers::exchange`] runs them. Offset maths is in [`schedule`], pure and unit-tested.
//!
//! | collective | algorithms |
//! |---|---|
//! | all_reduce | `ring` (reduce-scatter then all-gather, bandwidth-optimal), `hring` (hierarchical ring), `torus2d` (2D torus), `hd` (halving-doubling), `rd` (recursive doubling, latency-optimal for small messages) |
//! | reduce_scatter, all_gather | `ring` |
//! | broadcast, reduce | `chain` (pipelined, large messages), `tree` (binomial, small messages) |
//! | all_to_all | `pairwise` |
//! | barrier | `dissemination` |
//! | send/recv | `direct` |
//! | all_reduce, reduce_scatter, all_gather, broadcast, barrier, split's exchange (one host) | `shm_direct` (loads and stores in a shared window) |

pub mod broadcast;
pub mod dispatch;
pub mod doubling;
pub mod halving_doubling;
pub mod hierarchical;
pub mod intra;
pub mod narrow;
pub mod pairwise;
pub mod ring;
pub mod schedule;
pub mod torus2d;

use crate::trace::Phase as Stage;
use std::time::Instant;

use crate::collective::{Bufs, Fingerprint};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::reduce;
use crate::transport::exchange::{AllToAllPlan, RingPlan, Splits, Stream};
use crate::transport::window::Window;
use crate::transport::{Peers, Sink, Source};

/// The peers, fingerprint and deadline of one running operation.
#[derive(Debug)]
pub struct OpContext<'p> {
    /// The connected peers.
    pub peers: &'p mut Peers,
    /// The shared window of a one-host communicator (lent by its engine), for `shm_direct`.
    pub window: Option<&'p mut Window>,
    /// What every frame of this operation carries.
    pub fp: Fingerprint,
    /// When the whole operation must be done.
    pub deadline: Instant,
}

impl OpContext<'_> {
    /// The operation enters `phase` (the flight recorder and the timeline show it).
    pub fn phase(&mut self, phase: Stage) {
        self.peers.progress().phase(phase);
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.peers.rank()
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.peers.size()
    }

    /// One step: send and/or receive at once (see [`Peers::exchange`]).
    pub fn exchange(
        &mut self,
        step: usize,
        send: Option<(usize, Source<'_>)>,
        recv: Option<(usize, Sink<'_>)>,
    ) -> Result<()> {
        // Steps are compared modulo 2^16: enough to catch streams out of step.
        self.peers.exchange(&self.fp, step as u16, self.deadline, send, recv)
    }
}

impl OpContext<'_> {
    /// A whole ring schedule as one stream (see [`RingPlan`]).
    pub fn ring(&mut self, plan: &RingPlan<'_>, work: &mut [u8], src: Option<&[u8]>) -> Result<()> {
        self.peers.ring(&self.fp, self.deadline, plan, work, src)
    }

    /// Runs `streams` side by side until all are done (see `Peers::drive`): phases that use
    /// different links overlap.
    pub fn drive(&mut self, streams: &mut [&mut dyn Stream]) -> Result<()> {
        self.peers.drive(&self.fp, self.deadline, streams)
    }

    /// The pairwise all-to-all of `group`, this rank being member `me`, blocks of `block`
    /// bytes, several steps in flight (see [`AllToAllPlan`]). Uses steps
    /// `first_step .. first_step + n - 1`; this rank's own block is the caller's to copy.
    pub fn all_to_all(
        &mut self,
        group: Group<'_>,
        me: usize,
        first_step: usize,
        block: usize,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        let member = |j: usize| group.rank(j);
        let plan = AllToAllPlan { n: group.len(), me, member: &member, first_step, block, splits: None };
        self.peers.all_to_all(&self.fp, self.deadline, &plan, src, dst)
    }

    /// The pairwise all-to-all-v of the whole communicator: the blocks where `splits` puts
    /// them (this rank's own block is the caller's to copy). Uses steps `1 .. n - 1`.
    pub fn all_to_all_v(&mut self, splits: Splits<'_>, src: &[u8], dst: &mut [u8]) -> Result<()> {
        let (n, me) = (self.size(), self.rank());
        let member = |j: usize| j;
        let plan = AllToAllPlan { n, me, member: &member, first_step: 1, block: 0, splits: Some(splits) };
        self.peers.all_to_all(&self.fp, self.deadline, &plan, src, dst)
    }
}

/// Buffers owned by a communicator and reused by every call (they only grow).
#[derive(Debug, Default)]
pub struct Scratch {
    a: Vec<u64>,
    b: Vec<u64>,
    c: Vec<u64>,
}

pub(crate) fn grow(v: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    let words = bytes.div_ceil(8);
    if v.len() < words {
        v.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut::<u64, u8>(v)[..bytes]
}

impl Scratch {
    /// One scratch buffer of `bytes` bytes (8-byte aligned).
    pub fn one(&mut self, bytes: usize) -> &mut [u8] {
        grow(&mut self.a, bytes)
    }

    /// Two distinct scratch buffers.
    pub fn two(&mut self, a: usize, b: usize) -> (&mut [u8], &mut [u8]) {
        (grow(&mut self.a, a), grow(&mut self.b, b))
    }
}

/// Splits one buffer into a piece to read and a disjoint piece to write.
pub(crate) fn read_write(
    buf: &mut [u8],
    read: std::ops::Range<usize>,
    write: std::ops::Range<usize>,
) -> (&[u8], &mut [u8]) {
    assert!(
        read.end <= write.start || write.end <= read.start || read.is_empty() || write.is_empty(),
        "overlapping pieces {read:?} {write:?}"
    );
    if read.is_empty() {
        return (&[], &mut buf[write]);
    }
    if read.start < write.start {
        let (lo, hi) = buf.split_at_mut(write.start);
        (&lo[read], &mut hi[..write.end - write.start])
    } else {
        let (lo, hi) = buf.split_at_mut(read.start);
        (&hi[..read.end - read.start], &mut lo[write])
    }
}

/// Combines `a` and `b` into `dst` with the lower rank's operand first, so every rank computes
/// bit-identical results even where the operation is not (min/max of ±0, NaN payloads).
pub(crate) fn combine_ordered(
    dtype: DataType,
    op: ReduceOp,
    mine_first: bool,
    mine: &mut [u8],
    theirs: &mut [u8],
) -> bool {
    if mine_first {
        reduce::reduce_inplace(dtype, op, mine, theirs);
        true
    } else {
        reduce::reduce_inplace(dtype, op, theirs, mine);
        false
    }
}

/// The output buffer to work in and, out of place, the input to read, after `avg`'s
/// pre-scale (see [`prescale_in_place`]); with the op to reduce with.
pub(crate) fn work_and_input<'a>(
    bufs: Bufs<'a>,
    dtype: DataType,
    op: ReduceOp,
    n: usize,
) -> (&'a mut [u8], Option<&'a [u8]>, ReduceOp) {
    match prescale_in_place(bufs, dtype, op, n) {
        (Bufs::InPlace(b), op) => (b, None, op),
        (Bufs::OutOfPlace { send, recv }, op) => (recv, Some(send), op),
    }
}

/// `avg` is sum over inputs pre-scaled by 1/n (NCCL's choice: no overflow of the half types in
/// partial sums). Turns `bufs` into an in-place problem on the output holding scaled inputs and
/// returns the op to reduce with.
pub(crate) fn prescale_in_place<'a>(
    bufs: Bufs<'a>,
    dtype: DataType,
    op: ReduceOp,
    n: usize,
) -> (Bufs<'a>, ReduceOp) {
    if op != ReduceOp::Avg {
        return (bufs, op);
    }
    let factor = 1.0 / n as f64;
    let buf = match bufs {
        Bufs::InPlace(b) => {
            reduce::scale_inplace(dtype, b, factor);
            b
        }
        Bufs::OutOfPlace { send, recv } => {
            reduce::scale_into(dtype, recv, send, factor);
            recv
        }
    };
    (Bufs::InPlace(buf), ReduceOp::Sum)
}

/// An ordered set of ranks that runs a phase together (a ring follows this order).
#[derive(Debug, Clone, Copy)]
pub enum Group<'a> {
    /// Ranks `0..size` of the communicator, in order.
    World(usize),
    /// These ranks, in this order.
    Ranks(&'a [usize]),
}

impl Group<'_> {
    /// Number of members.
    pub fn len(&self) -> usize {
        match self {
            Group::World(n) => *n,
            Group::Ranks(r) => r.len(),
        }
    }

    /// The communicator rank at position `i`.
    pub fn rank(&self, i: usize) -> usize {
        match self {
            Group::World(_) => i,
            Group::Ranks(r) => r[i],
        }
    }
}
