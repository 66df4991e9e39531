//! CPU reduction kernels.
//!
//! Every collective that combines data ends in one of three kernels, each dispatched on
//! (data type, op) once per call and then running a tight loop the compiler vectorises:
//!
//! - [`reduce_inplace`]: `dst[i] = dst[i] ⊕ src[i]`
//! - [`reduce_into`]:    `dst[i] = a[i] ⊕ b[i]` (out-of-place collectives never copy first)
//! - [`scale_into`]:     `dst[i] = src[i] · factor` (how `avg` pre-scales its inputs, as NCCL does)
//!
//! `f16`/`bf16` are converted to `f32`, combined and rounded back per element, so a sum never
//! overflows in an intermediate narrower than the wire type. Integers wrap around on overflow
//! (C semantics). Buffers are byte slices; they need not be aligned for the element type.
//! `ReduceOp::Avg` is not a kernel: callers pre-scale with [`scale_into`] and then sum.

use half::{bf16, f16};

use crate::dtype::{DataType, ReduceOp};

/// Elements combined per block when a buffer is misaligned or of a half type: small enough to
/// stay in L1, large enough to amortise the per-block overhead.
const BLOCK: usize = 1024;

/// `dst[i] = dst[i] ⊕ src[i]` for every element.
///
/// # Panics
/// When the lengths differ, are not a whole number of elements, or `op` is `Avg` (a caller bug:
/// `avg` is pre-scale plus sum).
pub fn reduce_inplace(dtype: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce_inplace: length mismatch");
    assert_eq!(
        dst.len() % dtype.size(),
        0,
        "reduce_inplace: partial element"
    );
    dispatch!(dtype, op, T, F => kernel_inplace::<T, F>(dst, src));
}

/// `dst[i] = a[i] ⊕ b[i]` for every element.
///
/// # Panics
/// As [`reduce_inplace`].
pub fn reduce_into(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    assert!(
        dst.len() == a.len() && a.len() == b.len(),
        "reduce_into: length mismatch"
    );
    assert_eq!(dst.len() % dtype.size(), 0, "reduce_into: partial element");
    dispatch!(dtype, op, T, F => kernel_into::<T, F>(dst, a, b));
}

/// `dst[i] = src[i] · factor` for floating types (used to pre-scale `avg` inputs).
///
/// # Panics
/// When the lengths differ or `dtype` is an integer type.
pub fn scale_into(dtype: DataType, dst: &mut [u8], src: &[u8], factor: f64) {
    assert_eq!(dst.len(), src.len(), "scale_into: length mismatch");
    match dtype {
        DataType::F32 => map_into::<f32>(dst, src, |x| x * factor as f32),
        DataType::F64 => map_into::<f64>(dst, src, |x| x * factor),
        DataType::F16 => map_into::<f16>(dst, src, |x| f16::from_f32(x.to_f32() * factor as f32)),
        DataType::BF16 => {
            map_into::<bf16>(dst, src, |x| bf16::from_f32(x.to_f32() * factor as f32))
        }
        _ => panic!("scale_into: {dtype} is not a floating type"),
    }
}

/// In-place form of [`scale_into`].
pub fn scale_inplace(dtype: DataType, buf: &mut [u8], factor: f64) {
    match dtype {
        DataType::F32 => map_inplace::<f32>(buf, |x| x * factor as f32),
        DataType::F64 => map_inplace::<f64>(buf, |x| x * factor),
        DataType::F16 => map_inplace::<f16>(buf, |x| f16::from_f32(x.to_f32() * factor as f32)),
        DataType::BF16 => map_inplace::<bf16>(buf, |x| bf16::from_f32(x.to_f32() * factor as f32)),
        _ => panic!("scale_inplace: {dtype} is not a floating type"),
    }
}

/// A binary reduction on one element type.
trait Combine<T> {
    fn combine(a: T, b: T) -> T;
}

struct Sum;
struct Prod;
struct Min;
struct Max;

macro_rules! int_ops {
    ($($t:ty),*) => {$(
        impl Combine<$t> for Sum { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a.wrapping_add(b) } }
        impl Combine<$t> for Prod { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a.wrapping_mul(b) } }
        impl Combine<$t> for Min { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if b < a { b } else { a } } }
        impl Combine<$t> for Max { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if b > a { b } else { a } } }
    )*};
}
int_ops!(i8, u8, i32, u32, i64, u64);

macro_rules! float_ops {
    ($($t:ty),*) => {$(
        impl Combine<$t> for Sum { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a + b } }
        impl Combine<$t> for Prod { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a * b } }
        // Written as compares (not f32::min) so they lower to minps/maxps; a NaN in `b` is
        // dropped, a NaN in `a` kept, as in Gloo's std::min/std::max.
        impl Combine<$t> for Min { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if b < a { b } else { a } } }
        impl Combine<$t> for Max { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if b > a { b } else { a } } }
    )*};
}
float_ops!(f32, f64);

macro_rules! half_ops {
    ($($t:ty),*) => {$(
        impl<F: Combine<f32>> Combine<$t> for Wide<F> {
            #[inline(always)]
            fn combine(a: $t, b: $t) -> $t { <$t>::from_f32(F::combine(a.to_f32(), b.to_f32())) }
        }
    )*};
}
/// Combines half types through `f32`.
struct Wide<F>(F);
half_ops!(f16, bf16);

/// Calls `$body` with `$T` bound to the element type and `$F` to the combiner.
macro_rules! dispatch {
    ($dtype:expr, $op:expr, $T:ident, $F:ident => $body:expr) => {{
        macro_rules! by_op {
            ($t:ty) => {
                match $op {
                    ReduceOp::Sum => {
                        type $T = $t;
                        type $F = Sum;
                        $body
                    }
                    ReduceOp::Prod => {
                        type $T = $t;
                        type $F = Prod;
                        $body
                    }
                    ReduceOp::Min => {
                        type $T = $t;
                        type $F = Min;
                        $body
                    }
                    ReduceOp::Max => {
                        type $T = $t;
                        type $F = Max;
                        $body
                    }
                    ReduceOp::Avg => panic!("avg is pre-scale plus sum, not a kernel"),
                }
            };
        }
        macro_rules! by_op_half {
            ($t:ty) => {
                match $op {
                    ReduceOp::Sum => {
                        type $T = $t;
                        type $F = Wide<Sum>;
                        $body
                    }
                    ReduceOp::Prod => {
                        type $T = $t;
                        type $F = Wide<Prod>;
                        $body
                    }
                    ReduceOp::Min => {
                        type $T = $t;
                        type $F = Wide<Min>;
                        $body
                    }
                    ReduceOp::Max => {
                        type $T = $t;
                        type $F = Wide<Max>;
                        $body
                    }
                    ReduceOp::Avg => panic!("avg is pre-scale plus sum, not a kernel"),
                }
            };
        }
        match $dtype {
            DataType::I8 => by_op!(i8),
            DataType::U8 => by_op!(u8),
            DataType::I32 => by_op!(i32),
            DataType::U32 => by_op!(u32),
            DataType::I64 => by_op!(i64),
            DataType::U64 => by_op!(u64),
            DataType::F32 => by_op!(f32),
            DataType::F64 => by_op!(f64),
            DataType::F16 => by_op_half!(f16),
            DataType::BF16 => by_op_half!(bf16),
        }
    }};
}
use dispatch;

#[inline(always)]
fn kernel_inplace<T: bytemuck::Pod, F: Combine<T>>(dst: &mut [u8], src: &[u8]) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        (Ok(d), Ok(s)) => {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = F::combine(*d, s);
            }
        }
        _ => unaligned(dst, None, src, F::combine),
    }
}

#[inline(always)]
fn kernel_into<T: bytemuck::Pod, F: Combine<T>>(dst: &mut [u8], a: &[u8], b: &[u8]) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(a),
        bytemuck::try_cast_slice::<u8, T>(b),
    ) {
        (Ok(d), Ok(a), Ok(b)) => {
            for ((d, &a), &b) in d.iter_mut().zip(a).zip(b) {
                *d = F::combine(a, b);
            }
        }
        _ => unaligned(dst, Some(a), b, F::combine),
    }
}

/// Slow path for buffers not aligned to the element type: copies blocks into aligned
/// temporaries. `a = None` means `dst` is also the first operand.
fn unaligned<T: bytemuck::Pod>(dst: &mut [u8], a: Option<&[u8]>, b: &[u8], f: fn(T, T) -> T) {
    let size = std::mem::size_of::<T>();
    let mut ta = [T::zeroed(); BLOCK];
    let mut tb = [T::zeroed(); BLOCK];
    let mut off = 0;
    while off < dst.len() {
        let n = ((dst.len() - off) / size).min(BLOCK);
        let bytes = n * size;
        let first = match a {
            Some(a) => &a[off..off + bytes],
            None => &dst[off..off + bytes],
        };
        bytemuck::cast_slice_mut::<T, u8>(&mut ta[..n]).copy_from_slice(first);
        bytemuck::cast_slice_mut::<T, u8>(&mut tb[..n]).copy_from_slice(&b[off..off + bytes]);
        for (x, &y) in ta[..n].iter_mut().zip(&tb[..n]) {
            *x = f(*x, y);
        }
        dst[off..off + bytes].copy_from_slice(bytemuck::cast_slice(&ta[..n]));
        off += bytes;
    }
}

fn map_into<T: bytemuck::Pod>(dst: &mut [u8], src: &[u8], f: impl Fn(T) -> T) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        (Ok(d), Ok(s)) => {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = f(s);
            }
        }
        _ => {
            dst.copy_from_slice(src);
            map_inplace(dst, f);
        }
    }
}

fn map_inplace<T: bytemuck::Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(b) => b.iter_mut().for_each(|x| *x = f(*x)),
        Err(_) => {
            let size = std::mem::size_of::<T>();
            for c in buf.chunks_exact_mut(size) {
                let v: T = bytemuck::pod_read_unaligned(c);
                c.copy_from_slice(bytemuck::bytes_of(&f(v)));
            }
        }
    }
}
