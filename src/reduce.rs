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

use std::sync::atomic::{AtomicU8, Ordering};

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::dtype::{DataType, ReduceOp};

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

/// `dst[i] = src[i] · factor` for floating types (used to pre-scale `avg` inputs).
///
/// The product is taken in the element type for `f32`/`f64` (`x * factor as f32` for `f32`) and
/// in `f32` for `f16`/`bf16` (`T::from_f32(x.to_f32() * factor as f32)`).
///
/// # Panics
/// When the lengths differ or are not a whole number of elements, or `dtype` is an integer type.
pub fn scale_into(dtype: DataType, dst: &mut [u8], src: &[u8], factor: f64) {
    scale_into_at(level(), dtype, dst, src, factor);
}

/// In-place form of [`scale_into`].
///
/// # Panics
/// When the length is not a whole number of elements, or `dtype` is an integer type.
pub fn scale_inplace(dtype: DataType, buf: &mut [u8], factor: f64) {
    scale_inplace_at(level(), dtype, buf, factor);
}

/// Copies below this many bytes go to `copy_from_slice` (glibc's vector loops handle them).
const COPY_VECTOR_MIN: usize = 2048;

/// `dst.copy_from_slice(src)`, with an AVX2 loop of plain loads and stores for large copies.
///
/// Every shared-memory copy reads data another core has just written. glibc's `memcpy` moves
/// blocks from about 2 KiB up with `rep movsb`, which on some CPUs is far slower than a vector
/// loop on such data: measured on AMD Zen 3 under KVM with glibc 2.36, a 1 MiB all-reduce of 2
/// ranks over the shared window took 450 us with `memcpy` and 81 us with glibc's vector loop
/// forced by `GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=1073741824`.
///
/// # Panics
/// When the lengths differ.
pub fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy: length mismatch");
    // SAFETY: two valid slices of equal length; `&mut` and `&` cannot overlap.
    unsafe { copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), dst.len()) }
}

/// The raw-pointer form of [`copy`], for ring buffers inside shared mappings.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for `n` bytes, and
/// the two ranges do not overlap.
pub unsafe fn copy_nonoverlapping(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= COPY_VECTOR_MIN && level() != Level::Portable {
        // SAFETY: every level above `Portable` has AVX2 (checked by `Level::detect`); the
        // ranges are the caller's contract.
        unsafe { copy_avx2(src, dst, n) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
}

/// 128 bytes per iteration with 32-byte-aligned stores; the unaligned first and last vectors
/// are stored whole (overlapping bytes are written twice with the same value).
///
/// # Safety
/// AVX2 present, `n >= 64`, and the contract of [`copy_nonoverlapping`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(src: *const u8, dst: *mut u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_store_si256, _mm256_storeu_si256};
    // SAFETY (every block below): offsets stay below `n` (`i + 128 <= n`, `i + 32 <= n`,
    // `n - 32 >= 0`); stores at `i` are aligned because `i` starts at `dst`'s distance to a
    // 32-byte boundary and grows in multiples of 32; loads are unaligned.
    unsafe {
        let first = _mm256_loadu_si256(src as *const __m256i);
        let last = _mm256_loadu_si256(src.add(n - 32) as *const __m256i);
        _mm256_storeu_si256(dst as *mut __m256i, first);
        let mut i = (32 - dst as usize % 32) % 32;
        while i + 128 <= n {
            let s = src.add(i) as *const __m256i;
            let d = dst.add(i) as *mut __m256i;
            let (a, b, c, e) = (
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            );
            _mm256_store_si256(d, a);
            _mm256_store_si256(d.add(1), b);
            _mm256_store_si256(d.add(2), c);
            _mm256_store_si256(d.add(3), e);
            i += 128;
        }
        while i + 32 <= n {
            _mm256_store_si256(dst.add(i) as *mut __m256i, _mm256_loadu_si256(src.add(i) as *const __m256i));
            i += 32;
        }
        _mm256_storeu_si256(dst.add(n - 32) as *mut __m256i, last);
    }
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

fn scale_into_at(level: Level, dtype: DataType, dst: &mut [u8], src: &[u8], factor: f64) {
    assert_eq!(dst.len(), src.len(), "scale_into: length mismatch");
    assert!(dtype.is_float(), "scale_into: {dtype} is not a floating type");
    assert!(dst.len().is_multiple_of(dtype.size()), "scale_into: partial element");
    let k = factor as f32;
    // SAFETY (each arm): `level` came from `level()` or `Level::supported()`.
    unsafe {
        match dtype {
            DataType::F32 => level.map::<f32>(view_mut(dst), view(src), move |x| x * k),
            DataType::F64 => level.map::<f64>(view_mut(dst), view(src), move |x| x * factor),
            DataType::F16 => level.map::<f16>(view_mut(dst), view(src), move |x| x * k),
            DataType::BF16 => level.map::<bf16>(view_mut(dst), view(src), move |x| x * k),
            _ => unreachable!(),
        }
    }
}

fn scale_inplace_at(level: Level, dtype: DataType, buf: &mut [u8], factor: f64) {
    assert!(dtype.is_float(), "scale_inplace: {dtype} is not a floating type");
    assert!(buf.len().is_multiple_of(dtype.size()), "scale_inplace: partial element");
    let k = factor as f32;
    // SAFETY (each arm): `level` came from `level()` or `Level::supported()`.
    unsafe {
        match dtype {
            DataType::F32 => level.map_inplace::<f32>(view_mut(buf), move |x| x * k),
            DataType::F64 => level.map_inplace::<f64>(view_mut(buf), move |x| x * factor),
            DataType::F16 => level.map_inplace::<f16>(view_mut(buf), move |x| x * k),
            DataType::BF16 => level.map_inplace::<bf16>(view_mut(buf), move |x| x * k),
            _ => unreachable!(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Operations

/// A binary reduction on one (computation) element type.
trait Combine<T> {
    /// True when AVX2 has no instruction for this (op, type), so the result is a compare and a
    /// blend. In place, LLVM turns `store(blend(c, b, load(d)), d)` into `vmaskmovps`, which is
    /// microcoded on AMD (an f32 max in place ran 4x slower than out of place on Zen 4); see
    /// `Elem::zip_inplace`.
    const BLEND: bool = false;
    fn combine(a: T, b: T) -> T;
}

struct Sum;
struct Prod;
struct Min;
struct Max;

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

/// Calls `$body` with `$T` bound to the storage type and `$F` to the combiner (on `T::W`).
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
        match $dtype {
            DataType::I8 => by_op!(i8),
            DataType::U8 => by_op!(u8),
            DataType::I32 => by_op!(i32),
            DataType::U32 => by_op!(u32),
            DataType::I64 => by_op!(i64),
            DataType::U64 => by_op!(u64),
            DataType::F32 => by_op!(f32),
            DataType::F64 => by_op!(f64),
            DataType::F16 => by_op!(f16),
            DataType::BF16 => by_op!(bf16),
        }
    }};
}
use dispatch;

// ---------------------------------------------------------------------------------------------
// Unaligned element views

/// One element at any address: `repr(packed)` gives alignment 1, so a `&[u8]` of whole elements
/// is a valid `&[U<T>]` and the compiler emits unaligned loads (as fast as aligned ones on any
/// x86 since Nehalem when no cache line is split).
#[derive(Clone, Copy)]
#[repr(C, packed)]
struct U<T: Copy>(T);

#[inline]
fn view<T: bytemuck::Pod>(b: &[u8]) -> &[U<T>] {
    // SAFETY: U<T> has T's size and alignment 1, so the pointer is suitably aligned and the
    // range covers `len` whole elements inside `b`; T is Pod, so every bit pattern is a value.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len() / size_of::<T>()) }
}

#[inline]
fn view_mut<T: bytemuck::Pod>(b: &mut [u8]) -> &mut [U<T>] {
    // SAFETY: as in `view`; the exclusive borrow of `b` moves to the result.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast(), b.len() / size_of::<T>()) }
}

// ---------------------------------------------------------------------------------------------
// Element types and the generic loops

/// A storage type and the type its ops compute in (`W`: `f32` for halves, itself otherwise).
///
/// The default loops are what LLVM vectorises; they take the ISA token only so that `f16` can
/// override them with explicit F16C conversions.
trait Elem: bytemuck::Pod {
    type W: Copy;
    fn widen(self) -> Self::W;
    fn narrow(w: Self::W) -> Self;

    #[inline(always)]
    fn zip<I: Isa, F: Combine<Self::W>>(_: I, d: &mut [U<Self>], a: &[U<Self>], b: &[U<Self>]) {
        for ((d, a), b) in d.iter_mut().zip(a).zip(b) {
            *d = U(Self::narrow(F::combine(a.0.widen(), b.0.widen())));
        }
    }

    /// Where a blend would become a slow masked store (see [`Combine::BLEND`]; a widened type
    /// stores a narrowed value, never the blend itself), `d` is first copied in small blocks to
    /// the stack, so the loop loads from a different place than it stores to and keeps a plain
    /// blend and store: one extra L1 copy instead of microcode. `black_box` stops LLVM from
    /// seeing through the copy (it otherwise forwards the loads back to `d` and folds again).
    #[inline(always)]
    fn zip_inplace<I: Isa, F: Combine<Self::W>>(isa: I, d: &mut [U<Self>], b: &[U<Self>]) {
        let blend_store = F::BLEND && size_of::<Self>() == size_of::<Self::W>();
        if I::SLOW_MASKED_STORE && blend_store {
            const BLOCK: usize = 256;
            let mut tmp = [U(Self::zeroed()); BLOCK];
            for (d, b) in d.chunks_mut(BLOCK).zip(b.chunks(BLOCK)) {
                let tmp = &mut tmp[..d.len()];
                tmp.copy_from_slice(d);
                std::hint::black_box(&mut *tmp);
                Self::zip::<I, F>(isa, d, tmp, b);
            }
            return;
        }
        for (d, b) in d.iter_mut().zip(b) {
            *d = U(Self::narrow(F::combine(d.0.widen(), b.0.widen())));
        }
    }

    #[inline(always)]
    fn map<I: Isa>(_: I, d: &mut [U<Self>], s: &[U<Self>], f: impl Fn1<Self::W>) {
        for (d, s) in d.iter_mut().zip(s) {
            *d = U(Self::narrow(f(s.0.widen())));
        }
    }

    #[inline(always)]
    fn map_inplace<I: Isa>(_: I, d: &mut [U<Self>], f: impl Fn1<Self::W>) {
        for d in d.iter_mut() {
            *d = U(Self::narrow(f(d.0.widen())));
        }
    }
}

/// A binary element function.
trait Fn2<W>: Fn(W, W) -> W + Copy {}
impl<W, F: Fn(W, W) -> W + Copy> Fn2<W> for F {}
/// A unary element function.
trait Fn1<W>: Fn(W) -> W + Copy {}
impl<W, F: Fn(W) -> W + Copy> Fn1<W> for F {}

macro_rules! plain_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            type W = $t;
            #[inline(always)] fn widen(self) -> $t { self }
            #[inline(always)] fn narrow(w: $t) -> $t { w }
        }
    )*};
}
plain_elem!(i8, u8, i32, u32, i64, u64, f32, f64);

/// bf16 runs on pairs: a `u32` word holds two, the one in the low half widens as `w << 16` and
/// the one in the high half as `w & 0xffff_0000`, and they narrow back into the same halves
/// (whatever the byte order). Unlike element-wise widening (`vpmovzxwd` + shift, then a
/// lane-crossing pack to narrow) this needs no shuffles: on Zen 4, 40% faster with AVX-512
/// and 25% with AVX2.
impl Elem for bf16 {
    type W = f32;
    /// Exact: bf16 is the top half of an f32. (`bf16::to_f32` also sets the quiet bit of a
    /// NaN; `narrow` sets it anyway, so results are bit-identical.)
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn narrow(w: f32) -> bf16 {
        bf16::from_bits(f32_to_bf16_bits(w.to_bits()))
    }

    #[inline(always)]
    fn zip<I: Isa, F: Combine<f32>>(_: I, d: &mut [U<bf16>], a: &[U<bf16>], b: &[U<bf16>]) {
        let ((dp, dt), (ap, at), (bp, bt)) = (pairs_mut(d), pairs(a), pairs(b));
        for ((d, a), b) in dp.iter_mut().zip(ap).zip(bp) {
            *d = U(bf16_pair(a.0, b.0, F::combine));
        }
        for ((d, a), b) in dt.iter_mut().zip(at).zip(bt) {
            *d = U(Self::narrow(F::combine(a.0.widen(), b.0.widen())));
        }
    }

    #[inline(always)]
    fn zip_inplace<I: Isa, F: Combine<f32>>(_: I, d: &mut [U<bf16>], b: &[U<bf16>]) {
        let ((dp, dt), (bp, bt)) = (pairs_mut(d), pairs(b));
        for (d, b) in dp.iter_mut().zip(bp) {
            *d = U(bf16_pair(d.0, b.0, F::combine));
        }
        for (d, b) in dt.iter_mut().zip(bt) {
            *d = U(Self::narrow(F::combine(d.0.widen(), b.0.widen())));
        }
    }

    #[inline(always)]
    fn map<I: Isa>(_: I, d: &mut [U<bf16>], s: &[U<bf16>], f: impl Fn1<f32>) {
        let ((dp, dt), (sp, st)) = (pairs_mut(d), pairs(s));
        for (d, s) in dp.iter_mut().zip(sp) {
            *d = U(bf16_pair(s.0, s.0, move |x, _| f(x)));
        }
        for (d, s) in dt.iter_mut().zip(st) {
            *d = U(Self::narrow(f(s.0.widen())));
        }
    }

    #[inline(always)]
    fn map_inplace<I: Isa>(_: I, d: &mut [U<bf16>], f: impl Fn1<f32>) {
        let (dp, dt) = pairs_mut(d);
        for d in dp.iter_mut() {
            *d = U(bf16_pair(d.0, d.0, move |x, _| f(x)));
        }
        for d in dt.iter_mut() {
            *d = U(Self::narrow(f(d.0.widen())));
        }
    }
}

/// `f` on the two bf16 packed in each of `x` and `y` (see `impl Elem for bf16`).
#[inline(always)]
fn bf16_pair(x: u32, y: u32, f: impl Fn2<f32>) -> u32 {
    let lo = f(f32::from_bits(x << 16), f32::from_bits(y << 16));
    let hi = f(f32::from_bits(x & 0xffff_0000), f32::from_bits(y & 0xffff_0000));
    f32_to_bf16_bits(lo.to_bits()) as u32 | (f32_to_bf16_bits(hi.to_bits()) as u32) << 16
}

/// `s` as whole `u32` words of two bf16 each, and the odd element left over.
#[inline(always)]
fn pairs(s: &[U<bf16>]) -> (&[U<u32>], &[U<bf16>]) {
    let (p, tail) = s.split_at(s.len() & !1);
    // SAFETY: U<u32> is 4 bytes with alignment 1, the size of two U<bf16>; `p` has an even
    // length and every bit pattern is a u32.
    (unsafe { std::slice::from_raw_parts(p.as_ptr().cast(), p.len() / 2) }, tail)
}

/// Mutable form of [`pairs`].
#[inline(always)]
fn pairs_mut(s: &mut [U<bf16>]) -> (&mut [U<u32>], &mut [U<bf16>]) {
    let (p, tail) = s.split_at_mut(s.len() & !1);
    // SAFETY: as in `pairs`; the exclusive borrow of `p` moves to the result.
    (unsafe { std::slice::from_raw_parts_mut(p.as_mut_ptr().cast(), p.len() / 2) }, tail)
}

/// `bf16::from_f32(f32::from_bits(x)).to_bits()`, branch-free so that it vectorises: round to
/// nearest even by adding `0x7fff` plus the lowest kept bit; a NaN keeps its top payload bits
/// and becomes quiet. The NaN test is a float compare (one `vcmpunordps`, where an integer
/// range test takes three instructions on AVX2) and both cases share the final shift.
#[inline(always)]
fn f32_to_bf16_bits(x: u32) -> u16 {
    let nan = f32::from_bits(x).is_nan();
    let r = if nan { x | 0x0040_0000 } else { x.wrapping_add(0x7fff + ((x >> 16) & 1)) };
    (r >> 16) as u16
}

impl Elem for f16 {
    type W = f32;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn narrow(w: f32) -> f16 {
        f16::from_f32(w)
    }

    #[inline(always)]
    fn zip<I: Isa, F: Combine<f32>>(isa: I, d: &mut [U<f16>], a: &[U<f16>], b: &[U<f16>]) {
        let n = d.len().min(a.len()).min(b.len());
        // SAFETY: d, a and b are valid for n elements; d is exclusive and distinct from a, b.
        unsafe { f16_chunks(isa, d.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n, F::combine) }
    }

    #[inline(always)]
    fn zip_inplace<I: Isa, F: Combine<f32>>(isa: I, d: &mut [U<f16>], b: &[U<f16>]) {
        let n = d.len().min(b.len());
        let d = d.as_mut_ptr();
        // SAFETY: d and b are valid for n elements; the first operand is d itself, which
        // f16_chunks allows (it reads each chunk before writing it).
        unsafe { f16_chunks(isa, d, d, b.as_ptr(), n, F::combine) }
    }

    #[inline(always)]
    fn map<I: Isa>(isa: I, d: &mut [U<f16>], s: &[U<f16>], f: impl Fn1<f32>) {
        let n = d.len().min(s.len());
        let s = s.as_ptr();
        // SAFETY: as in `zip`; the unused second operand's conversion is dead code.
        unsafe { f16_chunks(isa, d.as_mut_ptr(), s, s, n, move |x, _| f(x)) }
    }

    #[inline(always)]
    fn map_inplace<I: Isa>(isa: I, d: &mut [U<f16>], f: impl Fn1<f32>) {
        let n = d.len();
        let d = d.as_mut_ptr();
        // SAFETY: as in `zip_inplace`.
        unsafe { f16_chunks(isa, d, d, d, n, move |x, _| f(x)) }
    }
}

/// Lanes per `f16` chunk: one zmm or two ymm of `f32`.
const L16: usize = 16;
type Chunk = [U<f16>; L16];

/// One chunk of [`f16_chunks`]. A function, not a closure: a closure is a separate function
/// without the caller's target features, so LLVM would not inline the F16C intrinsics into it.
#[inline(always)]
fn f16_chunk<I: Isa>(isa: I, x: &Chunk, y: &Chunk, f: impl Fn2<f32>) -> Chunk {
    let (x, y) = (isa.f16_widen(x), isa.f16_widen(y));
    let mut r = [0f32; L16];
    for i in 0..L16 {
        r[i] = f(x[i], y[i]);
    }
    isa.f16_narrow(&r)
}

/// `d[i] = narrow(f(widen(a[i]), widen(b[i])))` for `i < n`, 16 lanes at a time with the
/// ISA's conversions; the tail runs through the same chunk code on zero-padded copies, so every
/// element is converted the same way.
///
/// # Safety
/// `d` must be valid for writes and `a`, `b` for reads of `n` elements. `a` and `b` may equal
/// `d` (each chunk is read completely before it is written) but must not otherwise overlap it.
#[inline(always)]
unsafe fn f16_chunks<I: Isa>(
    isa: I,
    d: *mut U<f16>,
    a: *const U<f16>,
    b: *const U<f16>,
    n: usize,
    f: impl Fn2<f32>,
) {
    let full = n - n % L16;
    let mut i = 0;
    while i < full {
        // SAFETY: i + 16 <= n, so the chunk is in bounds for all three; U has alignment 1, so
        // the array pointers are aligned. Reads complete before the write (in-place is fine).
        unsafe {
            let x = a.add(i).cast::<Chunk>().read();
            let y = b.add(i).cast::<Chunk>().read();
            d.add(i).cast::<Chunk>().write(f16_chunk(isa, &x, &y, f));
        }
        i += L16;
    }
    let rest = n - full;
    if rest > 0 {
        let mut x = [U(f16::ZERO); L16];
        let mut y = [U(f16::ZERO); L16];
        // SAFETY: `rest` elements from `full` are in bounds; the temporaries are distinct.
        unsafe {
            std::ptr::copy_nonoverlapping(a.add(full), x.as_mut_ptr(), rest);
            std::ptr::copy_nonoverlapping(b.add(full), y.as_mut_ptr(), rest);
            std::ptr::copy_nonoverlapping(f16_chunk(isa, &x, &y, f).as_ptr(), d.add(full), rest);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Instruction-set levels

/// What differs between instruction-set levels beyond the compiler flags: the `f16` chunk
/// conversions. A token is only created inside an entry point compiled for its level, which is
/// only called after the CPU was checked, so its methods may use that level's intrinsics.
trait Isa: Copy {
    /// Whether a masked store is slow enough to avoid (see [`Combine::BLEND`]). AVX2's
    /// `vmaskmovps` is microcoded on AMD; AVX-512 masked stores are fast everywhere and SSE2
    /// has none.
    const SLOW_MASKED_STORE: bool = false;
    fn f16_widen(self, x: &[U<f16>; L16]) -> [f32; L16];
    fn f16_narrow(self, x: &[f32; L16]) -> [U<f16>; L16];
}

/// Baseline: `half`'s slice conversions, which use F16C or NEON `fp16` when the CPU has them
/// (one cached check per chunk rather than per element) and software otherwise.
#[derive(Clone, Copy)]
struct Portable;

impl Isa for Portable {
    #[inline(always)]
    fn f16_widen(self, x: &[U<f16>; L16]) -> [f32; L16] {
        let mut out = [0f32; L16];
        x.map(|h| h.0).convert_to_f32_slice(&mut out);
        out
    }
    #[inline(always)]
    fn f16_narrow(self, x: &[f32; L16]) -> [U<f16>; L16] {
        let mut out = [f16::ZERO; L16];
        out.convert_from_f32_slice(x);
        out.map(U)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Isa, L16, U, f16};

    /// AVX2 + FMA + F16C (Haswell, Zen 1 and later). The private field keeps construction here.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2(());

    /// AVX-512 F/BW/VL/DQ on top of [`Avx2`] (Skylake-SP, Ice Lake, Zen 4 and later).
    #[derive(Clone, Copy)]
    pub(super) struct Avx512(());

    impl Avx2 {
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C.
        #[inline(always)]
        pub(super) unsafe fn new() -> Self {
            Avx2(())
        }
    }

    impl Avx512 {
        /// # Safety
        /// The CPU must support AVX2, FMA, F16C and AVX-512 F, BW, VL and DQ.
        #[inline(always)]
        pub(super) unsafe fn new() -> Self {
            Avx512(())
        }
    }

    impl Isa for Avx2 {
        const SLOW_MASKED_STORE: bool = true;

        #[inline(always)]
        fn f16_widen(self, x: &[U<f16>; L16]) -> [f32; L16] {
            let p = x.as_ptr().cast::<__m128i>();
            let mut out = [0f32; L16];
            // SAFETY: an Avx2 token proves AVX and F16C; x is 32 readable bytes and out 64
            // writable ones, and the loads and stores are the unaligned forms.
            unsafe {
                let lo = _mm256_cvtph_ps(_mm_loadu_si128(p));
                let hi = _mm256_cvtph_ps(_mm_loadu_si128(p.add(1)));
                _mm256_storeu_ps(out.as_mut_ptr(), lo);
                _mm256_storeu_ps(out.as_mut_ptr().add(8), hi);
            }
            out
        }

        #[inline(always)]
        fn f16_narrow(self, x: &[f32; L16]) -> [U<f16>; L16] {
            let mut out = [U(f16::ZERO); L16];
            let p = out.as_mut_ptr().cast::<__m128i>();
            // SAFETY: as in f16_widen. Rounding is to nearest even, as in f16::from_f32.
            unsafe {
                let lo = _mm256_loadu_ps(x.as_ptr());
                let hi = _mm256_loadu_ps(x.as_ptr().add(8));
                _mm_storeu_si128(p, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(lo));
                _mm_storeu_si128(p.add(1), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(hi));
            }
            out
        }
    }

    /// The ymm conversions (an Avx512 token implies AVX2 and F16C): on Zen 4, with zmm
    /// double-pumped, the zmm forms measured ~15% slower (68 vs 78 GB/s, f16 sum in L2).
    impl Isa for Avx512 {
        #[inline(always)]
        fn f16_widen(self, x: &[U<f16>; L16]) -> [f32; L16] {
            Avx2(()).f16_widen(x)
        }

        #[inline(always)]
        fn f16_narrow(self, x: &[f32; L16]) -> [U<f16>; L16] {
            Avx2(()).f16_narrow(x)
        }
    }
}

/// The loops compiled for one level. `$new` builds the level's token; the `#[target_feature]`
/// copies are `unsafe fn`s whose caller guarantees the features.
macro_rules! entry_points {
    ($new:expr $(, $feature:literal)?) => {
        use super::*;

        $(#[target_feature(enable = $feature)])?
        pub(super) unsafe fn zip<T: Elem, F: Combine<T::W>>(d: &mut [U<T>], a: &[U<T>], b: &[U<T>]) {
            // SAFETY: the caller checked the features this function is compiled for.
            T::zip::<_, F>(unsafe { $new }, d, a, b)
        }

        $(#[target_feature(enable = $feature)])?
        pub(super) unsafe fn zip_inplace<T: Elem, F: Combine<T::W>>(d: &mut [U<T>], b: &[U<T>]) {
            // SAFETY: as in `zip`.
            T::zip_inplace::<_, F>(unsafe { $new }, d, b)
        }

        $(#[target_feature(enable = $feature)])?
        pub(super) unsafe fn map<T: Elem>(d: &mut [U<T>], s: &[U<T>], f: impl Fn1<T::W>) {
            // SAFETY: as in `zip`.
            T::map(unsafe { $new }, d, s, f)
        }

        $(#[target_feature(enable = $feature)])?
        pub(super) unsafe fn map_inplace<T: Elem>(d: &mut [U<T>], f: impl Fn1<T::W>) {
            // SAFETY: as in `zip`.
            T::map_inplace(unsafe { $new }, d, f)
        }
    };
}

mod portable {
    // `unsafe` only for symmetry with the other levels: there is nothing to check.
    #![allow(unused_unsafe, clippy::missing_safety_doc)]
    entry_points!(Portable);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    #![allow(clippy::missing_safety_doc)]
    entry_points!(x86::Avx2::new(), "avx2,fma,f16c");
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    #![allow(clippy::missing_safety_doc)]
    entry_points!(x86::Avx512::new(), "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c");
}

/// The instruction-set level a kernel runs at. A value other than `Portable` only ever comes
/// from what [`Level::detect`] found on this CPU (directly, through the cache in [`level`], or
/// as a lower level in [`Level::supported`]): the `unsafe` dispatch relies on that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Portable = 1,
    #[cfg(target_arch = "x86_64")]
    Avx2 = 2,
    #[cfg(target_arch = "x86_64")]
    Avx512 = 3,
}

impl Level {
    fn detect() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
                    return Level::Avx512;
                }
                return Level::Avx2;
            }
        }
        Level::Portable
    }

    /// Every level this CPU can run, lowest first (the tests run each).
    #[cfg(test)]
    fn supported() -> Vec<Level> {
        let best = level() as u8;
        let mut all = vec![Level::Portable];
        #[cfg(target_arch = "x86_64")]
        all.extend([Level::Avx2, Level::Avx512]);
        all.retain(|l| *l as u8 <= best);
        all
    }

    /// # Safety
    /// `self` must come from [`level`] or [`Level::supported`].
    #[inline]
    unsafe fn zip<T: Elem, F: Combine<T::W>>(self, d: &mut [U<T>], a: &[U<T>], b: &[U<T>]) {
        // SAFETY (each arm): the level was checked against the CPU (the caller's contract).
        unsafe {
            match self {
                Level::Portable => portable::zip::<T, F>(d, a, b),
                #[cfg(target_arch = "x86_64")]
                Level::Avx2 => avx2::zip::<T, F>(d, a, b),
                #[cfg(target_arch = "x86_64")]
                Level::Avx512 => avx512::zip::<T, F>(d, a, b),
            }
        }
    }

    /// # Safety
    /// As [`Level::zip`].
    #[inline]
    unsafe fn zip_inplace<T: Elem, F: Combine<T::W>>(self, d: &mut [U<T>], b: &[U<T>]) {
        // SAFETY (each arm): the level was checked against the CPU (the caller's contract).
        unsafe {
            match self {
                Level::Portable => portable::zip_inplace::<T, F>(d, b),
                #[cfg(target_arch = "x86_64")]
                Level::Avx2 => avx2::zip_inplace::<T, F>(d, b),
                #[cfg(target_arch = "x86_64")]
                Level::Avx512 => avx512::zip_inplace::<T, F>(d, b),
            }
        }
    }

    /// # Safety
    /// As [`Level::zip`].
    #[inline]
    unsafe fn map<T: Elem>(self, d: &mut [U<T>], s: &[U<T>], f: impl Fn1<T::W>) {
        // SAFETY (each arm): the level was checked against the CPU (the caller's contract).
        unsafe {
            match self {
                Level::Portable => portable::map(d, s, f),
                #[cfg(target_arch = "x86_64")]
                Level::Avx2 => avx2::map(d, s, f),
                #[cfg(target_arch = "x86_64")]
                Level::Avx512 => avx512::map(d, s, f),
            }
        }
    }

    /// # Safety
    /// As [`Level::zip`].
    #[inline]
    unsafe fn map_inplace<T: Elem>(self, d: &mut [U<T>], f: impl Fn1<T::W>) {
        // SAFETY (each arm): the level was checked against the CPU (the caller's contract).
        unsafe {
            match self {
                Level::Portable => portable::map_inplace(d, f),
                #[cfg(target_arch = "x86_64")]
                Level::Avx2 => avx2::map_inplace(d, f),
                #[cfg(target_arch = "x86_64")]
                Level::Avx512 => avx512::map_inplace(d, f),
            }
        }
    }
}

/// The best level for this CPU, probed on first use and cached: one relaxed atomic load per
/// call. Measured on a 64-byte `reduce_into`: < 1 ns over a hard-wired level, where checking
/// the seven features with `is_x86_feature_detected!` on every call cost 1.3-3 ns.
fn level() -> Level {
    static LEVEL: AtomicU8 = AtomicU8::new(0);
    match LEVEL.load(Ordering::Relaxed) {
        1 => Level::Portable,
        #[cfg(target_arch = "x86_64")]
        2 => Level::Avx2,
        #[cfg(target_arch = "x86_64")]
        3 => Level::Avx512,
        _ => {
            let l = Level::detect();
            LEVEL.store(l as u8, Ordering::Relaxed);
            l
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64: tiny, fast and good enough to fill test buffers.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        /// Uniform in [0, 1).
        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }

        /// Mostly moderate values of mixed sign and magnitude (so sums really round), one in
        /// sixteen a special one (signed zero, infinity, NaN, an f32 subnormal).
        fn float(&mut self, max_exp: i32) -> f64 {
            const SPECIAL: [f64; 8] =
                [0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 1.0, -1.0, 1e-40];
            match self.next() % 16 {
                0 => SPECIAL[(self.next() % SPECIAL.len() as u64) as usize],
                _ => {
                    let exp = (self.next() % (2 * max_exp as u64 + 1)) as i32 - max_exp;
                    let sign = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
                    sign * (1.0 + self.unit()) * 2f64.powi(exp)
                }
            }
        }
    }

    #[test]
    fn copy_is_exact_for_every_length_and_alignment_and_touches_nothing_else() {
        let mut rng = Rng(7);
        let src: Vec<u8> = (0..70_000).map(|_| rng.next() as u8).collect();
        let mut lens: Vec<usize> = (0..300).collect();
        lens.extend([2047, 2048, 2049, 2048 + 31, 4096 + 17, 65_536, 65_536 + 95]);
        for &len in &lens {
            for (so, d_off) in [(0, 0), (1, 0), (0, 1), (5, 31), (32, 7), (17, 64)] {
                let mut dst = vec![0xa5u8; len + 200];
                copy(&mut dst[d_off..d_off + len], &src[so..so + len]);
                assert_eq!(&dst[d_off..d_off + len], &src[so..so + len], "len {len} src+{so} dst+{d_off}");
                assert!(
                    dst[..d_off].iter().chain(&dst[d_off + len..]).all(|b| *b == 0xa5),
                    "len {len}: outside"
                );
            }
        }
    }

    /// `n` random elements of `dtype` as native-endian bytes; for f32/f64 one in eight is raw
    /// bits (signalling NaNs, subnormals, extremes).
    fn random_elems(rng: &mut Rng, dtype: DataType, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * dtype.size());
        for _ in 0..n {
            let bits = rng.next();
            match dtype {
                // Raw bits for halves cover every class (NaN, inf, subnormal) at useful rates.
                DataType::F16 | DataType::BF16 => out.extend_from_slice(&(bits as u16).to_ne_bytes()),
                DataType::F32 if !bits.is_multiple_of(8) => {
                    out.extend_from_slice(&(rng.float(20) as f32).to_ne_bytes())
                }
                DataType::F64 if !bits.is_multiple_of(8) => {
                    out.extend_from_slice(&rng.float(60).to_ne_bytes())
                }
                _ => out.extend_from_slice(&bits.to_ne_bytes()[..dtype.size()]),
            }
        }
        out
    }

    /// A byte buffer starting `offset` bytes past an 8-byte-aligned address.
    struct Buf {
        store: Vec<u64>,
        offset: usize,
        len: usize,
    }

    impl Buf {
        fn new(bytes: &[u8], offset: usize) -> Buf {
            let mut b = Buf { store: vec![0; (bytes.len() + offset).div_ceil(8)], offset, len: bytes.len() };
            b.bytes_mut().copy_from_slice(bytes);
            b
        }
        fn bytes(&self) -> &[u8] {
            &bytemuck::cast_slice(&self.store)[self.offset..self.offset + self.len]
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut bytemuck::cast_slice_mut(&mut self.store)[self.offset..self.offset + self.len]
        }
    }

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

    fn is_nan(dtype: DataType, b: &[u8]) -> bool {
        match dtype {
            DataType::F32 => f32::from_ne_bytes(b.try_into().unwrap()).is_nan(),
            DataType::F64 => f64::from_ne_bytes(b.try_into().unwrap()).is_nan(),
            DataType::F16 => f16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
            DataType::BF16 => bf16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
            _ => false,
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

    const LENS: [usize; 6] = [0, 1, 7, 31, 1000, 4099];
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
    fn level_is_detected_once_and_swept_by_the_tests() {
        let first = level();
        assert_eq!(first, Level::detect());
        assert_eq!(level(), first, "from the cache");
        assert_eq!(Level::supported().last(), Some(&first));
    }

    #[test]
    fn scale_matches_scalar_reference() {
        let mut rng = Rng(42);
        for level in Level::supported() {
            for dtype in [DataType::F32, DataType::F64, DataType::F16, DataType::BF16] {
                for factor in [0.5, 1.0 / 3.0, 3.0, -0.125, 1e-30] {
                    for n in LENS {
                        for offset in [0, 1] {
                            let size = dtype.size();
                            let src = random_elems(&mut rng, dtype, n);
                            let s = Buf::new(&src, offset);
                            let mut out = Buf::new(&vec![0; src.len()], 1 - offset);
                            scale_into_at(level, dtype, out.bytes_mut(), s.bytes(), factor);
                            let mut inplace = Buf::new(&src, offset);
                            scale_inplace_at(level, dtype, inplace.bytes_mut(), factor);
                            assert_eq!(
                                inplace.bytes(),
                                out.bytes(),
                                "{level:?} {dtype} scale_inplace differs"
                            );

                            let k = factor as f32;
                            for (i, (x, got)) in src.chunks(size).zip(out.bytes().chunks(size)).enumerate() {
                                let h = u16::from_ne_bytes(x.try_into().unwrap_or([0; 2]));
                                // The documented formulas, computed independently.
                                let want = match dtype {
                                    DataType::F32 => {
                                        ((f32::from_ne_bytes(x.try_into().unwrap()) as f64 * k as f64) as f32)
                                            .to_ne_bytes()
                                            .to_vec()
                                    }
                                    DataType::F64 => (f64::from_ne_bytes(x.try_into().unwrap()) * factor)
                                        .to_ne_bytes()
                                        .to_vec(),
                                    DataType::F16 => {
                                        f16::from_f32(f16::from_bits(h).to_f32() * k).to_ne_bytes().to_vec()
                                    }
                                    _ => {
                                        bf16::from_f32(bf16::from_bits(h).to_f32() * k).to_ne_bytes().to_vec()
                                    }
                                };
                                assert!(
                                    got == want || (is_nan(dtype, &want) && is_nan(dtype, got)),
                                    "{level:?} {dtype} scale {factor} n {n} offset {offset} [{i}]: {x:02x?} -> {got:02x?}, want {want:02x?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_narrowing_matches_half_bit_for_bit() {
        // Every sign/exponent/top-mantissa pattern (all NaN kinds included) with the low half
        // at each rounding boundary.
        for hi in 0..=u16::MAX as u32 {
            for lo in [0, 1, 0x7fff, 0x8000, 0x8001, 0xc000, 0xffff] {
                let x = hi << 16 | lo;
                assert_eq!(f32_to_bf16_bits(x), bf16::from_f32(f32::from_bits(x)).to_bits(), "{x:#010x}");
            }
        }
    }

    #[test]
    fn f16_chunk_conversions_match_half_bit_for_bit() {
        fn check<I: Isa>(isa: I) {
            // Widening: every f16.
            for base in (0..=u16::MAX).step_by(L16) {
                let x: Chunk = std::array::from_fn(|i| U(f16::from_bits(base + i as u16)));
                let w = isa.f16_widen(&x);
                for i in 0..L16 {
                    let want = x[i].0.to_f32();
                    assert!(
                        w[i].to_bits() == want.to_bits() || (want.is_nan() && w[i].is_nan()),
                        "{:#06x}",
                        base + i as u16
                    );
                }
            }
            // Narrowing: f32s around every f16 rounding boundary, NaNs and overflow included.
            let mut rng = Rng(3);
            for hi in 0..=u16::MAX as u32 {
                let x: [f32; L16] = std::array::from_fn(|i| {
                    let lo = [0, 1, 0x0fff, 0x1000, 0x1001, 0x2000, 0x1fff][i % 7];
                    f32::from_bits(if i < 7 { hi << 16 | lo } else { rng.next() as u32 })
                });
                let n = isa.f16_narrow(&x);
                for i in 0..L16 {
                    assert_eq!(n[i].0.to_bits(), f16::from_f32(x[i]).to_bits(), "{:#010x}", x[i].to_bits());
                }
            }
        }
        check(Portable);
        #[cfg(target_arch = "x86_64")]
        for level in Level::supported() {
            // SAFETY: `supported` lists only levels this CPU has.
            match level {
                Level::Avx2 => check(unsafe { x86::Avx2::new() }),
                Level::Avx512 => check(unsafe { x86::Avx512::new() }),
                Level::Portable => {}
            }
        }
    }

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

    #[test]
    #[should_panic(expected = "not a floating type")]
    fn integer_scale_into_panics() {
        scale_into(DataType::I32, &mut [0; 4], &[0; 4], 0.5);
    }

    #[test]
    #[should_panic(expected = "not a floating type")]
    fn integer_scale_inplace_panics() {
        scale_inplace(DataType::U8, &mut [0; 4], 0.5);
    }

    #[test]
    #[should_panic(expected = "scale_into: length mismatch")]
    fn scale_length_mismatch_panics() {
        scale_into(DataType::F32, &mut [0; 4], &[0; 8], 0.5);
    }
}
