//! A connected pair of Unix stream sockets (`socketpair(2)`) and the calls that move bytes on
//! them without blocking. The calls work on any connected stream socket.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Two connected, non-blocking, close-on-exec Unix stream sockets.
pub fn stream_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // `fds` is a live array of the two ints the call fills in.
    super::syscall!(socketpair(
        libc::AF_UNIX,
        libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        0,
        fds.as_mut_ptr()
    ))?;
    // SAFETY: both descriptors are fresh and owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends bytes from `buf` without blocking (`MSG_DONTWAIT`) and without `SIGPIPE` when the peer
/// has gone (`MSG_NOSIGNAL`: an `EPIPE` error instead). Returns the bytes sent.
pub fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // `buf` is a live buffer of `buf.len()` bytes that the call only reads.
    let n = super::syscall!(send(
        fd.as_raw_fd(),
        buf.as_ptr().cast(),
        buf.len(),
        libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL
    ))?;
    Ok(n as usize)
}

/// Receives bytes into `buf` without blocking; `Ok(0)` is end of stream (for a non-empty
/// `buf`), `WouldBlock` means nothing has arrived.
pub fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    recv_flags(fd, buf, libc::MSG_DONTWAIT)
}

/// As [`recv`], leaving the bytes in the socket (`MSG_PEEK`).
pub fn peek(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    recv_flags(fd, buf, libc::MSG_DONTWAIT | libc::MSG_PEEK)
}

fn recv_flags(fd: BorrowedFd<'_>, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    // `buf` is a live, exclusively borrowed buffer of `buf.len()` bytes.
    let n = super::syscall!(recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), flags))?;
    Ok(n as usize)
}

/// Ends the sending direction: the peer reads end of stream after the bytes already sent.
pub fn shutdown_write(fd: BorrowedFd<'_>) -> io::Result<()> {
    // Plain integers on a descriptor that `fd` keeps open.
    super::syscall!(shutdown(fd.as_raw_fd(), libc::SHUT_WR)).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn bytes_cross_peek_keeps_them_and_shutdown_ends_the_stream() {
        let (a, b) = stream_pair().unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(recv(b.as_fd(), &mut buf).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert_eq!(send(a.as_fd(), b"hello").unwrap(), 5);
        assert_eq!(peek(b.as_fd(), &mut buf).unwrap(), 5);
        assert_eq!(recv(b.as_fd(), &mut buf[..2]).unwrap(), 2);
        assert_eq!(&buf[..2], b"he");
        shutdown_write(a.as_fd()).unwrap();
        assert_eq!(recv(b.as_fd(), &mut buf).unwrap(), 3);
        assert_eq!(&buf[..3], b"llo");
        assert_eq!(recv(b.as_fd(), &mut buf).unwrap(), 0, "end of stream");
        // SAFETY: F_GETFD reads the descriptor's flags; no memory is involved.
        let fl = unsafe { libc::fcntl(a.as_raw_fd(), libc::F_GETFD) };
        assert!(fl & libc::FD_CLOEXEC != 0, "close-on-exec");
    }

    #[test]
    fn sending_to_a_closed_peer_is_an_error_not_a_signal() {
        let (a, b) = stream_pair().unwrap();
        drop(b);
        assert_eq!(send(a.as_fd(), b"x").unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_full_socket_would_block() {
        let (a, _b) = stream_pair().unwrap();
        let chunk = [0u8; 65536];
        let mut sent = 0usize;
        let e = loop {
            match send(a.as_fd(), &chunk) {
                Ok(n) => sent += n,
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "after {sent} bytes");
    }
}
