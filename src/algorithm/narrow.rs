//! Narrow transfers: float data (f32, f64) rounded to a 16-bit wire type (bf16, f16) to travel,
//! reduced in its own type where it lands. The conversions, and the compressed all-reduce of a
//! group of ranks that the compressed all-reduce (`comm/compressed.rs`, the whole communicator) and
//! the 2D torus's column phase (`torus2d.rs`, between hosts) are made of:
//!
//! 1. round the data to the wire type, in `n` pieces of `c = ceil(count / n)` elements;
//! 2. all-to-all within the group: piece `j` to member `j` (pairwise exchange, several steps in
//!    flight);
//! 3. member `j` reduces the `n` pieces `j` it received, in member order, in the data's own
//!    type, and rounds the result once;
//! 4. ring all-gather of the rounded pieces within the group, widened into the output; the
//!    owner of a piece keeps its rounded value too, so every member holds the same bits.
//!
//! Each value is rounded twice whatever `n`: per element `|result - exact| <= (2u + u^2) S`
//! plus the data type's own rounding of the sum, `S` the sum of the magnitudes of the group's
//! inputs and `u` the wire type's unit roundoff (2^-8 bf16, 2^-11 f16).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::ring::{self, Phase};
use super::{OpContext, Scratch};
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::trace::Phase as Stage;

/// Compressed all-reduce of `data` (elements of `phase.dtype`, in place) within `phase.group`,
/// this rank being member `phase.me`, travelling as `wire`. Uses steps
/// `phase.step0 .. phase.step0 + 2 (n - 1)`.
pub fn all_reduce_phase(
    w: &mut OpContext<'_>,
    scratch: &mut Scratch,
    phase: Phase<'_>,
    wire: DataType,
    data: &mut [u8],
) -> Result<()> {
    let Phase { group, me, dtype, op, step0 } = phase;
    let n = group.len();
    let count = data.len() / dtype.size();
    if n == 1 || count == 0 {
        return Ok(());
    }
    let mut col = Narrowed::round(scratch, n, me, wire, dtype, data);
    w.phase(Stage::Exchange);
    let block = 2 * col.c;
    let (pieces, received) = col.exchange_bufs();
    w.all_to_all(group, me, step0, block, pieces, received)?;
    col.reduce(dtype, op);
    let phase = Phase::new(group, me, wire, ReduceOp::Sum).at_step(step0 + n - 1);
    ring::all_gather_phase(w, phase, n * col.c, col.gather_buf())?;
    col.widen(dtype, data);
    Ok(())
}

/// One compressed all-reduce's wire values between its steps (in the communicator's scratch):
/// `n` pieces of `c` rounded values to send, then to gather, and the `n` pieces received.
#[derive(Debug)]
pub struct Narrowed<'s> {
    /// Members of the group.
    pub n: usize,
    /// This rank's position.
    pub me: usize,
    /// Values per piece, `ceil(count / n)`.
    pub c: usize,
    /// Elements of the data.
    pub count: usize,
    /// The wire type.
    pub wire: DataType,
    pieces: &'s mut [u16],
    received: &'s mut [u16],
}

impl<'s> Narrowed<'s> {
    /// Step 1: `data` (elements of `dtype`) rounded into `n` pieces, this member's own piece
    /// already in place among the received ones.
    pub fn round(
        scratch: &'s mut Scratch,
        n: usize,
        me: usize,
        wire: DataType,
        dtype: DataType,
        data: &[u8],
    ) -> Self {
        let count = data.len() / dtype.size();
        let c = count.div_ceil(n);
        let (a, b) = scratch.two(2 * n * c, 2 * n * c);
        let pieces: &mut [u16] = bytemuck::cast_slice_mut(&mut a[..2 * n * c]);
        let received: &mut [u16] = bytemuck::cast_slice_mut(&mut b[..2 * n * c]);
        narrow_into(wire, dtype, data, &mut pieces[..count]);
        pieces[count..].fill(0);
        received[me * c..(me + 1) * c].copy_from_slice(&pieces[me * c..(me + 1) * c]);
        Narrowed { n, me, c, count, wire, pieces, received }
    }

    /// Step 2's buffers: the pieces to send and where the others' arrive (blocks of `2 c` bytes).
    pub fn exchange_bufs(&mut self) -> (&[u8], &mut [u8]) {
        let nc = self.n * self.c;
        (bytemuck::cast_slice(&self.pieces[..nc]), bytemuck::cast_slice_mut(&mut self.received[..nc]))
    }

    /// Step 3: this member's piece, reduced wide in member order and rounded once.
    pub fn reduce(&mut self, dtype: DataType, op: ReduceOp) {
        let (me, c) = (self.me, self.c);
        let mine = self.count.saturating_sub(me * c).min(c);
        let out = &mut self.pieces[me * c..me * c + mine];
        reduce_pieces(self.wire, dtype, op, &self.received[..self.n * c], self.n, c, out);
        self.pieces[me * c + mine..(me + 1) * c].fill(0);
    }

    /// Step 4's buffer: the ring all-gather of the rounded pieces (`n c` wire values, equal
    /// pieces of `c`), this member's already in place.
    pub fn gather_buf(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.pieces[..self.n * self.c])
    }

    /// The gathered values widened into `data`.
    pub fn widen(&self, dtype: DataType, data: &mut [u8]) {
        widen_into(self.wire, dtype, &self.pieces[..self.count], data);
    }
}

/// Reduces the `n` pieces of `c` wire values in `received` (piece `j` at `j c`) element by
/// element, in piece order, in `dtype` (f32 or f64), and rounds the first `out.len()` results
/// into `out`.
pub fn reduce_pieces(
    wire: DataType,
    dtype: DataType,
    op: ReduceOp,
    received: &[u16],
    n: usize,
    c: usize,
    out: &mut [u16],
) {
    let scale = |acc: f64| if op == ReduceOp::Avg { acc / n as f64 } else { acc };
    if dtype == DataType::F32 {
        // Vectorised conversions in blocks, accumulated in f32.
        const BLOCK: usize = 1024;
        let (mut acc, mut next) = ([0f32; BLOCK], [0f32; BLOCK]);
        for start in (0..out.len()).step_by(BLOCK) {
            let len = BLOCK.min(out.len() - start);
            widen_f32(wire, &received[start..start + len], &mut acc[..len]);
            for j in 1..n {
                widen_f32(wire, &received[j * c + start..j * c + start + len], &mut next[..len]);
                combine(op, &mut acc[..len], &next[..len]);
            }
            if op == ReduceOp::Avg {
                let k = 1.0 / n as f32;
                acc[..len].iter_mut().for_each(|a| *a *= k);
            }
            narrow_f32(wire, &acc[..len], &mut out[start..start + len]);
        }
        return;
    }
    for (k, o) in out.iter_mut().enumerate() {
        let mut acc = widen(wire, received[k]);
        for j in 1..n {
            let v = widen(wire, received[j * c + k]);
            acc = match op {
                ReduceOp::Sum | ReduceOp::Avg => acc + v,
                ReduceOp::Prod => acc * v,
                ReduceOp::Min => acc.min(v),
                ReduceOp::Max => acc.max(v),
            };
        }
        *o = narrow(wire, scale(acc));
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
pub fn narrow_into(wire: DataType, dtype: DataType, input: &[u8], out: &mut [u16]) {
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
pub fn widen_into(wire: DataType, dtype: DataType, src: &[u16], output: &mut [u8]) {
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

    #[test]
    fn pieces_are_reduced_wide_in_order_and_rounded_once() {
        // 3 pieces of 2500 values (more than one block), f32 and f64, every op: the f32 path and
        // the element path agree with a reduction done here in f64 and rounded once.
        let (n, c) = (3, 2500);
        let values: Vec<f64> = (0..n * c).map(|i| ((i * 7919) % 1013) as f64 / 37.0 - 13.0).collect();
        for wire in [DataType::BF16, DataType::F16] {
            let received: Vec<u16> = values.iter().map(|&v| narrow(wire, v)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                for dtype in [DataType::F32, DataType::F64] {
                    let mut out = vec![0u16; c - 3];
                    reduce_pieces(wire, dtype, op, &received, n, c, &mut out);
                    for (k, got) in out.iter().enumerate() {
                        let xs: Vec<f64> = (0..n).map(|j| widen(wire, received[j * c + k])).collect();
                        let want = match op {
                            ReduceOp::Sum => xs.iter().sum::<f64>(),
                            ReduceOp::Avg => xs.iter().sum::<f64>() / n as f64,
                            ReduceOp::Prod => xs.iter().product(),
                            ReduceOp::Min => xs.iter().copied().fold(f64::INFINITY, f64::min),
                            ReduceOp::Max => xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                        };
                        // f32 accumulation may differ from f64's in the last f32 bit, which can
                        // move a tie: within one wire unit of the rounded exact value.
                        let u = if wire == DataType::BF16 { 2f64.powi(-8) } else { 2f64.powi(-11) };
                        let g = widen(wire, *got);
                        assert!(
                            (g - want).abs() <= u * want.abs() * 1.0001 + 1e-30,
                            "{wire} {op:?} {dtype} {k}"
                        );
                    }
                }
            }
        }
    }
}
