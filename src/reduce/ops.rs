//! The binary operations a reduction applies, one zero-sized type per
//! [`ReduceOp`](crate::dtype::ReduceOp), and the macro that turns a run-time (data type, op)
//! pair into a call of the kernel monomorphised for it.
//!
//! Each op is defined on the type it *computes* in (`Elem::W`): integers and `f32`/`f64` on
//! themselves, `f16`/`bf16` on `f32` (the widening and rounding live in `halves`).

/// A binary reduction on one (computation) element type.
pub(super) trait Combine<T> {
    /// True when AVX2 has no instruction for this (op, type), so the result is a compare and a
    /// blend. In place, LLVM turns `store(blend(c, b, load(d)), d)` into `vmaskmovps`, which is
    /// microcoded on AMD (an f32 max in place ran 4x slower than out of place on Zen 4); see
    /// `Elem::zip_inplace`.
    const BLEND: bool = false;
    fn combine(a: T, b: T) -> T;
}

pub(super) struct Sum;
pub(super) struct Prod;
pub(super) struct Min;
pub(super) struct Max;

macro_rules! int_ops {
    ($($t:ty: $blend:literal),*) => {$(
        impl Combine<$t> for Sum { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a.wrapping_add(b) } }
        impl Combine<$t> for Prod { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a.wrapping_mul(b) } }
        impl Combine<$t> for Min {
            const BLEND: bool = $blend;
            #[inline(always)] fn combine(a: $t, b: $t) -> $t { if b < a { b } else { a } }
        }
        impl Combine<$t> for Max {
            const BLEND: bool = $blend;
            #[inline(always)] fn combine(a: $t, b: $t) -> $t { if b > a { b } else { a } }
        }
    )*};
}
// AVX2 has vpmin/vpmax for 8 and 32 bits, not for 64 (that is AVX-512's vpminsq).
int_ops!(i8: false, u8: false, i32: false, u32: false, i64: true, u64: true);

macro_rules! float_ops {
    ($($t:ty),*) => {$(
        impl Combine<$t> for Sum { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a + b } }
        impl Combine<$t> for Prod { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a * b } }
        // Compares, not f32::min: they lower to minps/maxps (NaN rules in the module docs). Still
        // BLEND: LLVM folds the in-place blend into a masked store before it matches minps.
        impl Combine<$t> for Min {
            const BLEND: bool = true;
            #[inline(always)] fn combine(a: $t, b: $t) -> $t { if b < a { b } else { a } }
        }
        impl Combine<$t> for Max {
            const BLEND: bool = true;
            #[inline(always)] fn combine(a: $t, b: $t) -> $t { if b > a { b } else { a } }
        }
    )*};
}
float_ops!(f32, f64);

/// A binary element function.
pub(super) trait Fn2<W>: Fn(W, W) -> W + Copy {}
impl<W, F: Fn(W, W) -> W + Copy> Fn2<W> for F {}
/// A unary element function.
pub(super) trait Fn1<W>: Fn(W) -> W + Copy {}
impl<W, F: Fn(W) -> W + Copy> Fn1<W> for F {}

/// Calls `$body` with `$T` bound to the storage type and `$F` to the combiner (on `T::W`): one
/// match per call, after which the loop is fully monomorphic. Paths are absolute so that the
/// macro works wherever it is invoked.
macro_rules! dispatch {
    ($dtype:expr, $op:expr, $T:ident, $F:ident => $body:expr) => {{
        macro_rules! by_op {
            ($t:ty) => {
                match $op {
                    $crate::dtype::ReduceOp::Sum => {
                        type $T = $t;
                        type $F = $crate::reduce::ops::Sum;
                        $body
                    }
                    $crate::dtype::ReduceOp::Prod => {
                        type $T = $t;
                        type $F = $crate::reduce::ops::Prod;
                        $body
                    }
                    $crate::dtype::ReduceOp::Min => {
                        type $T = $t;
                        type $F = $crate::reduce::ops::Min;
                        $body
                    }
                    $crate::dtype::ReduceOp::Max => {
                        type $T = $t;
                        type $F = $crate::reduce::ops::Max;
                        $body
                    }
                    $crate::dtype::ReduceOp::Avg => panic!("avg is pre-scale plus sum, not a kernel"),
                }
            };
        }
        use $crate::dtype::DataType;
        match $dtype {
            DataType::I8 => by_op!(i8),
            DataType::U8 => by_op!(u8),
            DataType::I32 => by_op!(i32),
            DataType::U32 => by_op!(u32),
            DataType::I64 => by_op!(i64),
            DataType::U64 => by_op!(u64),
            DataType::F32 => by_op!(f32),
            DataType::F64 => by_op!(f64),
            DataType::F16 => by_op!(::half::f16),
            DataType::BF16 => by_op!(::half::bf16),
        }
    }};
}
pub(super) use dispatch;
