//! Recursive-doubling all-reduce for small messages (any rank count, MPICH's fold).
//!
//! With `p` the largest power of two not above `n`, the first `2 (n - p)` ranks pair up: each
//! even one hands its whole buffer to its odd partner and sits out. The remaining `p` ranks do
//! `log2 p` rounds; in round `k` each exchanges its whole buffer with the rank whose virtual
//! number differs in bit `k` and both combine (lower virtual rank's operand first, so every rank
//! ends with identical bits). Finally the odd partners hand the result back. That is
//! `log2 p (+2)` latencies against the ring's `2 (n - 1)`, at `log2 p` times the bytes:
//! the right trade below a few tens of kilobytes.

use super::schedule::Doubling;
use super::{Bufs, OpContext, Scratch, combine_ordered, prescale_in_place};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::transport::{Sink, Source};

/// Recursive-doubling all-reduce over the whole communicator.
pub fn all_reduce(
    ctx: &mut OpContext<'_>,
    scratch: &mut Scratch,
    bufs: Bufs<'_>,
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    let n = ctx.size();
    let rank = ctx.rank();
    let (bufs, op) = prescale_in_place(bufs, dtype, op, n);
    let buf: &mut [u8] = match bufs {
        Bufs::InPlace(b) => b,
        Bufs::OutOfPlace { send, recv } => {
            recv.copy_from_slice(send);
            recv
        }
    };
    let len = buf.len();
    let tmp = scratch.one(len);
    let d = Doubling::new(n);
    let rounds = d.rounds();
    // Fold: even ranks below 2*rem give their data to the odd rank above them.
    if rank < 2 * d.rem {
        if rank.is_multiple_of(2) {
            ctx.exchange(0, Some((rank + 1, Source::Bytes(buf))), None)?;
            // ... and get the result back at the end.
            return ctx.exchange(rounds + 1, None, Some((rank + 1, Sink::Copy(buf))));
        }
        ctx.exchange(0, None, Some((rank - 1, Sink::Copy(&mut *tmp))))?;
        // The partner is the lower rank: its operand goes first.
        if !combine_ordered(dtype, op, false, buf, tmp) {
            buf.copy_from_slice(tmp);
        }
    }
    let v = d.virtual_rank(rank).expect("folded ranks returned above");
    for k in 0..rounds {
        let partner_v = v ^ (1 << k);
        let partner = d.real_rank(partner_v);
        ctx.exchange(1 + k, Some((partner, Source::Bytes(buf))), Some((partner, Sink::Copy(&mut *tmp))))?;
        if !combine_ordered(dtype, op, v < partner_v, buf, tmp) {
            buf.copy_from_slice(tmp);
        }
    }
    if rank < 2 * d.rem {
        ctx.exchange(rounds + 1, Some((rank - 1, Source::Bytes(buf))), None)?;
    }
    Ok(())
}
