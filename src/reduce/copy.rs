//! The vectorised byte copy used for shared-memory traffic. It lives with the kernels because
//! it shares their run-time CPU check ([`level`](super::kernels::level)).

#[cfg(target_arch = "x86_64")]
use super::kernels::{Level, level};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::testutil::Rng;

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
}
