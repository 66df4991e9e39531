//! TLS 1.3 as toroid uses it (rustls, aws-lc-rs provider): one provider, the Ed25519 key
//! pairs ranks and store servers present as RFC 7250 raw public keys, and the verifiers that
//! decide which keys a side accepts.
//!
//! - Links between ranks ([`link_connection`]): both sides authenticate, and each accepts
//!   exactly the key the peer's rank published ([`Pinned`]). The handshake itself runs over a
//!   link's transport (`transport::tcp::secure`).
//! - The TCP store and the control plane ([`bound_client`], [`bound_server`]): the server
//!   presents a key made when it starts, which no client can know beforehand (an outside
//!   process asks the control plane too), so the client accepts any key whose signature holds
//!   ([`AnyKey`]) and the token, through a value exported from this very handshake, is what
//!   authenticates both ends (`rendezvous::tcp_store::auth`, `transport::tcp::control`): a
//!   machine in the middle would hold two handshakes with two different exported values, and
//!   cannot compute either side's proof without the token.
//!
//! TLS 1.2 and session resumption are never offered.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms, verify_tls13_signature_with_raw_key};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, SubjectPublicKeyInfoDer, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

use crate::error::{Error, Result};

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

/// This rank's key pair for the links of its communicators, and whom it trusts: only the keys
/// peers published (raw public keys), or with certificate files, peers whose certificate a CA
/// of the site signed and carries the key they published.
#[derive(Debug)]
pub struct Identity {
    key: Arc<CertifiedKey>,
    /// The public key as DER SubjectPublicKeyInfo: what the rank publishes and peers pin.
    public: Vec<u8>,
    /// The CAs that sign peers' certificates (`TOROID_TLS_CA`); none with raw public keys.
    roots: Option<Arc<RootCertStore>>,
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
        Ok(Identity { key, public, roots: None })
    }

    /// This rank's certificate chain and key, and the CAs it trusts, from PEM files
    /// (`TOROID_TLS_CERT`, `TOROID_TLS_KEY`, `TOROID_TLS_CA`). Refuses a key that does not
    /// match the certificate, and a certificate the CAs do not validate now (expired, not yet
    /// valid, of another CA), naming the file.
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<Identity> {
        let identity = Identity::load(ca, cert, key)?;
        let chain = &identity.key.cert;
        let (leaf, rest) = chain.split_first().ok_or_else(|| file_err(cert, "no certificate"))?;
        let parsed = ParsedCertificate::try_from(leaf).map_err(|e| file_err(cert, &e.to_string()))?;
        let roots = identity.roots.as_ref().ok_or_else(|| file_err(ca, "no CA"))?;
        let algs = provider().signature_verification_algorithms.all;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            roots,
            rest,
            UnixTime::now(),
            algs,
        )
        .map_err(|e| file_err(cert, &format!("{} (TOROID_TLS_CA {})", cert_refusal(&e), ca.display())))?;
        Ok(identity)
    }

    /// As [`Identity::from_files`] without checking the certificate against the CAs (the tests
    /// use it to present an expired or foreign certificate to a peer).
    pub(crate) fn load(ca: &Path, cert: &Path, key: &Path) -> Result<Identity> {
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(ca).map_err(|e| file_err(ca, &e.to_string()))? {
            roots
                .add(c.map_err(|e| file_err(ca, &e.to_string()))?)
                .map_err(|e| file_err(ca, &e.to_string()))?;
        }
        if roots.is_empty() {
            return Err(file_err(ca, "no CA certificate in it"));
        }
        let chain = CertificateDer::pem_file_iter(cert)
            .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| file_err(cert, &e.to_string()))?;
        let leaf = chain.first().ok_or_else(|| file_err(cert, "no certificate in it"))?;
        let public = ParsedCertificate::try_from(leaf)
            .map_err(|e| file_err(cert, &e.to_string()))?
            .subject_public_key_info()
            .as_ref()
            .to_vec();
        let der = PrivateKeyDer::from_pem_file(key).map_err(|e| file_err(key, &e.to_string()))?;
        let signer =
            provider().key_provider.load_private_key(der).map_err(|e| file_err(key, &e.to_string()))?;
        let certified = CertifiedKey::new(chain, signer);
        certified.keys_match().map_err(|_| {
            file_err(key, &format!("this key does not belong to the certificate in {}", cert.display()))
        })?;
        Ok(Identity { key: Arc::new(certified), public, roots: Some(Arc::new(roots)) })
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
/// signatures checked against the presented key: a raw public key (`true`, which is then
/// required) or a certificate's (`false`).
macro_rules! signature_methods {
    ($raw:literal) => {
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
            if $raw {
                let spki = SubjectPublicKeyInfoDer::from(cert.as_ref());
                verify_tls13_signature_with_raw_key(message, &spki, dss, &self.algs)
            } else {
                rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
            }
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algs.supported_schemes()
        }

        fn requires_raw_public_keys(&self) -> bool {
            $raw
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

    signature_methods!(true);
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

    signature_methods!(true);
}

/// A connection in its handshake: this rank dials (client) or was dialed (server), and
/// accepts only `peer_key`.
pub fn link_connection(me: &Identity, peer_key: &[u8], dialer: bool) -> Result<rustls::Connection> {
    let provider = provider();
    let algs = provider.signature_verification_algorithms;
    let key = peer_key.to_vec();
    let (server_verifier, client_verifier): (Arc<dyn ServerCertVerifier>, Arc<dyn ClientCertVerifier>) =
        match &me.roots {
            None => {
                let pinned = Arc::new(Pinned { key, algs });
                (pinned.clone(), pinned)
            }
            Some(roots) => {
                let webpki = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    roots.clone(),
                    provider.clone(),
                )
                .build()
                .map_err(|e| Error::Internal(format!("TLS configuration: {e}").into()))?;
                let pinned = Arc::new(PinnedCert { key, roots: roots.clone(), algs, webpki });
                (pinned.clone(), pinned)
            }
        };
    let certs = me.roots.is_some();
    if dialer {
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .dangerous()
            .with_custom_certificate_verifier(server_verifier);
        let cfg = if certs {
            builder.with_client_cert_resolver(Arc::new(SingleCertAndKey::from(me.key.clone())))
        } else {
            builder.with_client_cert_resolver(Arc::new(
                rustls::client::AlwaysResolvesClientRawPublicKeys::new(me.key.clone()),
            ))
        };
        Ok(rustls::ClientConnection::new(Arc::new(cfg), server_name()?).map_err(tls_err)?.into())
    } else {
        let builder = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(client_verifier);
        let mut cfg = if certs {
            builder.with_cert_resolver(Arc::new(SingleCertAndKey::from(me.key.clone())))
        } else {
            builder.with_cert_resolver(Arc::new(rustls::server::AlwaysResolvesServerRawPublicKeys::new(
                me.key.clone(),
            )))
        };
        cfg.send_tls13_tickets = 0;
        Ok(rustls::ServerConnection::new(Arc::new(cfg)).map_err(tls_err)?.into())
    }
}

/// With certificate files: accepts a certificate that the site's CAs validate now and that
/// carries exactly the key rank `peer` published. Names are not checked (ranks are reached by
/// address, and the published key says which rank this is).
struct PinnedCert {
    key: Vec<u8>,
    roots: Arc<RootCertStore>,
    algs: WebPkiSupportedAlgorithms,
    /// rustls's check of a client's chain (the client-authentication usage).
    webpki: Arc<dyn ClientCertVerifier>,
}

impl std::fmt::Debug for PinnedCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedCert").finish_non_exhaustive()
    }
}

impl PinnedCert {
    /// After the chain checked out: the certificate's key must be the one its rank published.
    fn check_key(&self, end_entity: &CertificateDer<'_>) -> std::result::Result<(), rustls::Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        if parsed.subject_public_key_info().as_ref() == self.key.as_slice() {
            Ok(())
        } else {
            Err(not_pinned())
        }
    }
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        self.check_key(end_entity)?;
        Ok(ServerCertVerified::assertion())
    }

    signature_methods!(false);
}

impl ClientCertVerifier for PinnedCert {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.webpki.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        self.webpki.verify_client_cert(end_entity, intermediates, now)?;
        self.check_key(end_entity)?;
        Ok(ClientCertVerified::assertion())
    }

    signature_methods!(false);
}

/// Why a certificate was refused, in words a user can act on.
pub fn cert_refusal(e: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    match e {
        rustls::Error::InvalidCertificate(c) => match c {
            C::Expired | C::ExpiredContext { .. } => "the certificate has expired".into(),
            C::NotValidYet | C::NotValidYetContext { .. } => "the certificate is not valid yet".into(),
            C::UnknownIssuer => "the certificate is not signed by a CA of TOROID_TLS_CA (a foreign certificate)".into(),
            C::ApplicationVerificationFailure => {
                "the certificate's key is not the one its rank published (a process with the job's token but not \
                 that rank's key?)"
                    .into()
            }
            C::InvalidPurpose | C::InvalidPurposeContext { .. } => {
                "the certificate is not for this use (it needs the serverAuth and clientAuth extended key usages, \
                 or none)"
                    .into()
            }
            other => format!("the certificate was refused ({other:?})"),
        },
        other => other.to_string(),
    }
}

fn file_err(path: &Path, why: &str) -> Error {
    Error::InvalidArgument(format!("{}: {why}", path.display()).into())
}

/// Accepts any raw public key whose handshake signature holds: for token-bound servers, whose
/// key is made at start-up and which the token binding authenticates instead.
#[derive(Debug)]
struct AnyKey {
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AnyKey {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if intermediates.is_empty() { Ok(ServerCertVerified::assertion()) } else { Err(not_pinned()) }
    }

    signature_methods!(true);
}

fn tls_err(e: rustls::Error) -> Error {
    Error::Internal(format!("TLS configuration: {e}").into())
}

/// The name a client gives (nothing checks it: keys are raw, not certificates).
fn server_name() -> Result<ServerName<'static>> {
    ServerName::try_from("toroid").map_err(|e| Error::Internal(format!("{e}").into()))
}

/// A client's connection to a token-bound server (the store, the control plane) in its
/// handshake: it accepts the server's key and presents none.
pub fn bound_client() -> Result<rustls::ClientConnection> {
    let provider = provider();
    let any = Arc::new(AnyKey { algs: provider.signature_verification_algorithms });
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(any)
        .with_no_client_auth();
    rustls::ClientConnection::new(Arc::new(cfg), server_name()?).map_err(tls_err)
}

/// The configuration of a token-bound server (the store, the control plane) presenting `me`;
/// clients present no key.
pub fn bound_server(me: &Identity) -> Result<Arc<rustls::ServerConfig>> {
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(rustls::server::AlwaysResolvesServerRawPublicKeys::new(me.key.clone())));
    cfg.send_tls13_tickets = 0;
    Ok(Arc::new(cfg))
}

/// Exports `out.len()` bytes of keying material under `label` from a link's handshake.
pub fn export_link(conn: &rustls::Connection, label: &[u8], out: &mut [u8]) -> Result<()> {
    match conn {
        rustls::Connection::Client(c) => export(c, label, out),
        rustls::Connection::Server(s) => export(s, label, out),
    }
}

/// Exports `out.len()` bytes of keying material under `label` (RFC 8446 section 7.5).
pub fn export<D>(conn: &rustls::ConnectionCommon<D>, label: &[u8], out: &mut [u8]) -> Result<()> {
    conn.export_keying_material(&mut *out, label, None)
        .map(|_| ())
        .map_err(|e| Error::Internal(format!("TLS exporter: {e}").into()))
}
