//! The store's client side: one connection, a hello, then one request and one answer at a time.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::auth::{self, NONCE_LEN, TAG_LEN};
use super::deadline;
use super::protocol::{
    Enc, FLAG_AUTH, FLAG_TLS, MAX_FRAME, ST_BAD_REQUEST, ST_INVALID_USAGE, ST_OK, ST_TIMEOUT,
};
use crate::config::AuthToken;
use crate::error::{Error, Result};

/// Added to a call's own timeout for the socket deadline, so that the server's answer "timed
/// out" arrives before the client gives up on the socket.
const IO_MARGIN: Duration = Duration::from_secs(2);

/// A connection to the server.
pub(super) struct Client {
    /// The address as given, for messages.
    pub(super) addr: String,
    /// The deadline of calls without one of their own.
    pub(super) timeout: Duration,
    conn: Mutex<ClientConn>,
}

struct ClientConn {
    stream: TcpStream,
    /// TLS over the stream once the hello agreed on it (`TOROID_ENCRYPT`).
    tls: Option<Box<rustls::ClientConnection>>,
    /// Why the connection cannot be used any more, after an I/O error left it out of step.
    broken: Option<String>,
}

/// Why a connection attempt failed.
pub(super) enum Retry {
    /// Nothing answered (yet): worth another attempt.
    Again(String),
    /// Something answered wrongly, or the attempt cannot succeed.
    Fatal(Error),
}

/// Whether a connection attempt that failed with `e` is worth another (nothing answered yet).
pub(crate) fn retriable(e: &io::Error) -> bool {
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
    /// One connection attempt to any of `addrs` within `attempt`, then the hello (with `auth`,
    /// the challenge-response of `auth`; with `encrypt` as well, inside TLS). `timeout` is the
    /// client's deadline for calls without one of their own.
    pub(super) fn connect(
        addr: &str,
        addrs: &[SocketAddr],
        attempt: Duration,
        timeout: Duration,
        auth: Option<&AuthToken>,
        encrypt: bool,
    ) -> std::result::Result<Client, Retry> {
        if encrypt && auth.is_none() {
            return Err(Retry::Fatal(Error::InvalidArgument(
                "an encrypted store needs a token (TOROID_AUTH_TOKEN)".into(),
            )));
        }
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
                conn: Mutex::new(ClientConn { stream, tls: None, broken: None }),
            };
            let io_timeout = deadline.saturating_duration_since(Instant::now());
            if encrypt {
                client.start_tls(io_timeout).map_err(Retry::Fatal)?;
            }
            client.hello(auth, io_timeout).map_err(Retry::Fatal)?;
            tracing::info!(target: "toroid::store", "connected to store at {addr} ({a}){}",
            match (auth.is_some(), encrypt) {
                (_, true) => ", authenticated and encrypted",
                (true, false) => ", authenticated",
                _ => "",
            });
            return Ok(client);
        }
        Err(Retry::Again(last))
    }

    /// The plaintext hello that asks for TLS (within `io_timeout` plus a margin), then the TLS
    /// handshake (within one such deadline in all). The server's key is not checked here: the
    /// token's challenge-response that follows covers a value exported from this handshake
    /// ([`auth::BINDING_LABEL`]).
    fn start_tls(&self, io_timeout: Duration) -> Result<()> {
        let addr = &self.addr;
        match self.exchange(Enc::hello_tls(), io_timeout)?.as_slice() {
            [ST_OK, FLAG_TLS] => {}
            [ST_OK, ..] => return Err(self.bad_answer("hello", "the server did not agree to TLS")),
            [_, msg @ ..] => {
                return Err(Error::Remote(
                    format!("store at {addr} refused the hello: {}", String::from_utf8_lossy(msg)).into(),
                ));
            }
            [] => return Err(self.bad_answer("hello", "empty answer")),
        }
        let mut tls = crate::tls::bound_client()?;
        let mut c = self.lock();
        // One deadline for the whole handshake, not one per socket call: a server that drips
        // its flight cannot stretch it.
        let deadline = deadline(io_timeout.saturating_add(IO_MARGIN));
        let res = (|| -> io::Result<()> {
            while tls.is_handshaking() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                c.stream.set_write_timeout(Some(left))?;
                c.stream.set_read_timeout(Some(left))?;
                tls.complete_io(&mut c.stream)?;
            }
            Ok(())
        })();
        if let Err(e) = res {
            c.broken = Some(format!("TLS handshake: {e}"));
            return Err(match e.kind() {
                io::ErrorKind::InvalidData => {
                    Error::Remote(format!("store {addr}: TLS handshake failed: {e}").into())
                }
                _ => self.io_error(e, io_timeout),
            });
        }
        c.tls = Some(Box::new(tls));
        Ok(())
    }

    /// The hello, and with a token the challenge-response: the server must prove it holds the
    /// token before this client proves it does. Under TLS the tags also cover the value both
    /// ends export from the handshake.
    fn hello(&self, token: Option<&AuthToken>, io_timeout: Duration) -> Result<()> {
        let addr = &self.addr;
        let nonce = token.map(|_| auth::nonce()).transpose()?;
        let hello = Enc::hello(nonce.as_ref().map(|n| &n[..]));
        let mut hello_payload = hello.payload().to_vec();
        if let Some(tls) = &self.lock().tls {
            let mut b = [0; auth::BINDING_LEN];
            crate::tls::export(tls, auth::BINDING_LABEL, &mut b)?;
            hello_payload.extend_from_slice(&b);
        }
        let answer = self.exchange(hello, io_timeout)?;
        let body = match answer.split_first() {
            Some((&ST_OK, body)) => body,
            Some((_, msg)) => {
                return Err(Error::Remote(
                    format!("store at {addr} refused the hello: {}", String::from_utf8_lossy(msg)).into(),
                ));
            }
            None => return Err(Error::Remote(format!("store at {addr}: empty answer to the hello").into())),
        };
        let Some(token) = token else {
            return match body {
                [0] => Ok(()),
                [FLAG_AUTH, ..] => Err(Error::Remote(
                    format!("store at {addr} authenticates but TOROID_AUTH_TOKEN is not set here").into(),
                )),
                _ => Err(self.bad_answer("hello", "unexpected answer")),
            };
        };
        // [FLAG_AUTH, server nonce, server tag]
        let (server_nonce, tag) = match body {
            [FLAG_AUTH, rest @ ..] if rest.len() == NONCE_LEN + TAG_LEN => rest.split_at(NONCE_LEN),
            [0] => {
                return Err(Error::Remote(
                    format!("store at {addr} does not authenticate, but TOROID_AUTH_TOKEN is set here")
                        .into(),
                ));
            }
            _ => return Err(self.bad_answer("hello", "malformed challenge")),
        };
        let server_nonce: auth::Nonce =
            server_nonce.try_into().map_err(|_| self.bad_answer("hello", "nonce"))?;
        if !auth::server_tag_ok(token, &hello_payload, &server_nonce, tag) {
            self.lock().broken = Some("authentication failed".into());
            return Err(Error::Remote(
                format!("store at {addr} failed authentication (a different TOROID_AUTH_TOKEN?)").into(),
            ));
        }
        let proof = auth::client_tag(token, &hello_payload, &server_nonce);
        match self.exchange(Enc::raw(&proof), io_timeout)?.as_slice() {
            [ST_OK, 0] => Ok(()),
            [_, msg @ ..] => Err(Error::Remote(
                format!("store at {addr} refused this client: {}", String::from_utf8_lossy(msg)).into(),
            )),
            [] => Err(self.bad_answer("hello", "empty answer")),
        }
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
            return Err(Error::Remote(
                format!("store {}: connection unusable after an earlier error: {why}", self.addr).into(),
            ));
        }
        let io_timeout = Some(timeout.saturating_add(IO_MARGIN));
        let ClientConn { stream, tls, .. } = &mut *c;
        let res = stream.set_write_timeout(io_timeout).and_then(|()| stream.set_read_timeout(io_timeout));
        let res = res.and_then(|()| match tls {
            Some(tls) => round_trip(&mut rustls::Stream::new(&mut **tls, stream), &frame),
            None => round_trip(stream, &frame),
        });
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
                Error::Timeout(format!("store {addr}: no answer within {timeout:?} + {IO_MARGIN:?}").into())
            }
            UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe => {
                Error::Remote(format!("store {addr}: server closed the connection ({e})").into())
            }
            InvalidData => Error::Remote(format!("store {addr}: {e}").into()),
            _ => Error::system(format!("store {addr}"), e),
        }
    }

    /// One request: returns the body of an OK answer, or the server's error.
    pub(super) fn call(&self, req: Enc, timeout: Duration, what: impl Fn() -> String) -> Result<Vec<u8>> {
        let mut answer = self.exchange(req, timeout).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{}: {m}", what()).into()),
            e => e,
        })?;
        let Some(&status) = answer.first() else {
            return Err(self.bad_answer(&what(), "empty answer"));
        };
        answer.remove(0);
        let msg = || format!("store {}: {}: {}", self.addr, what(), String::from_utf8_lossy(&answer));
        match status {
            ST_OK => Ok(answer),
            ST_TIMEOUT => Err(Error::Timeout(msg().into())),
            ST_INVALID_USAGE => Err(Error::InvalidUsage(msg().into())),
            ST_BAD_REQUEST => Err(Error::Remote(format!("{} (request rejected)", msg()).into())),
            s => Err(self.bad_answer(&what(), &format!("unknown status {s}"))),
        }
    }

    pub(super) fn bad_answer(&self, what: &str, why: &str) -> Error {
        Error::Remote(format!("store {}: {what}: malformed answer: {why}", self.addr).into())
    }
}

/// Writes one frame and reads the answer's frame.
fn round_trip(s: &mut (impl Read + Write), frame: &[u8]) -> io::Result<Vec<u8>> {
    s.write_all(frame)?;
    s.flush()?;
    let mut len = [0; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("server sent a frame of {len} bytes, above the limit of {MAX_FRAME}"),
        ));
    }
    let mut body = vec![0; len];
    s.read_exact(&mut body)?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::super::TcpStore;
    use super::super::tests::{T, raw_read};
    use super::*;
    use std::net::TcpListener;

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
}
