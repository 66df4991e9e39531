//! The TLS 1.3 handshake of an encrypted link (rustls, aws-lc-rs provider), run over a
//! connected [`Transport`] whose plaintext hello and ack have already checked the peer's rank
//! and the job's token.
//!
//! Each rank signs with an Ed25519 key pair made at start-up ([`Identity`]) and presents it as
//! an RFC 7250 raw public key: no certificates, no names. Each side accepts exactly the key the
//! peer's rank published ([`Pinned`]), so a process that has the job's token but not that
//! rank's private key fails here. The dialing rank is the TLS client; both sides authenticate.
//!
//! The handshake must not read past its last record: what follows is the record layer's
//! ([`super::record`]), which takes over the stream where the handshake stopped. So the
//! handshake reads through [`OneRecord`], which never hands rustls more than the rest of the
//! current TLS record, and the server sends no session tickets (nothing follows its Finished).

use std::io;
use std::sync::Arc;
use std::time::Instant;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms, verify_tls13_signature_with_raw_key};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, SubjectPublicKeyInfoDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::error::{Error, Result};
use crate::sys::poll::{PollFd, poll};
use crate::transport::{AbortSignal, Transport};

/// The provider every handshake uses: aws-lc-rs, TLS 1.3 with AES-128-GCM only, key exchange
/// by X25519 with ML-KEM-768 (a hybrid: recorded traffic stays safe if either holds), else
/// X25519 alone.
fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::aws_lc_rs::{cipher_suite, default_provider, kx_group};
    let mut p = default_provider();
    p.cipher_suites = vec![cipher_suite::TLS13_AES_128_GCM_SHA256];
    p.kx_groups = vec![kx_group::X25519MLKEM768, kx_group::X25519];
    Arc::new(p)
}

/// This rank's key pair for the links of its communicators.
#[derive(Debug)]
pub struct Identity {
    key: Arc<CertifiedKey>,
    /// The public key as DER SubjectPublicKeyInfo: what the rank publishes and peers pin.
    public: Vec<u8>,
}

impl Identity {
    /// A fresh Ed25519 key pair.
    pub fn generate() -> Result<Identity> {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let pkcs8 = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&rng)
            .map_err(|_| Error::Internal("generating an Ed25519 key pair failed".into()))?;
        let der = PrivateKeyDer::try_from(pkcs8.as_ref().to_vec())
            .map_err(|e| Error::Internal(format!("the new key's encoding: {e}").into()))?;
        let signer = provider()
            .key_provider
            .load_private_key(der)
            .map_err(|e| Error::Internal(format!("loading the new key: {e}").into()))?;
        let public = signer
            .public_key()
            .ok_or_else(|| Error::Internal("the new key has no public key".into()))?
            .as_ref()
            .to_vec();
        let key = Arc::new(CertifiedKey::new(vec![CertificateDer::from(public.clone())], signer));
        Ok(Identity { key, public })
    }

    /// The public key peers pin (DER SubjectPublicKeyInfo).
    pub fn public_key(&self) -> &[u8] {
        &self.public
    }
}

/// Accepts exactly one raw public key: the one rank `peer` published.
#[derive(Debug)]
struct Pinned {
    key: Vec<u8>,
    algs: WebPkiSupportedAlgorithms,
}

impl Pinned {
    fn check(&self, presented: &CertificateDer<'_>, intermediates: &[CertificateDer<'_>]) -> bool {
        intermediates.is_empty() && presented.as_ref() == self.key.as_slice()
    }
}

fn not_pinned() -> rustls::Error {
    rustls::Error::InvalidCertificate(rustls::CertificateError::ApplicationVerificationFailure)
}

/// The methods both verifier traits share, the same for both: TLS 1.2 refused, TLS 1.3
/// signatures checked against the raw public key, raw public keys required.
macro_rules! raw_key_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            _message: &[u8],
            _cert: &CertificateDer<'_>,
            _dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::PeerIncompatible(rustls::PeerIncompatible::Tls12NotOffered))
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature_with_raw_key(
                message,
                &SubjectPublicKeyInfoDer::from(cert.as_ref()),
                dss,
                &self.algs,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algs.supported_schemes()
        }

        fn requires_raw_public_keys(&self) -> bool {
            true
        }
    };
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if self.check(end_entity, intermediates) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(not_pinned())
        }
    }

    raw_key_signatures!();
}

impl ClientCertVerifier for Pinned {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        if self.check(end_entity, intermediates) {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(not_pinned())
        }
    }

    raw_key_signatures!();
}

/// A connection in its handshake: this rank dials (client) or was dialed (server), and
/// accepts only `peer_key`.
pub fn connection(me: &Identity, peer_key: &[u8], dialer: bool) -> Result<rustls::Connection> {
    let provider = provider();
    let pinned =
        Arc::new(Pinned { key: peer_key.to_vec(), algs: provider.signature_verification_algorithms });
    let tls_err = |e: rustls::Error| Error::Internal(format!("TLS configuration: {e}").into());
    if dialer {
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .dangerous()
            .with_custom_certificate_verifier(pinned)
            .with_client_cert_resolver(Arc::new(rustls::client::AlwaysResolvesClientRawPublicKeys::new(
                me.key.clone(),
            )));
        let name = ServerName::try_from("toroid").map_err(|e| Error::Internal(format!("{e}").into()))?;
        Ok(rustls::ClientConnection::new(Arc::new(cfg), name).map_err(tls_err)?.into())
    } else {
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(pinned)
            .with_cert_resolver(Arc::new(rustls::server::AlwaysResolvesServerRawPublicKeys::new(
                me.key.clone(),
            )));
        cfg.send_tls13_tickets = 0;
        Ok(rustls::ServerConnection::new(Arc::new(cfg)).map_err(tls_err)?.into())
    }
}

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
    let why = match e {
        rustls::Error::InvalidCertificate(_) => {
            "the peer presented a key other than the one its rank published (a process with the job's \
             token but not that rank's key?)"
                .to_string()
        }
        rustls::Error::AlertReceived(a) => {
            format!("the peer refused the handshake ({a:?}): it refused this rank's key")
        }
        other => other.to_string(),
    };
    Error::Remote(format!("{what}: TLS handshake refused: {why}").into())
}

/// Exports `out.len()` bytes of keying material under `label` (RFC 8446 section 7.5).
pub fn export(conn: &rustls::Connection, label: &[u8], out: &mut [u8]) -> Result<()> {
    conn.export_keying_material(&mut *out, label, None)
        .map(|_| ())
        .map_err(|e| Error::Internal(format!("TLS exporter: {e}").into()))
}
