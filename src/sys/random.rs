//! Random bytes from the kernel (`getrandom(2)`): nonces of the authenticated handshake,
//! communicator ids and shared-memory segment names.

use std::io;

/// Fills `buf` with random bytes from the kernel's generator.
pub fn fill(buf: &mut [u8]) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let rest = &mut buf[got..];
        // SAFETY: writes at most `rest.len()` bytes into the live, exclusively borrowed `rest`.
        let r = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        } else {
            got += r as usize;
        }
    }
    Ok(())
}

/// A random 64-bit id. Falls back to std's per-process random hash keys mixed with the time,
/// the process id and a counter if the kernel's generator is unavailable (ids need to be
/// unique, not secret).
pub fn id() -> u64 {
    let mut b = [0u8; 8];
    if fill(&mut b).is_ok() {
        return u64::from_le_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    h.write_u128(now.map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_differ_and_bytes_are_not_all_zero() {
        let ids: std::collections::HashSet<u64> = (0..1000).map(|_| super::id()).collect();
        assert_eq!(ids.len(), 1000);
        let mut b = [0u8; 64];
        super::fill(&mut b).unwrap();
        assert!(b.iter().any(|x| *x != 0));
    }
}
