//! TCP store: a key-value server run by rank 0; every rank (rank 0 included) is a client.
//!
//! # Wire protocol
//!
//! Integers are little-endian. Every message is a frame: `len: u32` then `len` bytes of payload,
//! with `len <= MAX_FRAME`; a larger header is answered with an error and the connection closed,
//! without allocating. The first frame a client sends is a hello (`b"TRDV"`, `version: u32`); the
//! server answers OK or, for another magic or version, an error and closes. Then every request
//! gets exactly one response, in order. `bytes` is `len: u32` then the bytes.
//!
//! ```text
//! request   op: u8, then
//!   SET     key: bytes, value: bytes
//!   GET     timeout_ms: u64, key: bytes            the server waits for the key
//!   ADD     delta: i64, key: bytes                 counter kept as decimal text
//!   WAIT    timeout_ms: u64, n: u32, key: bytes * n
//!   DELETE  key: bytes
//! response  status: u8, then for OK: the value (GET), new: i64 (ADD), existed: u8 (DELETE),
//!           nothing (SET, WAIT); otherwise a UTF-8 message
//! ```
//!
//! # Server
//!
//! One thread runs a `poll(2)` loop over non-blocking sockets. A GET or WAIT whose keys are
//! missing parks its connection (later requests on it stay buffered) until a SET or ADD supplies
//! them or its deadline passes, so clients never poll. Dropping the [`TcpStore`] that owns the
//! server closes one end of a socket pair the loop watches; the thread then drops every
//! connection and is joined, and clients blocked on it see the connection close.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

/// Largest frame either side accepts (64 MiB): a store carries addresses and ids, not tensors.
pub const MAX_FRAME: usize = 64 << 20;

const MAGIC: &[u8; 4] = b"TRDV";
const VERSION: u32 = 1;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_DELETE: u8 = 5;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_INVALID_USAGE: u8 = 2;
const ST_BAD_REQUEST: u8 = 3;

/// Added to a call's own timeout for the socket deadline, so that the server's answer "timed
/// out" arrives before the client gives up on the socket.
const IO_MARGIN: Duration = Duration::from_secs(2);
const BACKOFF_START: Duration = Duration::from_millis(10);
const BACKOFF_CAP: Duration = Duration::from_secs(1);

/// A client of the TCP store; the one created by [`TcpStore::serve`] also owns the server.
///
/// Calls from several threads are serialised on the one connection. After an I/O error the
/// connection is out of step with the server, so every later call fails fast with
/// [`Error::Remote`].
pub struct TcpStore {
    client: Client,
    // Declared after `client`, so dropped after it: the server outlives its own client.
    server: Option<ServerHandle>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.client.addr)
            .field("server", &self.server_addr())
            .finish_non_exhaustive()
    }
}

impl TcpStore {
    /// Starts the server on `addr` (`host:port`, port 0 picks a free one) and connects to it.
    ///
    /// `host` may be a name, an IPv4 address, an IPv6 address in brackets or `0.0.0.0`/`[::]`
    /// (every interface). `timeout` becomes the deadline of `set`, `add` and `delete` on the
    /// returned client. The server stops, closing every client's connection, when the returned
    /// handle is dropped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a malformed address, [`Error::System`] when it cannot be
    /// bound.
    pub fn serve(addr: &str, timeout: Duration) -> Result<TcpStore> {
        let (host, port) = split_host_port(addr)?;
        let candidates =
            resolve(&host, port).map_err(|e| Error::system(format!("store: resolve '{addr}'"), e))?;
        let mut last = None;
        let mut listener = None;
        for a in candidates {
            match TcpListener::bind(a) {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let listener = match (listener, last) {
            (Some(l), _) => l,
            (None, Some(e)) => return Err(Error::system(format!("store: bind {addr}"), e)),
            (None, None) => {
                return Err(Error::InvalidArgument(format!("store: '{addr}' resolves to no address")));
            }
        };
        let bound = listener.local_addr().map_err(|e| Error::system("store: local address", e))?;
        listener.set_nonblocking(true).map_err(|e| Error::system("store: set_nonblocking", e))?;
        let (wake_tx, wake_rx) = UnixStream::pair().map_err(|e| Error::system("store: socketpair", e))?;
        let server = Server { listener, wake: wake_rx, conns: Vec::new(), map: HashMap::new() };
        let thread = std::thread::Builder::new()
            .name("toroid-store".into())
            .spawn(move || server.run())
            .map_err(|e| Error::system("store: spawn server thread", e))?;
        tracing::info!(target: "toroid::store", "store server listening on {bound}");
        let handle = ServerHandle { addr: bound, wake: Some(wake_tx), thread: Some(thread) };

        // An unspecified bind address is not something to connect to: use loopback.
        let local = match bound.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => {
                SocketAddr::new(Ipv4Addr::LOCALHOST.into(), bound.port())
            }
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(Ipv6Addr::LOCALHOST.into(), bound.port())
            }
            _ => bound,
        };
        // On failure `handle` drops here, which stops and joins the server.
        let client =
            Client::connect(&local.to_string(), &[local], timeout, timeout).map_err(|r| match r {
                Retry::Again(e) => {
                    Error::System(format!("store: cannot reach its own server at {local}: {e}"))
                }
                Retry::Fatal(e) => e,
            })?;
        Ok(TcpStore { client, server: Some(handle) })
    }

    /// Connects to the server at `addr`, retrying with backoff until `timeout`.
    ///
    /// Refused and unreachable connections (the server not up yet) and failed name look-ups are
    /// retried with exponential backoff from 10 ms up to 1 s. `timeout` is also the deadline of
    /// `set`, `add` and `delete` on the returned client.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming `addr` when no server answered in time; [`Error::Remote`] when
    /// something answered that is not a toroid store of this version.
    pub fn connect(addr: &str, timeout: Duration) -> Result<TcpStore> {
        let (host, port) = split_host_port(addr)?;
        if port == 0 {
            return Err(Error::InvalidArgument(format!("store: cannot connect to port 0 ('{addr}')")));
        }
        let deadline = deadline(timeout);
        let mut backoff = BACKOFF_START;
        loop {
            let last = match resolve(&host, port) {
                Ok(addrs) => match Client::connect(
                    addr,
                    &addrs,
                    deadline.saturating_duration_since(Instant::now()),
                    timeout,
                ) {
                    Ok(client) => {
                        return Ok(TcpStore { client, server: None });
                    }
                    Err(Retry::Fatal(e)) => return Err(e),
                    Err(Retry::Again(e)) => e,
                },
                Err(e) => format!("cannot resolve '{host}': {e}"),
            };
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(Error::Timeout(format!(
                    "store: no server answered at {addr} within {timeout:?} (last error: {last})"
                )));
            }
            tracing::debug!(target: "toroid::store", "store {addr} not reachable yet ({last}); retrying in {backoff:?}");
            std::thread::sleep(backoff.min(remaining));
            backoff = (backoff * 2).min(BACKOFF_CAP);
        }
    }

    /// The address the server listens on (for `serve` with port 0), if this handle owns it.
    pub fn server_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(|s| s.addr)
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = Enc::new(OP_SET);
        req.bytes(key.as_bytes());
        req.bytes(value);
        self.client.call(req, self.client.timeout, || format!("set '{key}'"))?;
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut req = Enc::new(OP_GET);
        req.u64(millis(timeout));
        req.bytes(key.as_bytes());
        self.client.call(req, timeout, || format!("get '{key}'"))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = Enc::new(OP_ADD);
        req.i64(delta);
        req.bytes(key.as_bytes());
        let what = || format!("add '{key}'");
        let body = self.client.call(req, self.client.timeout, what)?;
        let mut d = Dec(&body);
        let v = d.i64().and_then(|v| d.end().map(|()| v));
        v.map_err(|e| self.client.bad_answer(&what(), &e))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut req = Enc::new(OP_WAIT);
        req.u64(millis(timeout));
        req.u32(
            u32::try_from(keys.len()).map_err(|_| Error::InvalidArgument("store: too many keys".into()))?,
        );
        for k in keys {
            req.bytes(k.as_bytes());
        }
        self.client.call(req, timeout, || format!("wait {keys:?}"))?;
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let mut req = Enc::new(OP_DELETE);
        req.bytes(key.as_bytes());
        let what = || format!("delete '{key}'");
        let body = self.client.call(req, self.client.timeout, what)?;
        match body.as_slice() {
            [b] => Ok(*b != 0),
            _ => Err(self.client.bad_answer(&what(), "expected one byte")),
        }
    }
}

/// Splits `host:port` or `[v6]:port` into host (brackets removed) and port.
pub(crate) fn split_host_port(addr: &str) -> Result<(String, u16)> {
    let bad = |why: &str| {
        Error::InvalidArgument(format!("store address '{addr}': {why} (expected host:port or [v6]:port)"))
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    let host = match host.strip_prefix('[') {
        Some(h) => h.strip_suffix(']').ok_or_else(|| bad("unclosed '['"))?,
        // A bare IPv6 address ("::1:80") is ambiguous: insist on brackets.
        None if host.contains(':') => return Err(bad("IPv6 addresses need brackets")),
        None => host,
    };
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    let port = port.parse().map_err(|_| bad("port is not a number in 0..=65535"))?;
    Ok((host.to_string(), port))
}

fn resolve(host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
    Ok((host, port).to_socket_addrs()?.collect())
}

/// `timeout` from now; a timeout too long for `Instant` becomes a year (no set-up lasts that long).
fn deadline(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or(now + Duration::from_secs(365 * 24 * 3600))
}

/// Milliseconds, rounded up so that a short timeout is not cut to zero.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------------------------------------
// Encoding

/// A frame being built: 4 bytes kept for the length, then the payload.
struct Enc(Vec<u8>);

impl Enc {
    fn new(op: u8) -> Enc {
        Enc(vec![0, 0, 0, 0, op])
    }
    fn hello() -> Enc {
        let mut e = Enc(vec![0; 4]);
        e.0.extend_from_slice(MAGIC);
        e.u32(VERSION);
        e
    }
    /// Fills in the length; fails for a payload above the limit.
    fn finish(mut self) -> Result<Vec<u8>> {
        let len = self.0.len() - 4;
        if len > MAX_FRAME {
            return Err(Error::InvalidArgument(format!(
                "store: message of {len} bytes exceeds the limit of {MAX_FRAME} bytes"
            )));
        }
        // MAX_FRAME < u32::MAX, so the cast is exact.
        self.0[..4].copy_from_slice(&(len as u32).to_le_bytes());
        Ok(self.0)
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        // Lengths above u32 are caught by the frame limit before anything is sent.
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
        self.0.extend_from_slice(b);
    }
}

struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!("truncated message: wanted {n} more bytes, have {}", self.0.len()));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }
    fn i64(&mut self) -> std::result::Result<i64, String> {
        self.array().map(i64::from_le_bytes)
    }
    fn bytes(&mut self) -> std::result::Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn end(&self) -> std::result::Result<(), String> {
        if self.0.is_empty() { Ok(()) } else { Err(format!("{} unexpected trailing bytes", self.0.len())) }
    }
}

fn is_hello(payload: &[u8]) -> bool {
    payload.len() == 8 && payload[..4] == *MAGIC && payload[4..] == VERSION.to_le_bytes()
}

// ---------------------------------------------------------------------------------------------
// Client

struct Client {
    addr: String,
    timeout: Duration,
    conn: Mutex<ClientConn>,
}

struct ClientConn {
    stream: TcpStream,
    /// Why the connection cannot be used any more, after an I/O error left it out of step.
    broken: Option<String>,
}

enum Retry {
    Again(String),
    Fatal(Error),
}

fn retriable(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | TimedOut
            | HostUnreachable
            | NetworkUnreachable
            | AddrNotAvailable
            | Interrupted
    )
}

impl Client {
    /// One connection attempt to any of `addrs` within `attempt`, then the hello. `timeout` is
    /// the client's deadline for calls without one of their own.
    fn connect(
        addr: &str,
        addrs: &[SocketAddr],
        attempt: Duration,
        timeout: Duration,
    ) -> std::result::Result<Client, Retry> {
        let deadline = deadline(attempt);
        let mut last = if addrs.is_empty() {
            format!("'{addr}' resolves to no address")
        } else {
            "no time left for an attempt".to_string()
        };
        for a in addrs {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            let stream = match TcpStream::connect_timeout(a, remaining) {
                Ok(s) => s,
                Err(e) if retriable(&e) => {
                    last = format!("{a}: {e}");
                    continue;
                }
                Err(e) => {
                    return Err(Retry::Fatal(Error::system(format!("store: connect to {addr} ({a})"), e)));
                }
            };
            // Setup traffic is small request/response pairs: do not let Nagle delay them.
            let _ = stream.set_nodelay(true);
            let client = Client {
                addr: addr.to_string(),
                timeout,
                conn: Mutex::new(ClientConn { stream, broken: None }),
            };
            let io_timeout = deadline.saturating_duration_since(Instant::now());
            let answer = client.exchange(Enc::hello(), io_timeout).map_err(Retry::Fatal)?;
            return match answer.split_first() {
                Some((&ST_OK, _)) => {
                    tracing::info!(target: "toroid::store", "connected to store at {addr} ({a})");
                    Ok(client)
                }
                Some((_, msg)) => Err(Retry::Fatal(Error::Remote(format!(
                    "store at {addr} refused the hello: {}",
                    String::from_utf8_lossy(msg)
                )))),
                None => {
                    Err(Retry::Fatal(Error::Remote(format!("store at {addr}: empty answer to the hello"))))
                }
            };
        }
        Err(Retry::Again(last))
    }

    fn lock(&self) -> MutexGuard<'_, ClientConn> {
        // The guarded state is a socket and a flag, both valid after a panic elsewhere.
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends one frame and reads one back, with `timeout` plus a margin on each socket call.
    fn exchange(&self, frame: Enc, timeout: Duration) -> Result<Vec<u8>> {
        let frame = frame.finish()?;
        let mut c = self.lock();
        if let Some(why) = &c.broken {
            return Err(Error::Remote(format!(
                "store {}: connection unusable after an earlier error: {why}",
                self.addr
            )));
        }
        let io_timeout = Some(timeout.saturating_add(IO_MARGIN));
        let res = (|| {
            c.stream.set_write_timeout(io_timeout)?;
            c.stream.set_read_timeout(io_timeout)?;
            c.stream.write_all(&frame)?;
            let mut len = [0; 4];
            c.stream.read_exact(&mut len)?;
            let len = u32::from_le_bytes(len) as usize;
            if len > MAX_FRAME {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("server sent a frame of {len} bytes, above the limit of {MAX_FRAME}"),
                ));
            }
            let mut body = vec![0; len];
            c.stream.read_exact(&mut body)?;
            Ok(body)
        })();
        res.map_err(|e| {
            c.broken = Some(e.to_string());
            self.io_error(e, timeout)
        })
    }

    fn io_error(&self, e: io::Error, timeout: Duration) -> Error {
        use io::ErrorKind::*;
        let addr = &self.addr;
        match e.kind() {
            WouldBlock | TimedOut => {
                Error::Timeout(format!("store {addr}: no answer within {timeout:?} + {IO_MARGIN:?}"))
            }
            UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe => {
                Error::Remote(format!("store {addr}: server closed the connection ({e})"))
            }
            InvalidData => Error::Remote(format!("store {addr}: {e}")),
            _ => Error::system(format!("store {addr}"), e),
        }
    }

    /// One request: returns the body of an OK answer, or the server's error.
    fn call(&self, req: Enc, timeout: Duration, what: impl Fn() -> String) -> Result<Vec<u8>> {
        let mut answer = self.exchange(req, timeout).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{}: {m}", what())),
            e => e,
        })?;
        let Some(&status) = answer.first() else {
            return Err(self.bad_answer(&what(), "empty answer"));
        };
        answer.remove(0);
        let msg = || format!("store {}: {}: {}", self.addr, what(), String::from_utf8_lossy(&answer));
        match status {
            ST_OK => Ok(answer),
            ST_TIMEOUT => Err(Error::Timeout(msg())),
            ST_INVALID_USAGE => Err(Error::InvalidUsage(msg())),
            ST_BAD_REQUEST => Err(Error::Remote(format!("{} (request rejected)", msg()))),
            s => Err(self.bad_answer(&what(), &format!("unknown status {s}"))),
        }
    }

    fn bad_answer(&self, what: &str, why: &str) -> Error {
        Error::Remote(format!("store {}: {what}: malformed answer: {why}", self.addr))
    }
}

// ---------------------------------------------------------------------------------------------
// Server

struct ServerHandle {
    addr: SocketAddr,
    /// Dropping this end of the socket pair tells the server thread to stop.
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        drop(self.wake.take());
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!(target: "toroid::store", "store server thread panicked");
        }
        tracing::info!(target: "toroid::store", "store server on {} stopped", self.addr);
    }
}

type Map = HashMap<Vec<u8>, Vec<u8>>;

struct Server {
    listener: TcpListener,
    wake: UnixStream,
    conns: Vec<Conn>,
    map: Map,
}

enum Want {
    Get(Vec<u8>),
    Wait(Vec<Vec<u8>>),
}

/// A GET or WAIT waiting for its keys.
struct Pending {
    want: Want,
    /// `None` when the timeout is too far to represent.
    deadline: Option<Instant>,
    timeout_ms: u64,
}

impl Pending {
    /// The answer, once the keys are there or the deadline passed.
    fn answer(&self, map: &Map, now: Instant) -> Option<Vec<u8>> {
        match &self.want {
            Want::Get(k) => {
                if let Some(v) = map.get(k) {
                    return Some(answer(ST_OK, v));
                }
            }
            Want::Wait(keys) => {
                if keys.iter().all(|k| map.contains_key(k)) {
                    return Some(answer(ST_OK, &[]));
                }
            }
        }
        if self.deadline.is_some_and(|d| now >= d) {
            let keys: Vec<&Vec<u8>> = match &self.want {
                Want::Get(k) => vec![k],
                Want::Wait(keys) => keys.iter().filter(|k| !map.contains_key(*k)).collect(),
            };
            let keys: Vec<_> = keys.iter().map(|k| String::from_utf8_lossy(k)).collect();
            let msg = format!("waited {} ms for keys {keys:?}", self.timeout_ms);
            return Some(answer(ST_TIMEOUT, msg.as_bytes()));
        }
        None
    }
}

fn answer(status: u8, body: &[u8]) -> Vec<u8> {
    let mut a = Vec::with_capacity(1 + body.len());
    a.push(status);
    a.extend_from_slice(body);
    a
}

#[derive(PartialEq, Eq)]
enum State {
    /// Waiting for the hello.
    New,
    Open,
    /// Flush what is queued, then shut down writing and discard input until the peer closes
    /// (closing with unread input would send a reset that can destroy our last answer).
    Closing,
    Dead,
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    state: State,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    pending: Option<Pending>,
    eof: bool,
    write_shut: bool,
}

/// `poll(2)` over `fds`, retrying on EINTR.
fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<()> {
    loop {
        // SAFETY: `fds` is an exclusively borrowed, initialised slice of `pollfd` that outlives
        // the call, and its exact length is passed with it.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn pollfd(fd: i32, events: libc::c_short) -> libc::pollfd {
    libc::pollfd { fd, events, revents: 0 }
}

impl Server {
    fn run(mut self) {
        if let Err(e) = self.serve() {
            tracing::error!(target: "toroid::store", "store server failed: {e}; closing all connections");
        }
    }

    fn serve(&mut self) -> io::Result<()> {
        let mut fds = Vec::new();
        loop {
            let now = Instant::now();
            let timeout_ms =
                self.conns.iter().filter_map(|c| c.pending.as_ref()?.deadline).min().map_or(-1, |d| {
                    // Rounded up, so that we wake after the deadline rather than just before.
                    let ms = d.saturating_duration_since(now).as_nanos().div_ceil(1_000_000);
                    i32::try_from(ms).unwrap_or(i32::MAX)
                });
            fds.clear();
            fds.push(pollfd(self.wake.as_raw_fd(), libc::POLLIN));
            fds.push(pollfd(self.listener.as_raw_fd(), libc::POLLIN));
            for c in &self.conns {
                let out = if c.wbuf.is_empty() { 0 } else { libc::POLLOUT };
                fds.push(pollfd(c.stream.as_raw_fd(), libc::POLLIN | out));
            }
            poll(&mut fds, timeout_ms)?;
            if fds[0].revents != 0 {
                return Ok(()); // the owner dropped its end
            }
            for (c, fd) in self.conns.iter_mut().zip(&fds[2..]) {
                if fd.revents != 0 {
                    c.fill();
                }
            }
            if fds[1].revents != 0 {
                self.accept();
            }
            // A SET on one connection can complete a GET parked on another: repeat until quiet.
            let now = Instant::now();
            while self.conns.iter_mut().fold(false, |m, c| c.drive(&mut self.map, now) | m) {}
            for c in &mut self.conns {
                c.flush();
                if c.eof && c.state != State::Dead {
                    tracing::debug!(target: "toroid::store", "store client {} disconnected", c.peer);
                    c.state = State::Dead;
                }
            }
            self.conns.retain(|c| c.state != State::Dead);
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!(target: "toroid::store", "store: dropping client {peer}: {e}");
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    tracing::debug!(target: "toroid::store", "store client {peer} connected");
                    self.conns.push(Conn {
                        stream,
                        peer,
                        state: State::New,
                        rbuf: Vec::new(),
                        wbuf: Vec::new(),
                        pending: None,
                        eof: false,
                        write_shut: false,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning on poll.
                    tracing::warn!(target: "toroid::store", "store: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }
}

impl Conn {
    /// Reads everything available.
    fn fill(&mut self) {
        let mut chunk = [0u8; 64 * 1024];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    self.eof = true;
                    return;
                }
                // Input after a rejected request is read only to be dropped.
                Ok(_) if self.state == State::Closing => {}
                Ok(n) => self.rbuf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(target: "toroid::store", "store client {}: {e}", self.peer);
                    self.state = State::Dead;
                    return;
                }
            }
        }
    }

    fn send(&mut self, payload: &[u8]) {
        // Answers are bounded by what a client could send, which is bounded by MAX_FRAME.
        self.wbuf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        self.wbuf.extend_from_slice(payload);
    }

    /// Answers with an error, then closes.
    fn reject(&mut self, msg: &str) {
        tracing::warn!(target: "toroid::store", "store client {}: {msg}; closing", self.peer);
        self.send(&answer(ST_BAD_REQUEST, msg.as_bytes()));
        self.rbuf = Vec::new();
        self.pending = None;
        self.state = State::Closing;
    }

    /// Answers every complete request it can; returns whether the map changed.
    fn drive(&mut self, map: &mut Map, now: Instant) -> bool {
        let mut mutated = false;
        while matches!(self.state, State::New | State::Open) {
            if let Some(p) = &self.pending {
                match p.answer(map, now) {
                    Some(a) => {
                        self.pending = None;
                        self.send(&a);
                    }
                    None => break,
                }
            }
            let Some(head) = self.rbuf.first_chunk::<4>() else {
                break;
            };
            let len = u32::from_le_bytes(*head) as usize;
            if len > MAX_FRAME {
                self.reject(&format!("frame of {len} bytes exceeds the limit of {MAX_FRAME} bytes"));
                break;
            }
            if self.rbuf.len() < 4 + len {
                break;
            }
            let frame = self.rbuf[4..4 + len].to_vec();
            self.rbuf.drain(..4 + len);
            if self.state == State::New {
                if is_hello(&frame) {
                    self.state = State::Open;
                    self.send(&answer(ST_OK, &[]));
                } else {
                    self.reject(&format!(
                        "bad hello: not a toroid store client of protocol version {VERSION}"
                    ));
                }
                continue;
            }
            match handle(&frame, map, now) {
                Ok(Handled::Answer(a, m)) => {
                    mutated |= m;
                    self.send(&a);
                }
                Ok(Handled::Park(p)) => self.pending = Some(p),
                Err(msg) => self.send(&answer(ST_BAD_REQUEST, msg.as_bytes())),
            }
        }
        mutated
    }

    /// Writes what the socket takes now.
    fn flush(&mut self) {
        while !self.wbuf.is_empty() && self.state != State::Dead {
            match self.stream.write(&self.wbuf) {
                Ok(0) => self.state = State::Dead,
                Ok(n) => {
                    self.wbuf.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(target: "toroid::store", "store client {}: {e}", self.peer);
                    self.state = State::Dead;
                }
            }
        }
        if self.state == State::Closing && self.wbuf.is_empty() && !self.write_shut {
            self.write_shut = true;
            let _ = self.stream.shutdown(Shutdown::Write);
        }
    }
}

enum Handled {
    /// The answer, and whether the map changed.
    Answer(Vec<u8>, bool),
    Park(Pending),
}

fn handle(frame: &[u8], map: &mut Map, now: Instant) -> std::result::Result<Handled, String> {
    let mut d = Dec(frame);
    let park = |want, timeout_ms: u64| {
        let deadline = now.checked_add(Duration::from_millis(timeout_ms));
        Handled::Park(Pending { want, deadline, timeout_ms })
    };
    let out = match d.u8()? {
        OP_SET => {
            let key = d.bytes()?.to_vec();
            let value = d.bytes()?.to_vec();
            d.end()?;
            map.insert(key, value);
            Handled::Answer(answer(ST_OK, &[]), true)
        }
        OP_GET => {
            let timeout_ms = d.u64()?;
            let key = d.bytes()?.to_vec();
            d.end()?;
            park(Want::Get(key), timeout_ms)
        }
        OP_ADD => {
            let delta = d.i64()?;
            let key = d.bytes()?;
            d.end()?;
            let name = String::from_utf8_lossy(key);
            let cur = match map.get(key) {
                Some(v) => match super::parse_counter(&name, v) {
                    Ok(n) => n,
                    Err(e) => {
                        return Ok(Handled::Answer(answer(ST_INVALID_USAGE, e.detail().as_bytes()), false));
                    }
                },
                None => 0,
            };
            let new = cur.wrapping_add(delta);
            map.insert(key.to_vec(), new.to_string().into_bytes());
            Handled::Answer(answer(ST_OK, &new.to_le_bytes()), true)
        }
        OP_WAIT => {
            let timeout_ms = d.u64()?;
            let n = d.u32()?;
            // Each key takes at least its 4-byte length, so `n` is bounded by the frame.
            let mut keys = Vec::with_capacity((n as usize).min(frame.len() / 4));
            for _ in 0..n {
                keys.push(d.bytes()?.to_vec());
            }
            d.end()?;
            park(Want::Wait(keys), timeout_ms)
        }
        OP_DELETE => {
            let key = d.bytes()?;
            d.end()?;
            let existed = map.remove(key).is_some();
            Handled::Answer(answer(ST_OK, &[u8::from(existed)]), false)
        }
        op => return Err(format!("unknown operation {op}")),
    };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const T: Duration = Duration::from_secs(5);

    fn server() -> TcpStore {
        TcpStore::serve("127.0.0.1:0", T).unwrap()
    }

    fn addr_of(s: &TcpStore) -> String {
        s.server_addr().unwrap().to_string()
    }

    /// A port that was free a moment ago.
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[test]
    fn set_get_add_delete_roundtrip() {
        let s = server();
        s.set("a", b"xyz").unwrap();
        assert_eq!(s.get("a", T).unwrap(), b"xyz");
        s.set("a", b"").unwrap();
        assert_eq!(s.get("a", T).unwrap(), b"");
        // Arbitrary UTF-8 keys and binary values.
        s.set("ключ/🔑 with spaces", &[0, 255, 10]).unwrap();
        assert_eq!(s.get("ключ/🔑 with spaces", T).unwrap(), [0, 255, 10]);
        assert_eq!(s.add("n", 5).unwrap(), 5);
        assert_eq!(s.add("n", -7).unwrap(), -2);
        assert_eq!(s.get("n", T).unwrap(), b"-2");
        s.set("bad", b"x").unwrap();
        assert!(matches!(s.add("bad", 1), Err(Error::InvalidUsage(_))));
        assert!(s.delete("a").unwrap());
        assert!(!s.delete("a").unwrap());
        s.wait(&[], T).unwrap();
        // The connection stays usable after server-side errors.
        assert!(matches!(s.get("a", Duration::ZERO), Err(Error::Timeout(_))));
        assert_eq!(s.add("n", 2).unwrap(), 0);
    }

    #[test]
    fn concurrent_adds_from_many_clients_are_exact() {
        let s = Arc::new(server());
        let addr = addr_of(&s);
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let shared = s.clone();
                let addr = addr.clone();
                std::thread::spawn(move || {
                    // Half the threads share the serving handle, half have their own connection.
                    let own = (i % 2 == 0).then(|| TcpStore::connect(&addr, T).unwrap());
                    let store: &TcpStore = own.as_ref().unwrap_or(&shared);
                    for _ in 0..100 {
                        store.add("count", 1).unwrap();
                    }
                    store.set(&format!("done/{i}"), b"1").unwrap();
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let keys: Vec<String> = (0..8).map(|i| format!("done/{i}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        s.wait(&keys, T).unwrap();
        assert_eq!(s.add("count", 0).unwrap(), 800);
    }

    #[test]
    fn get_blocks_until_another_client_sets() {
        let s = server();
        let addr = addr_of(&s);
        let t = std::thread::spawn(move || {
            let c = TcpStore::connect(&addr, T).unwrap();
            std::thread::sleep(Duration::from_millis(150));
            c.set("late", b"here").unwrap();
        });
        let start = Instant::now();
        assert_eq!(s.get("late", T).unwrap(), b"here");
        assert!(start.elapsed() >= Duration::from_millis(100), "{:?}", start.elapsed());
        t.join().unwrap();
    }

    #[test]
    fn wait_times_out_in_bounded_time_naming_the_missing_key() {
        let s = server();
        s.set("present", b"1").unwrap();
        let start = Instant::now();
        let err = s.wait(&["present", "absent"], Duration::from_millis(200)).unwrap_err();
        let took = start.elapsed();
        assert!(matches!(&err, Error::Timeout(m) if m.contains(r#"for keys ["absent"]"#)), "{err}");
        assert!(took >= Duration::from_millis(190) && took < Duration::from_secs(2), "{took:?}");
    }

    #[test]
    fn connect_retries_until_a_late_server_starts() {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let (tx, rx) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let s = TcpStore::serve(&format!("127.0.0.1:{port}"), T).unwrap();
            // Keep the server up until the client is done.
            rx.recv_timeout(T).unwrap();
            drop(s);
        });
        let start = Instant::now();
        let c = TcpStore::connect(&addr, T).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(150));
        c.set("k", b"v").unwrap();
        assert_eq!(c.get("k", T).unwrap(), b"v");
        tx.send(()).unwrap();
        server.join().unwrap();
    }

    #[test]
    fn connect_to_nothing_times_out_naming_the_address() {
        let addr = format!("127.0.0.1:{}", free_port());
        let start = Instant::now();
        let err = TcpStore::connect(&addr, Duration::from_millis(300)).unwrap_err();
        assert!(matches!(&err, Error::Timeout(m) if m.contains(&addr)), "{err}");
        assert!(start.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn dropping_the_server_fails_a_blocked_client_quickly() {
        let s = server();
        let addr = addr_of(&s);
        let c = TcpStore::connect(&addr, T).unwrap();
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            let r = c.get("never", Duration::from_secs(30));
            (r, start.elapsed(), c)
        });
        std::thread::sleep(Duration::from_millis(100));
        drop(s);
        let (r, took, c) = t.join().unwrap();
        assert!(matches!(r, Err(Error::Remote(_) | Error::System(_))), "{r:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        // Later calls fail fast too.
        assert!(matches!(c.set("x", b"y"), Err(Error::Remote(_))));
    }

    fn raw_frame(s: &mut TcpStream, payload: &[u8]) {
        s.write_all(&(payload.len() as u32).to_le_bytes()).unwrap();
        s.write_all(payload).unwrap();
    }

    fn raw_read(s: &mut TcpStream) -> Vec<u8> {
        let mut len = [0; 4];
        s.read_exact(&mut len).unwrap();
        let mut body = vec![0; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut body).unwrap();
        body
    }

    #[test]
    fn server_rejects_oversized_frames_and_bad_hellos_and_keeps_serving() {
        let s = server();
        let addr = s.server_addr().unwrap();

        let mut raw = TcpStream::connect(addr).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        raw.write_all(&Enc::hello().finish().unwrap()).unwrap();
        assert_eq!(raw_read(&mut raw), [ST_OK]);
        // Claim 1 GiB and send nothing more: the server must answer, not allocate and wait.
        raw.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
        let a = raw_read(&mut raw);
        assert_eq!(a[0], ST_BAD_REQUEST);
        assert!(String::from_utf8_lossy(&a[1..]).contains("exceeds"));
        let mut rest = Vec::new();
        raw.read_to_end(&mut rest).unwrap(); // the server closed it
        assert!(rest.is_empty());

        let mut raw = TcpStream::connect(addr).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        raw_frame(&mut raw, b"HTTP/1.1");
        assert_eq!(raw_read(&mut raw)[0], ST_BAD_REQUEST);

        // A malformed request is answered and the connection stays open.
        let mut raw = TcpStream::connect(addr).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        raw.write_all(&Enc::hello().finish().unwrap()).unwrap();
        assert_eq!(raw_read(&mut raw), [ST_OK]);
        raw_frame(&mut raw, &[OP_SET, 9, 0, 0]);
        assert_eq!(raw_read(&mut raw)[0], ST_BAD_REQUEST);
        raw_frame(&mut raw, &[OP_DELETE, 1, 0, 0, 0, b'z']);
        assert_eq!(raw_read(&mut raw), [ST_OK, 0]);

        s.set("still", b"fine").unwrap();
        assert_eq!(s.get("still", T).unwrap(), b"fine");
    }

    #[test]
    fn client_rejects_oversized_answers_without_allocating() {
        // A fake server that answers the hello with a 4 GiB-ish header.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(T)).unwrap();
            let _ = raw_read(&mut s);
            s.write_all(&u32::MAX.to_le_bytes()).unwrap();
        });
        let err = TcpStore::connect(&addr, T).unwrap_err();
        assert!(matches!(&err, Error::Remote(m) if m.contains("limit")), "{err}");
        fake.join().unwrap();
    }

    #[test]
    fn addresses_parse() {
        assert_eq!(split_host_port("h:1").unwrap(), ("h".into(), 1));
        assert_eq!(split_host_port("[::1]:29500").unwrap(), ("::1".into(), 29500));
        assert_eq!(split_host_port("0.0.0.0:0").unwrap(), ("0.0.0.0".into(), 0));
        for bad in ["h", ":1", "h:x", "h:65536", "::1:80", "[::1:80", "[]:1"] {
            assert!(matches!(split_host_port(bad), Err(Error::InvalidArgument(_))), "{bad}");
        }
        assert!(matches!(TcpStore::connect("127.0.0.1:0", T), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn serves_on_ipv6_loopback_and_all_interfaces() {
        if let Ok(s) = TcpStore::serve("[::1]:0", T) {
            let c = TcpStore::connect(&format!("[::1]:{}", s.server_addr().unwrap().port()), T).unwrap();
            c.set("v6", b"ok").unwrap();
            assert_eq!(s.get("v6", T).unwrap(), b"ok");
        } // else: no IPv6 on this machine
        let s = TcpStore::serve("0.0.0.0:0", T).unwrap();
        let c = TcpStore::connect(&format!("localhost:{}", s.server_addr().unwrap().port()), T).unwrap();
        c.set("any", b"ok").unwrap();
        assert_eq!(s.get("any", T).unwrap(), b"ok");
    }
}
