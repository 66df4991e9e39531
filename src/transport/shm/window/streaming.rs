//! Streaming (non-temporal) copies for large outputs of window collectives, and the size of the
//! last-level cache that decides when they pay.

/// Bytes of the last-level cache (for choosing streaming stores): the largest cache sysfs lists
/// for CPU 0 (`sysconf` is not trusted: under KVM glibc reports the host's total), 32 MiB when
/// unknown. Read once.
pub fn last_level_cache() -> usize {
    static LLC: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LLC.get_or_init(|| {
        let parse = |s: &str| {
            let s = s.trim();
            let (num, mult) = match s.chars().last() {
                Some('K') => (&s[..s.len() - 1], 1 << 10),
                Some('M') => (&s[..s.len() - 1], 1 << 20),
                _ => (s, 1),
            };
            num.parse::<usize>().ok().map(|v| v * mult)
        };
        (0..8)
            .filter_map(|i| {
                std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size")).ok()
            })
            .filter_map(|s| parse(&s))
            .max()
            .unwrap_or(32 << 20)
    })
}

/// Copies `src` to `dst` with non-temporal (streaming) stores: the destination is written to
/// memory without first being read into the cache (no read-for-ownership) and without evicting
/// useful lines. Worth it only for outputs that will not be read again soon and do not fit in
/// the cache anyway: a large collective's output. Falls back to a plain copy off x86-64.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: length mismatch");
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked); the slices are valid and of equal length.
            unsafe { stream_avx2(dst, src) };
        } else {
            // SAFETY: SSE2 is part of x86-64; the slices are valid and of equal length.
            unsafe { stream_sse2(dst, src) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Splits `dst` into a head that brings it to `align`, a body of whole `step`s and a tail.
#[cfg(target_arch = "x86_64")]
fn stream_split(dst: &[u8], align: usize, step: usize) -> (usize, usize) {
    let head = (align - dst.as_ptr() as usize % align) % align;
    let head = head.min(dst.len());
    let body = (dst.len() - head) / step * step;
    (head, body)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm_sfence, _mm256_loadu_si256, _mm256_stream_si256};
    let (head, body) = stream_split(dst, 32, 128);
    dst[..head].copy_from_slice(&src[..head]);
    let mut i = head;
    while i < head + body {
        // SAFETY: `i + 128 <= head + body <= len`; `dst + i` is 32-byte aligned (head brings it
        // there and steps are multiples of 32); loads are unaligned.
        unsafe {
            let s = src.as_ptr().add(i) as *const __m256i;
            let d = dst.as_mut_ptr().add(i) as *mut __m256i;
            let (a, b, c, e) = (
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            );
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
            _mm256_stream_si256(d.add(2), c);
            _mm256_stream_si256(d.add(3), e);
        }
        i += 128;
    }
    dst[i..].copy_from_slice(&src[i..]);
    // Streaming stores are weakly ordered: make them visible before anything that follows
    // (the collective's completion, which another thread may observe).
    _mm_sfence();
}

#[cfg(target_arch = "x86_64")]
unsafe fn stream_sse2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let (head, body) = stream_split(dst, 16, 64);
    dst[..head].copy_from_slice(&src[..head]);
    let mut i = head;
    while i < head + body {
        // SAFETY: as in `stream_avx2`, with 16-byte alignment and 64-byte steps.
        unsafe {
            let s = src.as_ptr().add(i) as *const __m128i;
            let d = dst.as_mut_ptr().add(i) as *mut __m128i;
            for k in 0..4 {
                _mm_stream_si128(d.add(k), _mm_loadu_si128(s.add(k)));
            }
        }
        i += 64;
    }
    dst[i..].copy_from_slice(&src[i..]);
    // SAFETY: sfence has no preconditions.
    unsafe { _mm_sfence() };
}
