//! A signal turned into an event a thread can wait for: the handler only writes to an eventfd
//! (`write(2)` is async-signal-safe; nothing else is safe in a handler: no lock, no allocation,
//! no logging), and an ordinary thread does the work. Used for `SIGUSR1` (print the stall report
//! of every live communicator) and by `toroid-run` to pass a signal on to a rank.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicI32, Ordering};

use super::eventfd::EventFd;
use super::poll::{PollFd, poll};

/// The user signal that asks for a stall report (`TOROID_DUMP_ON_SIGNAL`; `toroid-run` passes
/// it on to every rank).
pub const SIGUSR1: libc::c_int = libc::SIGUSR1;

/// Per signal number, the descriptor its handler writes to (-1: none).
static TARGETS: [AtomicI32; 65] = [const { AtomicI32::new(-1) }; 65];

fn target(sig: libc::c_int) -> Option<&'static AtomicI32> {
    usize::try_from(sig).ok().and_then(|i| TARGETS.get(i))
}

extern "C" fn on_signal(sig: libc::c_int) {
    let fd = target(sig).map_or(-1, |t| t.load(Ordering::Relaxed));
    if fd < 0 {
        return;
    }
    // SAFETY: errno is thread-local; the handler saves and restores it around write(2), which
    // is async-signal-safe and writes 8 bytes from a live u64.
    unsafe {
        let errno = *libc::__errno_location();
        let one: u64 = 1;
        libc::write(fd, (&one as *const u64).cast(), 8);
        *libc::__errno_location() = errno;
    }
}

/// The one event a signal fires (one per signal and process: handlers are process-wide).
#[derive(Debug)]
pub struct SignalEvent {
    event: EventFd,
}

impl SignalEvent {
    /// Makes `sig` fire the returned event, unless the program already handles or ignores `sig`
    /// (then `Ok(None)`: its own handler stays). Call once per process: the event is leaked, as
    /// the handler may run at any time until the process ends.
    pub fn install(sig: libc::c_int) -> io::Result<Option<&'static SignalEvent>> {
        // SAFETY: an all-zero sigaction is valid; sigaction writes the current one into it.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: reads the current action into the live `old` (no new action: null).
        super::syscall!(sigaction(sig, std::ptr::null(), &mut old))?;
        if old.sa_sigaction != libc::SIG_DFL {
            return Ok(None);
        }
        let slot = target(sig).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let ev: &'static SignalEvent = Box::leak(Box::new(SignalEvent { event: EventFd::new()? }));
        if slot.compare_exchange(-1, ev.event.as_raw_fd(), Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return Ok(None);
        }
        // SAFETY: an all-zero sigaction is valid (no flags, empty mask) before it is set up.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        // SAFETY: `sa.sa_mask` is a live sigset_t.
        unsafe { libc::sigemptyset(&mut sa.sa_mask) };
        // SAFETY: the handler only writes to an eventfd (async-signal-safe); sigaction reads the
        // live `sa` and writes no old action (null).
        super::syscall!(sigaction(sig, &sa, std::ptr::null_mut()))?;
        Ok(Some(ev))
    }

    /// Blocks until the signal arrived (once or more) since the last call.
    pub fn wait(&self) -> io::Result<()> {
        let fd = self.event.as_raw_fd();
        loop {
            let mut fds = [PollFd::new(fd, PollFd::IN)];
            match poll(&mut fds, -1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let mut count = 0u64;
            // SAFETY: reads at most 8 bytes into a live u64 from our own non-blocking eventfd.
            let n = unsafe { libc::read(fd, (&mut count as *mut u64).cast(), 8) };
            if n == 8 {
                return Ok(());
            }
        }
    }
}

/// Sends `sig` to the one process `pid` (not its group: a rank's exec'd children keep the
/// default action of `SIGUSR1`, which ends them). ESRCH (gone) is not an error.
pub fn send(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    match super::syscall!(kill(pid, sig)) {
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
        r => r.map(|_| ()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_fires_the_event() {
        // SIGWINCH (default: ignored): no other test of this binary touches it.
        let ev = SignalEvent::install(libc::SIGWINCH).unwrap().expect("default action before");
        send(std::process::id(), libc::SIGWINCH).unwrap();
        send(std::process::id(), libc::SIGWINCH).unwrap();
        ev.wait().unwrap();
        // Both were folded into one wake-up; a second install is refused (the handler is taken).
        let mut fds = [PollFd::new(ev.event.as_raw_fd(), PollFd::IN)];
        assert_eq!(poll(&mut fds, 0).unwrap(), 0);
        assert!(SignalEvent::install(libc::SIGWINCH).unwrap().is_none());
    }
}
