//! The TLS 1.3 handshake of an encrypted link, run over a connected [`Transport`] whose
//! plaintext hello and ack have already checked the peer's rank and the job's token. The
//! configuration (provider, key pairs, the verifier that pins each peer's published key) is
//! the crate's `tls` module; the dialing rank is the client, and both sides authenticate.
//!
//! The handshake must not read past its last record: what follows is the record layer's
//! ([`super::record`]), which takes over the stream where the handshake stopped. So the
//! handshake reads through [`OneRecord`], which never hands rustls more than the rest of the
//! current TLS record, and the server sends no session tickets (nothing follows its Finished).

use std::io;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::sys::poll::{PollFd, poll};
use crate::transport::{AbortSignal, Transport};

/// Reads from a transport no further than the end of the current TLS record.
struct OneRecord<'a> {
    t: &'a mut dyn Transport,
    header: [u8; 5],
    got: usize,
    body_left: usize,
}

impl io::Read for OneRecord<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.got < self.header.len() {
            let want = (self.header.len() - self.got).min(buf.len());
            let n = self.t.try_read(&mut [&mut buf[..want]])?;
            self.header[self.got..self.got + n].copy_from_slice(&buf[..n]);
            self.got += n;
            if self.got == self.header.len() {
                self.body_left = usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                if self.body_left == 0 {
                    self.got = 0;
                }
            }
            return Ok(n);
        }
        let want = self.body_left.min(buf.len());
        let n = self.t.try_read(&mut [&mut buf[..want]])?;
        self.body_left -= n;
        if self.body_left == 0 {
            self.got = 0;
        }
        Ok(n)
    }
}

/// Writes to a transport.
struct Writer<'a>(&'a mut dyn Transport);

impl io::Write for Writer<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(&[buf])
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs the handshake of `conn` over `t` to its end by `deadline`. `what` names the link
/// in errors.
pub fn handshake(
    conn: &mut rustls::Connection,
    t: &mut dyn Transport,
    deadline: Instant,
    abort: Option<&AbortSignal>,
    what: &str,
) -> Result<()> {
    let mut reader = OneRecord { t, header: [0; 5], got: 0, body_left: 0 };
    loop {
        let mut blocked_write = false;
        while conn.wants_write() {
            match conn.write_tls(&mut Writer(&mut *reader.t)) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    blocked_write = true;
                    break;
                }
                Err(e) => return Err(Error::system(format!("{what}: sending the TLS handshake"), e)),
            }
        }
        if !conn.is_handshaking() && !conn.wants_write() {
            return Ok(());
        }
        let mut blocked_read = false;
        if conn.wants_read() {
            match conn.read_tls(&mut reader) {
                Ok(0) => {
                    return Err(Error::Remote(
                        format!(
                            "{what}: the peer closed the connection in the TLS handshake (it refused this \
                             rank's key, or does not encrypt: every rank must set TOROID_ENCRYPT alike; its \
                             log says which)"
                        )
                        .into(),
                    ));
                }
                Ok(_) => {
                    if let Err(e) = conn.process_new_packets() {
                        // Tell the peer why before giving up (best effort).
                        let _ = conn.write_tls(&mut Writer(&mut *reader.t));
                        return Err(refused(what, &e));
                    }
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => blocked_read = true,
                Err(e) => return Err(Error::system(format!("{what}: receiving the TLS handshake"), e)),
            }
        }
        if let Some(a) = abort {
            a.check()?;
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout(
                format!("{what}: the TLS handshake did not finish by the deadline").into(),
            ));
        }
        if let Some(events) = reader.t.arm(blocked_read, blocked_write) {
            let mut fds = [PollFd::new(reader.t.pollable(), events)];
            let ms = deadline.saturating_duration_since(now).as_millis().clamp(1, 100) as i32;
            poll(&mut fds, ms).map_err(|e| Error::system("poll in a TLS handshake", e))?;
        }
    }
}

/// The error for a handshake rustls rejected.
fn refused(what: &str, e: &rustls::Error) -> Error {
    use rustls::AlertDescription as A;
    let why = match e {
        rustls::Error::InvalidCertificate(rustls::CertificateError::ApplicationVerificationFailure) => {
            "the peer presented a key other than the one its rank published (a process with the job's \
             token but not that rank's key?)"
                .to_string()
        }
        rustls::Error::InvalidCertificate(_) => {
            format!("the peer's certificate was refused: {}", crate::tls::cert_refusal(e))
        }
        rustls::Error::AlertReceived(a @ (A::CertificateExpired | A::UnknownCA | A::BadCertificate)) => {
            format!("the peer refused this rank's certificate ({a:?}): see its log for why")
        }
        rustls::Error::AlertReceived(a) => {
            format!("the peer refused the handshake ({a:?}): it refused this rank's key")
        }
        rustls::Error::PeerIncompatible(p) => format!(
            "the peer cannot use this rank's kind of identity ({p:?}): TOROID_TLS_CA/CERT/KEY must be set \
             alike on every rank"
        ),
        other => other.to_string(),
    };
    Error::Remote(format!("{what}: TLS handshake refused: {why}").into())
}
