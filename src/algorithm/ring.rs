//! Ring reduce-scatter, all-gather and all-reduce (Baidu, Horovod, Gloo, NCCL).
//!
//! The buffer is cut into one piece per member (balanced, see [`schedule::piece`]). In the
//! reduce-scatter phase each of `n - 1` steps sends one piece to the right neighbour and
//! reduces the piece arriving from the left into place; afterwards position `i` holds the full
//! reduction of piece `i`. The all-gather phase circulates the finished pieces for `n - 1` more
//! steps. Every byte crosses each link `2 (n - 1) / n` times: bandwidth-optimal.
//!
//! Each step is one full-duplex exchange; its pieces travel as frames of at most the segment
//! size and arriving bytes are reduced as soon as whole elements are in, so reduction overlaps
//! transfer. Out-of-place calls read the input where they first need it and never copy it.

use std::ops::Range;

use super::schedule::{self, ring_all_gather, ring_reduce_scatter};
use super::{Bufs, Group, OpContext, Scratch, grow, work_and_input};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::reduce;
use crate::trace::Phase as Stage;
use crate::transport::exchange::RingPlan;
use crate::transport::{Sink, Source};

/// Piece `i` of `count` elements cut into `n` pieces, in bytes.
fn piece(count: usize, n: usize, esize: usize, i: usize) -> Range<usize> {
    schedule::bytes(schedule::piece(count, n, i), esize)
}

/// Where a reduce-scatter reads its inputs and leaves its results.
#[derive(Debug)]
pub enum RsBufs<'a> {
    /// Every piece lives in `buf`; the result lands in this position's piece.
    InPlace(&'a mut [u8]),
    /// Inputs in `src`; partial results and the result go to `dst`, laid out like `src`.
    Full {
        /// Inputs.
        src: &'a [u8],
        /// Output (same length as `src`).
        dst: &'a mut [u8],
    },
}

/// Where and how one ring phase runs: the ordered members, this rank's position among them,
/// the element type and reduction, and the step number of its first frame (phases of one
/// collective number their steps one after another).
#[derive(Debug, Clone, Copy)]
pub struct Phase<'g> {
    /// The members, in ring order.
    pub group: Group<'g>,
    /// This rank's position in `group`.
    pub me: usize,
    /// Element type.
    pub dtype: DataType,
    /// Reduction (`Avg` only in the public entry points, which pre-scale).
    pub op: ReduceOp,
    /// Step number of the phase's first step on the wire.
    pub step0: usize,
}

impl<'g> Phase<'g> {
    /// A phase over `group` at position `me` starting at step 0.
    pub fn new(group: Group<'g>, me: usize, dtype: DataType, op: ReduceOp) -> Phase<'g> {
        Phase { group, me, dtype, op, step0: 0 }
    }

    /// The same phase starting at step `step0`.
    pub fn at_step(self, step0: usize) -> Phase<'g> {
        Phase { step0, ..self }
    }
}

/// A ring plan over `group` for position `me`: the caller fills in the schedule.
struct Ring<'g> {
    group: Group<'g>,
    me: usize,
}

impl Ring<'_> {
    fn plan<'f>(
        &self,
        steps: usize,
        first_step: usize,
        reduce: Option<(usize, DataType, ReduceOp)>,
        send0: Range<usize>,
        piece: &'f dyn Fn(usize) -> Range<usize>,
    ) -> RingPlan<'f> {
        let n = self.group.len();
        let (reduce_steps, dtype, op) = reduce.unwrap_or((0, DataType::U8, ReduceOp::Sum));
        RingPlan {
            left: self.group.rank((self.me + n - 1) % n),
            right: self.group.rank((self.me + 1) % n),
            steps,
            first_step,
            reduce_steps,
            lag: n - 1,
            dtype,
            op,
            send0,
            piece,
        }
    }
}

/// The three ring phases, as streams that other phases can run beside (`OpContext::drive`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `n - 1` reducing steps: position `i` ends with piece `i` reduced.
    ReduceScatter,
    /// `n - 1` copying steps: every position ends with every piece (its own already in place).
    AllGather,
    /// Both as one stream, `2 (n - 1)` steps.
    AllReduce,
}

/// The byte range of its `count` elements that position `me` of `n` receives at step `k` of a
/// ring phase of `kind`.
pub fn recv_piece(kind: Kind, count: usize, n: usize, es: usize, me: usize, k: usize) -> Range<usize> {
    let i = match kind {
        Kind::ReduceScatter => ring_reduce_scatter(n, me, k).1,
        Kind::AllGather => ring_all_gather(n, me, k).1,
        // Step k receives piece me - k - 2 (mod n), in both halves.
        Kind::AllReduce => (me + 3 * n - k - 2) % n,
    };
    piece(count, n, es, i)
}

/// The plan of a ring phase of `kind` over `count` elements (`phase.group` of at least two),
/// `recv` being [`recv_piece`] for it: run it with [`RingRun`](crate::transport::exchange::RingRun)
/// beside other streams, or alone with `OpContext::ring`.
pub fn plan<'f>(
    kind: Kind,
    phase: Phase<'_>,
    count: usize,
    recv: &'f dyn Fn(usize) -> Range<usize>,
) -> RingPlan<'f> {
    let Phase { group, me, dtype, op, step0 } = phase;
    let n = group.len();
    let es = dtype.size();
    let ring = Ring { group, me };
    match kind {
        Kind::ReduceScatter => {
            let send0 = piece(count, n, es, ring_reduce_scatter(n, me, 0).0);
            ring.plan(n - 1, step0, Some((n - 1, dtype, op)), send0, recv)
        }
        // Copies only: the element type and op are not used.
        Kind::AllGather => ring.plan(n - 1, step0, None, piece(count, n, es, me), recv),
        Kind::AllReduce => {
            let send0 = piece(count, n, es, (me + n - 1) % n);
            ring.plan(2 * (n - 1), step0, Some((n - 1, dtype, op)), send0, recv)
        }
    }
}

/// Ring reduce-scatter of `count` elements over the phase's group. Uses steps
/// `step0 .. step0 + n - 1`.
pub fn reduce_scatter_phase(
    ctx: &mut OpContext<'_>,
    phase: Phase<'_>,
    count: usize,
    bufs: RsBufs<'_>,
) -> Result<()> {
    ctx.phase(Stage::ReduceScatter);
    let n = phase.group.len();
    let recv = |k: usize| recv_piece(Kind::ReduceScatter, count, n, phase.dtype.size(), phase.me, k);
    match bufs {
        RsBufs::InPlace(buf) => {
            if n > 1 {
                ctx.ring(&plan(Kind::ReduceScatter, phase, count, &recv), buf, None)?;
            }
        }
        RsBufs::Full { src, dst } => {
            if n == 1 {
                dst.copy_from_slice(src);
            } else {
                ctx.ring(&plan(Kind::ReduceScatter, phase, count, &recv), dst, Some(src))?;
            }
        }
    }
    Ok(())
}

/// Ring reduce-scatter where only this position's piece is wanted, in `out` (the public
/// out-of-place form): partial sums alternate between the scratch pieces `a` and `b`, one step
/// at a time (receive into one while the other is sent).
fn reduce_scatter_own(
    ctx: &mut OpContext<'_>,
    phase: Phase<'_>,
    src: &[u8],
    out: &mut [u8],
    (a, b): (&mut [u8], &mut [u8]),
) -> Result<()> {
    let Phase { group, me, dtype, op, step0 } = phase;
    let n = group.len();
    if n == 1 {
        out.copy_from_slice(src);
        return Ok(());
    }
    let count = src.len() / dtype.size();
    let p = |i: usize| piece(count, n, dtype.size(), i);
    let right = group.rank((me + 1) % n);
    let left = group.rank((me + n - 1) % n);
    for s in 0..n - 1 {
        let (ps, pr) = ring_reduce_scatter(n, me, s);
        let (cur, prev) = if s % 2 == 0 { (&mut *a, &*b) } else { (&mut *b, &*a) };
        let send: &[u8] = if s == 0 { &src[p(ps)] } else { &prev[..p(ps).len()] };
        let target: &mut [u8] = if s == n - 2 { &mut *out } else { &mut cur[..p(pr).len()] };
        let sink = Sink::Reduce { dst: target, other: Some(&src[p(pr)]), dtype, op };
        ctx.exchange(step0 + s, Some((right, Source::Bytes(send))), Some((left, sink)))?;
    }
    Ok(())
}

/// The public reduce-scatter over `group`: in place, the result lands in this position's piece
/// of the buffer; out of place, `recv` gets it. `avg` pre-scales the inputs by `1/scale_n`.
pub fn reduce_scatter(
    ctx: &mut OpContext<'_>,
    scratch: &mut Scratch,
    phase: Phase<'_>,
    bufs: Bufs<'_>,
    scale_n: usize,
) -> Result<()> {
    let Phase { dtype, op, .. } = phase;
    let factor = 1.0 / scale_n as f64;
    let sum_op = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    match bufs {
        Bufs::InPlace(buf) => {
            if op == ReduceOp::Avg {
                reduce::scale_inplace(dtype, buf, factor);
            }
            let count = buf.len() / dtype.size();
            reduce_scatter_phase(ctx, Phase { op: sum_op, ..phase }, count, RsBufs::InPlace(buf))
        }
        Bufs::OutOfPlace { send, recv } => {
            let Scratch { a, b, c } = scratch;
            let piece_len = recv.len();
            let tmp = (grow(a, piece_len), grow(b, piece_len));
            // avg: reduce a pre-scaled copy; the caller's input stays untouched.
            let src: &[u8] = if op == ReduceOp::Avg {
                let scaled = grow(c, send.len());
                reduce::scale_into(dtype, scaled, send, factor);
                scaled
            } else {
                send
            };
            reduce_scatter_own(ctx, Phase { op: sum_op, ..phase }, src, recv, tmp)
        }
    }
}

/// Ring all-gather over the phase's group on `count` elements held in `buf`, where this
/// position's piece is already in place. Uses steps `step0 .. step0 + n - 1`. Copies only: the
/// phase's reduction is not used.
pub fn all_gather_phase(
    ctx: &mut OpContext<'_>,
    phase: Phase<'_>,
    count: usize,
    buf: &mut [u8],
) -> Result<()> {
    ctx.phase(Stage::AllGather);
    let n = phase.group.len();
    if n == 1 {
        return Ok(());
    }
    let recv = |k: usize| recv_piece(Kind::AllGather, count, n, phase.dtype.size(), phase.me, k);
    ctx.ring(&plan(Kind::AllGather, phase, count, &recv), buf, None)
}

/// Ring all-reduce over `group`: reduce-scatter then all-gather, `2 (n - 1)` steps run as one
/// stream (the piece finished last in the reduce-scatter is the first one all-gathered).
/// `avg` pre-scales the inputs by `1/scale_n`.
pub fn all_reduce(ctx: &mut OpContext<'_>, phase: Phase<'_>, bufs: Bufs<'_>, scale_n: usize) -> Result<()> {
    let (work, src, op) = work_and_input(bufs, phase.dtype, phase.op, scale_n);
    all_reduce_phase(ctx, Phase { op, ..phase }, work, src)
}

/// The all-reduce phase over `group` on `work` (the result), reading inputs from `src` when
/// given (else from `work`); steps `step0 .. step0 + 2 (n - 1)`. `op` is never `Avg` here.
pub fn all_reduce_phase(
    ctx: &mut OpContext<'_>,
    phase: Phase<'_>,
    work: &mut [u8],
    src: Option<&[u8]>,
) -> Result<()> {
    // One stream in which the reduce-scatter's last steps overlap the all-gather's first.
    ctx.phase(Stage::AllReduce);
    let n = phase.group.len();
    let count = work.len() / phase.dtype.size();
    if n == 1 {
        if let Some(src) = src {
            work.copy_from_slice(src);
        }
        return Ok(());
    }
    let recv = |k: usize| recv_piece(Kind::AllReduce, count, n, phase.dtype.size(), phase.me, k);
    ctx.ring(&plan(Kind::AllReduce, phase, count, &recv), work, src)
}
