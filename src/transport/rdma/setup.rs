//! Set-up: moving the links between hosts to RDMA (`TOROID_RDMA`), after shared memory took
//! the links inside each host.
//!
//! Every rank publishes at set-up whether it can use RDMA (its host record's link
//! preferences: [`wanted`]), so both ranks of a pair know whether to talk about it; a pair
//! where either cannot keeps TCP without a word. The others agree in three set-up messages over
//! their fresh, authenticated TCP link, the higher rank of the pair (the one that dials links
//! opened on demand) offering and the lower one answering:
//! 1. higher -> lower: `OFFER` with its [`RingInfo`] (hex), or `DECLINE` with why it cannot;
//! 2. lower -> higher: `ACCEPT` with its own ring, already connected to the offered one, or
//!    `DECLINE`;
//! 3. higher -> lower: `READY` once its queue pair is connected to the accepted one, or `FAIL`.
//!
//! After `READY` both sides move the link to an [`RdmaTransport`] over the ring, the TCP link
//! kept as its liveness channel; after anything else both keep TCP, with one WARN per rank.
//! The peer's description is decoded and checked ([`RingInfo::decode`]) before use. The same
//! steps serve a mesh ([`connect`], every pair at set-up, each step for every pair before the
//! next, which cannot deadlock: a step waits only for messages of the step before) and links
//! opened on demand ([`offer`] and [`confirm`] in the dialing rank, [`answer`] and
//! [`settle`] in the accepting rank's control thread).

use std::time::Instant;

use super::RdmaTransport;
#[cfg(any(test, feature = "rdma-fake"))]
use super::fake::FakeVerbs;
use super::verbs::Verbs;
use super::write_ring::{Geometry, RdmaRing, RingInfo};
use crate::config::{Config, RdmaMode};
use crate::error::{Error, Result};
use crate::transport::Transport;
pub(crate) use crate::transport::shm::setup::{MSG_LEN, Msg, decode_msg, encode_msg};
use crate::transport::shm::setup::{recv_msg_as, send_msg_as};

/// What these messages are for (in errors).
const WHAT: &str = "RDMA set-up";

/// Message kinds (apart from the shared-memory set-up's).
const OFFER: u8 = 21;
const DECLINE: u8 = 22;
const ACCEPT: u8 = 23;
const READY: u8 = 24;
const FAIL: u8 = 25;

/// Whether this rank can use RDMA towards other hosts: `TOROID_RDMA=fake`, or `auto` with a
/// usable device (cargo feature `rdma`; the check is made once per process and said at INFO).
pub fn wanted(cfg: &Config) -> bool {
    match cfg.rdma {
        RdmaMode::Off => false,
        #[cfg(any(test, feature = "rdma-fake"))]
        RdmaMode::Fake => true,
        #[cfg(feature = "rdma")]
        RdmaMode::Auto => super::hca::can_connect(cfg),
        #[cfg(not(feature = "rdma"))]
        RdmaMode::Auto => false,
    }
}

/// A ring made and not yet connected, whatever its verbs.
trait Pending: Send {
    fn info(&self) -> RingInfo;
    fn connect(&mut self, peer: &RingInfo) -> Result<()>;
    fn into_transport(self: Box<Self>, tcp: Box<dyn Transport>) -> Result<Box<dyn Transport>>;
}

impl<V: Verbs + 'static> Pending for RdmaRing<V> {
    fn info(&self) -> RingInfo {
        RdmaRing::info(self)
    }

    fn connect(&mut self, peer: &RingInfo) -> Result<()> {
        RdmaRing::connect(self, peer)
    }

    fn into_transport(self: Box<Self>, tcp: Box<dyn Transport>) -> Result<Box<dyn Transport>> {
        let t = RdmaTransport::new(*self, tcp).map_err(|e| Error::system("RDMA transport", e))?;
        Ok(Box::new(t))
    }
}

/// This rank's ring towards `peer`, on the device or the fake fabric.
// The fake fabric is what pairs rings by communicator and rank; the device needs only the
// geometry (and without the feature `rdma` either, nothing is opened at all).
#[cfg_attr(not(any(test, feature = "rdma-fake")), allow(unused_variables))]
fn open(cfg: &Config, comm_id: u64, rank: usize, peer: usize, geo: Geometry) -> Result<Box<dyn Pending>> {
    match cfg.rdma {
        RdmaMode::Off => Err(Error::Unsupported("RDMA is off (TOROID_RDMA=off)".into())),
        #[cfg(any(test, feature = "rdma-fake"))]
        RdmaMode::Fake => {
            let verbs = FakeVerbs::fabric(comm_id, rank, peer, geo.send_depth())
                .map_err(|e| Error::system("fake RDMA endpoint", e))?;
            Ok(Box::new(RdmaRing::new(verbs, peer, geo)?))
        }
        #[cfg(feature = "rdma")]
        RdmaMode::Auto => {
            let verbs = super::hca::HcaVerbs::open(cfg, geo.send_depth(), geo.recv_depth())?;
            Ok(Box::new(RdmaRing::new(verbs, peer, geo)?))
        }
        #[cfg(not(feature = "rdma"))]
        RdmaMode::Auto => Err(Error::Unsupported("built without the cargo feature `rdma`".into())),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

fn unexpected(peer: usize, m: &Msg) -> Error {
    Error::Remote(format!("{WHAT}: rank {peer} sent message kind {}", m.kind).into()).with_peer(peer)
}

/// A ring on its way to a link: made (and, on the answering side, connected) during the
/// exchange, moved to a transport once the pair agreed.
pub(crate) struct Upgrade {
    ring: Option<Box<dyn Pending>>,
    /// Why the pair keeps TCP, once known.
    pub failure: Option<String>,
}

impl std::fmt::Debug for Upgrade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upgrade").field("ring", &self.ring.is_some()).field("failure", &self.failure).finish()
    }
}

impl Upgrade {
    fn failed(why: String) -> Upgrade {
        Upgrade { ring: None, failure: Some(why) }
    }

    /// The link to the peer after the exchange: RDMA over the agreed ring, else `tcp` itself.
    pub fn finish(self, tcp: Box<dyn Transport>) -> Result<Box<dyn Transport>> {
        match self.ring {
            Some(ring) => ring.into_transport(tcp),
            None => Ok(tcp),
        }
    }

    /// True when the link will move to RDMA.
    pub fn agreed(&self) -> bool {
        self.ring.is_some()
    }
}

/// A ring made (message `kind` describing it), or why not (`DECLINE` with the reason).
fn described(made: Result<Box<dyn Pending>>, kind: u8) -> (Upgrade, [u8; MSG_LEN]) {
    match made {
        Ok(ring) => {
            let msg = encode_msg(kind, 0, 0, &hex(&ring.info().encode()));
            (Upgrade { ring: Some(ring), failure: None }, msg)
        }
        Err(e) => {
            let why = e.to_string();
            let msg = encode_msg(DECLINE, 0, 0, &why);
            (Upgrade::failed(why), msg)
        }
    }
}

/// Step 1, in the higher rank: its ring and the message that offers it (or declines).
pub(crate) fn offer(cfg: &Config, comm_id: u64, rank: usize, peer: usize) -> (Upgrade, [u8; MSG_LEN]) {
    described(open(cfg, comm_id, rank, peer, Geometry::DEFAULT), OFFER)
}

/// The peer's ring in an `OFFER` or `ACCEPT` (`Ok(None)`: it declined, with its reason).
fn ring_in(m: &Msg, peer: usize, kind: u8) -> Result<std::result::Result<RingInfo, String>> {
    match m.kind {
        k if k == kind => unhex(&m.text)
            .ok_or_else(|| Error::Remote(format!("{WHAT}: rank {peer} sent a malformed ring").into()))
            .and_then(|b| RingInfo::decode(&b))
            .map(Ok)
            .map_err(|e| e.with_peer(peer)),
        DECLINE => Ok(Err(format!("rank {peer}: {}", m.text))),
        _ => Err(unexpected(peer, m)),
    }
}

/// Step 2, in the lower rank: answers `offer` (its ring connected to the offered one, or a
/// decline). An error means the peer broke the protocol.
pub(crate) fn answer(
    cfg: &Config,
    comm_id: u64,
    rank: usize,
    peer: usize,
    offer: &Msg,
) -> Result<(Upgrade, [u8; MSG_LEN])> {
    let theirs = match ring_in(offer, peer, OFFER)? {
        Ok(info) => info,
        Err(why) => return Ok((Upgrade::failed(why), encode_msg(DECLINE, 0, 0, "the offer was declined"))),
    };
    let made = open(cfg, comm_id, rank, peer, Geometry::DEFAULT).and_then(|mut ring| {
        ring.connect(&theirs)?;
        Ok(ring)
    });
    Ok(described(made, ACCEPT))
}

/// Step 3, in the higher rank: connects to the accepted ring; the verdict to send.
pub(crate) fn confirm(mut up: Upgrade, peer: usize, accept: &Msg) -> Result<(Upgrade, [u8; MSG_LEN])> {
    let theirs = ring_in(accept, peer, ACCEPT)?;
    let outcome = match (theirs, up.ring.as_mut()) {
        (Err(why), _) => Err(why),
        (Ok(_), None) => Err(up.failure.clone().unwrap_or_default()),
        (Ok(info), Some(ring)) => ring.connect(&info).map_err(|e| e.to_string()),
    };
    Ok(match outcome {
        Ok(()) => (up, encode_msg(READY, 0, 0, "")),
        Err(why) => {
            let msg = encode_msg(FAIL, 0, 0, &why);
            (Upgrade::failed(why), msg)
        }
    })
}

/// Step 4, in the lower rank: the higher rank's verdict settles the pair.
pub(crate) fn settle(up: Upgrade, peer: usize, verdict: &Msg) -> Result<Upgrade> {
    match verdict.kind {
        // After a decline (ours or theirs) the verdict only closes the exchange.
        READY => Ok(up),
        FAIL => Ok(Upgrade::failed(up.failure.unwrap_or_else(|| format!("rank {peer}: {}", verdict.text)))),
        _ => Err(unexpected(peer, verdict)),
    }
}

/// A link opened on demand, in the dialing (higher) rank: offers, confirms, and returns the
/// link on RDMA, or `tcp` itself when the pair keeps TCP (with a WARN saying why).
pub(crate) fn dial_side(
    cfg: &Config,
    comm_id: u64,
    rank: usize,
    peer: usize,
    mut tcp: Box<dyn Transport>,
    deadline: Instant,
) -> Result<Box<dyn Transport>> {
    let (up, msg) = offer(cfg, comm_id, rank, peer);
    send_msg_as(WHAT, tcp.as_mut(), peer, &msg, deadline)?;
    let m = recv_msg_as(WHAT, tcp.as_mut(), peer, deadline)?;
    let (up, msg) = confirm(up, peer, &m)?;
    send_msg_as(WHAT, tcp.as_mut(), peer, &msg, deadline)?;
    if let Some(why) = &up.failure {
        tracing::warn!(target: "toroid::net", "rank {rank}: link to rank {peer} stays TCP: {why}");
    }
    up.finish(tcp)
}

/// Moves the links to `peers` (ranks on other hosts that also want RDMA) to RDMA where both
/// sides can; returns how many moved. Runs before any frame moves, on every rank at set-up.
pub fn connect(
    rank: usize,
    peers: &[usize],
    links: &mut [Option<Box<dyn Transport>>],
    cfg: &Config,
    comm_id: u64,
    deadline: Instant,
) -> Result<usize> {
    if peers.is_empty() {
        return Ok(0);
    }
    let (lower, higher): (Vec<usize>, Vec<usize>) = peers.iter().partition(|&&p| p < rank);
    let mut ups: Vec<Option<Upgrade>> = (0..links.len()).map(|_| None).collect();
    // 1. Offer to every lower peer.
    for &p in &lower {
        let (up, msg) = offer(cfg, comm_id, rank, p);
        ups[p] = Some(up);
        send_msg_as(WHAT, link_of(links, p)?, p, &msg, deadline)?;
    }
    // 2. Answer every higher peer's offer.
    for &p in &higher {
        let m = recv_msg_as(WHAT, link_of(links, p)?, p, deadline)?;
        let (up, msg) = answer(cfg, comm_id, rank, p, &m)?;
        ups[p] = Some(up);
        send_msg_as(WHAT, link_of(links, p)?, p, &msg, deadline)?;
    }
    // 3. Confirm to every lower peer.
    for &p in &lower {
        let m = recv_msg_as(WHAT, link_of(links, p)?, p, deadline)?;
        let up = ups[p].take().ok_or_else(|| Error::Internal("RDMA set-up lost a ring".into()))?;
        let (up, msg) = confirm(up, p, &m)?;
        ups[p] = Some(up);
        send_msg_as(WHAT, link_of(links, p)?, p, &msg, deadline)?;
    }
    // 4. Settle with every higher peer.
    for &p in &higher {
        let m = recv_msg_as(WHAT, link_of(links, p)?, p, deadline)?;
        let up = ups[p].take().ok_or_else(|| Error::Internal("RDMA set-up lost a ring".into()))?;
        ups[p] = Some(settle(up, p, &m)?);
    }
    let mut failures: Vec<String> = Vec::new();
    let mut moved = 0;
    for &p in peers {
        let (Some(up), Some(tcp)) = (ups[p].take(), links[p].take()) else { continue };
        if let Some(why) = &up.failure {
            failures.push(why.clone());
        }
        moved += usize::from(up.agreed());
        links[p] = Some(up.finish(tcp)?);
    }
    log_outcome(rank, moved, peers.len(), failures.first());
    Ok(moved)
}

/// One line per rank: INFO when every pair moved, else WARN with the first reason.
pub fn log_outcome(rank: usize, moved: usize, of: usize, failure: Option<&String>) {
    match failure {
        None => tracing::info!(target: "toroid::net", "rank {rank}: RDMA with {moved} peers on other hosts"),
        Some(why) => tracing::warn!(target: "toroid::net",
            "rank {rank}: RDMA with {moved} of {of} peers on other hosts, TCP with the others: {why}"),
    }
}

fn link_of(links: &mut [Option<Box<dyn Transport>>], p: usize) -> Result<&mut dyn Transport> {
    match links.get_mut(p).and_then(Option::as_mut) {
        Some(t) => Ok(t.as_mut()),
        None => Err(Error::Internal(format!("no connection to rank {p} for {WHAT}").into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_descriptions_travel_as_hex() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&b)), Some(b));
        for bad in ["a", "zz", "0g", "é0"] {
            assert_eq!(unhex(bad), None, "{bad}");
        }
    }

    fn msg(m: &[u8; MSG_LEN]) -> Msg {
        decode_msg(m).expect("a well-formed message")
    }

    #[test]
    fn the_exchange_agrees_when_both_can_and_keeps_tcp_when_either_cannot() {
        let fake = Config { rdma: RdmaMode::Fake, ..Config::default() };
        let off = Config { rdma: RdmaMode::Off, ..Config::default() };
        // Both can: offer, answer, confirm, settle.
        // The four steps between a higher rank with `hi` and a lower rank with `lo`.
        let exchange = |hi: &Config, lo: &Config, comm: u64| {
            let (up_hi, m1) = offer(hi, comm, 1, 0);
            let (up_lo, m2) = answer(lo, comm, 0, 1, &msg(&m1)).expect("answer");
            let (up_hi, m3) = confirm(up_hi, 0, &msg(&m2)).expect("confirm");
            (up_hi, settle(up_lo, 1, &msg(&m3)).expect("settle"))
        };
        // Both can.
        let (up_hi, up_lo) = exchange(&fake, &fake, 77);
        assert!(up_hi.agreed() && up_lo.agreed() && up_hi.failure.is_none() && up_lo.failure.is_none());
        // The offering side cannot: the answer declines, the verdict fails, both keep TCP.
        let (up_hi, up_lo) = exchange(&off, &fake, 78);
        assert!(!up_hi.agreed() && !up_lo.agreed());
        assert!(up_lo.failure.as_deref().is_some_and(|w| w.contains("TOROID_RDMA=off")), "{up_lo:?}");
        // The answering side cannot.
        let (up_hi, up_lo) = exchange(&fake, &off, 79);
        assert!(!up_hi.agreed() && !up_lo.agreed());
        assert!(up_hi.failure.as_deref().is_some_and(|w| w.contains("rank 0")), "{up_hi:?}");
    }

    #[test]
    fn a_malformed_or_out_of_turn_message_is_an_error_naming_the_peer() {
        let fake = Config { rdma: RdmaMode::Fake, ..Config::default() };
        let bad_ring = encode_msg(OFFER, 0, 0, "zz");
        let e = answer(&fake, 80, 0, 1, &msg(&bad_ring)).expect_err("malformed");
        assert!(e.to_string().contains("malformed") && e.peer() == Some(1), "{e}");
        let short = encode_msg(OFFER, 0, 0, &hex(&[0u8; 10]));
        assert!(answer(&fake, 80, 0, 1, &msg(&short)).is_err());
        let (up, _) = offer(&fake, 81, 1, 0);
        let e = confirm(up, 0, &msg(&encode_msg(READY, 0, 0, ""))).expect_err("out of turn");
        assert!(e.to_string().contains("kind") && e.peer() == Some(0), "{e}");
        let (up, _) = offer(&fake, 82, 1, 0);
        assert!(settle(up, 1, &msg(&encode_msg(OFFER, 0, 0, ""))).is_err());
    }

    #[test]
    fn only_a_fake_or_a_device_makes_a_rank_want_rdma() {
        let off = Config { rdma: RdmaMode::Off, ..Config::default() };
        let fake = Config { rdma: RdmaMode::Fake, ..Config::default() };
        assert!(!wanted(&off) && wanted(&fake));
        // `auto` wants it only where a device opens (never on this machine or CI's).
        #[cfg(not(feature = "rdma"))]
        assert!(!wanted(&Config::default()));
    }
}
