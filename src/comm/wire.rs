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
//! `tests/wire.rs` checks the bound on every element of random data.
//!
//! In the statistics, recorder and timeline the operation shows as its all-to-all and
//! all-gather, in the wire type.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::{Core, RawOp, lock};
use crate::collective::{CallOptions, OpKind};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::memory::{RawBuf, RawBufMut, RawBufs};

impl Core {
    /// The wire type `op` travels in, when it is compressed: a float all-reduce (f32, f64) on
    /// more than one rank, with a 16-bit float wire type asked for by the call or the
    /// communicator.
    pub(super) fn wire_of(&self, op: &RawOp) -> Option<DataType> {
        let wire = op.opts.wire.or(self.config.wire)?;
        let compressible = matches!(op.kind, OpKind::AllReduce(_))
            && matches!(op.dtype, DataType::F32 | DataType::F64)
            && matches!(wire, DataType::BF16 | DataType::F16)
            && self.size > 1;
        compressible.then_some(wire)
    }

    /// Runs the all-reduce `op` as an all-to-all and an all-gather in `wire` (see the module
    /// docs). The recorder's running operation is the all-gather when this returns.
    pub(super) fn execute_compressed(&self, op: &RawOp, wire: DataType, issued_ns: u64) -> Result<()> {
        let OpKind::AllReduce(rop) = op.kind else {
            return self.execute(op, issued_ns);
        };
        let (n, me) = (self.size, self.rank);
        let es = op.dtype.size();
        let count = op.bufs.output_len() / es;
        let c = count.div_ceil(n).max(1);
        let mut scratch = lock(&self.wire_scratch);
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
        };
        self.execute(&scatter, issued_ns)?;
        self.recorder.end(true);
        // Piece `me` of every rank, reduced in rank order (the same order on every rank), in
        // f32 for f32 data (vectorised conversions) and in f64 for f64 data.
        let mine = count.saturating_sub(me * c).min(c);
        if op.dtype == DataType::F32 {
            let mut wide = lock(&self.wire_wide);
            if wide.len() < 2 * c {
                wide.resize(2 * c, 0.0);
            }
            let (acc, next) = wide[..2 * c].split_at_mut(c);
            widen_f32(wire, &received[..c], acc);
            for j in 1..n {
                widen_f32(wire, &received[j * c..(j + 1) * c], next);
                combine(rop, acc, next);
            }
            if rop == ReduceOp::Avg {
                let k = 1.0 / n as f32;
                acc.iter_mut().for_each(|a| *a *= k);
            }
            narrow_f32(wire, &acc[..mine], &mut pieces[me * c..me * c + mine]);
        } else {
            for k in 0..mine {
                let mut acc = widen(wire, received[k]);
                for j in 1..n {
                    let v = widen(wire, received[j * c + k]);
                    acc = match rop {
                        ReduceOp::Sum | ReduceOp::Avg => acc + v,
                        ReduceOp::Prod => acc * v,
                        ReduceOp::Min => acc.min(v),
                        ReduceOp::Max => acc.max(v),
                    };
                }
                if rop == ReduceOp::Avg {
                    acc /= n as f64;
                }
                pieces[me * c + k] = narrow(wire, acc);
            }
        }
        pieces[me * c + mine..(me + 1) * c].fill(0);
        let gather = RawOp {
            kind: OpKind::AllGather,
            dtype: wire,
            bufs: RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(pieces))),
            opts,
            source: None,
        };
        self.execute(&gather, issued_ns)?;
        // SAFETY: as for the input; nothing else touches the output meanwhile.
        let output = unsafe { output.as_mut_slice() };
        widen_into(wire, op.dtype, &pieces[..count], output);
        Ok(())
    }
}

/// `acc[i] = acc[i] op v[i]` (an average sums; the caller divides).
fn combine(op: ReduceOp, acc: &mut [f32], v: &[f32]) {
    let pairs = acc.iter_mut().zip(v);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(a, b)| *a += *b),
        ReduceOp::Prod => pairs.for_each(|(a, b)| *a *= *b),
        ReduceOp::Min => pairs.for_each(|(a, b)| *a = a.min(*b)),
        ReduceOp::Max => pairs.for_each(|(a, b)| *a = a.max(*b)),
    }
}

/// `src` (f32) rounded into `out` (wire bits), with half's slice conversions.
fn narrow_f32(wire: DataType, src: &[f32], out: &mut [u16]) {
    match wire {
        DataType::F16 => bytemuck::cast_slice_mut::<u16, f16>(out).convert_from_f32_slice(src),
        _ => bytemuck::cast_slice_mut::<u16, bf16>(out).convert_from_f32_slice(src),
    }
}

/// `src` (wire bits) widened into `out` (f32, exact).
fn widen_f32(wire: DataType, src: &[u16], out: &mut [f32]) {
    match wire {
        DataType::F16 => bytemuck::cast_slice::<u16, f16>(src).convert_to_f32_slice(out),
        _ => bytemuck::cast_slice::<u16, bf16>(src).convert_to_f32_slice(out),
    }
}

/// The elements of `input` (f32 or f64 bytes) rounded into `out`: by slices for aligned f32,
/// element by element otherwise.
fn narrow_into(wire: DataType, dtype: DataType, input: &[u8], out: &mut [u16]) {
    if dtype == DataType::F32
        && let Ok(src) = bytemuck::try_cast_slice::<u8, f32>(input)
    {
        return narrow_f32(wire, src, out);
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = narrow(wire, read(dtype, input, i));
    }
}

/// `src` widened into `output` (f32 or f64 bytes), as [`narrow_into`].
fn widen_into(wire: DataType, dtype: DataType, src: &[u16], output: &mut [u8]) {
    if dtype == DataType::F32
        && let Ok(dst) = bytemuck::try_cast_slice_mut::<u8, f32>(output)
    {
        return widen_f32(wire, src, dst);
    }
    for (i, p) in src.iter().enumerate() {
        write(dtype, output, i, widen(wire, *p));
    }
}

/// `v` rounded to the nearest value of `wire`, as its bits.
fn narrow(wire: DataType, v: f64) -> u16 {
    match wire {
        DataType::F16 => f16::from_f64(v).to_bits(),
        _ => bf16::from_f64(v).to_bits(),
    }
}

/// The value of `wire` bits `b`.
fn widen(wire: DataType, b: u16) -> f64 {
    match wire {
        DataType::F16 => f16::from_bits(b).to_f64(),
        _ => bf16::from_bits(b).to_f64(),
    }
}

/// Element `i` of a little-endian f32 or f64 buffer.
fn read(dtype: DataType, bytes: &[u8], i: usize) -> f64 {
    match dtype {
        DataType::F64 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            f64::from_le_bytes(b)
        }
        _ => {
            let mut b = [0u8; 4];
            b.copy_from_slice(&bytes[i * 4..i * 4 + 4]);
            f64::from(f32::from_le_bytes(b))
        }
    }
}

/// Stores `v` (a wire value: exact in f32 and f64) as element `i`.
fn write(dtype: DataType, bytes: &mut [u8], i: usize, v: f64) {
    match dtype {
        DataType::F64 => bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes()),
        _ => bytes[i * 4..i * 4 + 4].copy_from_slice(&(v as f32).to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_rounds_to_nearest_within_the_unit_roundoff() {
        for (wire, u) in [(DataType::BF16, 2f64.powi(-8)), (DataType::F16, 2f64.powi(-11))] {
            for v in [1.0, -3.3, 1234.5678, 1e-3, 0.0, 65000.0] {
                let w = widen(wire, narrow(wire, v));
                assert!((w - v).abs() <= u * v.abs(), "{wire:?} {v} -> {w}");
                assert_eq!(narrow(wire, w), narrow(wire, v), "a wire value is exact");
            }
        }
        assert!(widen(DataType::F16, narrow(DataType::F16, 1e6)).is_infinite(), "f16 overflows");
        assert_eq!(widen(DataType::BF16, narrow(DataType::BF16, 1e30)).log10().round(), 30.0);
    }

    #[test]
    fn elements_are_read_and_written_little_endian() {
        let mut b = [0u8; 16];
        write(DataType::F32, &mut b, 1, 2.5);
        assert_eq!(read(DataType::F32, &b, 1), 2.5);
        write(DataType::F64, &mut b, 1, -0.125);
        assert_eq!(read(DataType::F64, &b, 1), -0.125);
    }
}
