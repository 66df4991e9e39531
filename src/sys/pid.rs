//! Whether a process exists (`kill(2)` with signal 0).

/// True when process `pid` exists: running, stopped, or exited but not yet reaped by its
/// parent, and whether or not this process may signal it. False when no such process exists
/// (`ESRCH`) and for 0 and values above `i32::MAX`, which name no single process.
pub fn exists(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    if pid == 0 {
        return false;
    }
    // Signal 0 sends nothing: the kernel only looks the process up.
    match super::syscall!(kill(pid, 0)) {
        Ok(_) => true,
        Err(e) => e.raw_os_error() != Some(libc::ESRCH),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_exists_and_a_reaped_child_does_not() {
        assert!(exists(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!exists(pid));
        assert!(!exists(0) && !exists(u32::MAX));
    }
}
