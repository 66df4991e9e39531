//! An event descriptor (`eventfd(2)`): a counter that makes the descriptor readable once
//! signalled, so a thread sleeping in `poll(2)` on it wakes up.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// A non-blocking, close-on-exec event descriptor.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A fresh event that has not been signalled.
    pub fn new() -> io::Result<EventFd> {
        let fd = super::syscall!(eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK))?;
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Makes the descriptor readable. Never blocks: a full counter (`EAGAIN`) still leaves it
    /// readable, which is all a waiter needs.
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own descriptor.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Resets the counter, so that the descriptor is readable again only after the next
    /// [`EventFd::signal`]. Never blocks (the descriptor is non-blocking).
    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64 from our own descriptor.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::poll::{PollFd, poll};

    #[test]
    fn readable_only_after_a_signal() {
        let e = EventFd::new().unwrap();
        let mut fds = [PollFd::new(e.as_raw_fd(), PollFd::IN)];
        assert_eq!(poll(&mut fds, 0).unwrap(), 0);
        e.signal();
        e.signal();
        assert_eq!(poll(&mut fds, 1000).unwrap(), 1);
        assert!(fds[0].revents() & PollFd::IN != 0);
        e.drain();
        assert_eq!(poll(&mut fds, 0).unwrap(), 0);
        e.drain();
    }
}
