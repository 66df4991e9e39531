//! What a launcher needs beyond `std::process`: CPU affinity (`sched_getaffinity(2)`,
//! `sched_setaffinity(2)`), children that die with their launcher (`prctl(PR_SET_PDEATHSIG)`),
//! signals to a whole process group (`kill(2)` of `-pgid`) and signals caught into a flag
//! (`sigaction(2)`).

use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

/// A signal number, as in `signal(7)` and `ExitStatusExt::signal`.
pub type Signal = libc::c_int;

/// Interrupt from the terminal (Ctrl-C).
pub const SIGINT: Signal = libc::SIGINT;
/// Polite termination request.
pub const SIGTERM: Signal = libc::SIGTERM;
/// The controlling terminal went away.
pub const SIGHUP: Signal = libc::SIGHUP;
/// Termination that cannot be caught.
pub const SIGKILL: Signal = libc::SIGKILL;
/// Stall report (see [`super::signal::SIGUSR1`]), here with the other signals a launcher sends.
pub use super::signal::SIGUSR1;

/// A set of CPUs (`cpu_set_t`).
#[derive(Clone, Copy)]
pub struct CpuSet(libc::cpu_set_t);

impl std::fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CpuSet").field(&self.cpus()).finish()
    }
}

impl CpuSet {
    /// How many CPUs a set can name (indices `0..CAPACITY`).
    pub const CAPACITY: usize = 8 * std::mem::size_of::<libc::cpu_set_t>();

    /// The set of `cpus`; indices from [`CpuSet::CAPACITY`] on are left out.
    pub fn new(cpus: &[usize]) -> CpuSet {
        // SAFETY: an all-zero cpu_set_t is the valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in cpus.iter().filter(|&&c| c < Self::CAPACITY) {
            // SAFETY: CPU_SET writes one bit of `set`, below its capacity (checked above).
            unsafe { libc::CPU_SET(c, &mut set) };
        }
        CpuSet(set)
    }

    /// The CPUs this process may run on (`sched_getaffinity` of the calling thread).
    pub fn allowed() -> io::Result<CpuSet> {
        let mut set = CpuSet::new(&[]);
        // SAFETY: `set.0` is a live cpu_set_t and its exact size is passed.
        super::syscall!(sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set.0))?;
        Ok(set)
    }

    /// Restricts the calling thread to the CPUs of the set (`sched_setaffinity(0)` names the
    /// calling thread on Linux).
    pub fn bind_current_thread(&self) -> io::Result<()> {
        // SAFETY: `self.0` is a live cpu_set_t and its exact size is passed; the kernel reads it.
        super::syscall!(sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.0))?;
        Ok(())
    }

    /// The CPUs in the set, in increasing order.
    pub fn cpus(&self) -> Vec<usize> {
        // SAFETY: CPU_ISSET reads one bit of the set, below its capacity.
        (0..Self::CAPACITY).filter(|&c| unsafe { libc::CPU_ISSET(c, &self.0) }).collect()
    }
}

/// Makes the child that `cmd` starts get SIGKILL when the thread that spawns it exits
/// (`PR_SET_PDEATHSIG`; spawn from a thread that lives as long as the launcher, such as the
/// main thread). The signal survives exec but not fork: the child's own children are not
/// covered. If the launcher died between fork and `prctl`, the signal would never come, so the
/// child also checks that its parent is still the launcher, and the spawn fails (ESRCH) if not.
pub fn kill_child_with_parent(cmd: &mut Command) {
    let launcher = std::process::id() as libc::pid_t;
    let sig = libc::SIGKILL as libc::c_ulong;
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe
    // calls are allowed: prctl, getppid and building an io::Error from errno (no allocation).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Binds the child that `cmd` starts to the CPUs of `set` (`sched_setaffinity` between fork and
/// exec). A failure (a CPU taken away meanwhile) only loses the binding: the child starts anyway.
pub fn bind_child(cmd: &mut Command, set: CpuSet) {
    // SAFETY: the closure runs in the forked child before exec and makes one plain system call
    // (async-signal-safe) that reads the set captured by value.
    unsafe {
        cmd.pre_exec(move || {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set.0);
            Ok(())
        });
    }
}

/// Sends `sig` to every process of the process group `pgid` (`kill(-pgid, sig)`). A `pgid` of
/// 0 (the caller's own group) or beyond `pid_t` is refused with `InvalidInput`.
pub fn kill_group(pgid: u32, sig: Signal) -> io::Result<()> {
    let pgid = libc::pid_t::try_from(pgid)
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a process group id"))?;
    // SAFETY: kill reads no memory of ours.
    super::syscall!(kill(-pgid, sig))?;
    Ok(())
}

/// The last signal [`catch_signals`] recorded (0: none).
static CAUGHT: AtomicI32 = AtomicI32::new(0);

extern "C" fn record(sig: libc::c_int) {
    CAUGHT.store(sig, Ordering::SeqCst);
}

/// From now on, each of `sigs` no longer has its default effect but is recorded, for
/// [`caught_signal`] to report (`SA_RESTART`: interrupted system calls resume).
pub fn catch_signals(sigs: &[Signal]) -> io::Result<()> {
    for &sig in sigs {
        // SAFETY: an all-zero sigaction is valid (no flags, empty mask) before it is set up.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        // SAFETY: `sa.sa_mask` is a live sigset_t.
        unsafe { libc::sigemptyset(&mut sa.sa_mask) };
        // SAFETY: the handler only stores to an atomic (async-signal-safe); sigaction reads the
        // live `sa` and writes no old action (null).
        super::syscall!(sigaction(sig, &sa, std::ptr::null_mut()))?;
    }
    Ok(())
}

/// The last signal caught since the start or the last [`clear_caught_signal`].
pub fn caught_signal() -> Option<Signal> {
    Some(CAUGHT.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

/// Forgets the signals caught so far.
pub fn clear_caught_signal() {
    CAUGHT.store(0, Ordering::SeqCst);
}

/// How many descriptors this process may open (the soft `RLIMIT_NOFILE`); `None` when unlimited
/// or unknown.
pub fn open_files_limit() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a live, writable rlimit for the duration of the call.
    super::syscall!(getrlimit(libc::RLIMIT_NOFILE, &mut lim)).ok()?;
    (lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;

    #[test]
    fn cpu_sets_round_trip_and_this_process_may_run_somewhere() {
        assert_eq!(CpuSet::new(&[0, 3, 5, CpuSet::CAPACITY]).cpus(), [0, 3, 5]);
        assert!(!CpuSet::allowed().unwrap().cpus().is_empty());
    }

    #[test]
    fn a_bound_child_runs_on_its_cpu() {
        let cpu = *CpuSet::allowed().unwrap().cpus().last().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "grep Cpus_allowed_list /proc/self/status"]).stdout(Stdio::piped());
        bind_child(&mut cmd, CpuSet::new(&[cpu]));
        kill_child_with_parent(&mut cmd);
        let out = cmd.output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).split_whitespace().last(), Some(&*cpu.to_string()));
    }

    #[test]
    fn a_group_is_killed_and_group_zero_is_refused() {
        let mut child = Command::new("sleep").arg("30").process_group(0).spawn().unwrap();
        kill_group(child.id(), SIGKILL).unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(SIGKILL));
        assert_eq!(kill_group(0, SIGTERM).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn a_caught_signal_is_recorded_until_cleared() {
        // SIGUSR2: no other test in this process relies on its default action.
        catch_signals(&[libc::SIGUSR2]).unwrap();
        // SAFETY: raise reads no memory of ours; the handler installed above records it.
        assert_eq!(unsafe { libc::raise(libc::SIGUSR2) }, 0);
        assert_eq!(caught_signal(), Some(libc::SIGUSR2));
        clear_caught_signal();
        assert_eq!(caught_signal(), None);
    }
}
