//! Waiting on a 32-bit word that another process may change (`futex(2)`, shared form: the word
//! may live in memory mapped by several processes).

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `*word == expected`, at most `timeout`. Returns early (spuriously, or because
/// the word changed, or on a signal); the caller re-checks the word.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned 32-bit atomic for the duration of the call and `ts` a
    // live timespec; FUTEX_WAIT only reads them.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every waiter sleeping on `word`.
pub fn wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE does not dereference memory
    // beyond the word's address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<u32>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn a_wake_ends_a_wait_and_a_changed_word_does_not_sleep() {
        let w = Arc::new(AtomicU32::new(0));
        let w2 = w.clone();
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            while w2.load(Ordering::Acquire) == 0 {
                wait(&w2, 0, Duration::from_secs(10));
            }
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(20));
        w.store(1, Ordering::Release);
        wake(&w);
        assert!(t.join().unwrap() < Duration::from_secs(5));
        let start = Instant::now();
        wait(&w, 0, Duration::from_secs(10)); // the word is 1: returns at once
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
