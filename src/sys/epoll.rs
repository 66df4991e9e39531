//! `epoll(7)` as a set of descriptors that is itself one descriptor: readable (for `poll(2)`)
//! when any member is ready for what it was registered with. A striped connection sleeps on
//! its reading lane and its writing lane at once through one such set; the store's server
//! waits on it for its connections ([`EpollSet::wait`]), so a round costs what is ready, not
//! every connection it holds.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Readiness bits, as in `epoll_ctl(2)`.
pub type Interest = u32;

/// Data to read.
pub const IN: Interest = libc::EPOLLIN as Interest;
/// Room to write.
pub const OUT: Interest = libc::EPOLLOUT as Interest;
/// The peer closed its writing side.
pub const RDHUP: Interest = libc::EPOLLRDHUP as Interest;

/// A close-on-exec epoll instance.
#[derive(Debug)]
pub struct EpollSet {
    fd: OwnedFd,
}

impl EpollSet {
    /// An empty set.
    pub fn new() -> io::Result<EpollSet> {
        let fd = super::syscall!(epoll_create1(libc::EPOLL_CLOEXEC))?;
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(EpollSet { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Adds `fd`, ready for `interest` (errors and hang-ups are always reported).
    pub fn add(&self, fd: RawFd, interest: Interest) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, interest)
    }

    /// Changes what member `fd` is ready for.
    pub fn modify(&self, fd: RawFd, interest: Interest) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, interest)
    }

    /// Waits until members are ready or `timeout_ms` passes (-1: no limit), and puts what is
    /// ready in `ready` (at most its capacity). An interrupted wait reports nothing.
    pub fn wait(&self, ready: &mut ReadyList, timeout_ms: i32) -> io::Result<()> {
        ready.n = 0;
        let cap = libc::c_int::try_from(ready.buf.len()).unwrap_or(libc::c_int::MAX);
        // SAFETY: `buf` holds `cap` initialised events the kernel may overwrite; it writes at
        // most `cap` and returns how many.
        match super::syscall!(epoll_wait(self.fd.as_raw_fd(), ready.buf.as_mut_ptr(), cap, timeout_ms)) {
            Ok(n) => ready.n = n as usize,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        Ok(())
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, interest: Interest) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: interest, u64: fd as u64 };
        // SAFETY: `ev` is a live, initialised event for the duration of the call; the kernel
        // copies it. A bad `fd` is an error (EBADF), not undefined behaviour.
        super::syscall!(epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev))?;
        Ok(())
    }
}

/// What [`EpollSet::wait`] found ready: each member's descriptor and its readiness bits.
pub struct ReadyList {
    buf: Vec<libc::epoll_event>,
    n: usize,
}

impl std::fmt::Debug for ReadyList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl ReadyList {
    /// Room for `cap` ready members per wait (at least one).
    pub fn with_capacity(cap: usize) -> ReadyList {
        ReadyList { buf: vec![libc::epoll_event { events: 0, u64: 0 }; cap.max(1)], n: 0 }
    }

    /// The members found ready by the last wait: (descriptor, readiness).
    pub fn iter(&self) -> impl Iterator<Item = (RawFd, Interest)> + '_ {
        self.buf[..self.n].iter().map(|e| (e.u64 as RawFd, e.events))
    }
}

impl AsRawFd for EpollSet {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::poll::{PollFd, poll};
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn the_set_is_readable_only_when_a_member_is_ready_for_its_interest() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let set = EpollSet::new().unwrap();
        set.add(b.as_raw_fd(), IN).unwrap();
        let mut fds = [PollFd::new(set.as_raw_fd(), PollFd::IN)];
        assert_eq!(poll(&mut fds, 0).unwrap(), 0, "nothing to read yet");
        a.write_all(b"x").unwrap();
        assert_eq!(poll(&mut fds, 1000).unwrap(), 1);
        set.modify(b.as_raw_fd(), 0).unwrap();
        assert_eq!(poll(&mut fds, 0).unwrap(), 0, "no interest, no readiness");
        set.modify(b.as_raw_fd(), OUT).unwrap();
        assert_eq!(poll(&mut fds, 1000).unwrap(), 1, "room to write");
    }

    #[test]
    fn wait_names_the_ready_members() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let (_c, d) = UnixStream::pair().unwrap();
        let set = EpollSet::new().unwrap();
        set.add(b.as_raw_fd(), IN).unwrap();
        set.add(d.as_raw_fd(), IN).unwrap();
        let mut ready = ReadyList::with_capacity(4);
        set.wait(&mut ready, 0).unwrap();
        assert_eq!(ready.iter().count(), 0);
        a.write_all(b"x").unwrap();
        set.wait(&mut ready, 1000).unwrap();
        let got: Vec<_> = ready.iter().collect();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, b.as_raw_fd());
        assert_ne!(got[0].1 & IN, 0);
    }
}
