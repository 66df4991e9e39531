//! Recursive halving-doubling all-reduce (Rabenseifner) for small and medium messages, any
//! rank count.
//!
//! With `p` the largest power of two not above `n`, the first `2 (n - p)` ranks fold in pairs
//! first (MPICH): each even one hands its buffer to the odd one above it and waits for the
//! result at the end. The `p` remaining ranks cut the buffer into `p` blocks and run a
//! reduce-scatter by recursive halving (round `k`: exchange half of the current range with the
//! rank differing in bit `k`, keep and reduce the other half: `n/2, n/4, ...` bytes, the
//! largest messages between the nearest ranks, as Gloo does), then an all-gather by recursive
//! doubling (the same rounds backwards). `2 log2 p (+2)` steps and `2 (p-1)/p` of the buffer
//! per rank: the latency of recursive doubling at the bandwidth of the ring.

use super::schedule::{self, Doubling, halving_round};
use super::{Bufs, OpContext, read_write, work_and_input};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::trace::Phase as Stage;
use crate::transport::{Sink, Source};

/// Halving-doubling all-reduce over the whole communicator.
pub fn all_reduce(ctx: &mut OpContext<'_>, bufs: Bufs<'_>, dtype: DataType, op: ReduceOp) -> Result<()> {
    let n = ctx.size();
    let rank = ctx.rank();
    let es = dtype.size();
    let (buf, src, op) = work_and_input(bufs, dtype, op, n);
    let d = Doubling::new(n);
    let rounds = d.rounds();
    let count = buf.len() / es;
    let p = d.pof2;
    // Byte range of blocks `r` (blocks are balanced pieces of the buffer).
    let blocks = |r: std::ops::Range<usize>| {
        let a = schedule::piece(count, p, r.start).start;
        let b = if r.end == p { count } else { schedule::piece(count, p, r.end).start };
        a * es..b * es
    };
    let last = 2 * rounds + 1;
    // Fold: even ranks below 2*rem hand their data to the odd rank above them.
    ctx.phase(Stage::Reduce);
    if rank < 2 * d.rem {
        if rank.is_multiple_of(2) {
            ctx.exchange(0, Some((rank + 1, Source::Bytes(src.unwrap_or(buf)))), None)?;
            ctx.phase(Stage::Broadcast);
            return ctx.exchange(last, None, Some((rank + 1, Sink::Copy(buf))));
        }
        ctx.exchange(0, None, Some((rank - 1, Sink::Reduce { dst: &mut *buf, other: src, dtype, op })))?;
    } else if let Some(src) = src {
        buf.copy_from_slice(src);
    }
    let v = d.virtual_rank(rank).expect("folded ranks returned above");
    ctx.phase(Stage::ReduceScatter);
    for k in 0..rounds {
        let partner = d.real_rank(v ^ (1 << k));
        let (send, keep) = halving_round(v, rounds, k);
        let (out, dst) = read_write(buf, blocks(send), blocks(keep));
        let sink = Sink::Reduce { dst, other: None, dtype, op };
        ctx.exchange(1 + k, Some((partner, Source::Bytes(out))), Some((partner, sink)))?;
    }
    ctx.phase(Stage::AllGather);
    for k in (0..rounds).rev() {
        let partner = d.real_rank(v ^ (1 << k));
        let (theirs, mine) = halving_round(v, rounds, k);
        let (out, dst) = read_write(buf, blocks(mine), blocks(theirs));
        ctx.exchange(2 * rounds - k, Some((partner, Source::Bytes(out))), Some((partner, Sink::Copy(dst))))?;
    }
    if rank < 2 * d.rem {
        ctx.phase(Stage::Broadcast);
        ctx.exchange(last, Some((rank - 1, Source::Bytes(buf))), None)?;
    }
    Ok(())
}
