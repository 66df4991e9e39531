//! Element storage: unaligned views of byte buffers, and the [`Elem`] trait whose generic loops
//! every kernel is built from.
//!
//! The loops are written once, as plain iterator code that LLVM vectorises; `kernels` compiles
//! them once per instruction-set level. `halves` overrides them for `f16` and `bf16`.

use super::isa::Isa;
use super::ops::{Combine, Fn1};

/// One element at any address: `repr(packed)` gives alignment 1, so a `&[u8]` of whole elements
/// is a valid `&[U<T>]` and the compiler emits unaligned loads (as fast as aligned ones on any
/// x86 since Nehalem when no cache line is split).
#[derive(Clone, Copy)]
#[repr(C, packed)]
pub(super) struct U<T: Copy>(pub(super) T);

#[inline]
pub(super) fn view<T: bytemuck::Pod>(b: &[u8]) -> &[U<T>] {
    // SAFETY: U<T> has T's size and alignment 1, so the pointer is suitably aligned and the
    // range covers `len` whole elements inside `b`; T is Pod, so every bit pattern is a value.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len() / size_of::<T>()) }
}

#[inline]
pub(super) fn view_mut<T: bytemuck::Pod>(b: &mut [u8]) -> &mut [U<T>] {
    // SAFETY: as in `view`; the exclusive borrow of `b` moves to the result.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast(), b.len() / size_of::<T>()) }
}

/// A storage type and the type its ops compute in (`W`: `f32` for halves, itself otherwise).
///
/// The default loops are what LLVM vectorises; they take the ISA token only so that `f16` can
/// override them with explicit F16C conversions.
pub(super) trait Elem: bytemuck::Pod {
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

/// Integers and `f32`/`f64` compute in themselves: widening and narrowing are the identity.
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
