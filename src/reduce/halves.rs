//! The half-precision element types, `bf16` and `f16`: each element is widened to `f32`,
//! combined there and rounded back to nearest even, so the result is exactly
//! `T::from_f32(op(a.to_f32(), b.to_f32()))` and a sum never overflows in a narrower
//! intermediate. What differs is how the conversions vectorise: `bf16` is integer arithmetic on
//! pairs of elements, `f16` needs the ISA's conversion instructions, 16 lanes at a time.

use half::{bf16, f16};

use super::elem::{Elem, U};
use super::isa::Isa;
use super::ops::{Combine, Fn1, Fn2};

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
pub(super) const L16: usize = 16;
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
