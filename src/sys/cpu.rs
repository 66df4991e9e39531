//! How many CPUs this machine has online, and how much CPU time this process used.

/// CPUs online on this machine (not this thread's affinity: launchers bind each rank to a few
/// CPUs, and what matters for contention is how many ranks share the machine's CPUs).
pub fn online_cpus() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 { n as usize } else { std::thread::available_parallelism().map_or(1, |n| n.get()) }
}

/// CPU time (user plus system, every thread) this process has used so far
/// (`getrusage(RUSAGE_SELF)`).
pub fn process_cpu_time() -> std::io::Result<std::time::Duration> {
    // SAFETY: `rusage` is plain data, for which all zeroes is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a live, writable `rusage` for the duration of the call; RUSAGE_SELF is a
    // valid `who`.
    super::syscall!(getrusage(libc::RUSAGE_SELF, &mut u))?;
    let d = |t: libc::timeval| {
        std::time::Duration::from_secs(t.tv_sec.max(0) as u64)
            + std::time::Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    Ok(d(u.ru_utime) + d(u.ru_stime))
}

#[cfg(test)]
mod tests {
    #[test]
    fn at_least_the_cpus_this_process_may_use() {
        let mine = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(super::online_cpus() >= mine);
    }

    #[test]
    fn cpu_time_grows_with_work() {
        let a = super::process_cpu_time().unwrap();
        let mut x = 0u64;
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(30) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(super::process_cpu_time().unwrap() > a);
    }
}
