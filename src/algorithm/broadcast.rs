//! Rooted collectives: broadcast and reduce, by pipelined chain or binomial tree.
//!
//! **Chain** (large messages): ranks line up from the root (`root, root+1, ...`). For
//! broadcast each rank receives from its predecessor and forwards every frame to its successor
//! as soon as it has landed, so all links stream at once and the time is about one message
//! transfer plus `n - 1` frame latencies. Reduce runs the same chain backwards: each rank
//! reduces the stream from its successor with its own input and forwards the result.
//!
//! **Binomial tree** (small messages): `ceil(log2 n)` rounds. Virtual rank `v` (root moved to 0)
//! receives from `v` with its lowest set bit cleared and serves `v + 2^k` for every `k` below
//! that bit, largest subtree first. The round of the edge to a child whose lowest set bit is
//! `k` is `L - 1 - k` for broadcast (`L = ceil(log2 n)`) and `k` for reduce, so both ends of an
//! edge agree on the step.

use super::schedule::{absolute, binomial_children, binomial_parent, relative};
use super::{Bufs, OpContext, Scratch};
use crate::collective::Algorithm;
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::reduce;
use crate::transport::{Sink, Source};

fn ceil_log2(n: usize) -> usize {
    (usize::BITS - (n.max(1) - 1).leading_zeros()) as usize
}

/// Broadcast from `root` with `algo` (`Chain` or `Tree`).
pub fn broadcast(ctx: &mut OpContext<'_>, algo: Algorithm, bufs: Bufs<'_>, root: usize) -> Result<()> {
    let n = ctx.size();
    let rank = ctx.rank();
    // The root's data: its input; everyone's output: the receive buffer.
    let (src, dst): (Option<&[u8]>, &mut [u8]) = match bufs {
        Bufs::InPlace(b) => (None, b),
        Bufs::OutOfPlace { send, recv } => (Some(send), recv),
    };
    if rank == root
        && let Some(src) = src
    {
        dst.copy_from_slice(src);
    }
    if n == 1 {
        return Ok(());
    }
    let v = relative(rank, root, n);
    match algo {
        Algorithm::Chain => {
            let prev = absolute((v + n - 1) % n, root, n);
            let next = absolute(v + 1, root, n);
            if v == 0 {
                ctx.exchange(0, Some((next, Source::Bytes(dst))), None)
            } else if v == n - 1 {
                ctx.exchange(0, None, Some((prev, Sink::Copy(dst))))
            } else {
                ctx.exchange(0, Some((next, Source::Forward)), Some((prev, Sink::Copy(dst))))
            }
        }
        _ => {
            let rounds = ceil_log2(n);
            if let Some(parent) = binomial_parent(v) {
                let k = v.trailing_zeros() as usize;
                ctx.exchange(rounds - 1 - k, None, Some((absolute(parent, root, n), Sink::Copy(&mut *dst))))?;
            }
            for child in binomial_children(n, v) {
                let k = child.trailing_zeros() as usize;
                ctx.exchange(rounds - 1 - k, Some((absolute(child, root, n), Source::Bytes(dst))), None)?;
            }
            Ok(())
        }
    }
}

/// Reduce to `root` with `algo` (`Chain` or `Tree`). Only the root's output is written; other
/// ranks' inputs are left untouched.
pub fn reduce(
    ctx: &mut OpContext<'_>,
    scratch: &mut Scratch,
    algo: Algorithm,
    bufs: Bufs<'_>,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let n = ctx.size();
    let rank = ctx.rank();
    // avg: reduce inputs pre-scaled by 1/n, then sum.
    let scale = (op == ReduceOp::Avg).then_some(1.0 / n as f64);
    let op = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    // Puts this rank's (scaled) input into `acc`.
    let load = |acc: &mut [u8], input: &[u8]| match scale {
        Some(f) => reduce::scale_into(dtype, acc, input, f),
        None => acc.copy_from_slice(input),
    };
    if rank == root {
        let acc: &mut [u8] = match bufs {
            Bufs::InPlace(b) => {
                if let Some(f) = scale {
                    reduce::scale_inplace(dtype, b, f);
                }
                b
            }
            Bufs::OutOfPlace { send, recv } => {
                load(&mut *recv, send);
                recv
            }
        };
        if n == 1 {
            return Ok(());
        }
        return match algo {
            Algorithm::Chain => {
                let from = absolute(1, root, n);
                ctx.exchange(0, None, Some((from, Sink::Reduce { dst: acc, other: None, dtype, op })))
            }
            _ => {
                let tmp = scratch.one(acc.len());
                tree_gather(ctx, tmp, acc, 0, dtype, op, root)
            }
        };
    }
    let input = bufs.input();
    let (a, b) = scratch.two(input.len(), input.len());
    let v = relative(rank, root, n);
    let toward_root =
        absolute(binomial_parent(v).filter(|_| algo != Algorithm::Chain).unwrap_or(v - 1), root, n);
    match algo {
        Algorithm::Chain => {
            // Scaled input (avg) goes to `b`; the running result to `a`.
            let input: &[u8] = match scale {
                Some(_) => {
                    load(&mut *b, input);
                    b
                }
                None => input,
            };
            if v == n - 1 {
                return ctx.exchange(0, Some((toward_root, Source::Bytes(input))), None);
            }
            let from = absolute(v + 1, root, n);
            let sink = Sink::Reduce { dst: a, other: Some(input), dtype, op };
            ctx.exchange(0, Some((toward_root, Source::Forward)), Some((from, sink)))
        }
        _ => {
            // Children's partial results are combined into `a`, then sent up.
            load(&mut *a, input);
            tree_gather(ctx, b, a, v, dtype, op, root)?;
            let k = v.trailing_zeros() as usize;
            ctx.exchange(k, Some((toward_root, Source::Bytes(a))), None)
        }
    }
}

/// Receives and combines the partial results of `v`'s children into `acc`, smallest subtree
/// first: round `k` for the child `v + 2^k`.
fn tree_gather(
    ctx: &mut OpContext<'_>,
    tmp: &mut [u8],
    acc: &mut [u8],
    v: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let n = ctx.size();
    let limit = if v == 0 { usize::BITS } else { v.trailing_zeros() };
    for k in 0..limit as usize {
        let Some(child) = v.checked_add(1 << k).filter(|&c| c < n) else { break };
        ctx.exchange(k, None, Some((absolute(child, root, n), Sink::Copy(&mut *tmp))))?;
        reduce::reduce_inplace(dtype, op, acc, tmp);
    }
    Ok(())
}
