//! TCP transport: one connection per pair of ranks, or several striped ones
//! (`TOROID_NSOCKS`, [`striped`]).
//!
//! Set-up: every rank listens on the chosen interface ([`interface`](choose_address)) and
//! publishes its address; rank `j` connects to every lower rank `i < j` and accepts from every
//! higher one ([`connect_mesh`]). The connecting side sends a hello (magic, protocol version,
//! communicator id, its rank, the rank it expects); the accepting side checks all of it and
//! answers with an ack carrying the same fields, which the connecting side checks in turn. With
//! `TOROID_AUTH_TOKEN` set, both directions are authenticated by challenge and response
//! (HMAC-SHA256 keyed by the token, which never goes on the wire): the hello carries the
//! connector's fresh random nonce and a MAC over the hello (whose communicator id is fresh per
//! communicator) and that nonce; the ack carries a MAC over the ack and the connector's nonce.
//! A connection that fails is dropped with a WARN on the accepting side and an error on the
//! connecting side. Connections are `TCP_NODELAY`; socket buffers stay under Linux autotuning
//! (which grows them to `tcp_rmem`/`tcp_wmem` max, megabytes) unless `TOROID_SOCKET_BUFFER`
//! pins them, because setting `SO_RCVBUF` turns autotuning off. `TOROID_TCP_CONGESTION` picks
//! the congestion control per connection (`TCP_CONGESTION`): collectives send bursts and then
//! wait, which BBR handles badly on a shaped link (see docs/ENV.md).
//!
//! Data moves with `sendmsg`/`recvmsg` and `MSG_DONTWAIT | MSG_NOSIGNAL`: never blocking, and
//! never raising `SIGPIPE` in a host process (Python, a C program) that did not ignore it.
//!
//! | part | what |
//! |---|---|
//! | `interface` | which address to listen on (`TOROID_SOCKET_IFNAME`, the route to the store) |
//! | `mesh` | listening, connecting and accepting every peer (`TOROID_CONNECT=mesh`) |
//! | `lazy` | connecting a pair the first time an operation needs it (`TOROID_CONNECT=lazy`) |
//! | `handshake` | the hello and ack bytes and their MACs |
//! | `handshaking` | one connection whose handshake is under way, on a non-blocking socket |
//! | `striped` | one byte stream over several connections (lanes), and how many a pair uses |
//! | `secure` | encrypted links (`TOROID_ENCRYPT`): the TLS 1.3 handshake and the record layer |
//! | this file | the connection options and the [`TcpTransport`] itself |

use std::io::{self, IoSlice, IoSliceMut};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use super::Transport;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::sys::fork::ForkGuarded;
use crate::sys::socket;

pub mod control;
pub(crate) mod handshake;
mod handshaking;
mod interface;
pub mod lazy;
mod mesh;
pub mod progress;
pub mod secure;
pub mod striped;

pub use handshake::PROTOCOL_VERSION;
pub use interface::{Interface, choose_address};
pub use mesh::{Endpoint, MeshSpec, connect_mesh, listen};

/// How connections between ranks are set up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SocketOptions {
    /// `SO_SNDBUF`/`SO_RCVBUF` in bytes; 0 keeps Linux autotuning.
    pub buffer: usize,
    /// Congestion control (`TCP_CONGESTION`), e.g. `cubic`; `None` keeps the system default.
    pub congestion: Option<String>,
    /// Test-only cap on each connection's sending rate in bytes per second
    /// (`TOROID_TEST_FLOW_RATE`, `SO_MAX_PACING_RATE`); 0 for none.
    pub flow_rate: u64,
    /// Progress threads that move the bytes of every connection (`TOROID_NTHREADS`); `None`:
    /// the calling thread does.
    pub progress: Option<progress::ProgressThreads>,
    /// Encrypted links (`TOROID_ENCRYPT`): the keys of the communicator's ranks; set by the
    /// communicator's set-up once they are published, `None` for plaintext.
    pub secure: Option<std::sync::Arc<secure::LinkSecurity>>,
}

impl SocketOptions {
    /// The options `cfg` asks for (`TOROID_SOCKET_BUFFER`, `TOROID_TCP_CONGESTION`).
    pub fn from_config(cfg: &Config) -> SocketOptions {
        SocketOptions {
            buffer: cfg.socket_buffer,
            congestion: cfg.tcp_congestion.clone(),
            flow_rate: cfg.test_flow_rate,
            progress: (cfg.nthreads > 0).then(|| progress::ProgressThreads::new(cfg.nthreads)),
            secure: None,
        }
    }
}

/// A connected TCP peer.
#[derive(Debug)]
pub struct TcpTransport {
    /// Closed in a forked child at once, so that a dead parent looks dead to its peers
    /// (see `sys::fork`).
    stream: ForkGuarded<TcpStream>,
}

impl TcpTransport {
    fn new(stream: TcpStream, opts: &SocketOptions) -> Result<TcpTransport> {
        Ok(TcpTransport { stream: ForkGuarded::new(configure(stream, opts)?) })
    }
}

/// Sets a checked connection up for data: no Nagle delay, the chosen congestion control and
/// buffers, the test pacing cap, non-blocking.
pub(super) fn configure(stream: TcpStream, opts: &SocketOptions) -> Result<TcpStream> {
    stream.set_nodelay(true).map_err(|e| Error::system("TCP_NODELAY", e))?;
    if let Some(name) = &opts.congestion {
        set_congestion(stream.as_fd(), name)?;
    }
    let buffer = effective_buffer(opts.buffer);
    if buffer > 0 {
        socket::set_buffer_sizes(stream.as_fd(), buffer)
            .map_err(|e| Error::system("setting socket buffer size", e))?;
    }
    if opts.flow_rate > 0 {
        socket::set_max_pacing_rate(stream.as_fd(), opts.flow_rate)
            .map_err(|e| Error::system("SO_MAX_PACING_RATE (TOROID_TEST_FLOW_RATE)", e))?;
    }
    stream.set_nonblocking(true).map_err(|e| Error::system("O_NONBLOCK", e))?;
    Ok(stream)
}

/// Sets the connection's congestion control; an error names the variable and what the kernel
/// offers when it refuses (unknown name, or not in `tcp_allowed_congestion_control` for an
/// unprivileged process).
fn set_congestion(fd: BorrowedFd<'_>, name: &str) -> Result<()> {
    socket::set_congestion(fd, name).map_err(|e| {
        let list = |f: &str| {
            std::fs::read_to_string(format!("/proc/sys/net/ipv4/{f}")).map_or_else(|_| "?".into(), |s| s.trim().to_string())
        };
        Error::InvalidArgument(format!(
            "TOROID_TCP_CONGESTION={name}: the kernel refused it ({e}); available: {}; allowed without privilege: {}",
            list("tcp_available_congestion_control"),
            list("tcp_allowed_congestion_control")
        ).into())
    })
}

#[cfg(test)]
/// The connection's congestion control as the kernel reports it.
pub fn congestion_of(fd: BorrowedFd<'_>) -> io::Result<String> {
    socket::congestion(fd)
}

/// The buffer size to set: the request, or 0 (keep autotuning) when the kernel would cap it
/// below the request (`net.core.rmem_max`/`wmem_max`), since a capped fixed buffer is worse than
/// autotuning.
fn effective_buffer(requested: usize) -> usize {
    if requested == 0 {
        return 0;
    }
    let cap = |name: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/core/{name}"))
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(0)
    };
    if cap("rmem_max") >= requested && cap("wmem_max") >= requested { requested } else { 0 }
}

/// Most buffers one vectored call takes.
const MAX_BUFS: usize = 4;

/// Packs the non-empty buffers of `bufs` at the front of `out`; returns how many there are.
fn non_empty<T: std::ops::Deref<Target = [u8]>>(bufs: impl Iterator<Item = T>, out: &mut [T]) -> usize {
    let mut n = 0;
    for b in bufs.filter(|b| !b.is_empty()) {
        assert!(n < out.len(), "too many buffers for one vectored call");
        out[n] = b;
        n += 1;
    }
    n
}

impl Transport for TcpTransport {
    fn kind(&self) -> &'static str {
        "tcp"
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        let mut iov = [IoSlice::new(&[]); MAX_BUFS];
        let n = non_empty(bufs.iter().map(|b| IoSlice::new(b)), &mut iov);
        if n == 0 {
            return Ok(0);
        }
        socket::send_vectored(self.stream.as_fd(), &iov[..n])
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        let mut iov: [IoSliceMut<'_>; MAX_BUFS] = std::array::from_fn(|_| IoSliceMut::new(&mut []));
        let n = non_empty(bufs.iter_mut().map(|b| IoSliceMut::new(b)), &mut iov);
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty read"));
        }
        socket::recv_vectored(self.stream.as_fd(), &mut iov[..n])
    }

    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        socket::peek(self.stream.as_fd(), buf)
    }

    fn pollable(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    fn shutdown(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_come_from_the_config() {
        let vars = [("TOROID_TCP_CONGESTION", " cubic "), ("TOROID_SOCKET_BUFFER", "4M")];
        let c = Config::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()));
        let opts = SocketOptions::from_config(&c.unwrap());
        assert_eq!(
            opts,
            SocketOptions {
                buffer: 4 << 20,
                congestion: Some("cubic".into()),
                flow_rate: 0,
                progress: None,
                secure: None
            }
        );
        let none = SocketOptions::from_config(&Config::from_lookup(|_| None).unwrap());
        let default = crate::config::DEFAULT_SOCKET_BUFFER;
        assert_eq!(
            none,
            SocketOptions { buffer: default, congestion: None, flow_rate: 0, progress: None, secure: None }
        );
    }

    #[test]
    fn vectored_calls_skip_empty_buffers() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let (mut a, mut b) = (
            TcpTransport::new(a, &SocketOptions::default()).unwrap(),
            TcpTransport::new(b, &SocketOptions::default()).unwrap(),
        );
        assert_eq!(a.try_write(&[b"", b""]).unwrap(), 0);
        assert_eq!(b.try_read(&mut [&mut []]).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(a.try_write(&[b"", b"ab", b"", b"c", b"", b"d", b"e"]).unwrap(), 5);
        let (mut x, mut y) = ([0u8; 3], [0u8; 2]);
        let got = loop {
            match b.try_read(&mut [&mut [], &mut x, &mut y]) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        };
        // One small send on loopback arrives whole.
        assert_eq!((got, &x, &y), (5, b"abc", b"de"));
    }
}
