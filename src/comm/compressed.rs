//! Compressed all-reduce: a float all-reduce whose bytes travel in a 16-bit type (bf16 or f16,
//! `TOROID_WIRE_DTYPE` or [`CallOptions::wire`](crate::CallOptions)), every reduction
//! accumulated in the data's own type, and the same result on every rank. Horovod's and torch
//! DDP's fp16/bf16 compression hooks narrow the data and reduce in the narrow type; here only
//! the transfer is narrow:
//!
//! 1. each rank rounds its input to the wire type, in `n` pieces of `c = ceil(count / n)`
//!    elements (the last padded);
//! 2. an all-to-all sends piece `j` to rank `j` (the reduce-scatter's traffic, half the bytes);
//! 3. rank `r` reduces the `n` pieces `r` it received, in rank order, in the data's own type
//!    (f32 or f64), and rounds the result to the wire type once;
//! 4. an all-gather of the rounded pieces (the all-gather's traffic, half the bytes), widened
//!    into the output. Every rank holds the same bits: the owner of a piece uses its rounded
//!    value too.
//!
//! Error, per element, with `u` the wire type's unit roundoff (2^-8 for bf16, which keeps 8
//! significant bits; 2^-11 for f16, 11 bits) and `S = sum |x_r|` over the ranks' inputs: each
//! input is rounded once (at most `u |x_r|`), the sum of the n rounded values adds at most
//! (n-1) 2^-24 S in f32 (2^-53 in f64), and the result is rounded once (`u` of it), so
//! `|result - exact| <= 2u S + u^2 S` plus that small term for a sum, that divided by `n` for
//! an average; a minimum or maximum is the rounded extreme (`u |result|`). Whatever the number
//! of ranks, each value is rounded twice: the bound grows with n only through the tiny f32
//! term. f16 holds magnitudes up to 65504 only: a larger input or sum becomes infinite (bf16
//! has f32's range).
//! `tests/compressed.rs` checks the bound on every element of random data.
//!
//! In the statistics, recorder and timeline the operation shows as its all-to-all and
//! all-gather, in the wire type.
//!
//! With several ranks on each of several hosts it runs instead as the 2D torus
//! (`algorithm/torus2d.rs`): exact reduce-scatter and all-gather within each host, and the
//! steps above (`algorithm/narrow.rs`) only in the column phase, between hosts, where the bytes
//! cost. The row sums are rounded once and the column's result once: the same bound, `S` over
//! all ranks' inputs. It shows as one all-reduce, algorithm torus2d.

use super::{Core, RawOp, lock};
use crate::algorithm::narrow::{narrow_into, reduce_pieces, widen_into};
use crate::collective::{Algorithm, CallOptions, OpKind};
use crate::dtype::DataType;
use crate::error::Result;
use crate::memory::{RawBuf, RawBufMut, RawBufs};

/// Whether an all-reduce of `dtype` on `size` ranks travels compressed as `wire`: a float type
/// (f32, f64) narrowed to a 16-bit float, on more than one rank.
pub(super) fn compressible(dtype: DataType, wire: DataType, size: usize) -> bool {
    matches!(dtype, DataType::F32 | DataType::F64)
        && matches!(wire, DataType::BF16 | DataType::F16)
        && size > 1
}

impl Core {
    /// The wire type `op` travels in, when it is compressed: a float all-reduce (f32, f64) on
    /// more than one rank, with a 16-bit float wire type asked for by the call or the
    /// communicator.
    pub(super) fn wire_of(&self, op: &RawOp) -> Option<DataType> {
        let wire = op.opts.wire.or(self.config.wire)?;
        (matches!(op.kind, OpKind::AllReduce(_)) && compressible(op.dtype, wire, self.ident.size))
            .then_some(wire)
    }

    /// Runs the all-reduce `op` as an all-to-all and an all-gather in `wire` (see the module
    /// docs). The recorder's running operation is the all-gather when this returns.
    pub(super) fn execute_compressed(&self, op: &RawOp, wire: DataType, issued_ns: u64) -> Result<()> {
        let OpKind::AllReduce(rop) = op.kind else {
            return self.execute(op, issued_ns);
        };
        let grid = &self.ident.layout.grid;
        if self.ident.layout.roots.len() > 1 && grid.x > 1 && grid.y > 1 {
            // Several ranks on each of several hosts: the 2D torus, exact within each host and
            // compressed between hosts only (`algorithm/torus2d.rs`).
            let opts = CallOptions { algorithm: Some(Algorithm::Torus2d), ..op.opts };
            return self.execute(&RawOp { opts, ..op.clone() }, issued_ns);
        }
        let (n, me) = (self.ident.size, self.ident.rank);
        let es = op.dtype.size();
        let count = op.bufs.output_len() / es;
        let c = count.div_ceil(n).max(1);
        let mut scratch = lock(&self.buffers.wire);
        if scratch.len() < 2 * n * c {
            scratch.resize(2 * n * c, 0);
        }
        let (pieces, received) = scratch[..2 * n * c].split_at_mut(n * c);
        let (input, output) = match op.bufs {
            RawBufs::InPlace(b) => (b.as_read(), b),
            RawBufs::OutOfPlace(s, r) => (s, r),
            RawBufs::None | RawBufs::Read(_) => return self.execute(op, issued_ns),
        };
        // SAFETY: the caller's promise for the operation's buffers (valid until it completes);
        // the input is only read here, before the output is written.
        let input = unsafe { input.as_slice() };
        narrow_into(wire, op.dtype, input, &mut pieces[..count]);
        pieces[count..].fill(0);
        let opts = CallOptions { wire: Some(wire), ..op.opts };
        let scatter = RawOp {
            kind: OpKind::AllToAll,
            dtype: wire,
            bufs: RawBufs::OutOfPlace(
                RawBuf::new(bytemuck::cast_slice(pieces)),
                RawBufMut::new(bytemuck::cast_slice_mut(received)),
            ),
            opts,
            source: None,
            splits: None,
            batch: None,
        };
        self.execute(&scatter, issued_ns)?;
        self.watch.recorder.end(true);
        // Piece `me` of every rank, reduced in rank order (the same order on every rank) in the
        // data's own type, rounded once.
        let mine = count.saturating_sub(me * c).min(c);
        reduce_pieces(wire, op.dtype, rop, &received[..n * c], n, c, &mut pieces[me * c..me * c + mine]);
        pieces[me * c + mine..(me + 1) * c].fill(0);
        let gather = RawOp {
            kind: OpKind::AllGather,
            dtype: wire,
            bufs: RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(pieces))),
            opts,
            source: None,
            splits: None,
            batch: None,
        };
        self.execute(&gather, issued_ns)?;
        // SAFETY: as for the input; nothing else touches the output meanwhile.
        let output = unsafe { output.as_mut_slice() };
        widen_into(wire, op.dtype, &pieces[..count], output);
        Ok(())
    }
}
