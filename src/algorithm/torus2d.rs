//! 2D-torus all-reduce (Sony, Mikami et al. 2018; Horovod's hierarchical all-reduce).
//!
//! The ranks form an `X x Y` grid: rows of `X` (the ranks of one host when every host has `X`
//! ranks), columns of `Y`. Three ring phases:
//!
//! 1. reduce-scatter along the row: rank `(x, y)` ends with piece `x` of its row's sum
//!    (`X - 1` steps, `(X-1)/X` of the buffer);
//! 2. all-reduce along the column on that piece only, `1/X` of the data (`2 (Y - 1)` steps):
//!    the `X` columns cross hosts in parallel;
//! 3. all-gather along the row (`X - 1` steps).
//!
//! `2 (X - 1) + 2 (Y - 1)` steps instead of the flat ring's `2 (XY - 1)`, with the same bytes
//! per rank as the flat ring.
//!
//! Compressed (`narrow_to`, `TOROID_WIRE_DTYPE`): phase 2, the only one between hosts, is the
//! compressed all-reduce of `narrow.rs` within the column (16-bit on the wire, reduced in the
//! data's own type), and the row phases stay exact within the host. The row sums are rounded
//! once and the column's result once: the bound of `narrow.rs` with `S` the sum of the
//! magnitudes of all inputs, as for the flat compressed all-reduce.

use std::ops::Range;

use super::narrow::{self, Narrowed};
use super::ring::{self, Kind, Phase, RsBufs};
use super::schedule;
use super::{Bufs, Group, OpContext, Scratch, work_and_input};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::topology::Layout;
use crate::trace::Phase as Stage;
use crate::transport::exchange::{AllToAllPlan, AllToAllRun, RingRun, Then};

/// Chunks of the pipelined torus at most.
pub const MAX_CHUNKS: usize = 8;

/// How many chunks an all-reduce of `bytes` on an `nx x ny` grid can be pipelined in (1: not
/// pipelined): one per `chunk` bytes (`TOROID_PIPELINE_CHUNK`; 0: off), at most
/// [`MAX_CHUNKS`], and only with a row and a column to overlap. The cost model
/// (`CostModel::torus_chunks`) takes it where it is cheaper than the plain form.
pub fn pipeline_chunks(bytes: usize, nx: usize, ny: usize, chunk: usize) -> usize {
    if nx < 2 || ny < 2 || chunk == 0 {
        return 1;
    }
    (bytes / chunk).clamp(1, MAX_CHUNKS)
}

/// 2D-torus all-reduce over the communicator's grid, pipelined in `chunks` chunks when more
/// than one (every rank passes the same number).
pub fn all_reduce(
    ctx: &mut OpContext<'_>,
    scratch: &mut Scratch,
    layout: &Layout,
    bufs: Bufs<'_>,
    (dtype, op): (DataType, ReduceOp),
    narrow_to: Option<DataType>,
    chunks: usize,
) -> Result<()> {
    let n = ctx.size();
    let es = dtype.size();
    let (buf, src, op) = work_and_input(bufs, dtype, op, n);
    let count = buf.len() / es;
    let (x, y) = layout.position;
    let (nx, ny) = (layout.grid.x, layout.grid.y);
    let p = chunks.min(count).min(MAX_CHUNKS);
    if p > 1 && nx > 1 && ny > 1 {
        return pipelined(ctx, scratch, layout, (buf, src), (dtype, op), narrow_to, p);
    }
    let row = Group::Ranks(&layout.row);
    let rs = match src {
        Some(src) => RsBufs::Full { src, dst: &mut *buf },
        None => RsBufs::InPlace(&mut *buf),
    };
    ring::reduce_scatter_phase(ctx, Phase::new(row, x, dtype, op), count, rs)?;
    let mine = schedule::bytes(schedule::piece(count, nx, x), es);
    match narrow_to {
        Some(to) => {
            let column = Phase::new(Group::Ranks(&layout.column), y, dtype, op).at_step(nx);
            narrow::all_reduce_phase(ctx, scratch, column, to, &mut buf[mine])?;
        }
        None => {
            let column = Phase::new(Group::Ranks(&layout.column), y, dtype, op).at_step(nx);
            ring::all_reduce_phase(ctx, column, &mut buf[mine], None)?;
        }
    }
    ring::all_gather_phase(ctx, Phase::new(row, x, dtype, op).at_step(nx + 2 * ny), count, buf)
}

/// The torus pipelined in `p` chunks: while chunk `c` crosses the hosts along the column, the
/// row reduces chunk `c + 1` and then gathers chunk `c - 1` (two streams side by side on
/// different links, `OpContext::drive`). Time: about one chunk's row phases plus the column phases
/// of every chunk, instead of every row phase plus every column phase. The chunks' phases keep
/// the unpipelined order of steps, chunk after chunk.
///
/// Compressed, the column's all-to-all runs beside the row's reduce-scatter and its all-gather
/// beside the row's all-gather, with the rounding, reduction and widening of `narrow.rs` in
/// between: the same bound, per chunk.
fn pipelined(
    ctx: &mut OpContext<'_>,
    scratch: &mut Scratch,
    layout: &Layout,
    (buf, src): (&mut [u8], Option<&[u8]>),
    (dtype, op): (DataType, ReduceOp),
    narrow_to: Option<DataType>,
    p: usize,
) -> Result<()> {
    let es = dtype.size();
    let count = buf.len() / es;
    let (x, y) = layout.position;
    let (nx, ny) = (layout.grid.x, layout.grid.y);
    let (row, column) = (Group::Ranks(&layout.row), Group::Ranks(&layout.column));
    let stride = 2 * (nx - 1) + 2 * (ny - 1);
    let chunk = |c: usize| schedule::bytes(schedule::piece(count, p, c), es);
    let counts = |c: usize| chunk(c).len() / es;
    // Chunk c's row reduce-scatter, column phase and row all-gather start at these steps.
    let row_rs = |c: usize| Phase::new(row, x, dtype, op).at_step(c * stride);
    let col_step = |c: usize| c * stride + nx - 1;
    let row_ag = |c: usize| Phase::new(row, x, dtype, op).at_step(c * stride + nx - 1 + 2 * (ny - 1));

    ctx.phase(Stage::ReduceScatter);
    let first = match src {
        Some(s) => RsBufs::Full { src: &s[chunk(0)], dst: &mut buf[chunk(0)] },
        None => RsBufs::InPlace(&mut buf[chunk(0)]),
    };
    ring::reduce_scatter_phase(ctx, row_rs(0), counts(0), first)?;
    ctx.phase(Stage::AllReduce);
    for c in 0..p {
        let (prev, cur, next) =
            around(buf, c.checked_sub(1).map(chunk), chunk(c), (c + 1 < p).then(|| chunk(c + 1)));
        // The row lane: the next chunk's reduce-scatter, then the previous chunk's all-gather.
        let rs_recv = |k: usize| ring::recv_piece(Kind::ReduceScatter, counts(c + 1), nx, es, x, k);
        let ag_recv = |k: usize| ring::recv_piece(Kind::AllGather, counts(c - 1), nx, es, x, k);
        let rs_plan =
            next.is_some().then(|| ring::plan(Kind::ReduceScatter, row_rs(c + 1), counts(c + 1), &rs_recv));
        let ag_plan =
            prev.is_some().then(|| ring::plan(Kind::AllGather, row_ag(c - 1), counts(c - 1), &ag_recv));
        let next_src = src.filter(|_| c + 1 < p).map(|s| &s[chunk(c + 1)]);
        let mut lane = Then {
            first: rs_plan.as_ref().zip(next).map(|(plan, b)| RingRun::new(plan, b, next_src)),
            second: ag_plan.as_ref().zip(prev).map(|(plan, b)| RingRun::new(plan, b, None)),
        };
        // The column: this chunk's own piece of the row's sums.
        let mine = schedule::bytes(schedule::piece(counts(c), nx, x), es);
        let data = &mut cur[mine];
        let col_count = data.len() / es;
        match narrow_to {
            None => {
                let recv = |k: usize| ring::recv_piece(Kind::AllReduce, col_count, ny, es, y, k);
                let phase = Phase::new(column, y, dtype, op).at_step(col_step(c));
                let plan = ring::plan(Kind::AllReduce, phase, col_count, &recv);
                ctx.drive(&mut [&mut RingRun::new(&plan, data, None), &mut lane])?;
            }
            Some(to) => {
                let mut col = Narrowed::round(scratch, ny, y, to, dtype, data);
                let member = |j: usize| column.rank(j);
                let a2a = AllToAllPlan {
                    n: ny,
                    me: y,
                    member: &member,
                    first_step: col_step(c),
                    block: 2 * col.c,
                    splits: None,
                };
                let (pieces, received) = col.exchange_bufs();
                ctx.drive(&mut [&mut AllToAllRun::new(&a2a, pieces, received)?, &mut lane.first])?;
                col.reduce(dtype, op);
                let gathered = ny * col.c;
                let recv = |k: usize| ring::recv_piece(Kind::AllGather, gathered, ny, 2, y, k);
                let phase = Phase::new(column, y, to, ReduceOp::Sum).at_step(col_step(c) + ny - 1);
                let plan = ring::plan(Kind::AllGather, phase, gathered, &recv);
                ctx.drive(&mut [&mut RingRun::new(&plan, col.gather_buf(), None), &mut lane.second])?;
                col.widen(dtype, data);
            }
        }
    }
    ring::all_gather_phase(ctx, row_ag(p - 1), counts(p - 1), &mut buf[chunk(p - 1)])
}

/// The chunks before, at and after the current one, as disjoint slices of `buf` (`prev` and
/// `next` optional; the ranges in increasing order, not overlapping).
fn around(
    buf: &mut [u8],
    prev: Option<Range<usize>>,
    cur: Range<usize>,
    next: Option<Range<usize>>,
) -> (Option<&mut [u8]>, &mut [u8], Option<&mut [u8]>) {
    let end = cur.end;
    let (before, rest) = buf.split_at_mut(cur.start);
    let (cur, after) = rest.split_at_mut(end - cur.start);
    (prev.map(|r| &mut before[r]), cur, next.map(|r| &mut after[r.start - end..r.end - end]))
}
