//! Encrypted links (`TOROID_ENCRYPT=1`): every byte of a TCP link between two ranks,
//! striped lanes and progress threads included, confidential and authenticated.
//!
//! How a link is secured, after the plaintext hello and ack ([`super::handshake`]) have
//! checked the peer's rank, the communicator and the job's token on every lane:
//!
//! 1. **A TLS 1.3 handshake** ([`tls`], rustls with aws-lc-rs; configured by the crate's `tls`) on the link's stream, the dialing
//!    rank as client. Each side presents the Ed25519 key its rank made at start-up and
//!    published through the store beside its address; each accepts only the key the peer's
//!    rank published ([`LinkSecurity`] holds them, one per rank). Key exchange: X25519 with
//!    ML-KEM-768 (hybrid post-quantum), else X25519.
//! 2. **Token binding.** Each side sends HMAC-SHA256 under `TOROID_AUTH_TOKEN` of a value
//!    exported from the handshake (RFC 8446 section 7.5) and its role, and checks the peer's:
//!    keys read from a store that someone rewrote in transit still cannot put a machine in
//!    the middle, which would need two handshakes with two different exported values.
//! 3. **Records** ([`record`]): the stream continues as AES-128-GCM records under keys
//!    exported from the same handshake, one secret per direction ([`Sealed`]).
//!
//! The store and the control plane have their own TLS, bound to the token rather than to a
//! rank's key (`rendezvous::tcp_store`, `super::control`). Not covered: RDMA links (refused with
//! encryption on). Shared memory stays as it is: one host, one user (`docs/RELIABILITY.md`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::AuthToken;
use crate::error::{Error, Result};
use crate::transport::{AbortSignal, Transport};

pub mod record;
pub mod tls;

pub use crate::tls::Identity;
pub use record::Sealed;

const LINK_LABEL: &[u8] = b"EXPORTER-toroid-link-keys-v1";
const BIND_LABEL: &[u8] = b"EXPORTER-toroid-token-binding-v1";
const BIND_MAC_LABEL: &[u8] = b"toroid tls binding v1";
const BIND_LEN: usize = 32;

/// What the encrypted links of one communicator need: this rank's key pair, every rank's
/// published public key (index = rank), the job's token, and how long a handshake may take
/// when nothing else bounds it.
pub struct LinkSecurity {
    identity: Arc<Identity>,
    keys: Vec<Vec<u8>>,
    token: AuthToken,
    timeout: Duration,
}

impl std::fmt::Debug for LinkSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkSecurity").field("ranks", &self.keys.len()).finish_non_exhaustive()
    }
}

impl PartialEq for LinkSecurity {
    fn eq(&self, other: &LinkSecurity) -> bool {
        self.identity.public_key() == other.identity.public_key() && self.keys == other.keys
    }
}

impl Eq for LinkSecurity {}

impl LinkSecurity {
    /// The links of a communicator whose ranks published `keys`; this rank holds `identity`.
    pub fn new(
        identity: Arc<Identity>,
        keys: Vec<Vec<u8>>,
        token: AuthToken,
        timeout: Duration,
    ) -> LinkSecurity {
        LinkSecurity { identity, keys, token, timeout }
    }

    /// The same for a communicator of the ranks `members` of this one (its rank `i` is this
    /// one's `members[i]`): a split or a shrink keeps every member's key.
    pub fn for_members(&self, members: &[usize]) -> Result<LinkSecurity> {
        let keys = members
            .iter()
            .map(|&r| {
                self.keys
                    .get(r)
                    .cloned()
                    .ok_or_else(|| Error::Internal(format!("no published key for rank {r}").into()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LinkSecurity {
            identity: self.identity.clone(),
            keys,
            token: self.token.clone(),
            timeout: self.timeout,
        })
    }

    /// How long a handshake may take when the caller gives no deadline.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Secures the link `inner` to `peer` (this rank dialed it when `dialer`): handshake, token
/// binding, then records. Bounded by `deadline`; `abort` ends it early.
pub fn secure_link(
    mut inner: Box<dyn Transport>,
    me: usize,
    peer: usize,
    dialer: bool,
    sec: &LinkSecurity,
    deadline: Instant,
    abort: Option<&AbortSignal>,
) -> Result<Box<dyn Transport>> {
    let what = format!("rank {me}: encrypted link to rank {peer}");
    let key = sec
        .keys
        .get(peer)
        .ok_or_else(|| Error::Internal(format!("{what}: no published key for rank {peer}").into()))?;
    let mut conn = crate::tls::link_connection(&sec.identity, key, dialer)?;
    tls::handshake(&mut conn, &mut *inner, deadline, abort, &what)?;
    let mut secrets = [0u8; 2 * record::SECRET_LEN];
    crate::tls::export_link(&conn, LINK_LABEL, &mut secrets)?;
    let mut bind = [0u8; BIND_LEN];
    crate::tls::export_link(&conn, BIND_LABEL, &mut bind)?;
    drop(conn);
    let (to_server, to_client) = secrets.split_at(record::SECRET_LEN);
    let (tx, rx) = if dialer { (to_server, to_client) } else { (to_client, to_server) };
    let dir = |s: &[u8]| -> Result<record::Direction> {
        let s: &[u8; record::SECRET_LEN] =
            s.try_into().map_err(|_| Error::Internal("exported secret length".into()))?;
        record::Direction::new(s).map_err(|e| Error::system("deriving the link keys", e))
    };
    let mut sealed = Sealed::new(inner, peer, dir(tx)?, dir(rx)?);
    let role = |client: bool| -> [u8; 1] { [u8::from(client)] };
    let mine = crate::transport::tcp::handshake::mac(&sec.token, BIND_MAC_LABEL, &[&role(dialer), &bind]);
    let theirs = crate::transport::tcp::handshake::mac(&sec.token, BIND_MAC_LABEL, &[&role(!dialer), &bind]);
    use hmac::Mac;
    let mine = mine.finalize().into_bytes();
    let mut got = [0u8; BIND_LEN];
    exchange(&mut sealed, &mine, &mut got, deadline, abort, &what)?;
    if theirs.verify_slice(&got).is_err() {
        return Err(Error::Remote(
            format!(
                "{what}: the peer's token binding does not match (a different TOROID_AUTH_TOKEN, or a machine \
                 in the middle)"
            )
            .into(),
        ));
    }
    Ok(Box::new(sealed))
}

/// Sends `mine` and receives `theirs.len()` bytes over `t` by `deadline`.
fn exchange(
    t: &mut Sealed,
    mine: &[u8],
    theirs: &mut [u8],
    deadline: Instant,
    abort: Option<&AbortSignal>,
    what: &str,
) -> Result<()> {
    use crate::sys::poll::{PollFd, poll};
    let (mut sent, mut got) = (0, 0);
    let io_err = |e: std::io::Error| Error::system(format!("{what}: token binding"), e);
    loop {
        if sent < mine.len() {
            match t.try_write(&[&mine[sent..]]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(io_err(e)),
            }
        }
        if got < theirs.len() {
            match t.try_read(&mut [&mut theirs[got..]]) {
                Ok(0) => {
                    return Err(Error::Remote(
                        format!(
                            "{what}: the peer closed the link before its token binding (it refused ours?)"
                        )
                        .into(),
                    ));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(io_err(e)),
            }
        }
        if sent == mine.len() && got == theirs.len() {
            return Ok(());
        }
        if let Some(a) = abort {
            a.check()?;
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout(
                format!("{what}: no token binding from the peer by the deadline").into(),
            ));
        }
        if let Some(events) = t.arm(got < theirs.len(), sent < mine.len()) {
            let mut fds = [PollFd::new(t.pollable(), events)];
            let ms = deadline.saturating_duration_since(now).as_millis().clamp(1, 100) as i32;
            poll(&mut fds, ms).map_err(|e| Error::system("poll in a token binding", e))?;
        }
    }
}

/// A connected pair of plain TCP transports over loopback (the tests secure them).
#[cfg(test)]
fn tcp_pair() -> (Box<dyn Transport>, Box<dyn Transport>) {
    use crate::transport::tcp::{SocketOptions, TcpTransport};
    let (mut a, mut b) = crate::transport::testutil::loopback_sockets(1);
    let opts = SocketOptions::default();
    let a = TcpTransport::new(a.pop().unwrap(), &opts).unwrap();
    let b = TcpTransport::new(b.pop().unwrap(), &opts).unwrap();
    (Box::new(a), Box::new(b))
}

#[cfg(test)]
mod cert_tests;
#[cfg(test)]
mod tests;
