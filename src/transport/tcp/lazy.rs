//! Connections on demand (`TOROID_CONNECT=lazy`, the default): a pair of ranks connects the
//! first time an operation needs it, not at set-up.
//!
//! Why: a full mesh costs every rank `N - 1` sockets and `N - 1` handshakes at start-up, and
//! every rank reading every other rank's address from the store (Gloo's full mesh fails above
//! about 1,000 ranks, pytorch/gloo#327). An all-reduce needs far fewer peers: a ring its two
//! neighbours, torus2d its row and column, halving-doubling its log2 N partners.
//!
//! Who connects: the higher rank of a pair dials ([`Dialer`], the progress engine's
//! [`Connector`]), with the hello, ack, MAC and lane checks of set-up ([`super::handshaking`]). The
//! lower rank never dials it: its listener is served for the communicator's life by the
//! control thread (`comm::control`), which recognises a hello carrying the communicator's own
//! id, runs the accepting half of the handshake in its poll loop ([`Inbox`]) and hands the
//! checked connections over, every lane of a peer at once, waking the engine through an event
//! descriptor. Accepting never waits for the engine, so a dial completes in a round trip
//! whatever the lower rank is doing, and two ranks never both dial each other.
//!
//! Pairs on different hosts where both ranks can use RDMA (`LazyCtx::rdma`) move the new link
//! to RDMA before using it, with the exchange of `transport::rdma::setup`: the dialing rank
//! offers and confirms in [`Connector::dial`]; the accepting rank answers and settles in the
//! control thread's poll loop, without blocking it ([`Inbox::advance`]), before the engine
//! takes the link. Pairs on one host where both ranks allow shared memory (`LazyCtx::shm`)
//! move the new link to shared memory the same way (`transport::shm::pair`): the dialing rank
//! creates and offers the segment on the raw connection before securing it, the accepting
//! rank's control thread maps it and answers (`lazy/upgrade.rs`). So a pair of one host gets its
//! segment only once an operation needs it: set-up maps only the window and rank 0's pairs,
//! whose links the window's set-up runs over.
//!
//! Strangers meet the bounds of set-up: at most [`MAX_PENDING`] connections in handshake (the
//! oldest goes), each with the set-up allowance to finish, a rank and lane claimed once. After
//! this rank failed ([`Inbox::close`]), a peer that connects gets the abort frame with the
//! reason and a closed connection, so it fails at once with this rank's reason.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::handshaking::{Ctx, Incoming, Outgoing};
use super::mesh::{HANDSHAKE_ALLOWANCE, LinkEnd, transport_of};
use super::{SocketOptions, control};
use crate::config::{AuthToken, Config};
use crate::error::{Error, Result};
use crate::sys::eventfd::EventFd;
use crate::sys::poll::{Events, PollFd, poll};
use crate::transport::rdma::setup as rdma;
use crate::transport::shm::ShmOptions;
use crate::transport::{AbortSignal, Connector, Transport};
use upgrade::{Accepting, Exchange, Upgrade, dial_shm};

/// Incoming connections in handshake at most; past this the oldest is dropped. A genuine
/// peer's hello arrives within a round trip, so only that many dials at one rank within one
/// round trip (every rank receiving from any source at once) could push one out.
pub const MAX_PENDING: usize = 1024;
/// Dropped connections logged one by one (then every 1000th).
const WARNS: usize = 16;
/// Longest sleep of a dial, so that cancellation and the abort signal are seen promptly.
const DIAL_SLICE: Duration = Duration::from_millis(100);
/// How long [`Dialer::peer_gone`] waits for a verdict.
const GONE_TIMEOUT: Duration = Duration::from_millis(500);

/// Who this rank is, for both halves of the handshake.
#[derive(Debug, Clone)]
pub struct LazyCtx {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub size: usize,
    /// The communicator's id.
    pub comm_id: u64,
    /// `TOROID_AUTH_TOKEN`.
    pub auth: Option<AuthToken>,
    /// Connections (lanes) per peer, as at set-up.
    pub lanes: Vec<usize>,
    /// Peers whose links move to RDMA once open (both ranks can, different hosts); empty: none.
    pub rdma: Vec<bool>,
    /// The settings rings open with, when `rdma` names any peer.
    pub rdma_cfg: Option<std::sync::Arc<Config>>,
    /// Peers whose links move to shared memory once open (same host, both ranks allow it);
    /// empty: none.
    pub shm: Vec<bool>,
    /// The shared-memory settings, when `shm` names any peer.
    pub shm_opts: Option<std::sync::Arc<ShmOptions>>,
}

impl LazyCtx {
    /// The settings to move the link to `peer` to RDMA with, if it moves.
    fn rdma_for(&self, peer: usize) -> Option<&Config> {
        self.rdma_cfg.as_deref().filter(|_| self.rdma.get(peer).copied().unwrap_or(false))
    }

    /// The settings to move the link to `peer` to shared memory with, if it moves.
    fn shm_for(&self, peer: usize) -> Option<&ShmOptions> {
        self.shm_opts.as_deref().filter(|_| self.shm.get(peer).copied().unwrap_or(false))
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            rank: self.rank,
            size: self.size,
            comm_id: self.comm_id,
            auth: self.auth.as_ref(),
            lanes: &self.lanes,
        }
    }
}

#[derive(Default)]
struct InState {
    pending: Vec<Incoming>,
    /// Lanes (bit `l`) of each rank that a connection holds or held (2 bytes per rank, as
    /// the addresses every rank keeps).
    claimed: Vec<u16>,
    /// Checked lanes of ranks not all of whose lanes are in yet.
    partial: HashMap<usize, Vec<Option<TcpStream>>>,
    /// Peers whose every lane is in and whose RDMA or shared-memory exchange is underway.
    upgrading: Vec<Accepting>,
    /// Peers whose every lane is in (and exchange done), for the engine to take.
    ready: Vec<Ready>,
    /// The abort frame to answer with once this rank failed.
    closed: Option<Vec<u8>>,
    dropped: usize,
}

/// A linked peer for the engine: its lanes, and what the link moves to (RDMA, shared memory).
type Ready = (usize, Vec<TcpStream>, Option<Upgrade>);

/// The accepting half: connections the control thread took whose hello carries this
/// communicator's id, until their handshake is done and the engine takes them.
pub struct Inbox {
    ctx: LazyCtx,
    state: Mutex<InState>,
    event: EventFd,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("rank", &self.ctx.rank).finish_non_exhaustive()
    }
}

impl Inbox {
    /// An empty inbox for this rank.
    pub fn new(ctx: LazyCtx) -> Result<Inbox> {
        let event = EventFd::new().map_err(|e| Error::system("eventfd for connections on demand", e))?;
        let state = InState { claimed: vec![0; ctx.size], ..InState::default() };
        Ok(Inbox { ctx, state: Mutex::new(state), event })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The communicator id a data hello carries.
    pub fn comm_id(&self) -> u64 {
        self.ctx.comm_id
    }

    /// Takes a connection accepted on the listener whose hello (not yet consumed) carries this
    /// communicator's id: a stranger until its hello checks out.
    pub fn take(&self, stream: TcpStream, from: SocketAddr) {
        let now = Instant::now();
        let mut st = self.lock();
        if st.pending.len() >= MAX_PENDING {
            let old = st.pending.remove(0);
            Self::drop_one(
                &mut st,
                self.ctx.rank,
                old,
                "too many connections in handshake at once (the oldest goes)",
            );
        }
        st.pending.push(Incoming::new(stream, from, now, now + HANDSHAKE_ALLOWANCE));
        drop(st);
        self.advance(now);
    }

    /// What the control thread polls for: the connections in handshake or in their RDMA
    /// exchange.
    pub fn interest(&self) -> Vec<(RawFd, Events)> {
        let st = self.lock();
        let exchanging =
            st.upgrading.iter().filter_map(|a| a.lanes.first()).map(|s| (s.as_raw_fd(), PollFd::IN));
        st.pending.iter().filter_map(Incoming::interest).chain(exchanging).collect()
    }

    /// The earliest deadline of a handshake or an RDMA exchange, if any is underway.
    pub fn wake_at(&self) -> Option<Instant> {
        let st = self.lock();
        st.pending.iter().map(|c| c.deadline).chain(st.upgrading.iter().map(|a| a.deadline)).min()
    }

    /// Moves every connection in handshake on as far as its socket allows; hands the peers
    /// whose every lane is checked to the engine (or, after [`Inbox::close`], answers them
    /// with the abort frame and closes them).
    pub fn advance(&self, now: Instant) {
        let ctx = self.ctx.ctx();
        let mut st = self.lock();
        let st = &mut *st;
        let mut i = 0;
        let mut delivered = false;
        while i < st.pending.len() {
            let res = st.pending[i].advance(ctx, &mut st.claimed);
            match res {
                Err(why) => {
                    let c = st.pending.swap_remove(i);
                    if let Some((r, l)) = c.claimed()
                        && let Some(bits) = st.claimed.get_mut(r)
                    {
                        *bits &= !(1 << l);
                    }
                    Self::drop_one(st, ctx.rank, c, &why);
                }
                Ok(()) if st.pending[i].interest().is_none() => {
                    let c = st.pending.swap_remove(i);
                    if let Some((r, l, s)) = c.into_link() {
                        let n = ctx.lanes.get(r).copied().unwrap_or(1);
                        let lanes = st.partial.entry(r).or_insert_with(|| (0..n).map(|_| None).collect());
                        if let Some(slot) = lanes.get_mut(l) {
                            *slot = Some(s);
                        }
                        if lanes.iter().all(Option::is_some) {
                            let lanes: Vec<TcpStream> =
                                st.partial.remove(&r).unwrap_or_default().into_iter().flatten().collect();
                            match &st.closed {
                                None if self.ctx.rdma_for(r).is_some() => st.upgrading.push(Accepting::new(
                                    r,
                                    lanes,
                                    Exchange::Rdma,
                                    now + HANDSHAKE_ALLOWANCE,
                                )),
                                // Even after this rank failed: the dialer's offer is read and
                                // refused first, so that the abort frame reaches its engine.
                                _ if self.ctx.shm_for(r).is_some() => st.upgrading.push(Accepting::new(
                                    r,
                                    lanes,
                                    Exchange::Shm,
                                    now + HANDSHAKE_ALLOWANCE,
                                )),
                                Some(frame) => refuse(lanes, frame),
                                None => {
                                    st.ready.push((r, lanes, None));
                                    delivered = true;
                                }
                            }
                        }
                    }
                }
                Ok(()) if now >= st.pending[i].deadline => {
                    let c = st.pending.swap_remove(i);
                    if let Some((r, l)) = c.claimed()
                        && let Some(bits) = st.claimed.get_mut(r)
                    {
                        *bits &= !(1 << l);
                    }
                    Self::drop_one(st, ctx.rank, c, "no complete hello before its handshake deadline");
                }
                Ok(()) => i += 1,
            }
        }
        delivered |= self.exchange(st, now);
        if delivered {
            self.event.signal();
        }
    }

    /// Moves the RDMA and shared-memory exchanges on; returns true when a link became ready.
    /// A peer that breaks the exchange or misses its deadline is dropped: its dial fails.
    fn exchange(&self, st: &mut InState, now: Instant) -> bool {
        let rank = self.ctx.rank;
        let mut delivered = false;
        let mut i = 0;
        let closed = st.closed.is_some();
        while i < st.upgrading.len() {
            let a = &mut st.upgrading[i];
            let step = match a.read() {
                Ok(None) if now < a.deadline => {
                    i += 1;
                    continue;
                }
                Ok(None) => Err("no exchange before its deadline".to_string()),
                Err(why) => Err(why),
                Ok(Some(m)) => a.step(
                    &m,
                    self.ctx.rdma_cfg.as_deref(),
                    self.ctx.shm_opts.as_deref().filter(|_| !closed),
                    self.ctx.comm_id,
                    rank,
                ),
            };
            match step {
                Ok(None) => i += 1,
                Ok(Some(up)) => {
                    let a = st.upgrading.swap_remove(i);
                    match &st.closed {
                        Some(frame) => refuse(a.lanes, frame),
                        None => {
                            st.ready.push((a.peer, a.lanes, up));
                            delivered = true;
                        }
                    }
                }
                Err(why) => {
                    let a = st.upgrading.swap_remove(i);
                    tracing::warn!(target: "toroid::net", "rank {rank}: dropped the link from rank {}: {why}", a.peer);
                    drop(a.lanes);
                }
            }
        }
        delivered
    }

    fn drop_one(st: &mut InState, rank: usize, c: Incoming, why: &str) {
        st.dropped += 1;
        if st.dropped <= WARNS || st.dropped.is_multiple_of(1000) {
            tracing::warn!(target: "toroid::net", "rank {rank}: dropped connection from {}: {why} ({} dropped so far)",
                c.from_addr, st.dropped);
        }
    }

    /// The peers whose links are in since the last call, with their lanes in order.
    fn take_ready(&self) -> Vec<Ready> {
        self.event.drain();
        std::mem::take(&mut self.lock().ready)
    }

    /// This rank failed: links handed over but not taken, and those that arrive later, get
    /// `frame` (an abort frame) and are closed.
    fn close(&self, frame: &[u8]) {
        let mut st = self.lock();
        for (_, lanes, _) in std::mem::take(&mut st.ready) {
            refuse(lanes, frame);
        }
        for a in std::mem::take(&mut st.upgrading) {
            refuse(a.lanes, frame);
        }
        st.closed = Some(frame.to_vec());
    }
}

/// Best effort: the abort frame on the first lane, then every lane closed.
fn refuse(lanes: Vec<TcpStream>, frame: &[u8]) {
    use std::io::Write;
    if let Some(mut s) = lanes.first() {
        let _ = s.write(frame);
    }
    for s in lanes {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

/// The dialing half, and the engine's [`Connector`].
#[derive(Debug)]
pub struct Dialer {
    ctx: LazyCtx,
    addrs: std::sync::Arc<[SocketAddr]>,
    opts: SocketOptions,
    inbox: std::sync::Arc<Inbox>,
    sockets: AtomicUsize,
}

impl Dialer {
    /// Dials the peers at `addrs` (index = rank) for the communicator of `ctx`; links they
    /// open arrive through `inbox` (served by the control thread).
    pub fn new(
        ctx: LazyCtx,
        addrs: std::sync::Arc<[SocketAddr]>,
        opts: SocketOptions,
        inbox: std::sync::Arc<Inbox>,
    ) -> Dialer {
        Dialer { ctx, addrs, opts, inbox, sockets: AtomicUsize::new(0) }
    }

    /// Links every rank of `peers` now (set-up: the ranks shared memory pairs with), dialing
    /// the lower ones and waiting for the higher ones; one transport per rank (`None` for
    /// ranks not in `peers`, unless such a rank already opened its link to this one for its
    /// first operation: that link is kept too).
    pub fn link_now(
        &mut self,
        peers: &[usize],
        deadline: Instant,
        abort: &AbortSignal,
    ) -> Result<Vec<Option<Box<dyn Transport>>>> {
        let mut out: Vec<Option<Box<dyn Transport>>> = (0..self.ctx.size).map(|_| None).collect();
        let lower: Vec<usize> = peers.iter().copied().filter(|&p| self.dials(p)).collect();
        for (p, t) in self.dial_many(&lower, deadline, abort)? {
            out[p] = Some(t);
        }
        loop {
            for (p, t) in self.arrived()? {
                if let Some(slot) = out.get_mut(p) {
                    *slot = Some(t);
                }
            }
            let missing: Vec<usize> = peers.iter().copied().filter(|&p| out[p].is_none()).collect();
            if missing.is_empty() {
                return Ok(out);
            }
            abort.check()?;
            crate::cancel::check("connecting to the ranks of this host")?;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(
                    format!(
                        "rank {}: ranks {missing:?} of this host never connected before the set-up deadline",
                        self.ctx.rank
                    )
                    .into(),
                )
                .with_peer(missing[0]));
            }
            let mut fds = [
                PollFd::new(self.inbox.event.as_raw_fd(), PollFd::IN),
                PollFd::new(abort.event_fd(), PollFd::IN),
            ];
            let ms = deadline.saturating_duration_since(now).min(DIAL_SLICE).as_millis().max(1) as i32;
            poll(&mut fds, ms).map_err(|e| Error::system("poll while connecting", e))?;
        }
    }

    /// Dials every rank of `peers` (all lower than this rank) at once, every lane, in one poll
    /// loop, and returns their transports in the order given.
    fn dial_many(
        &mut self,
        peers: &[usize],
        deadline: Instant,
        abort: &AbortSignal,
    ) -> Result<Vec<(usize, Box<dyn Transport>)>> {
        let ctx = self.ctx.ctx();
        let mut out: Vec<Outgoing> = Vec::new();
        for &peer in peers {
            let addr = *self.addrs.get(peer).ok_or_else(|| {
                Error::Internal(format!("rank {} has no address for rank {peer}", ctx.rank).into())
            })?;
            for l in 0..ctx.lanes.get(peer).copied().unwrap_or(1) {
                out.push(Outgoing::new(ctx, peer, l, addr)?);
            }
        }
        let mut fds: Vec<PollFd> = Vec::with_capacity(out.len() + 1);
        loop {
            let now = Instant::now();
            for o in &mut out {
                o.advance(ctx, now).map_err(|e| e.with_peer(o.peer))?;
                // The peer published this address after it started listening, and its listener
                // stays open for the communicator's life: a refusal means its process is gone.
                if let Some(e) = o.refusal() {
                    return Err(Error::Remote(
                        format!(
                            "rank {}: could not connect to rank {} at {}: {e} (its process is gone)",
                            ctx.rank, o.peer, self.addrs[o.peer]
                        )
                        .into(),
                    )
                    .with_peer(o.peer));
                }
            }
            if out.iter().all(Outgoing::is_done) {
                let mut links = Vec::with_capacity(peers.len());
                let mut lanes = out.into_iter();
                for &peer in peers {
                    let n = ctx.lanes.get(peer).copied().unwrap_or(1);
                    let streams: Vec<TcpStream> =
                        lanes.by_ref().take(n).filter_map(Outgoing::into_stream).collect();
                    self.sockets.fetch_add(streams.len(), Ordering::Relaxed);
                    let mapped = match (self.ctx.shm_for(peer), streams.first()) {
                        (Some(o), Some(lane)) => {
                            dial_shm(o, ctx.comm_id, ctx.rank, peer, lane, deadline, abort)?
                        }
                        _ => None,
                    };
                    let end = LinkEnd { me: ctx.rank, peer, dialer: true, deadline, abort: Some(abort) };
                    let t = transport_of(streams, &self.opts, end)?
                        .ok_or_else(|| Error::Internal("a dial produced no connection".into()))?;
                    links.push((
                        peer,
                        match mapped {
                            Some(m) => m.into_link(false, t),
                            None => t,
                        },
                    ));
                }
                return Ok(links);
            }
            abort.check()?;
            crate::cancel::check("connecting to a peer")?;
            if now >= deadline {
                let parts: Vec<String> =
                    out.iter().filter(|o| !o.is_done()).map(|o| o.describe_unfinished(ctx.rank)).collect();
                let first = out.iter().find(|o| !o.is_done()).map(|o| o.peer);
                let e = Error::Timeout(parts.join("; ").into());
                return Err(match first {
                    Some(p) => e.with_peer(p),
                    None => e,
                });
            }
            fds.clear();
            fds.push(PollFd::new(abort.event_fd(), PollFd::IN));
            for o in &out {
                if let Some((fd, ev)) = o.interest() {
                    fds.push(PollFd::new(fd, ev));
                }
            }
            let wake =
                out.iter().filter_map(Outgoing::wake_at).fold(deadline, Instant::min).min(now + DIAL_SLICE);
            let ms = wake.saturating_duration_since(now).as_millis().max(1) as i32;
            poll(&mut fds, ms).map_err(|e| Error::system("poll while connecting", e))?;
        }
    }
}

impl Connector for Dialer {
    fn dials(&self, peer: usize) -> bool {
        peer < self.ctx.rank
    }

    fn dial(&mut self, peer: usize, deadline: Instant, abort: &AbortSignal) -> Result<Box<dyn Transport>> {
        let t = self
            .dial_many(&[peer], deadline, abort)?
            .pop()
            .map(|(_, t)| t)
            .ok_or_else(|| Error::Internal("a dial produced no connection".into()))?;
        match self.ctx.rdma_for(peer) {
            Some(cfg) => rdma::dial_side(cfg, self.ctx.comm_id, self.ctx.rank, peer, t, deadline),
            None => Ok(t),
        }
    }

    fn arrived(&mut self) -> Result<Vec<(usize, Box<dyn Transport>)>> {
        let mut out = Vec::new();
        for (p, lanes, up) in self.inbox.take_ready() {
            self.sockets.fetch_add(lanes.len(), Ordering::Relaxed);
            // The dialer is securing this link now (it does so right after its handshake).
            let deadline = Instant::now() + self.opts.secure.as_ref().map_or(Duration::ZERO, |s| s.timeout());
            let end = LinkEnd { me: self.ctx.rank, peer: p, dialer: false, deadline, abort: None };
            if let Some(t) = transport_of(lanes, &self.opts, end)? {
                out.push((
                    p,
                    match up {
                        Some(Upgrade::Rdma(up)) => up.finish(t)?,
                        Some(Upgrade::Shm(m)) => m.into_link(true, t),
                        None => t,
                    },
                ));
            }
        }
        Ok(out)
    }

    fn arrival_fd(&self) -> RawFd {
        self.inbox.event.as_raw_fd()
    }

    fn peer_gone(&self, peer: usize) -> Option<String> {
        control::is_gone(*self.addrs.get(peer)?, GONE_TIMEOUT)
    }

    fn close(&mut self, abort_frame: &[u8]) {
        self.inbox.close(abort_frame);
    }

    #[cfg(test)]
    fn sockets(&self) -> usize {
        self.sockets.load(Ordering::Relaxed)
    }

    fn kind_of(&self, peer: usize) -> &'static str {
        if self.ctx.rdma_for(peer).is_some() {
            "rdma"
        } else if self.ctx.shm_for(peer).is_some() {
            "shm"
        } else if self.ctx.lanes.get(peer).is_some_and(|&l| l > 1) {
            "tcp-striped"
        } else {
            "tcp"
        }
    }
}

#[cfg(test)]
mod tests;
mod upgrade;
