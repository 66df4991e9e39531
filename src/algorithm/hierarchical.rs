//! Hierarchical ring all-reduce (Tencent, Jia et al. 2018).
//!
//! Three phases over the hosts' groups, all ring-based:
//!
//! 1. reduce to each host's root: ring reduce-scatter among the host's `k` ranks, then each
//!    rank hands its reduced piece to the root (`2 (k - 1)` steps);
//! 2. ring all-reduce of the whole buffer among the `m` roots (`2 (m - 1)` steps): only the
//!    roots' links cross hosts;
//! 3. broadcast from each root: the root hands piece `i` to local rank `i`, then a ring
//!    all-gather among the host's ranks (`2 (k - 1)` steps).
//!
//! `4 (k - 1) + 2 (m - 1)` steps against the flat ring's `2 (N - 1)`, but the inter-host phase
//! moves the full buffer through one rank per host. Hosts of different sizes work (each uses
//! its own `k`); step numbers use the largest `k` so that every link agrees on them.

use super::ring::{self, Phase, RsBufs};
use super::schedule;
use super::{Bufs, Group, OpContext, work_and_input};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::topology::Layout;
use crate::trace::Phase as Stage;
use crate::transport::{Sink, Source};

/// Hierarchical ring all-reduce over the communicator.
pub fn all_reduce(
    ctx: &mut OpContext<'_>,
    layout: &Layout,
    bufs: Bufs<'_>,
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    let n = ctx.size();
    let es = dtype.size();
    let (buf, src, op) = work_and_input(bufs, dtype, op, n);
    let count = buf.len() / es;
    let local = Group::Ranks(&layout.local);
    let (k, me) = (layout.local.len(), layout.local_pos);
    let big_k = layout.max_local;
    let m = layout.roots.len();
    let piece = |i: usize| schedule::bytes(schedule::piece(count, k, i), es);
    let root = layout.local[0];

    // 1. Reduce to the local root.
    let rs = match src {
        Some(src) => RsBufs::Full { src, dst: &mut *buf },
        None => RsBufs::InPlace(&mut *buf),
    };
    ring::reduce_scatter_phase(ctx, Phase::new(local, me, dtype, op), count, rs)?;
    ctx.phase(Stage::Reduce);
    if me == 0 {
        for i in 1..k {
            ctx.exchange(big_k + i, None, Some((layout.local[i], Sink::Copy(&mut buf[piece(i)]))))?;
        }
    } else {
        ctx.exchange(big_k + me, Some((root, Source::Bytes(&buf[piece(me)]))), None)?;
    }
    // 2. All-reduce among the roots.
    if let Some(pos) = layout.root_pos {
        let roots = Phase::new(Group::Ranks(&layout.roots), pos, dtype, op).at_step(2 * big_k + 1);
        ring::all_reduce_phase(ctx, roots, buf, None)?;
    }
    // 3. Broadcast from the local root: scatter, then all-gather.
    let base = 2 * big_k + 2 * m + 1;
    ctx.phase(Stage::Broadcast);
    if me == 0 {
        for i in 1..k {
            ctx.exchange(base + i, Some((layout.local[i], Source::Bytes(&buf[piece(i)]))), None)?;
        }
    } else {
        ctx.exchange(base + me, None, Some((root, Sink::Copy(&mut buf[piece(me)]))))?;
    }
    ring::all_gather_phase(ctx, Phase::new(local, me, dtype, op).at_step(base + big_k + 1), count, buf)
}
