//! The kernels per instruction-set level and the run-time choice between them.
//!
//! The crate is built for baseline x86-64 (SSE2), so the generic loops of [`Elem`] are
//! instantiated three times: portable, and inside `#[target_feature]` functions for AVX2 (+FMA,
//! F16C) and AVX-512 (F, BW, VL, DQ). The CPU is probed once ([`level`]) and [`Level`]'s
//! methods jump to the matching copy.

use std::sync::atomic::{AtomicU8, Ordering};

use super::elem::{Elem, U};
use super::isa::Portable;
#[cfg(target_arch = "x86_64")]
use super::isa::x86;
use super::ops::{Combine, Fn1};

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
pub(super) enum Level {
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
    pub(super) fn supported() -> Vec<Level> {
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
    pub(super) unsafe fn zip<T: Elem, F: Combine<T::W>>(self, d: &mut [U<T>], a: &[U<T>], b: &[U<T>]) {
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
    pub(super) unsafe fn zip_inplace<T: Elem, F: Combine<T::W>>(self, d: &mut [U<T>], b: &[U<T>]) {
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
    pub(super) unsafe fn map<T: Elem>(self, d: &mut [U<T>], s: &[U<T>], f: impl Fn1<T::W>) {
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
    pub(super) unsafe fn map_inplace<T: Elem>(self, d: &mut [U<T>], f: impl Fn1<T::W>) {
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
pub(super) fn level() -> Level {
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

    #[test]
    fn level_is_detected_once_and_swept_by_the_tests() {
        let first = level();
        assert_eq!(first, Level::detect());
        assert_eq!(level(), first, "from the cache");
        assert_eq!(Level::supported().last(), Some(&first));
    }
}
