//! A store connection's bytes on the server: the socket itself, or TLS over it once a client
//! that encrypts (`TOROID_ENCRYPT`) asked for it in its plaintext hello.
//!
//! Both read and write without blocking, as the loop needs. With TLS, a read may leave
//! decrypted bytes in rustls (the caller's buffer was full): the socket then shows nothing
//! new, so the loop asks [`ConnIo::has_buffered_input`] rather than waiting for epoll. Before
//! the handshake is done a client can make the server hold at most [`MAX_HANDSHAKE_INPUT`]
//! bytes of it (a real ClientHello with its hybrid key share is about 1.5 KiB).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;

/// Ciphertext a client may send before its handshake completes.
pub(super) const MAX_HANDSHAKE_INPUT: usize = 16 << 10;

/// A connection's socket, with TLS over it once started.
pub(in crate::rendezvous::tcp_store) struct ConnIo {
    stream: TcpStream,
    tls: Option<Box<Tls>>,
}

struct Tls {
    conn: rustls::ServerConnection,
    /// Plaintext bytes that go out before any TLS byte (the answer to the plaintext hello).
    prefix: Vec<u8>,
    /// Decrypted bytes rustls holds that have not been read yet.
    plain: usize,
    /// Ciphertext read while the handshake ran.
    handshake_input: usize,
    /// The socket reached its end.
    eof: bool,
}

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

impl ConnIo {
    pub(super) fn plain(stream: TcpStream) -> ConnIo {
        ConnIo { stream, tls: None }
    }

    pub(super) fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Continues in TLS as the server of `cfg`: `prefix` goes out first in plaintext, and
    /// `early` (bytes that arrived after the plaintext hello) is the start of the handshake.
    pub(super) fn start_tls(
        &mut self,
        cfg: &Arc<rustls::ServerConfig>,
        prefix: Vec<u8>,
        mut early: &[u8],
    ) -> io::Result<()> {
        let conn = rustls::ServerConnection::new(cfg.clone()).map_err(invalid)?;
        let mut tls = Box::new(Tls { conn, prefix, plain: 0, handshake_input: early.len(), eof: false });
        if tls.handshake_input > MAX_HANDSHAKE_INPUT {
            return Err(invalid("handshake too large"));
        }
        while !early.is_empty() {
            tls.conn.read_tls(&mut early)?;
            let state = tls.conn.process_new_packets().map_err(invalid)?;
            tls.plain = state.plaintext_bytes_to_read();
        }
        self.tls = Some(tls);
        Ok(())
    }

    /// The value both ends export from the handshake for the token binding, once it is done.
    pub(super) fn binding(&self) -> Option<[u8; super::super::auth::BINDING_LEN]> {
        let tls = self.tls.as_ref()?;
        if tls.conn.is_handshaking() {
            return None;
        }
        let mut out = [0; super::super::auth::BINDING_LEN];
        tls.conn.export_keying_material(&mut out, super::super::auth::BINDING_LABEL, None).ok()?;
        Some(out)
    }

    /// Whether rustls holds decrypted input that a read would return without the socket.
    pub(super) fn has_buffered_input(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.plain > 0)
    }

    /// Reads what is there without blocking: `Ok(0)` at the end, `WouldBlock` when nothing is.
    pub(super) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(tls) = &mut self.tls else { return self.stream.read(buf) };
        loop {
            match tls.conn.reader().read(buf) {
                Ok(n) => {
                    tls.plain = tls.plain.saturating_sub(n);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // The peer closed the socket without TLS's close_notify: an end like any other.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) => return Err(e),
            }
            if tls.eof {
                return Ok(0);
            }
            let n = tls.conn.read_tls(&mut self.stream)?;
            tls.eof = n == 0;
            if tls.conn.is_handshaking() {
                tls.handshake_input += n;
                if tls.handshake_input > MAX_HANDSHAKE_INPUT {
                    return Err(invalid(format!("more than {MAX_HANDSHAKE_INPUT} bytes of handshake")));
                }
            }
            match tls.conn.process_new_packets() {
                Ok(state) => tls.plain = state.plaintext_bytes_to_read(),
                Err(e) => {
                    // Tell the client why (best effort: the alert is queued by rustls).
                    let _ = tls.conn.write_tls(&mut self.stream);
                    return Err(invalid(e));
                }
            }
        }
    }

    /// Takes what it can of `buf` without blocking (`WouldBlock` when nothing).
    pub(super) fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.tls.is_none() {
            return self.stream.write(buf);
        }
        self.push()?;
        let Some(tls) = &mut self.tls else { return Err(invalid("no TLS")) };
        let n = tls.conn.writer().write(buf)?;
        self.push()?;
        if n == 0 { Err(io::ErrorKind::WouldBlock.into()) } else { Ok(n) }
    }

    /// Sends what TLS holds (the plaintext prefix first) as far as the socket takes it.
    pub(super) fn push(&mut self) -> io::Result<()> {
        let Some(tls) = &mut self.tls else { return Ok(()) };
        while !tls.prefix.is_empty() {
            match self.stream.write(&tls.prefix) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => drop(tls.prefix.drain(..n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        while tls.conn.wants_write() {
            match tls.conn.write_tls(&mut self.stream) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Whether TLS holds bytes the socket has not taken yet.
    pub(super) fn wants_write(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| !t.prefix.is_empty() || t.conn.wants_write())
    }

    pub(super) fn shutdown_write(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }
}
