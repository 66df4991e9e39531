//! The control plane in TLS (`TOROID_ENCRYPT`): after the plaintext hello and ack have checked
//! the job's token, the asker (the TLS client) and the rank (the server) run a TLS 1.3
//! handshake, each proves the token over a value exported from it (as the store does, since an
//! asker may be an outside process that holds no rank's key), and the request and its answer
//! cross inside TLS.
//!
//! ```text
//! asker -> rank   hello (plaintext, as without TLS)       rank -> asker   ack (plaintext)
//! TLS 1.3 handshake (the rank presents a key made when its control plane started)
//! asker -> rank   binding (32) | request (8)              rank -> asker   binding (32) | len u32 | answer
//! binding = HMAC-SHA256(token, "toroid control binding v1" | role | exporter("EXPORTER-toroid-control-binding-v1", 32))
//! ```
//!
//! The rank's side is driven step by step from the control thread's poll loop ([`Server`]);
//! before its handshake is done a peer can make it hold at most [`MAX_HANDSHAKE_INPUT`] bytes.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Instant;

use hmac::Mac;

use super::{MAX_ANSWER, REQUEST_LEN, REQUEST_MAGIC};
use crate::config::AuthToken;

/// Bytes of each side's binding.
pub const BINDING_LEN: usize = 32;
const EXPORT_LABEL: &[u8] = b"EXPORTER-toroid-control-binding-v1";
const MAC_LABEL: &[u8] = b"toroid control binding v1";
/// Handshake bytes a peer may send before its handshake completes.
pub const MAX_HANDSHAKE_INPUT: usize = 16 << 10;

/// The binding of `role` (true: the asker) for a session that exported `exported`.
fn binding(token: &AuthToken, client: bool, exported: &[u8; BINDING_LEN]) -> hmac::Hmac<sha2::Sha256> {
    crate::transport::tcp::handshake::mac(token, MAC_LABEL, &[&[u8::from(client)], exported])
}

fn exported<D>(conn: &rustls::ConnectionCommon<D>) -> io::Result<[u8; BINDING_LEN]> {
    let mut out = [0; BINDING_LEN];
    crate::tls::export(conn, EXPORT_LABEL, &mut out).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(out)
}

fn invalid(m: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, m.to_string())
}

/// What a step of the rank's side came to.
pub enum Progress {
    Wait,
    Done,
    Failed(String),
}

/// The rank's side of one encrypted control connection, after its ack.
pub struct Server {
    conn: rustls::ServerConnection,
    handshake_input: usize,
    sent_binding: bool,
    /// The asker's binding and request, as they arrive.
    input: Vec<u8>,
    answered: bool,
}

impl Server {
    pub fn new(cfg: &Arc<rustls::ServerConfig>) -> io::Result<Server> {
        let conn = rustls::ServerConnection::new(cfg.clone()).map_err(invalid)?;
        Ok(Server { conn, handshake_input: 0, sent_binding: false, input: Vec::new(), answered: false })
    }

    /// Whether the socket should be watched for room to write.
    pub fn wants_write(&self) -> bool {
        self.conn.wants_write()
    }

    /// Moves as far as the socket allows: the handshake, the bindings, the request, then the
    /// answer `answer(request)` gives. `Done` once the answer is all out.
    pub fn step(
        &mut self,
        s: &mut TcpStream,
        token: &AuthToken,
        answer: &mut dyn FnMut(u8) -> Vec<u8>,
    ) -> Progress {
        loop {
            while self.conn.wants_write() {
                match self.conn.write_tls(s) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Wait,
                    Err(e) => return Progress::Failed(format!("TLS: {e}")),
                }
            }
            if self.answered {
                return Progress::Done;
            }
            if !self.conn.is_handshaking() && !self.sent_binding {
                let Ok(x) = exported(&self.conn) else { return Progress::Failed("TLS exporter".into()) };
                let mine = binding(token, false, &x).finalize().into_bytes();
                if self.conn.writer().write_all(&mine).is_err() {
                    return Progress::Failed("TLS: queueing the binding".into());
                }
                self.sent_binding = true;
                continue;
            }
            if self.sent_binding {
                let need = BINDING_LEN + REQUEST_LEN;
                let mut buf = [0u8; BINDING_LEN + REQUEST_LEN];
                let want = need - self.input.len();
                match self.conn.reader().read(&mut buf[..want]) {
                    Ok(0) => return Progress::Failed("closed before its request".into()),
                    Ok(n) => self.input.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Progress::Failed(format!("TLS: {e}")),
                }
                if self.input.len() == need {
                    let Ok(x) = exported(&self.conn) else { return Progress::Failed("TLS exporter".into()) };
                    if binding(token, true, &x).verify_slice(&self.input[..BINDING_LEN]).is_err() {
                        return Progress::Failed(
                            "its token binding does not match (a machine in the middle?)".into(),
                        );
                    }
                    let req = &self.input[BINDING_LEN..];
                    if req[..4] != REQUEST_MAGIC {
                        return Progress::Failed("an unknown request".into());
                    }
                    let body = answer(req[4]);
                    let body = &body[..body.len().min(MAX_ANSWER)];
                    let mut msg = (body.len() as u32).to_le_bytes().to_vec();
                    msg.extend_from_slice(body);
                    if self.conn.writer().write_all(&msg).is_err() {
                        return Progress::Failed("TLS: queueing the answer".into());
                    }
                    self.answered = true;
                    continue;
                }
            }
            match self.conn.read_tls(s) {
                Ok(0) => return Progress::Failed("closed in the TLS exchange".into()),
                Ok(n) => {
                    if self.conn.is_handshaking() {
                        self.handshake_input += n;
                        if self.handshake_input > MAX_HANDSHAKE_INPUT {
                            return Progress::Failed(format!(
                                "more than {MAX_HANDSHAKE_INPUT} bytes of handshake"
                            ));
                        }
                    }
                    if let Err(e) = self.conn.process_new_packets() {
                        let _ = self.conn.write_tls(s);
                        return Progress::Failed(format!("TLS: {e}"));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Wait,
                Err(e) => return Progress::Failed(format!("TLS: {e}")),
            }
        }
    }
}

/// The asker's side after the ack: the handshake, the bindings, `request`, and the answer, each
/// socket call bounded by what is left until `deadline`.
pub fn ask(s: &mut TcpStream, token: &AuthToken, request: &[u8], deadline: Instant) -> io::Result<Vec<u8>> {
    let mut tls = crate::tls::bound_client().map_err(|e| io::Error::other(e.to_string()))?;
    let arm = |s: &TcpStream| -> io::Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        s.set_write_timeout(Some(left))
    };
    while tls.is_handshaking() {
        arm(s)?;
        tls.complete_io(&mut *s)?;
    }
    let x = exported(&tls)?;
    let mut out = binding(token, true, &x).finalize().into_bytes().to_vec();
    out.extend_from_slice(request);
    arm(s)?;
    let mut st = rustls::Stream::new(&mut tls, &mut *s);
    st.write_all(&out)?;
    st.flush()?;
    let mut theirs = [0u8; BINDING_LEN];
    read_exact(&mut tls, s, &mut theirs, &arm)?;
    if binding(token, false, &x).verify_slice(&theirs).is_err() {
        return Err(invalid("the rank's token binding does not match (a machine in the middle?)"));
    }
    let mut len = [0u8; 4];
    read_exact(&mut tls, s, &mut len, &arm)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_ANSWER {
        return Err(invalid(format!("an answer of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    read_exact(&mut tls, s, &mut body, &arm)?;
    Ok(body)
}

fn read_exact(
    tls: &mut rustls::ClientConnection,
    s: &mut TcpStream,
    buf: &mut [u8],
    arm: &dyn Fn(&TcpStream) -> io::Result<()>,
) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        arm(s)?;
        match rustls::Stream::new(&mut *tls, &mut *s).read(&mut buf[got..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before answering")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
