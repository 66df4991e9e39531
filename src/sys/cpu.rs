//! How many CPUs this machine has online.

/// CPUs online on this machine (not this thread's affinity: launchers bind each rank to a few
/// CPUs, and what matters for contention is how many ranks share the machine's CPUs).
pub fn online_cpus() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 { n as usize } else { std::thread::available_parallelism().map_or(1, |n| n.get()) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn at_least_the_cpus_this_process_may_use() {
        let mine = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(super::online_cpus() >= mine);
    }
}
