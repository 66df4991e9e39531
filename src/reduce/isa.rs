//! Instruction-set tokens: what differs between levels beyond the compiler flags.
//!
//! The generic loops in `elem` and `halves` take a token type `I: Isa`; `kernels` instantiates
//! them once per level, inside functions compiled with that level's `#[target_feature]`s.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::elem::U;
use super::halves::L16;

/// What differs between instruction-set levels beyond the compiler flags: the `f16` chunk
/// conversions. A token is only created inside an entry point compiled for its level, which is
/// only called after the CPU was checked, so its methods may use that level's intrinsics.
pub(super) trait Isa: Copy {
    /// Whether a masked store is slow enough to avoid (see
    /// [`Combine::BLEND`](super::ops::Combine::BLEND)). AVX2's
    /// `vmaskmovps` is microcoded on AMD; AVX-512 masked stores are fast everywhere and SSE2
    /// has none.
    const SLOW_MASKED_STORE: bool = false;
    fn f16_widen(self, x: &[U<f16>; L16]) -> [f32; L16];
    fn f16_narrow(self, x: &[f32; L16]) -> [U<f16>; L16];
}

/// Baseline: `half`'s slice conversions, which use F16C or NEON `fp16` when the CPU has them
/// (one cached check per chunk rather than per element) and software otherwise.
#[derive(Clone, Copy)]
pub(super) struct Portable;

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
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::{Isa, L16, U, f16};

    /// AVX2 + FMA + F16C (Haswell, Zen 1 and later). The private field keeps construction here.
    #[derive(Clone, Copy)]
    pub(in crate::reduce) struct Avx2(());

    /// AVX-512 F/BW/VL/DQ on top of [`Avx2`] (Skylake-SP, Ice Lake, Zen 4 and later).
    #[derive(Clone, Copy)]
    pub(in crate::reduce) struct Avx512(());

    impl Avx2 {
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C.
        #[inline(always)]
        pub(in crate::reduce) unsafe fn new() -> Self {
            Avx2(())
        }
    }

    impl Avx512 {
        /// # Safety
        /// The CPU must support AVX2, FMA, F16C and AVX-512 F, BW, VL and DQ.
        #[inline(always)]
        pub(in crate::reduce) unsafe fn new() -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "x86_64")]
    use crate::reduce::kernels::Level;
    use crate::reduce::testutil::Rng;

    #[test]
    fn f16_chunk_conversions_match_half_bit_for_bit() {
        fn check<I: Isa>(isa: I) {
            // Widening: every f16.
            for base in (0..=u16::MAX).step_by(L16) {
                let x: [U<f16>; L16] = std::array::from_fn(|i| U(f16::from_bits(base + i as u16)));
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
}
