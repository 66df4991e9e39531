//! `poll(2)`: sleep until one of several descriptors is ready, a timeout, or a signal.

use std::io;
use std::os::fd::RawFd;

/// The events of one descriptor (`struct pollfd`).
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub struct PollFd(libc::pollfd);

/// Event bits, as in `poll(2)`.
pub type Events = libc::c_short;

impl PollFd {
    /// Data to read.
    pub const IN: Events = libc::POLLIN;
    /// Urgent data (used to ask for a look at an idle link).
    pub const PRI: Events = libc::POLLPRI;
    /// Room to write.
    pub const OUT: Events = libc::POLLOUT;
    /// The peer closed its writing side.
    pub const RDHUP: Events = libc::POLLRDHUP;
    /// Hang-up (output only).
    pub const HUP: Events = libc::POLLHUP;
    /// Error (output only).
    pub const ERR: Events = libc::POLLERR;

    /// Waits for `events` on `fd`.
    pub fn new(fd: RawFd, events: Events) -> PollFd {
        PollFd(libc::pollfd { fd, events, revents: 0 })
    }

    /// The events asked for.
    pub fn events(&self) -> Events {
        self.0.events
    }

    /// The events that happened (after [`poll`]).
    pub fn revents(&self) -> Events {
        self.0.revents
    }
}

/// Polls `fds` for up to `timeout_ms` milliseconds (0: do not sleep; negative: forever).
/// Returns how many descriptors have events; an interrupted sleep (EINTR) returns `Ok(0)`, so
/// callers re-check their own state and deadline.
pub fn poll(fds: &mut [PollFd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: `PollFd` is a transparent `pollfd`; `fds` is an exclusively borrowed, initialised
    // slice that outlives the call, and its exact length is passed with it.
    let n = unsafe { libc::poll(fds.as_mut_ptr().cast(), fds.len() as libc::nfds_t, timeout_ms) };
    if n >= 0 {
        return Ok(n as usize);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::Interrupted { Ok(0) } else { Err(e) }
}
