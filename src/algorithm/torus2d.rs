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

use super::ring::{self, Phase, RsBufs};
use super::schedule;
use super::{Bufs, Group, Scratch, Wire, narrow, work_and_input};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::topology::Layout;

/// 2D-torus all-reduce over the communicator's grid.
pub fn all_reduce(
    wire: &mut Wire<'_>,
    scratch: &mut Scratch,
    layout: &Layout,
    bufs: Bufs<'_>,
    dtype: DataType,
    op: ReduceOp,
    narrow_to: Option<DataType>,
) -> Result<()> {
    let n = wire.size();
    let es = dtype.size();
    let (buf, src, op) = work_and_input(bufs, dtype, op, n);
    let count = buf.len() / es;
    let (x, y) = layout.position;
    let (nx, ny) = (layout.grid.x, layout.grid.y);
    let row = Group::Ranks(&layout.row);
    let rs = match src {
        Some(src) => RsBufs::Full { src, dst: &mut *buf },
        None => RsBufs::InPlace(&mut *buf),
    };
    ring::reduce_scatter_phase(wire, Phase::new(row, x, dtype, op), count, rs)?;
    let mine = schedule::bytes(schedule::piece(count, nx, x), es);
    match narrow_to {
        Some(to) => {
            narrow::all_reduce_phase(wire, scratch, &layout.column, y, nx, dtype, op, to, &mut buf[mine])?;
        }
        None => {
            let column = Phase::new(Group::Ranks(&layout.column), y, dtype, op).at_step(nx);
            ring::all_reduce_phase(wire, column, &mut buf[mine], None)?;
        }
    }
    ring::all_gather_phase(wire, Phase::new(row, x, dtype, op).at_step(nx + 2 * ny), count, buf)
}
