//! What std does not offer on TCP sockets: buffer sizes and congestion control
//! (`setsockopt(2)`/`getsockopt(2)`), a larger listen backlog, and non-blocking vectored I/O that
//! never raises `SIGPIPE` (`sendmsg(2)`/`recvmsg(2)`/`recv(2)` with `MSG_DONTWAIT`,
//! `MSG_NOSIGNAL`, `MSG_PEEK`). `TCP_NODELAY`, `O_NONBLOCK`, timeouts and shutdown are std's.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd};

use libc::{c_int, socklen_t};

/// Sets an integer socket option.
fn set_int(fd: BorrowedFd<'_>, level: c_int, opt: c_int, v: c_int) -> io::Result<()> {
    // SAFETY: `v` lives across the call and its size is passed; the kernel copies it.
    super::syscall!(setsockopt(
        fd.as_raw_fd(),
        level,
        opt,
        (&v as *const c_int).cast(),
        std::mem::size_of::<c_int>() as socklen_t
    ))?;
    Ok(())
}

#[cfg(test)]
/// Reads an integer socket option.
fn get_int(fd: BorrowedFd<'_>, level: c_int, opt: c_int) -> io::Result<c_int> {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: `v` and `len` live across the call; `len` holds `v`'s size, so the kernel writes
    // at most that many bytes.
    super::syscall!(getsockopt(fd.as_raw_fd(), level, opt, (&mut v as *mut c_int).cast(), &mut len))?;
    Ok(v)
}

/// Pins the send and then the receive buffer (`SO_SNDBUF`, `SO_RCVBUF`) to `bytes` (at most
/// `i32::MAX`), which turns Linux autotuning off for this socket; the kernel doubles the value
/// for its bookkeeping and caps it at `net.core.wmem_max`/`rmem_max`.
pub fn set_buffer_sizes(fd: BorrowedFd<'_>, bytes: usize) -> io::Result<()> {
    let v = bytes.min(i32::MAX as usize) as c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        set_int(fd, libc::SOL_SOCKET, opt, v)?;
    }
    Ok(())
}

#[cfg(test)]
/// The send and receive buffer sizes as the kernel reports them (`SO_SNDBUF`, `SO_RCVBUF`).
pub fn buffer_sizes(fd: BorrowedFd<'_>) -> io::Result<(usize, usize)> {
    let get = |opt| get_int(fd, libc::SOL_SOCKET, opt).map(|v| v.max(0) as usize);
    Ok((get(libc::SO_SNDBUF)?, get(libc::SO_RCVBUF)?))
}

/// Sets the connection's congestion control (`TCP_CONGESTION`) by name, e.g. `cubic`.
pub fn set_congestion(fd: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    // SAFETY: `name` lives across the call and its length is passed; the kernel copies it.
    super::syscall!(setsockopt(
        fd.as_raw_fd(),
        libc::IPPROTO_TCP,
        libc::TCP_CONGESTION,
        name.as_ptr().cast(),
        name.len() as socklen_t
    ))?;
    Ok(())
}

/// Caps the connection's sending rate at `bytes_per_sec` (`SO_MAX_PACING_RATE`). Without the
/// `fq` qdisc TCP paces the socket itself (Linux 4.13 and later), so the cap holds on any
/// interface.
pub fn set_max_pacing_rate(fd: BorrowedFd<'_>, bytes_per_sec: u64) -> io::Result<()> {
    let rate: u64 = bytes_per_sec;
    // SAFETY: `rate` lives across the call and its size is passed; the kernel copies it (it
    // takes a u32 or a u64 by the length given).
    super::syscall!(setsockopt(
        fd.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_MAX_PACING_RATE,
        (&rate as *const u64).cast(),
        std::mem::size_of::<u64>() as socklen_t
    ))?;
    Ok(())
}

#[cfg(test)]
/// The connection's congestion control as the kernel reports it (`TCP_CONGESTION`).
pub fn congestion(fd: BorrowedFd<'_>) -> io::Result<String> {
    let mut buf = [0u8; 16];
    let mut len = buf.len() as socklen_t;
    // SAFETY: `buf` and `len` live across the call; `len` holds `buf`'s size.
    super::syscall!(getsockopt(
        fd.as_raw_fd(),
        libc::IPPROTO_TCP,
        libc::TCP_CONGESTION,
        buf.as_mut_ptr().cast(),
        &mut len
    ))?;
    let name = &buf[..(len as usize).min(buf.len())];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// Lets a listening socket queue up to `backlog` connections (at most `i32::MAX`; the kernel
/// caps it at `net.core.somaxconn`): `listen(2)` again, which only changes the backlog.
pub fn set_backlog(fd: BorrowedFd<'_>, backlog: usize) -> io::Result<()> {
    let n = backlog.min(i32::MAX as usize) as c_int;
    // SAFETY: no pointers.
    super::syscall!(listen(fd.as_raw_fd(), n))?;
    Ok(())
}

/// A header naming only `iov` (no address, no control data).
fn msghdr(iov: *mut libc::iovec, n: usize) -> libc::msghdr {
    // SAFETY: all-zero is a valid msghdr: null pointers and zero lengths.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = n as _;
    msg
}

/// Sends what the socket takes now from `bufs`, in order (`sendmsg(2)` with `MSG_DONTWAIT |
/// MSG_NOSIGNAL`): never blocks (`WouldBlock` when full) and reports a closed peer as
/// `BrokenPipe` instead of raising `SIGPIPE` in the host process.
pub fn send_vectored(fd: BorrowedFd<'_>, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // IoSlice is guaranteed ABI-compatible with iovec; sendmsg only reads through the pointer.
    let msg = msghdr(bufs.as_ptr() as *mut libc::iovec, bufs.len());
    // SAFETY: `msg` names `bufs.len()` iovecs that point into buffers borrowed for the call.
    let n = super::syscall!(sendmsg(fd.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL))?;
    Ok(n as usize)
}

/// Receives what has arrived into `bufs`, in order (`recvmsg(2)` with `MSG_DONTWAIT`): never
/// blocks (`WouldBlock` when nothing is there); `Ok(0)` means the peer closed.
pub fn recv_vectored(fd: BorrowedFd<'_>, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
    // IoSliceMut is guaranteed ABI-compatible with iovec.
    let mut msg = msghdr(bufs.as_mut_ptr().cast(), bufs.len());
    // SAFETY: `msg` names `bufs.len()` iovecs that point into buffers exclusively borrowed for
    // the call, each with its own length.
    let n = super::syscall!(recvmsg(fd.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT))?;
    Ok(n as usize)
}

/// [`recv_vectored`] into memory that need not be initialised (a ring buffer's free slots):
/// the kernel writes the first `n` bytes of `a` then `b`, and `Ok(n)` says how many; the rest
/// stays as it was. `Ok(0)` means the peer closed.
pub fn recv_uninit(
    fd: BorrowedFd<'_>,
    a: &mut [std::mem::MaybeUninit<u8>],
    b: &mut [std::mem::MaybeUninit<u8>],
) -> io::Result<usize> {
    let mut iov = [
        libc::iovec { iov_base: a.as_mut_ptr().cast(), iov_len: a.len() },
        libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: b.len() },
    ];
    let n = if b.is_empty() { 1 } else { 2 };
    let mut msg = msghdr(iov.as_mut_ptr(), n);
    // SAFETY: `msg` names `n` iovecs over `a` and `b`, exclusively borrowed for the call with
    // their own lengths; the kernel only writes into them (uninitialised bytes are fine).
    let n = super::syscall!(recvmsg(fd.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT))?;
    Ok(n as usize)
}

/// Copies what has arrived into `buf` without consuming it (`recv(2)` with `MSG_PEEK |
/// MSG_DONTWAIT`).
pub fn peek(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, exclusively borrowed buffer of `buf.len()` bytes.
    let n = super::syscall!(recv(
        fd.as_raw_fd(),
        buf.as_mut_ptr().cast(),
        buf.len(),
        libc::MSG_PEEK | libc::MSG_DONTWAIT
    ))?;
    Ok(n as usize)
}

/// Starts a TCP connection to `addr` without waiting for it (`socket(2)` with `SOCK_NONBLOCK |
/// SOCK_CLOEXEC`, then `connect(2)`): the stream is returned at once, still connecting when the
/// peer has not answered yet. It becomes writable when the connection is made or has failed;
/// `TcpStream::take_error` then tells which (`ConnectionRefused` while nobody listens).
pub fn connect_nonblocking(addr: &std::net::SocketAddr) -> io::Result<std::net::TcpStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let family = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    let fd =
        super::syscall!(socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0))?;
    // SAFETY: `socket` just returned this descriptor and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: all-zero is a valid `sockaddr_storage`.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        std::net::SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: `sockaddr_storage` is larger than and aligned for every sockaddr type.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        std::net::SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: `storage` holds an initialised address of `len` bytes and lives across the call.
    let r = super::syscall!(connect(
        fd.as_raw_fd(),
        (&storage as *const libc::sockaddr_storage).cast(),
        len as socklen_t
    ));
    match r {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(std::net::TcpStream::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn buffer_sizes_and_congestion_round_trip() {
        let (a, _b) = pair();
        set_buffer_sizes(a.as_fd(), 16 << 10).unwrap();
        let (snd, rcv) = buffer_sizes(a.as_fd()).unwrap();
        // Linux doubles the value (and caps it at the sysctl maximum, far above 16K by default).
        assert!(snd >= 16 << 10 && rcv >= 16 << 10, "{snd} {rcv}");
        // reno is built into every Linux kernel and always allowed.
        set_congestion(a.as_fd(), "reno").unwrap();
        assert_eq!(congestion(a.as_fd()).unwrap(), "reno");
        assert!(set_congestion(a.as_fd(), "nosuchcc").is_err());
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        set_backlog(l.as_fd(), 4096).unwrap();
    }

    #[test]
    fn vectored_io_and_peek_never_block() {
        let (a, b) = pair();
        let mut buf = [0u8; 8];
        let e = recv_vectored(b.as_fd(), &mut [IoSliceMut::new(&mut buf)]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        let n = send_vectored(a.as_fd(), &[IoSlice::new(b"abc"), IoSlice::new(b"defg")]).unwrap();
        assert_eq!(n, 7);
        let mut got = 0;
        while got < 7 {
            match peek(b.as_fd(), &mut buf) {
                Ok(n) => got = n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        let (mut x, mut y) = ([0u8; 2], [0u8; 5]);
        let n = recv_vectored(b.as_fd(), &mut [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)]).unwrap();
        assert_eq!((n, &x, &y), (7, b"ab", b"cdefg"));
        // A closed peer is an error, not SIGPIPE.
        drop(b);
        let e = (0..100)
            .find_map(|_| {
                std::thread::sleep(std::time::Duration::from_millis(5));
                send_vectored(a.as_fd(), &[IoSlice::new(b"x")]).err()
            })
            .expect("a send to a closed peer fails");
        assert!(matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset), "{e}");
    }

    #[test]
    fn a_nonblocking_connect_completes_or_reports_refusal() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let s = connect_nonblocking(&addr).unwrap();
        let mut fds = [crate::sys::poll::PollFd::new(s.as_raw_fd(), crate::sys::poll::PollFd::OUT)];
        assert_eq!(crate::sys::poll::poll(&mut fds, 5000).unwrap(), 1);
        assert!(s.take_error().unwrap().is_none());
        let (_b, from) = l.accept().unwrap();
        assert_eq!(from, s.local_addr().unwrap());
        drop(l);
        // Nobody listens there now: the connection is refused, at once or once polled.
        let s = match connect_nonblocking(&addr) {
            Ok(s) => s,
            Err(e) => return assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused),
        };
        let mut fds = [crate::sys::poll::PollFd::new(s.as_raw_fd(), crate::sys::poll::PollFd::OUT)];
        assert_eq!(crate::sys::poll::poll(&mut fds, 5000).unwrap(), 1);
        assert_eq!(s.take_error().unwrap().expect("an error").kind(), io::ErrorKind::ConnectionRefused);
    }
}
