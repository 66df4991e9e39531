//! TCP store: a key-value server run by rank 0; every rank (rank 0 included) is a client.
//!
//! # Wire protocol (version 2)
//!
//! Integers are little-endian. Every message is a frame: `len: u32` then `len` bytes of payload.
//! The first frame a client sends is a hello: `b"TRDV"`, `version: u32`, `flags: u8` (1: it
//! authenticates, 2: it encrypts), and with flag 1 a 16-byte nonce. Without a token the server
//! answers OK and `flags = 0`; with one, it runs the challenge-response of `auth` (its nonce and
//! proof, the client's proof, OK). With `TOROID_ENCRYPT` the client's first hello carries flag 2
//! alone, the server answers OK and `flags = 2`, a TLS 1.3 handshake follows, and inside it the
//! hello with flag 1 and the challenge-response, bound to that handshake (`auth`). A hello of
//! another magic, version, token or encryption setting is answered with an error naming
//! `TOROID_AUTH_TOKEN` or `TOROID_ENCRYPT` where that is the cause, and the connection closed. Then
//! every request gets exactly one response, in order. `bytes` is `len: u32` then the bytes.
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
//! # Bounds
//!
//! A stranger that reaches the port must not be able to grow the server's memory or stall the
//! job's set-up. Sized so that a job of thousands of ranks fits with a wide margin:
//!
//! | limit | value | over it |
//! |---|---|---|
//! | key | [`MAX_KEY`] = 1 KiB | error answer |
//! | value | [`MAX_VALUE`] = 64 KiB | error answer |
//! | frame | [`MAX_FRAME`] = a SET of both, 64 KiB + 1088 B; 64 B before the hello is done | error answer, connection closed (the length header is not trusted) |
//! | stored in all (key + value + 64 B each) | [`MAX_STORED`] = 4 MiB (a 10,000-rank job stores about 2 MiB) | error answer ("store full") |
//! | keys of one WAIT | [`MAX_WAIT_KEYS`] = 16,384 | error answer |
//! | connections | [`MAX_CONNECTIONS`] = 4,096 | new ones wait in the listen backlog |
//! | hello (and proof) | [`HANDSHAKE_DEADLINE`] = 4 s | connection closed |
//! | TLS handshake bytes (encrypted store) | 16 KiB, within the same 4 s | connection closed |
//! | buffered input per connection | one frame | not read until answered |
//! | unsent output per connection | 64 KiB, plus the one answer that crossed it | requests not answered, input not read, until the peer reads |
//! | GET/WAIT timeout | [`MAX_PARK`] = 24 h | cut to it: every parked request has a deadline |
//!
//! Each refusal is logged as a WARN naming the peer (at most 20 a second, the rest counted).
//! With a token, a stranger never gets past the hello: it costs a few hundred bytes for at most
//! 4 s. Without a token it is a client like any other: it can read every key and store up to
//! `MAX_STORED`, and make the server hold one queued answer and one frame of input.
//!
//! # Server lifetime
//!
//! torch's TCPStore serves for the job's whole life (torch uses it after set-up: barriers,
//! new process groups). toroid's ranks use the store only to meet: `Communicator::from_launch`
//! stops rank 0's server as soon as its communicator is connected, when every rank has read
//! everything it needs (splits and later communicators go through the connected ranks, not the
//! store). So the port is open for the set-up only. A store that the user creates
//! ([`TcpStore::serve`], and stores given to `Communicator::with_store`, the C ABI or Python)
//! serves until the user drops it.
//!
//! # Server
//!
//! One thread runs an `epoll(7)` loop over non-blocking sockets. A GET or WAIT whose keys are
//! missing parks its connection (later requests on it stay buffered) until a SET or ADD supplies
//! them or its deadline passes, so clients never poll. A request costs the same however many
//! connections are open (only ready connections and the requests parked on a key just set are
//! looked at), so rank 0's store serves a job of `N` ranks in `O(N)`. Dropping the [`TcpStore`] that owns the
//! server (or [`TcpStore::stop_serving`]) closes one end of a socket pair the loop watches; the
//! thread then drops every connection and is joined, and clients blocked on it see the
//! connection close.
//!
//! | part | what |
//! |---|---|
//! | `protocol` | constants and limits, frame encoder and decoder, the hello |
//! | `auth` | the challenge-response with `TOROID_AUTH_TOKEN`, and its binding to TLS |
//! | `client` | one connection: hello, then a request and its answer at a time |
//! | `server` | the `epoll(7)` loop: connections, their buffers, parked requests by key, deadlines; a connection's socket or TLS over it (`conn_io`) |
//! | `requests` | the bounded table, the operations, parked requests |
//! | this file | [`TcpStore`]: addresses, serving, connecting with backoff, the [`Store`] calls |

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::time::{Duration, Instant};

use std::sync::{Mutex, MutexGuard};

use super::Store;
use crate::config::AuthToken;
use crate::error::{Error, Result};

mod auth;
mod client;
pub(crate) mod protocol;
pub(crate) mod requests;
mod server;
#[cfg(test)]
mod tls_tests;

pub(crate) use client::retriable;
use client::{Client, Retry};
use protocol::{Dec, Enc, OP_ADD, OP_DELETE, OP_GET, OP_SET, OP_WAIT};
pub use protocol::{
    HANDSHAKE_DEADLINE, MAX_CONNECTIONS, MAX_FRAME, MAX_KEY, MAX_PARK, MAX_STORED, MAX_VALUE, MAX_WAIT_KEYS,
};
use server::ServerHandle;

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
    server: Mutex<Option<ServerHandle>>,
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
        TcpStore::serve_with_token(addr, timeout, None)
    }

    /// As [`TcpStore::serve`]; with `token`, every connection (this handle's own included) must
    /// pass the challenge-response keyed by it before any request, and clients without it, or
    /// with another, are refused with an error naming `TOROID_AUTH_TOKEN`.
    ///
    /// # Errors
    /// As [`TcpStore::serve`].
    pub fn serve_with_token(addr: &str, timeout: Duration, token: Option<&AuthToken>) -> Result<TcpStore> {
        TcpStore::serve_secured(addr, timeout, token, false)
    }

    /// As [`TcpStore::serve_with_token`], with every connection (after a plaintext hello that
    /// asks for it) in TLS 1.3, and the token's challenge-response bound to each connection's
    /// handshake: the keys and values cross the network encrypted (`TOROID_ENCRYPT`).
    ///
    /// # Errors
    /// As [`TcpStore::serve`].
    pub fn serve_encrypted(addr: &str, timeout: Duration, token: &AuthToken) -> Result<TcpStore> {
        TcpStore::serve_secured(addr, timeout, Some(token), true)
    }

    /// Serves with `token` and, if `encrypt`, TLS (which needs the token).
    pub(crate) fn serve_secured(
        addr: &str,
        timeout: Duration,
        token: Option<&AuthToken>,
        encrypt: bool,
    ) -> Result<TcpStore> {
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
                return Err(Error::InvalidArgument(format!("store: '{addr}' resolves to no address").into()));
            }
        };
        let bound = listener.local_addr().map_err(|e| Error::system("store: local address", e))?;
        let handle = server::start(listener, bound, token.cloned(), encrypt, MAX_CONNECTIONS)?;

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
        let client = Client::connect(&local.to_string(), &[local], timeout, timeout, token, encrypt)
            .map_err(|r| match r {
                Retry::Again(e) => {
                    Error::System(format!("store: cannot reach its own server at {local}: {e}").into())
                }
                Retry::Fatal(e) => e,
            })?;
        Ok(TcpStore { client, server: Mutex::new(Some(handle)) })
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
        TcpStore::connect_with_token(addr, timeout, None)
    }

    /// As [`TcpStore::connect`]; with `token`, the server must prove it holds the same token
    /// before this client proves it does (see [`TcpStore::serve_with_token`]).
    ///
    /// # Errors
    /// As [`TcpStore::connect`]; [`Error::Remote`] naming `TOROID_AUTH_TOKEN` when the server
    /// has another token or none.
    pub fn connect_with_token(addr: &str, timeout: Duration, token: Option<&AuthToken>) -> Result<TcpStore> {
        TcpStore::connect_secured(addr, timeout, token, false)
    }

    /// As [`TcpStore::connect_with_token`] to a server of [`TcpStore::serve_encrypted`].
    ///
    /// # Errors
    /// As [`TcpStore::connect_with_token`]; [`Error::Remote`] naming `TOROID_ENCRYPT` when the
    /// server does not encrypt.
    pub fn connect_encrypted(addr: &str, timeout: Duration, token: &AuthToken) -> Result<TcpStore> {
        TcpStore::connect_secured(addr, timeout, Some(token), true)
    }

    /// Connects with `token` and, if `encrypt`, TLS (which needs the token).
    pub(crate) fn connect_secured(
        addr: &str,
        timeout: Duration,
        token: Option<&AuthToken>,
        encrypt: bool,
    ) -> Result<TcpStore> {
        let (host, port) = split_host_port(addr)?;
        if port == 0 {
            return Err(Error::InvalidArgument(format!("store: cannot connect to port 0 ('{addr}')").into()));
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
                    token,
                    encrypt,
                ) {
                    Ok(client) => {
                        return Ok(TcpStore { client, server: Mutex::new(None) });
                    }
                    Err(Retry::Fatal(e)) => return Err(e),
                    Err(Retry::Again(e)) => e,
                },
                Err(e) => format!("cannot resolve '{host}': {e}"),
            };
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(Error::Timeout(
                    format!("store: no server answered at {addr} within {timeout:?} (last error: {last})")
                        .into(),
                ));
            }
            tracing::debug!(target: "toroid::store", "store {addr} not reachable yet ({last}); retrying in {backoff:?}");
            crate::cancel::check("connecting to the store")?;
            let slice = if crate::cancel::active() { crate::cancel::SLICE } else { BACKOFF_CAP };
            std::thread::sleep(backoff.min(remaining).min(slice));
            backoff = (backoff * 2).min(BACKOFF_CAP);
        }
    }

    /// The address the server listens on (for `serve` with port 0), if this handle owns it.
    pub fn server_addr(&self) -> Option<SocketAddr> {
        self.server_handle().as_ref().map(|s| s.addr)
    }

    /// Stops the server this handle owns (if any, and if still running), closing every client's
    /// connection; this handle's own calls fail from then on.
    pub fn stop_serving(&self) {
        let handle = self.server_handle().take();
        drop(handle); // joins the server thread, outside the lock
    }

    fn server_handle(&self) -> MutexGuard<'_, Option<ServerHandle>> {
        // The guarded value is an optional handle, valid after a panic elsewhere.
        self.server.lock().unwrap_or_else(|e| e.into_inner())
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
        Error::InvalidArgument(
            format!("store address '{addr}': {why} (expected host:port or [v6]:port)").into(),
        )
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::check_store_contract;
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::Arc;

    pub(super) const T: Duration = Duration::from_secs(5);

    pub(super) fn server() -> TcpStore {
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
    fn keeps_the_store_contract() {
        check_store_contract(&server());
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

    pub(super) fn raw_frame(s: &mut TcpStream, payload: &[u8]) {
        s.write_all(&(payload.len() as u32).to_le_bytes()).unwrap();
        s.write_all(payload).unwrap();
    }

    pub(super) fn raw_read(s: &mut TcpStream) -> Vec<u8> {
        let mut len = [0; 4];
        s.read_exact(&mut len).unwrap();
        let mut body = vec![0; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut body).unwrap();
        body
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
