//! CPU reduction kernels.
//!
//! Every collective that combines data ends in one of three kernels, each dispatched on
//! (data type, op) once per call and then running a tight vectorised loop:
//!
//! - [`reduce_inplace`]: `dst[i] = dst[i] ⊕ src[i]`
//! - [`reduce_into`]:    `dst[i] = a[i] ⊕ b[i]` (out-of-place collectives never copy first)
//! - [`scale_into`]:     `dst[i] = src[i] · factor` (how `avg` pre-scales its inputs, as NCCL does)
//!
//! `f16`/`bf16` are converted to `f32`, combined and rounded back (round to nearest even) per
//! element, so a sum never overflows in an intermediate narrower than the wire type, and the
//! result is exactly `T::from_f32(op(a.to_f32(), b.to_f32()))`. Integers wrap around on overflow
//! (C semantics). Buffers are byte slices; they need not be aligned for the element type.
//! `ReduceOp::Avg` is not a kernel: callers pre-scale with [`scale_into`] and then sum.
//!
//! Float `min`/`max` are compares, `if b < a { b } else { a }` (and `>` for max), which lower to
//! `minps`/`maxps`: a NaN in the second operand (`b`, or `src` in place) is dropped, a NaN in the
//! first (`a`, or `dst` in place) is kept, as with Gloo's `std::min`/`std::max`. `-0.0` and
//! `+0.0` compare equal, so the first operand wins. Sums and products propagate NaN, with an
//! unspecified payload.
//!
//! ## Speed
//!
//! The crate is built for baseline x86-64 (SSE2), so each loop exists in three copies of the
//! same generic source: portable, AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL, DQ), the last two
//! compiled with `#[target_feature]`. The CPU is probed once ([`Level`], cached in an atomic) and
//! every call jumps to the best copy. Slices are viewed as `[U<T>]`, a packed (alignment 1)
//! wrapper, so misaligned buffers run the same loop with unaligned loads instead of a copy.
//! `bf16` widening is a shift or a mask and narrowing an integer round-to-nearest-even, two
//! elements per `u32` word, all plain Rust that LLVM vectorises; `f16` goes through F16C
//! (`vcvtph2ps`/`vcvtps2ph`) 16 lanes at a time.
//! Other architectures get the portable copy, which LLVM still vectorises for the baseline
//! (`f16` there goes through `half`'s slice conversions, 16 at a time).
//!
//! ## Layout
//!
//! - `ops`: the binary operations (`Sum`, `Prod`, `Min`, `Max`) and the (type, op) dispatch.
//! - `elem`: unaligned element views and the generic loops every kernel is made of.
//! - `halves`: `bf16` and `f16`, widened to `f32`, combined and rounded back.
//! - `isa` and `kernels`: the per-level tokens, the `#[target_feature]` copies of the loops and
//!   the run-time choice between them.
//! - `scale` ([`scale_into`], [`scale_inplace`]) and `copy` ([`copy`]).

mod copy;
mod elem;
mod halves;
mod isa;
mod kernels;
mod ops;
mod scale;
#[cfg(test)]
pub(crate) mod testutil;

pub use copy::{copy, copy_nonoverlapping};
pub use scale::{scale_inplace, scale_into};

use crate::dtype::{DataType, ReduceOp};
use elem::{view, view_mut};
use kernels::{Level, level};
use ops::dispatch;

/// `dst[i] = dst[i] ⊕ src[i]` for every element.
///
/// # Panics
/// When the lengths differ, are not a whole number of elements, or `op` is `Avg` (a caller bug:
/// `avg` is pre-scale plus sum).
pub fn reduce_inplace(dtype: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    reduce_inplace_at(level(), dtype, op, dst, src);
}

/// `dst[i] = a[i] ⊕ b[i]` for every element.
///
/// # Panics
/// As [`reduce_inplace`].
pub fn reduce_into(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    reduce_into_at(level(), dtype, op, dst, a, b);
}

fn reduce_inplace_at(level: Level, dtype: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce_inplace: length mismatch");
    assert!(dst.len().is_multiple_of(dtype.size()), "reduce_inplace: partial element");
    dispatch!(dtype, op, T, F => {
        let (d, s) = (view_mut::<T>(dst), view::<T>(src));
        // SAFETY: `level` came from `level()` or `Level::supported()`, which checked the CPU.
        unsafe { level.zip_inplace::<T, F>(d, s) }
    });
}

fn reduce_into_at(level: Level, dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    assert!(dst.len() == a.len() && a.len() == b.len(), "reduce_into: length mismatch");
    assert!(dst.len().is_multiple_of(dtype.size()), "reduce_into: partial element");
    dispatch!(dtype, op, T, F => {
        let (d, a, b) = (view_mut::<T>(dst), view::<T>(a), view::<T>(b));
        // SAFETY: `level` came from `level()` or `Level::supported()`, which checked the CPU.
        unsafe { level.zip::<T, F>(d, a, b) }
    });
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::testutil::{Buf, LENS, Rng, is_nan, random_elems};
    use super::*;

    fn f64_op(op: ReduceOp, x: f64, y: f64) -> f64 {
        match op {
            ReduceOp::Sum => x + y,
            ReduceOp::Prod => x * y,
            ReduceOp::Min => {
                if y < x {
                    y
                } else {
                    x
                }
            }
            ReduceOp::Max => {
                if y > x {
                    y
                } else {
                    x
                }
            }
            ReduceOp::Avg => unreachable!(),
        }
    }

    /// The scalar reference for one element: integers wrap, floats are computed in f64 and
    /// rounded once to the type. For f32 and the halves that equals computing in f32 (the
    /// exact result of one + or * on p-bit inputs rounds the same directly or via a format of
    /// at least 2p+2 bits); `check_elem` also compares halves with the f32 formula itself.
    fn reference(dtype: DataType, op: ReduceOp, x: &[u8], y: &[u8]) -> Vec<u8> {
        macro_rules! int {
            ($t:ty) => {{
                let (x, y) =
                    (<$t>::from_ne_bytes(x.try_into().unwrap()), <$t>::from_ne_bytes(y.try_into().unwrap()));
                let r = match op {
                    ReduceOp::Sum => x.wrapping_add(y),
                    ReduceOp::Prod => x.wrapping_mul(y),
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                    ReduceOp::Avg => unreachable!(),
                };
                r.to_ne_bytes().to_vec()
            }};
        }
        let h = |b: &[u8]| u16::from_ne_bytes(b.try_into().unwrap());
        match dtype {
            DataType::I8 => int!(i8),
            DataType::U8 => int!(u8),
            DataType::I32 => int!(i32),
            DataType::U32 => int!(u32),
            DataType::I64 => int!(i64),
            DataType::U64 => int!(u64),
            // min/max select an operand: its bits pass through unchanged (even a signalling
            // NaN, which a trip through f64 would quieten).
            DataType::F32 | DataType::F64 if matches!(op, ReduceOp::Min | ReduceOp::Max) => {
                let v = |b: &[u8]| match b.len() {
                    4 => f32::from_ne_bytes(b.try_into().unwrap()) as f64,
                    _ => f64::from_ne_bytes(b.try_into().unwrap()),
                };
                let pick_y = match op {
                    ReduceOp::Min => v(y) < v(x),
                    _ => v(y) > v(x),
                };
                if pick_y { y.to_vec() } else { x.to_vec() }
            }
            DataType::F32 => {
                let (x, y) =
                    (f32::from_ne_bytes(x.try_into().unwrap()), f32::from_ne_bytes(y.try_into().unwrap()));
                (f64_op(op, x as f64, y as f64) as f32).to_ne_bytes().to_vec()
            }
            DataType::F64 => {
                let (x, y) =
                    (f64::from_ne_bytes(x.try_into().unwrap()), f64::from_ne_bytes(y.try_into().unwrap()));
                f64_op(op, x, y).to_ne_bytes().to_vec()
            }
            DataType::F16 => {
                let (x, y) = (f16::from_bits(h(x)).to_f64(), f16::from_bits(h(y)).to_f64());
                f16::from_f64(f64_op(op, x, y)).to_bits().to_ne_bytes().to_vec()
            }
            DataType::BF16 => {
                let (x, y) = (bf16::from_bits(h(x)).to_f64(), bf16::from_bits(h(y)).to_f64());
                bf16::from_f64(f64_op(op, x, y)).to_bits().to_ne_bytes().to_vec()
            }
        }
    }

    /// The half-type contract, `T::from_f32(op(a.to_f32(), b.to_f32()))`, as bits.
    fn half_formula(dtype: DataType, op: ReduceOp, x: &[u8], y: &[u8]) -> [u8; 2] {
        let (x, y) = (u16::from_ne_bytes(x.try_into().unwrap()), u16::from_ne_bytes(y.try_into().unwrap()));
        let f = |a: f32, b: f32| f64_op(op, a as f64, b as f64) as f32;
        match dtype {
            DataType::F16 => {
                f16::from_f32(f(f16::from_bits(x).to_f32(), f16::from_bits(y).to_f32())).to_ne_bytes()
            }
            _ => bf16::from_f32(f(bf16::from_bits(x).to_f32(), bf16::from_bits(y).to_f32())).to_ne_bytes(),
        }
    }

    /// Bit-exact, except that a NaN from a sum or product may have any payload (IEEE 754 does
    /// not say which operand's NaN an arithmetic op returns; min/max select, so are exact).
    fn check_elem(what: &str, dtype: DataType, op: ReduceOp, i: usize, x: &[u8], y: &[u8], got: &[u8]) {
        let want = reference(dtype, op, x, y);
        let arith = matches!(op, ReduceOp::Sum | ReduceOp::Prod);
        let ok = |want: &[u8]| got == want || (arith && is_nan(dtype, want) && is_nan(dtype, got));
        assert!(ok(&want), "{what} {dtype} {op} [{i}]: {x:02x?} ⊕ {y:02x?} = {got:02x?}, want {want:02x?}");
        if matches!(dtype, DataType::F16 | DataType::BF16) {
            let want = half_formula(dtype, op, x, y);
            assert!(
                ok(&want),
                "{what} {dtype} {op} [{i}]: {x:02x?} ⊕ {y:02x?} = {got:02x?}, from_f32 gives {want:02x?}"
            );
        }
    }

    const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

    #[test]
    fn reductions_match_scalar_reference() {
        let mut rng = Rng(0x5eed);
        for level in Level::supported() {
            for dtype in DataType::ALL {
                for op in OPS {
                    for n in LENS {
                        for offset in [0, 1] {
                            let size = dtype.size();
                            let a = random_elems(&mut rng, dtype, n);
                            let b = random_elems(&mut rng, dtype, n);
                            let what = format!("{level:?} offset {offset} n {n}");

                            let (ba, bb) = (Buf::new(&a, offset), Buf::new(&b, offset));
                            let mut out = Buf::new(&vec![0xa5; a.len()], offset);
                            reduce_into_at(level, dtype, op, out.bytes_mut(), ba.bytes(), bb.bytes());
                            for (i, ((x, y), got)) in
                                a.chunks(size).zip(b.chunks(size)).zip(out.bytes().chunks(size)).enumerate()
                            {
                                check_elem(&format!("into {what}"), dtype, op, i, x, y, got);
                            }

                            let mut acc = Buf::new(&a, offset);
                            // The source at another offset: the two need not be aligned alike.
                            let src = Buf::new(&b, 1 - offset);
                            reduce_inplace_at(level, dtype, op, acc.bytes_mut(), src.bytes());
                            assert_eq!(
                                acc.bytes(),
                                out.bytes(),
                                "inplace {what} {dtype} {op} differs from into"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The public functions run at the best detected level, and the sweeps above reach it.
    #[test]
    fn integer_and_float_edge_cases() {
        let mut d = [0u8; 4];
        reduce_into(DataType::I32, ReduceOp::Sum, &mut d, &i32::MAX.to_ne_bytes(), &1i32.to_ne_bytes());
        assert_eq!(i32::from_ne_bytes(d), i32::MIN, "integers wrap");
        reduce_into(DataType::U32, ReduceOp::Prod, &mut d, &u32::MAX.to_ne_bytes(), &2u32.to_ne_bytes());
        assert_eq!(u32::from_ne_bytes(d), u32::MAX - 1);
        // min: a NaN in the second operand is dropped, in the first kept.
        let (nan, one) = (f32::NAN.to_ne_bytes(), 1f32.to_ne_bytes());
        reduce_into(DataType::F32, ReduceOp::Min, &mut d, &one, &nan);
        assert_eq!(f32::from_ne_bytes(d), 1.0);
        reduce_into(DataType::F32, ReduceOp::Max, &mut d, &nan, &one);
        assert!(f32::from_ne_bytes(d).is_nan());
        // bf16 sum rounds to nearest even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
        let (a, b) = (bf16::from_f32(1.0).to_ne_bytes(), bf16::from_f32(2f32.powi(-8)).to_ne_bytes());
        let mut h = [0u8; 2];
        reduce_into(DataType::BF16, ReduceOp::Sum, &mut h, &a, &b);
        assert_eq!(bf16::from_ne_bytes(h), bf16::from_f32(1.0));
    }

    #[test]
    #[should_panic(expected = "avg is pre-scale plus sum")]
    fn avg_into_panics() {
        reduce_into(DataType::F32, ReduceOp::Avg, &mut [0; 4], &[0; 4], &[0; 4]);
    }

    #[test]
    #[should_panic(expected = "avg is pre-scale plus sum")]
    fn avg_inplace_panics() {
        reduce_inplace(DataType::BF16, ReduceOp::Avg, &mut [0; 4], &[0; 4]);
    }

    #[test]
    #[should_panic(expected = "reduce_into: length mismatch")]
    fn into_length_mismatch_panics() {
        reduce_into(DataType::F32, ReduceOp::Sum, &mut [0; 8], &[0; 8], &[0; 4]);
    }

    #[test]
    #[should_panic(expected = "reduce_inplace: length mismatch")]
    fn inplace_length_mismatch_panics() {
        reduce_inplace(DataType::I8, ReduceOp::Sum, &mut [0; 3], &[0; 4]);
    }

    #[test]
    #[should_panic(expected = "partial element")]
    fn partial_element_panics() {
        reduce_inplace(DataType::F64, ReduceOp::Max, &mut [0; 12], &[0; 12]);
    }
}
