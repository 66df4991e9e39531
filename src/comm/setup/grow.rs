//! Growing a communicator: its ranks admit new processes, as NCCL 2.29's `ncclCommGrow` does.
//! The usual use follows a shrink: a host is lost, the survivors shrink and go on, and once a
//! replacement is up it joins them without anyone restarting.
//!
//! Three steps, each bounded by a deadline:
//!
//! 1. Every rank of the communicator calls [`Communicator::grow_offer`] with the number of ranks
//!    to add. Rank 0 starts a store server for this one grow, on the interface the communicator
//!    uses, keyed by 32 fresh random bytes, and broadcasts its address and that secret to the
//!    others over the communicator itself: each gets the same [`JoinToken`].
//! 2. The token goes to the new processes by whatever channel the framework has (its own
//!    store, a file, an orchestrator). It is the one thing a newcomer needs besides the job's
//!    own settings: the store refuses anyone without the secret (the challenge-response of
//!    `rendezvous::tcp_store`), and the links' handshake still asks for `TOROID_AUTH_TOKEN`.
//! 3. The old ranks call [`Communicator::grow`] with their offer and keep their ranks; each new
//!    process calls [`Communicator::join`] with the token and its rank (`old size ..
//!    new size`). They meet through that store as a job's ranks meet at creation
//!    (`Communicator::build`), so the new communicator is like any other; then rank 0 stops the
//!    server, so the token admits nobody afterwards.
//!
//! The old communicator stays as it was (destroy it as usual).

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;

use super::Calibration;
use super::pending::PendingComm;
use crate::comm::Communicator;
use crate::config::{AuthToken, Config};
use crate::error::{Error, Result};
use crate::rendezvous::Store;
use crate::rendezvous::tcp_store::TcpStore;

/// Length of the join secret.
const SECRET_LEN: usize = 32;
/// Most ranks one grow may add.
const MAX_GROW: usize = 1 << 16;
/// The broadcast that carries the token (rank 0's error instead when it could not start).
const OFFER_LEN: usize = 256;
/// The token's text form begins with this (the format's version).
const TOKEN_PREFIX: &str = "toroid-join1";

/// What a new process needs to join a growing communicator: the size after the grow, where
/// the grow's store listens, and the secret it asks for. Its text form
/// (`toroid-join1/<size>/<secret, hex>/<address>`) is what travels between processes.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    size: usize,
    addr: SocketAddr,
    secret: [u8; SECRET_LEN],
}

impl JoinToken {
    /// The communicator's size once grown.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Where the grow's store listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinToken")
            .field("size", &self.size)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{TOKEN_PREFIX}/{}/", self.size)?;
        for b in self.secret {
            write!(f, "{b:02x}")?;
        }
        write!(f, "/{}", self.addr)
    }
}

impl FromStr for JoinToken {
    type Err = Error;

    fn from_str(s: &str) -> Result<JoinToken> {
        let bad = |why: &str| Error::InvalidArgument(format!("join token: {why}").into());
        let mut parts = s.trim().splitn(4, '/');
        if parts.next() != Some(TOKEN_PREFIX) {
            return Err(bad(&format!("does not start with '{TOKEN_PREFIX}/' (not a token of this version)")));
        }
        let size: usize =
            parts.next().and_then(|v| v.parse().ok()).ok_or_else(|| bad("the size is not a number"))?;
        if size < 2 {
            return Err(bad("the size is below 2"));
        }
        let hex = parts.next().ok_or_else(|| bad("no secret"))?;
        if hex.len() != 2 * SECRET_LEN || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad(&format!("the secret is not {SECRET_LEN} bytes of hex")));
        }
        let mut secret = [0u8; SECRET_LEN];
        for (i, b) in secret.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad("the secret is not hex"))?;
        }
        let addr: SocketAddr =
            parts.next().and_then(|v| v.parse().ok()).ok_or_else(|| bad("the address is not host:port"))?;
        if addr.port() == 0 || addr.ip().is_unspecified() {
            return Err(bad(&format!("{addr} is not an address to connect to")));
        }
        Ok(JoinToken { size, addr, secret })
    }
}

/// One old rank's part of a grow: the token to hand to the new processes, and (on rank 0) the
/// grow's store, served until [`Communicator::grow`] is done with it or the offer is dropped.
pub struct GrowOffer {
    token: JoinToken,
    /// Rank 0's serving store; None on the others.
    server: Option<Arc<TcpStore>>,
    /// The communicator this offer was made on (a grow uses its own offer).
    comm_id: u64,
}

impl fmt::Debug for GrowOffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrowOffer")
            .field("token", &self.token)
            .field("serving", &self.server.is_some())
            .finish()
    }
}

impl GrowOffer {
    /// The token the new processes join with (the same on every old rank).
    pub fn token(&self) -> &JoinToken {
        &self.token
    }
}

impl Communicator {
    /// Every rank of this communicator calls it to admit `added` new ranks (1 to 65536):
    /// a collective (a broadcast from rank 0) that returns at once with the offer, whose
    /// [`GrowOffer::token`] the new processes need. Then [`Communicator::grow`].
    pub fn grow_offer(&self, added: usize) -> Result<GrowOffer> {
        self.core.forked()?;
        if added == 0 || added > MAX_GROW {
            return Err(Error::InvalidArgument(format!("grow: {added} new ranks (1 to {MAX_GROW})").into()));
        }
        let size = self.size() + added;
        let mut msg = [0u8; OFFER_LEN];
        let mut server = None;
        if self.rank() == 0 {
            match self.serve_grow(size) {
                Ok((store, token)) => {
                    server = Some(store);
                    encode_offer(&mut msg, Ok(&token.to_string()));
                }
                Err(e) => encode_offer(&mut msg, Err(&e.to_string())),
            }
        }
        self.broadcast(&mut msg, 0)?;
        let token = decode_offer(&msg)?;
        if token.size != size {
            return Err(Error::InvalidUsage(
                format!(
                    "grow: rank 0 offers a communicator of {} ranks, this rank asked for {size}",
                    token.size
                )
                .into(),
            ));
        }
        Ok(GrowOffer { token, server, comm_id: self.id() })
    }

    /// Rank 0's store for a grow to `size` ranks, and its token.
    fn serve_grow(&self, size: usize) -> Result<(Arc<TcpStore>, JoinToken)> {
        let mut secret = [0u8; SECRET_LEN];
        crate::sys::random::fill(&mut secret).map_err(|e| Error::system("grow: random secret", e))?;
        let ip = self.core.links.iface.addr;
        let bind = SocketAddr::new(ip, 0).to_string();
        // Encrypted when this communicator's links are: the newcomers' keys cross it.
        let encrypt = self.core.config.encrypt;
        let store =
            TcpStore::serve_secured(&bind, self.core.timeout, Some(&AuthToken::new(&secret)), encrypt)?;
        let addr =
            store.server_addr().ok_or_else(|| Error::Internal("grow: the store has no address".into()))?;
        Ok((Arc::new(store), JoinToken { size, addr, secret }))
    }

    /// This old rank's part of the grow `offer` (from [`Communicator::grow_offer`] on this
    /// communicator): a new communicator of `offer.token().size()` ranks in which this rank
    /// keeps its rank, once every new process has joined. Bounded by this communicator's
    /// timeout; rank 0 stops the grow's store when done, so the token admits nobody later.
    pub fn grow(&self, offer: GrowOffer) -> Result<Communicator> {
        self.check_offer(&offer)?;
        grow_with(self.rank(), offer, &self.core.config, self.parent_measurements())
    }

    /// [`Communicator::grow`] on a thread of its own: returns at once with a [`PendingComm`] to
    /// poll, wait for or abort.
    pub fn grow_async(&self, offer: GrowOffer) -> Result<PendingComm> {
        self.check_offer(&offer)?;
        let (rank, cfg, parent) = (self.rank(), self.core.config.clone(), self.parent_measurements());
        PendingComm::spawn(format!("grow of communicator {:#x}", self.id()), move || {
            grow_with(rank, offer, &cfg, parent)
        })
    }

    /// What the grown communicator's cost model may start from: this one's measurements and
    /// host count (`setup::calibrate`).
    fn parent_measurements(&self) -> Calibration {
        Calibration::Grow(self.measured().map(|m| (m, self.core.ident.topology.hosts)))
    }

    /// A grow uses an offer made on this communicator, in this process.
    fn check_offer(&self, offer: &GrowOffer) -> Result<()> {
        self.core.forked()?;
        if offer.comm_id != self.id() {
            return Err(Error::InvalidUsage("grow: the offer was made on another communicator".into()));
        }
        Ok(())
    }

    /// A new process's part of a grow: joins as `rank` (from the old size to `token.size()`,
    /// each new process its own) the communicator the old ranks are growing, with settings
    /// `cfg` (its timeout bounds the join; `TOROID_AUTH_TOKEN` must be the job's).
    pub fn join(token: &JoinToken, rank: usize, cfg: &Config) -> Result<Communicator> {
        crate::config::init_logging();
        join_with(token, rank, cfg)
    }

    /// [`Communicator::join`] on a thread of its own: returns at once with a [`PendingComm`].
    pub fn join_async(token: &JoinToken, rank: usize, cfg: &Config) -> Result<PendingComm> {
        crate::config::init_logging();
        let (token, cfg) = (token.clone(), cfg.clone());
        PendingComm::spawn(format!("join as rank {rank} of {}", token.size), move || {
            join_with(&token, rank, &cfg)
        })
    }
}

/// An old rank's grow: rank 0 through its own serving store, the others as its clients.
fn grow_with(rank: usize, offer: GrowOffer, cfg: &Config, calibration: Calibration) -> Result<Communicator> {
    let GrowOffer { token, server, .. } = offer;
    let what = format!("rank {rank}: grow to {} ranks", token.size);
    let store: Arc<dyn Store> = match &server {
        Some(s) => s.clone(),
        None => Arc::new(connect(&token, cfg)?),
    };
    let host = token.addr.ip().to_string();
    let comm = Communicator::build(rank, token.size, store, cfg, Some(&host), calibration)
        .map_err(|e| e.context(&what));
    // As at creation: rank 0's set-up returns only once every rank has read what it needs.
    if let Some(s) = server {
        s.stop_serving();
    }
    comm
}

/// A new process's join.
fn join_with(token: &JoinToken, rank: usize, cfg: &Config) -> Result<Communicator> {
    let what = format!("join as rank {rank} of {}", token.size);
    if rank >= token.size {
        return Err(Error::InvalidArgument(format!("{what}: the rank is not below the size").into()));
    }
    let store: Arc<dyn Store> = Arc::new(connect(token, cfg).map_err(|e| e.context(&what))?);
    let host = token.addr.ip().to_string();
    Communicator::build(rank, token.size, store, cfg, Some(&host), Calibration::Grow(None))
        .map_err(|e| e.context(&what))
}

/// A client of the grow's store, proving the token's secret.
fn connect(token: &JoinToken, cfg: &Config) -> Result<TcpStore> {
    let secret = AuthToken::new(&token.secret);
    TcpStore::connect_secured(&token.addr.to_string(), cfg.timeout, Some(&secret), cfg.encrypt).map_err(|e| {
        match e {
        // The store's message names TOROID_AUTH_TOKEN, which is not what a newcomer got wrong.
        Error::Remote(m) if m.to_string().contains("authentication") => Error::Remote(
            format!(
                "the grow's store at {} refused this token's secret (a forged token, or one of another grow)",
                token.addr
            )
            .into(),
        ),
        e => e,
    }
    })
}

/// Rank 0's broadcast: 1, length, token; or 0, length, the error that kept it from serving.
fn encode_offer(msg: &mut [u8; OFFER_LEN], what: std::result::Result<&str, &str>) {
    let (tag, text) = match what {
        Ok(t) => (1u8, t),
        Err(e) => (0u8, e),
    };
    let bytes = &text.as_bytes()[..text.len().min(OFFER_LEN - 3)];
    msg[0] = tag;
    msg[1..3].copy_from_slice(&(bytes.len() as u16).to_le_bytes());
    msg[3..3 + bytes.len()].copy_from_slice(bytes);
}

/// The token of rank 0's broadcast, or its error.
fn decode_offer(msg: &[u8; OFFER_LEN]) -> Result<JoinToken> {
    let len = (u16::from_le_bytes([msg[1], msg[2]]) as usize).min(OFFER_LEN - 3);
    let text = String::from_utf8_lossy(&msg[3..3 + len]);
    match msg[0] {
        1 => text.parse(),
        _ => Err(Error::Remote(format!("grow: rank 0 could not start the grow's store: {text}").into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_reads_back_and_bad_ones_are_refused() {
        let t = JoinToken { size: 8, addr: "127.0.0.1:4242".parse().unwrap(), secret: [0xa5; SECRET_LEN] };
        let s = t.to_string();
        assert!(s.starts_with("toroid-join1/8/a5a5"), "{s}");
        assert_eq!(s.parse::<JoinToken>().unwrap(), t);
        let v6 = JoinToken { addr: "[::1]:7".parse().unwrap(), ..t.clone() };
        assert_eq!(v6.to_string().parse::<JoinToken>().unwrap(), v6);
        let secret = "a5".repeat(SECRET_LEN);
        for bad in [
            String::new(),
            "toroid-join0/8/aa/127.0.0.1:1".into(),
            format!("toroid-join1/x/{secret}/127.0.0.1:1"),
            format!("toroid-join1/1/{secret}/127.0.0.1:1"),
            format!("toroid-join1/8/{}/127.0.0.1:1", &secret[2..]),
            format!("toroid-join1/8/{}zz/127.0.0.1:1", &secret[2..]),
            format!("toroid-join1/8/{secret}/127.0.0.1"),
            format!("toroid-join1/8/{secret}/127.0.0.1:0"),
            format!("toroid-join1/8/{secret}/0.0.0.0:5"),
        ] {
            assert!(bad.parse::<JoinToken>().is_err(), "{bad}");
        }
        assert!(!format!("{t:?}").contains("a5"), "Debug shows no secret");
    }

    #[test]
    fn the_offer_broadcast_carries_a_token_or_an_error() {
        let t = JoinToken { size: 3, addr: "10.0.0.1:99".parse().unwrap(), secret: [7; SECRET_LEN] };
        let mut msg = [0u8; OFFER_LEN];
        encode_offer(&mut msg, Ok(&t.to_string()));
        assert_eq!(decode_offer(&msg).unwrap(), t);
        encode_offer(&mut msg, Err("bind failed"));
        let e = decode_offer(&msg).unwrap_err().to_string();
        assert!(e.contains("bind failed"), "{e}");
        let mut junk = [0xffu8; OFFER_LEN];
        junk[0] = 1;
        assert!(decode_offer(&junk).is_err());
    }
}
