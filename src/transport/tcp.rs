//! TCP transport: one connection per pair of ranks.
//!
//! Set-up: every rank listens on the chosen interface and publishes its address; rank `j`
//! connects to every lower rank `i < j` and accepts from every higher one. The connecting side
//! sends a hello (magic, protocol version, communicator id, its rank, the rank it expects); the
//! accepting side checks all of it and answers with an ack carrying the same fields, which the
//! connecting side checks in turn. With `TOROID_AUTH_TOKEN` set, both directions are
//! authenticated by challenge and response (HMAC-SHA256 keyed by the token, which never goes on
//! the wire): the hello carries the connector's fresh random nonce and a MAC over the hello
//! (whose communicator id is fresh per communicator) and that nonce; the ack carries a MAC over
//! the ack and the connector's nonce. A connection that fails is dropped with a WARN on the
//! accepting side and an error on the connecting side. Connections are `TCP_NODELAY`; socket buffers stay under
//! Linux autotuning (which grows them to `tcp_rmem`/`tcp_wmem` max, megabytes) unless
//! `TOROID_SOCKET_BUFFER` pins them, because setting `SO_RCVBUF` turns autotuning off.
//! `TOROID_TCP_CONGESTION` picks the congestion control per connection (`TCP_CONGESTION`):
//! collectives send bursts and then wait, which BBR handles badly on a shaped link (see
//! docs/ENV.md).
//!
//! Data moves with `sendmsg`/`recvmsg` and `MSG_DONTWAIT | MSG_NOSIGNAL`: never blocking, and
//! never raising `SIGPIPE` in a host process (Python, a C program) that did not ignore it.

use std::ffi::CStr;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use hmac::{KeyInit, Mac};

use super::Transport;
use crate::config::AuthToken;
use crate::error::{Error, Result};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;
/// Bytes of the connector's challenge nonce.
const NONCE_LEN: usize = 16;
/// Bytes of an HMAC-SHA256 tag.
const MAC_LEN: usize = 32;
/// `hello[7]`: the sender authenticates (nonce and MAC follow the hello; a MAC follows the ack).
const FLAG_AUTH: u8 = 1;

/// Wire protocol version; bumped on any incompatible change of handshake or frames.
/// (2: links between ranks of one host start with the shared-memory set-up of `shm`;
/// 3: authenticated handshakes.)
pub const PROTOCOL_VERSION: u16 = 3;
const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"TRDH");
const HELLO_LEN: usize = 24;
const KIND_HELLO: u8 = 1;
const KIND_ACK: u8 = 2;

/// Calls a libc function and turns `-1` into the `io::Error` of `errno` (mio's `syscall!`).
macro_rules! syscall {
    ($fn:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: each call site passes pointers to live, correctly sized objects; see there.
        let res = unsafe { libc::$fn($($arg),*) };
        if res == -1 { Err(io::Error::last_os_error()) } else { Ok(res) }
    }};
}

/// How connections between ranks are set up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SocketOptions {
    /// `SO_SNDBUF`/`SO_RCVBUF` in bytes; 0 keeps Linux autotuning.
    pub buffer: usize,
    /// Congestion control (`TCP_CONGESTION`), e.g. `cubic`; `None` keeps the system default.
    pub congestion: Option<String>,
}

/// A connected TCP peer.
#[derive(Debug)]
pub struct TcpTransport {
    stream: TcpStream,
}

impl TcpTransport {
    fn new(stream: TcpStream, opts: &SocketOptions) -> Result<TcpTransport> {
        stream.set_nodelay(true).map_err(|e| Error::system("TCP_NODELAY", e))?;
        if let Some(name) = &opts.congestion {
            set_congestion(stream.as_raw_fd(), name)?;
        }
        let buffer = effective_buffer(opts.buffer);
        if buffer > 0 {
            let fd = stream.as_raw_fd();
            let v = buffer.min(i32::MAX as usize) as libc::c_int;
            for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
                // SAFETY: `v` lives across the call and its size is passed.
                let r = syscall!(setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&v as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t
                ));
                r.map_err(|e| Error::system("setting socket buffer size", e))?;
            }
        }
        stream.set_nonblocking(true).map_err(|e| Error::system("O_NONBLOCK", e))?;
        Ok(TcpTransport { stream })
    }
}

/// Sets the connection's congestion control; an error names the variable and what the kernel
/// offers when it refuses (unknown name, or not in `tcp_allowed_congestion_control` for an
/// unprivileged process).
fn set_congestion(fd: RawFd, name: &str) -> Result<()> {
    // SAFETY: `name` lives across the call and its length is passed; the kernel copies it.
    let r = syscall!(setsockopt(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_CONGESTION,
        name.as_ptr().cast(),
        name.len() as libc::socklen_t
    ));
    r.map(drop).map_err(|e| {
        let list = |f: &str| {
            std::fs::read_to_string(format!("/proc/sys/net/ipv4/{f}")).map_or_else(|_| "?".into(), |s| s.trim().to_string())
        };
        Error::InvalidArgument(format!(
            "TOROID_TCP_CONGESTION={name}: the kernel refused it ({e}); available: {}; allowed without privilege: {}",
            list("tcp_available_congestion_control"),
            list("tcp_allowed_congestion_control")
        ))
    })
}

/// The connection's congestion control as the kernel reports it.
pub fn congestion_of(fd: RawFd) -> io::Result<String> {
    let mut buf = [0u8; 16];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: `buf` and `len` live across the call; `len` holds `buf`'s size.
    syscall!(getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_CONGESTION, buf.as_mut_ptr().cast(), &mut len))?;
    let name = &buf[..(len as usize).min(buf.len())];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
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

fn iovecs<const N: usize>(bufs: impl Iterator<Item = (*mut u8, usize)>) -> ([libc::iovec; N], usize) {
    let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; N];
    let mut n = 0;
    for (ptr, len) in bufs {
        if len == 0 {
            continue;
        }
        assert!(n < N, "too many buffers for one vectored call");
        iov[n] = libc::iovec { iov_base: ptr.cast(), iov_len: len };
        n += 1;
    }
    (iov, n)
}

impl Transport for TcpTransport {
    fn kind(&self) -> &'static str {
        "tcp"
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        let (mut iov, n) = iovecs::<4>(bufs.iter().map(|b| (b.as_ptr() as *mut u8, b.len())));
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: zeroed msghdr is a valid "no name, no control" header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n;
        // SAFETY: the iovecs point into `bufs`, borrowed for the call; sendmsg only reads them.
        let r = syscall!(sendmsg(self.stream.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL))?;
        Ok(r as usize)
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        let (mut iov, n) = iovecs::<4>(bufs.iter_mut().map(|b| (b.as_mut_ptr(), b.len())));
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty read"));
        }
        // SAFETY: zeroed msghdr is a valid "no name, no control" header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n;
        // SAFETY: the iovecs point into `bufs`, exclusively borrowed for the call.
        let r = syscall!(recvmsg(self.stream.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT))?;
        Ok(r as usize)
    }

    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is a live exclusive buffer of `buf.len()` bytes.
        let r = syscall!(recv(
            self.stream.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT
        ))?;
        Ok(r as usize)
    }

    fn pollable(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    fn shutdown(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
    }
}

/// Where this rank listens, and the interface that address belongs to.
#[derive(Debug)]
pub struct Endpoint {
    /// The listening socket (non-blocking).
    pub listener: TcpListener,
    /// The address peers connect to.
    pub addr: SocketAddr,
    /// Interface name the address was taken from ("" when chosen by route only).
    pub ifname: String,
}

/// One address of one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Interface name (`eth0`, `lo`).
    pub name: String,
    /// One of its addresses.
    pub addr: IpAddr,
}

/// Lists the IPv4 and IPv6 addresses of every interface that is up.
pub fn interfaces() -> Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head`; freed below with freeifaddrs.
    syscall!(getifaddrs(&mut head)).map_err(|e| Error::system("getifaddrs", e))?;
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as libc::c_uint == 0 {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: ifa_addr is non-null and points at a sockaddr whose family says its real type.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr))))
                }
                libc::AF_INET6 => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr)))
                }
                _ => None,
            }
        };
        if let Some(addr) = addr {
            out.push(Interface { name, addr });
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// Filters interfaces by NCCL's `NCCL_SOCKET_IFNAME` syntax: a comma list of name prefixes;
/// a leading `^` excludes instead; a leading `=` asks for exact names.
pub fn select_interfaces(all: &[Interface], spec: &str) -> Vec<Interface> {
    let (exclude, rest) = match spec.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, spec),
    };
    let (exact, rest) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let names: Vec<&str> = rest.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    let matches = |n: &str| names.iter().any(|p| if exact { n == *p } else { n.starts_with(p) });
    all.iter().filter(|i| matches(&i.name) != exclude).cloned().collect()
}

/// Picks the address this rank listens on.
///
/// With `ifname` set, the first matching interface (IPv4 first unless `family` is
/// `AF_INET6`), or an error listing what exists. Without it, the local address of the route
/// towards `store_host` (the address every rank can already reach), else the first interface
/// that is not loopback or docker, else loopback.
pub fn choose_address(
    ifname: Option<&str>,
    family: Option<&str>,
    store_host: Option<&str>,
) -> Result<Interface> {
    let all = interfaces()?;
    let want_v6 = matches!(
        family.map(str::to_ascii_uppercase).as_deref(),
        Some("AF_INET6") | Some("INET6") | Some("IPV6")
    );
    let family_ok = |i: &Interface| i.addr.is_ipv6() == want_v6;
    let listing = || all.iter().map(|i| format!("{} ({})", i.name, i.addr)).collect::<Vec<_>>().join(", ");
    if let Some(spec) = ifname {
        let mut chosen = select_interfaces(&all, spec);
        // Prefer the requested family but accept the other rather than fail.
        chosen.sort_by_key(|i| !family_ok(i));
        chosen.retain(|i| !matches!(i.addr, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80));
        return chosen.into_iter().next().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "TOROID_SOCKET_IFNAME={spec} matches no interface that is up; available: {}",
                listing()
            ))
        });
    }
    if let Some(host) = store_host
        && let Some(local) = route_source(host)
    {
        let name = all.iter().find(|i| i.addr == local).map(|i| i.name.clone()).unwrap_or_default();
        return Ok(Interface { name, addr: local });
    }
    let candidates = select_interfaces(&all, "^lo,docker,virbr");
    let pick = candidates
        .iter()
        .filter(|i| !matches!(i.addr, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80))
        .find(|i| family_ok(i))
        .or_else(|| candidates.first())
        .cloned();
    Ok(pick.unwrap_or(Interface { name: "lo".into(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) }))
}

/// The local address the kernel would use to reach `host` (no packet is sent: a UDP connect
/// only picks a route).
fn route_source(host: &str) -> Option<IpAddr> {
    let target = (host, 9).to_socket_addrs().ok()?.next()?;
    let bind: SocketAddr =
        if target.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
    let sock = UdpSocket::bind(bind).ok()?;
    sock.connect(target).ok()?;
    sock.local_addr().ok().map(|a| a.ip())
}

/// Opens the listening socket on `iface`.
pub fn listen(iface: &Interface, backlog_hint: usize) -> Result<Endpoint> {
    let listener = TcpListener::bind((iface.addr, 0))
        .map_err(|e| Error::system(format!("binding a listener on {} ({})", iface.addr, iface.name), e))?;
    // std's default backlog (128) covers the peers that connect before we accept; raise it for
    // very large worlds.
    if backlog_hint > 128 {
        let n = backlog_hint.min(i32::MAX as usize) as libc::c_int;
        // SAFETY: listen on a descriptor we own; no pointers.
        let _ = syscall!(listen(listener.as_raw_fd(), n));
    }
    listener.set_nonblocking(true).map_err(|e| Error::system("O_NONBLOCK on listener", e))?;
    let addr = listener.local_addr().map_err(|e| Error::system("getsockname", e))?;
    Ok(Endpoint { listener, addr, ifname: iface.name.clone() })
}

fn hello(kind: u8, comm_id: u64, from: usize, to: usize, auth: bool) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6] = kind;
    h[7] = if auth { FLAG_AUTH } else { 0 };
    h[8..16].copy_from_slice(&comm_id.to_le_bytes());
    h[16..20].copy_from_slice(&(from as u32).to_le_bytes());
    h[20..24].copy_from_slice(&(to as u32).to_le_bytes());
    h
}

/// Checks a hello or ack; returns the sender's rank.
fn check_hello(h: &[u8; HELLO_LEN], kind: u8, comm_id: u64, me: usize, size: usize) -> Result<usize> {
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    if u32_at(0) != HELLO_MAGIC {
        return Err(Error::Remote("handshake: not a toroid peer (bad magic)".into()));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != PROTOCOL_VERSION {
        return Err(Error::Remote(format!(
            "handshake: peer speaks protocol version {version}, this build speaks {PROTOCOL_VERSION} (mixed toroid versions?)"
        )));
    }
    if h[6] != kind {
        return Err(Error::Remote(format!("handshake: expected message kind {kind}, got {}", h[6])));
    }
    let mut idb = [0u8; 8];
    idb.copy_from_slice(&h[8..16]);
    let id = u64::from_le_bytes(idb);
    if id != comm_id {
        return Err(Error::Remote(format!(
            "handshake: peer belongs to communicator {id:#x}, not {comm_id:#x} (a stale or foreign job?)"
        )));
    }
    let (from, to) = (u32_at(16) as usize, u32_at(20) as usize);
    if to != me || from >= size || from == me {
        return Err(Error::Remote(format!(
            "handshake: peer claims rank {from} calling rank {to}; this is rank {me} of {size}"
        )));
    }
    Ok(from)
}

/// HMAC-SHA256 of `parts` under `token`, labelled so a hello's tag can never pass as an ack's.
fn mac(token: &AuthToken, label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length, so this cannot fail.
    let mut m =
        <HmacSha256 as KeyInit>::new_from_slice(token.as_bytes()).expect("HMAC accepts any key length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m
}

/// A fresh random nonce from the kernel.
fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    let mut got = 0;
    while got < NONCE_LEN {
        // SAFETY: writes at most `NONCE_LEN - got` bytes into the live array `n` past `got`.
        let r = unsafe { libc::getrandom(n[got..].as_mut_ptr().cast(), NONCE_LEN - got, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(Error::system("getrandom", e));
            }
        } else {
            got += r as usize;
        }
    }
    Ok(n)
}

/// The accepting side's check of a connector's authentication (`extra`: what followed the
/// hello when it announced authentication).
fn check_hello_auth(h: &[u8; HELLO_LEN], extra: Option<&[u8]>, auth: Option<&AuthToken>) -> Result<()> {
    match (auth, extra) {
        (None, None) => Ok(()),
        (Some(_), None) => Err(Error::Remote(
            "handshake: peer did not authenticate (TOROID_AUTH_TOKEN is set here, not there)".into(),
        )),
        (None, Some(_)) => {
            Err(Error::Remote("handshake: peer authenticates but TOROID_AUTH_TOKEN is not set here".into()))
        }
        (Some(t), Some(x)) => {
            let (n, tag) = x.split_at(NONCE_LEN);
            mac(t, b"toroid hello", &[h, n]).verify_slice(tag).map_err(|_| {
                Error::Remote("handshake: authentication failed (a different TOROID_AUTH_TOKEN)".into())
            })
        }
    }
}

fn remaining(deadline: Instant) -> Result<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(Error::Timeout("connecting to peers: deadline passed".into()));
    }
    Ok(d)
}

fn read_hello(s: &mut TcpStream, deadline: Instant, what: &str) -> Result<[u8; HELLO_LEN]> {
    let mut h = [0u8; HELLO_LEN];
    read_exact_by(s, &mut h, deadline, what)?;
    Ok(h)
}

fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant, what: &str) -> Result<()> {
    s.set_read_timeout(Some(remaining(deadline)?)).map_err(|e| Error::system("SO_RCVTIMEO", e))?;
    s.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            Error::Timeout(format!("{what}: no handshake before the deadline"))
        }
        _ => Error::Remote(format!("{what}: handshake failed: {e}")),
    })
}

/// Connects this rank to every other rank: connects to lower ranks, accepts higher ones, and
/// checks the handshake both ways. Returns one transport per rank (`None` at `rank`).
pub fn connect_mesh(
    rank: usize,
    addrs: &[SocketAddr],
    endpoint: &Endpoint,
    comm_id: u64,
    opts: &SocketOptions,
    auth: Option<&AuthToken>,
    deadline: Instant,
) -> Result<Vec<Option<Box<dyn Transport>>>> {
    let size = addrs.len();
    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    // The nonce each connection to a lower rank sent, which that rank's ack must answer.
    let mut nonces: Vec<[u8; NONCE_LEN]> = vec![[0; NONCE_LEN]; rank];
    // 1. Connect to every lower rank and say hello (the listener's backlog holds us until it
    //    accepts, so this never waits for the peer's code to run).
    for (peer, addr) in addrs.iter().enumerate().take(rank) {
        let mut s = loop {
            match TcpStream::connect_timeout(addr, remaining(deadline)?.min(Duration::from_secs(5))) {
                Ok(s) => break s,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::WouldBlock
                    ) =>
                {
                    if remaining(deadline).is_err() {
                        return Err(Error::Timeout(format!(
                            "rank {rank}: could not connect to rank {peer} at {addr}: {e}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => {
                    return Err(Error::system(
                        format!("rank {rank}: connecting to rank {peer} at {addr}"),
                        e,
                    ));
                }
            }
        };
        s.set_write_timeout(Some(remaining(deadline)?)).map_err(|e| Error::system("SO_SNDTIMEO", e))?;
        let h = hello(KIND_HELLO, comm_id, rank, peer, auth.is_some());
        let mut msg = h.to_vec();
        if let Some(t) = auth {
            let n = nonce()?;
            msg.extend_from_slice(&n);
            msg.extend_from_slice(&mac(t, b"toroid hello", &[&h, &n]).finalize().into_bytes());
            nonces[peer] = n;
        }
        s.write_all(&msg)
            .map_err(|e| Error::Remote(format!("rank {rank}: hello to rank {peer} at {addr} failed: {e}")))?;
        streams[peer] = Some(s);
    }
    // 2. Accept every higher rank, check its hello, ack it.
    let mut pending = size - rank - 1;
    while pending > 0 {
        match endpoint.listener.accept() {
            Ok((mut s, from_addr)) => {
                s.set_nonblocking(false).map_err(|e| Error::system("accepted socket", e))?;
                let h = read_hello(&mut s, deadline, &format!("rank {rank}: connection from {from_addr}"))?;
                let checked = check_hello(&h, KIND_HELLO, comm_id, rank, size).and_then(|f| {
                    let mut extra = [0u8; NONCE_LEN + MAC_LEN];
                    let announced = h[7] & FLAG_AUTH != 0;
                    if announced {
                        read_exact_by(&mut s, &mut extra, deadline, "the authentication after a hello")?;
                    }
                    check_hello_auth(&h, announced.then_some(&extra[..]), auth)?;
                    Ok((f, extra))
                });
                let (from, extra) = match checked {
                    Ok(x) => x,
                    Err(e) => {
                        // A foreign or stale connection must not kill the job: log and drop it.
                        tracing::warn!(target: "toroid::net", "rank {rank}: rejected connection from {from_addr}: {e}");
                        continue;
                    }
                };
                if from < rank || streams[from].is_some() {
                    tracing::warn!(target: "toroid::net", "rank {rank}: unexpected second connection from rank {from}; dropped");
                    continue;
                }
                s.set_write_timeout(Some(remaining(deadline)?))
                    .map_err(|e| Error::system("SO_SNDTIMEO", e))?;
                let ack = hello(KIND_ACK, comm_id, rank, from, auth.is_some());
                let mut msg = ack.to_vec();
                if let Some(t) = auth {
                    let n = &extra[..NONCE_LEN];
                    msg.extend_from_slice(&mac(t, b"toroid ack", &[&ack, n]).finalize().into_bytes());
                }
                s.write_all(&msg)
                    .map_err(|e| Error::Remote(format!("rank {rank}: ack to rank {from} failed: {e}")))?;
                streams[from] = Some(s);
                pending -= 1;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let left = remaining(deadline).map_err(|_| {
                    let missing: Vec<usize> = (rank + 1..size).filter(|r| streams[*r].is_none()).collect();
                    Error::Timeout(format!(
                        "rank {rank}: ranks {missing:?} never connected before the deadline"
                    ))
                })?;
                let mut pfd =
                    libc::pollfd { fd: endpoint.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                let ms = left.as_millis().clamp(1, 1000) as libc::c_int;
                // SAFETY: one live pollfd.
                let _ = syscall!(poll(&mut pfd, 1, ms));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::system("accept", e)),
        }
    }
    // 3. Read the acks of the lower ranks.
    for (peer, s) in streams.iter_mut().enumerate().take(rank) {
        let s = s.as_mut().ok_or_else(|| Error::Internal("missing stream".into()))?;
        let what = format!("rank {rank}: waiting for rank {peer}'s ack");
        let h = read_hello(s, deadline, &what).map_err(|e| match e {
            // A peer that rejects our hello closes the connection without an ack.
            Error::Remote(m) => Error::Remote(format!(
                "{m} (rank {peer} drops connections whose TOROID_AUTH_TOKEN, communicator or protocol \
                 version differ from its own; its log says which)"
            )),
            e => e,
        })?;
        let from = check_hello(&h, KIND_ACK, comm_id, rank, size)?;
        if let Some(t) = auth {
            let mut tag = [0u8; MAC_LEN];
            read_exact_by(s, &mut tag, deadline, &what)?;
            if h[7] & FLAG_AUTH == 0
                || mac(t, b"toroid ack", &[&h, &nonces[peer]]).verify_slice(&tag).is_err()
            {
                return Err(Error::Remote(format!(
                    "rank {rank}: rank {peer} failed authentication (a different TOROID_AUTH_TOKEN?)"
                )));
            }
        }
        if from != peer {
            return Err(Error::Remote(format!(
                "rank {rank}: ack from rank {from} on the connection to rank {peer}"
            )));
        }
    }
    let mut out: Vec<Option<Box<dyn Transport>>> = Vec::with_capacity(size);
    for s in streams {
        out.push(match s {
            Some(s) => {
                s.set_read_timeout(None).map_err(|e| Error::system("SO_RCVTIMEO", e))?;
                s.set_write_timeout(None).map_err(|e| Error::system("SO_SNDTIMEO", e))?;
                Some(Box::new(TcpTransport::new(s, opts)?) as Box<dyn Transport>)
            }
            None => None,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ifs(names: &[&str]) -> Vec<Interface> {
        names
            .iter()
            .map(|n| Interface { name: n.to_string(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) })
            .collect()
    }

    #[test]
    fn ifname_syntax_matches_nccl() {
        let all = ifs(&["lo", "eth0", "eth1", "docker0", "ib0"]);
        let names =
            |spec: &str| select_interfaces(&all, spec).into_iter().map(|i| i.name).collect::<Vec<_>>();
        assert_eq!(names("eth"), ["eth0", "eth1"]);
        assert_eq!(names("=eth"), Vec::<String>::new());
        assert_eq!(names("=eth1"), ["eth1"]);
        assert_eq!(names("^lo,docker"), ["eth0", "eth1", "ib0"]);
        assert_eq!(names("ib,lo"), ["lo", "ib0"]);
    }

    #[test]
    fn unknown_ifname_is_a_clear_error() {
        let e = choose_address(Some("nosuchif0"), None, None).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("nosuchif0") && msg.contains("available") && msg.contains("lo"), "{msg}");
    }

    #[test]
    fn loopback_store_routes_over_loopback() {
        let i = choose_address(None, None, Some("127.0.0.1")).unwrap();
        assert!(i.addr.is_loopback());
    }

    #[test]
    fn handshake_rejects_foreign_and_stale_peers() {
        let h = hello(KIND_HELLO, 7, 3, 1, false);
        assert_eq!(check_hello(&h, KIND_HELLO, 7, 1, 4).unwrap(), 3);
        assert!(check_hello(&h, KIND_HELLO, 8, 1, 4).unwrap_err().to_string().contains("communicator"));
        assert!(check_hello(&h, KIND_HELLO, 7, 2, 4).is_err());
        assert!(check_hello(&h, KIND_ACK, 7, 1, 4).is_err());
        let mut bad = h;
        bad[4] = 9;
        assert!(check_hello(&bad, KIND_HELLO, 7, 1, 4).unwrap_err().to_string().contains("version"));
        bad[0] = 0;
        assert!(check_hello(&bad, KIND_HELLO, 7, 1, 4).unwrap_err().to_string().contains("magic"));
    }

    #[test]
    fn mesh_of_three_threads_connects_and_moves_bytes() {
        let iface = Interface { name: "lo".into(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) };
        let eps: Vec<Endpoint> = (0..3).map(|_| listen(&iface, 3).unwrap()).collect();
        let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr).collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let handles: Vec<_> = eps
            .into_iter()
            .enumerate()
            .map(|(r, ep)| {
                let addrs = addrs.clone();
                std::thread::spawn(move || {
                    connect_mesh(r, &addrs, &ep, 42, &SocketOptions::default(), None, deadline).unwrap()
                })
            })
            .collect();
        let mut meshes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (r, m) in meshes.iter().enumerate() {
            for (p, t) in m.iter().enumerate() {
                assert_eq!(t.is_some(), r != p);
            }
        }
        let msg = b"hello from 2";
        let n = meshes[2][0].as_mut().unwrap().try_write(&[msg]).unwrap();
        assert_eq!(n, msg.len());
        let mut buf = [0u8; 12];
        let t = meshes[0][2].as_mut().unwrap();
        let mut got = 0;
        while got < buf.len() {
            match t.try_read(&mut [&mut buf[got..]]) {
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(&buf, msg);
    }

    type Mesh = Vec<Option<Box<dyn Transport>>>;

    /// Connects `tokens.len()` ranks (threads) with those tokens; each rank's result.
    fn mesh_with(tokens: &[Option<&str>], secs: u64) -> Vec<Result<Mesh>> {
        mesh_of(tokens, &SocketOptions::default(), secs)
    }

    /// Connects `n` ranks (threads) with these socket options; each rank's result.
    fn mesh_opts(n: usize, opts: &SocketOptions) -> Vec<Result<Mesh>> {
        mesh_of(&vec![None; n], opts, 10)
    }

    /// Connects `tokens.len()` ranks (threads) with those tokens and socket options.
    fn mesh_of(tokens: &[Option<&str>], opts: &SocketOptions, secs: u64) -> Vec<Result<Mesh>> {
        let iface = Interface { name: "lo".into(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) };
        let n = tokens.len();
        let eps: Vec<Endpoint> = (0..n).map(|_| listen(&iface, n).expect("listen")).collect();
        let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr).collect();
        let deadline = Instant::now() + Duration::from_secs(secs);
        let handles: Vec<_> = eps
            .into_iter()
            .zip(tokens)
            .enumerate()
            .map(|(r, (ep, t))| {
                let (addrs, opts) = (addrs.clone(), opts.clone());
                let token = t.map(|t| AuthToken::new(t.as_bytes()));
                std::thread::spawn(move || connect_mesh(r, &addrs, &ep, 99, &opts, token.as_ref(), deadline))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    #[test]
    fn every_connection_gets_the_chosen_congestion_control() {
        // reno is built into every Linux kernel and always allowed.
        let opts = SocketOptions { buffer: 0, congestion: Some("reno".into()) };
        let before = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap_or_default();
        for (r, m) in mesh_opts(3, &opts).into_iter().enumerate() {
            let m = m.expect("mesh with reno");
            for (p, t) in m.iter().enumerate() {
                if let Some(t) = t {
                    assert_eq!(congestion_of(t.pollable()).expect("getsockopt"), "reno", "rank {r} -> {p}");
                }
            }
        }
        // Without the option the system default stays.
        let default = before.trim();
        if !default.is_empty() {
            for m in mesh_opts(2, &SocketOptions::default()) {
                let m = m.expect("mesh");
                let t = m.iter().flatten().next().expect("a link");
                assert_eq!(congestion_of(t.pollable()).expect("getsockopt"), default);
            }
        }
    }

    #[test]
    fn an_unknown_congestion_control_fails_every_rank_with_the_variable_named() {
        let opts = SocketOptions { buffer: 0, congestion: Some("nosuchcc".into()) };
        for (r, m) in mesh_opts(3, &opts).into_iter().enumerate() {
            let e = m.err().unwrap_or_else(|| panic!("rank {r} connected")).to_string();
            assert!(e.contains("TOROID_TCP_CONGESTION=nosuchcc") && e.contains("available"), "rank {r}: {e}");
        }
    }

    #[test]
    fn ranks_sharing_a_token_connect_and_move_bytes() {
        let mut meshes: Vec<_> =
            mesh_with(&[Some("s3cret"); 3], 10).into_iter().map(|m| m.expect("authenticated mesh")).collect();
        let msg = b"authenticated";
        assert_eq!(meshes[1][2].as_mut().expect("link").try_write(&[msg]).expect("write"), msg.len());
        let mut buf = [0u8; 13];
        let mut got = 0;
        let t = meshes[2][1].as_mut().expect("link");
        while got < buf.len() {
            match t.try_read(&mut [&mut buf[got..]]) {
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(&buf, msg);
    }

    /// Rank 1 connects to rank 0; both must fail, the connector with a hint and the acceptor
    /// (which drops the connection and keeps waiting for a genuine peer) at its deadline.
    fn refused(tokens: [Option<&str>; 2]) {
        let r = mesh_with(&tokens, 2);
        let connector = r[1].as_ref().map(|_| ()).expect_err("the connector must fail").to_string();
        assert!(connector.contains("TOROID_AUTH_TOKEN"), "{tokens:?}: {connector}");
        let acceptor = r[0].as_ref().map(|_| ()).expect_err("the acceptor must fail").to_string();
        assert!(acceptor.contains("never connected"), "{tokens:?}: {acceptor}");
    }

    #[test]
    fn a_different_token_is_refused() {
        refused([Some("one"), Some("two")]);
    }

    #[test]
    fn a_token_on_one_side_only_is_refused() {
        refused([Some("one"), None]);
        refused([None, Some("one")]);
    }

    #[test]
    fn the_token_never_goes_on_the_wire_and_the_hello_carries_its_mac() {
        let token = "a-long-and-recognisable-secret";
        let iface = Interface { name: "lo".into(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) };
        let raw = TcpListener::bind("127.0.0.1:0").expect("bind");
        let ep = listen(&iface, 2).expect("listen");
        let addrs = vec![raw.local_addr().expect("addr"), ep.addr];
        let deadline = Instant::now() + Duration::from_secs(2);
        let connector = std::thread::spawn(move || {
            let t = AuthToken::new(token.as_bytes());
            connect_mesh(1, &addrs, &ep, 5, &SocketOptions::default(), Some(&t), deadline).map(|_| ())
        });
        let (mut s, _) = raw.accept().expect("accept");
        let mut sent = vec![0u8; HELLO_LEN + NONCE_LEN + MAC_LEN];
        s.read_exact(&mut sent).expect("hello, nonce and MAC");
        assert!(!sent.windows(token.len()).any(|w| w == token.as_bytes()));
        let mut h = [0u8; HELLO_LEN];
        h.copy_from_slice(&sent[..HELLO_LEN]);
        assert_eq!(check_hello(&h, KIND_HELLO, 5, 0, 2).expect("a valid hello"), 1);
        let extra = &sent[HELLO_LEN..];
        check_hello_auth(&h, Some(extra), Some(&AuthToken::new(token.as_bytes())))
            .expect("MAC under the token");
        assert!(check_hello_auth(&h, Some(extra), Some(&AuthToken::new(b"other"))).is_err());
        drop(s); // no ack: the connector fails
        assert!(connector.join().expect("connector thread").is_err());
    }
}
