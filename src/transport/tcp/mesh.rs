//! Setting up the mesh: every rank listens on its address; rank `j` connects to every lower
//! rank `i < j` and accepts from every higher one, and each connection is checked with the
//! handshake of [`super::handshake`] both ways before it becomes a [`TcpTransport`] (or, with
//! several lanes to a peer, one connection per lane, each with its own handshake naming its
//! lane, joined into a [`StripedTransport`]). Anyone
//! can connect to a listener: a connection is trusted only once its hello checks out, and a
//! stranger's connection never fails or delays set-up.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use super::handshaking::{Ctx, Incoming, Outgoing};
use super::striped::StripedTransport;
use super::{Interface, SocketOptions, TcpTransport};
use crate::config::AuthToken;
use crate::error::{Error, Result};
use crate::sys::poll::{PollFd, poll};
use crate::transport::Transport;

/// Where this rank listens, and the interface that address belongs to.
#[derive(Debug)]
pub struct Endpoint {
    /// The listening socket (non-blocking).
    pub listener: TcpListener,
    /// The address peers connect to.
    pub addr: SocketAddr,
    /// Interface name the address was taken from ("" when chosen by route only).
    pub ifname: String,
}

/// Opens the listening socket on `iface`.
pub fn listen(iface: &Interface, backlog_hint: usize) -> Result<Endpoint> {
    let listener = TcpListener::bind((iface.addr, 0))
        .map_err(|e| Error::system(format!("binding a listener on {} ({})", iface.addr, iface.name), e))?;
    // The backlog holds the peers (and any strangers) that connect before set-up accepts
    // them: std's default (128) could be filled by a stranger before a genuine peer's turn.
    // The kernel caps it at `net.core.somaxconn` (4096 since Linux 5.4).
    let _ = crate::sys::socket::set_backlog(listener.as_fd(), backlog_hint.max(MIN_BACKLOG));
    listener.set_nonblocking(true).map_err(|e| Error::system("O_NONBLOCK on listener", e))?;
    let addr = listener.local_addr().map_err(|e| Error::system("getsockname", e))?;
    Ok(Endpoint { listener, addr, ifname: iface.name.clone() })
}

/// Smallest listen backlog (see [`listen`]).
const MIN_BACKLOG: usize = 1024;
/// How long one incoming connection has to complete its handshake, from its accept (never
/// past the set-up deadline). A genuine peer sends its whole hello (24 to 72 bytes) in one
/// write right after its connect completes, so it needs one round trip plus its own scheduling
/// delay; 5 s covers a heavily oversubscribed host. The allowance never delays set-up (which
/// ends as soon as the expected peers are in); it only bounds how long a silent or dripping
/// stranger holds a descriptor and a slot of [`MAX_STRANGERS`].
pub(super) const HANDSHAKE_ALLOWANCE: Duration = Duration::from_secs(5);
/// Incoming connections in handshake beyond the ranks still expected: past this, the oldest
/// one still reading is dropped. A genuine peer's hello arrives within a round trip, so only a
/// flood of more than this many connections inside one round trip could push one out.
pub(super) const MAX_STRANGERS: usize = 64;
/// Connections accepted per round at most, so that a flood cannot keep the loop in `accept`.
const ACCEPTS_PER_ROUND: usize = 256;
/// Dropped connections logged one by one; past this only their number is logged, at the end.
const WARNS: usize = 16;

/// Who a mesh connects: this rank, every rank's published address, the communicator (its id is
/// in every hello), the connections per peer and the job's token.
#[derive(Debug, Clone, Copy)]
pub struct MeshSpec<'a> {
    /// This rank.
    pub rank: usize,
    /// Every rank's listening address (`addrs[rank]` is this rank's own).
    pub addrs: &'a [SocketAddr],
    /// The communicator's id.
    pub comm_id: u64,
    /// `lanes[p]` connections go to rank `p` (1 or more, below [`super::handshake::MAX_LANES`];
    /// rank `p` must pass the same number for this rank).
    pub lanes: &'a [usize],
    /// The job's token: handshakes carry and check MACs with it.
    pub auth: Option<&'a AuthToken>,
}

/// Connects this rank to every other rank of `spec`: connects to lower ranks, accepts higher
/// ones, and checks the handshake both ways. Returns one transport per rank (`None` at
/// `spec.rank`).
///
/// One poll loop drives every connection at once on non-blocking sockets (see
/// [`super::handshaking`]). An incoming connection that closes, stays silent past its own deadline,
/// sends anything but a valid hello (and MAC, with a token), or claims a rank that is not
/// expected or already connected is dropped with a WARN naming its address and the reason, and
/// set-up goes on. A failure on a connection this rank made to a published address is that
/// peer's failure, and so an error, as is the deadline passing with ranks missing.
///
/// `accepted` are connections already accepted on the listener and not read (a shrink: the
/// control plane parked them while this rank was not yet shrinking); they start as any other
/// incoming connection, as strangers until their hello checks out.
pub fn connect_mesh(
    spec: &MeshSpec<'_>,
    endpoint: &Endpoint,
    accepted: Vec<(TcpStream, SocketAddr)>,
    opts: &SocketOptions,
    deadline: Instant,
) -> Result<Vec<Option<Box<dyn Transport>>>> {
    let &MeshSpec { rank, addrs, comm_id, lanes, auth } = spec;
    let size = addrs.len();
    if lanes.len() != size || lanes.iter().any(|&l| l == 0 || l > super::handshake::MAX_LANES) {
        return Err(Error::Internal(format!("bad lanes per peer {lanes:?}").into()));
    }
    let ctx = Ctx { rank, size, comm_id, auth, lanes };
    let mut mesh = MeshLoop::new(ctx, addrs, &endpoint.listener, deadline)?;
    for (s, from) in accepted {
        mesh.adopt(s, from);
    }
    let streams = mesh.run()?;
    let mut out: Vec<Option<Box<dyn Transport>>> = Vec::with_capacity(size);
    // Encrypted links shake hands one peer after another in rank order on both ends: the
    // lowest unfinished pair is always next on both of its ranks, so this cannot deadlock.
    for (peer, lanes) in streams.into_iter().enumerate() {
        let end = LinkEnd { me: rank, peer, dialer: peer < rank, deadline, abort: None };
        out.push(transport_of(lanes, opts, end)?);
    }
    Ok(out)
}

/// Which end of a link this rank holds, for securing it (`TOROID_ENCRYPT`).
pub(super) struct LinkEnd<'a> {
    pub me: usize,
    pub peer: usize,
    /// This rank opened the connections (the TLS client).
    pub dialer: bool,
    pub deadline: Instant,
    pub abort: Option<&'a crate::transport::AbortSignal>,
}

/// The transport over the checked connections of one peer, in lane order: none, one
/// [`TcpTransport`], or a [`StripedTransport`] over several; with progress threads
/// (`TOROID_NTHREADS`), their [`Offloaded`](super::progress::Offloaded) side of the lanes;
/// with encryption, [`secure::Sealed`](super::secure::Sealed) over that.
pub(super) fn transport_of(
    lanes: Vec<TcpStream>,
    opts: &SocketOptions,
    end: LinkEnd<'_>,
) -> Result<Option<Box<dyn Transport>>> {
    let plain = plain_transport_of(lanes, opts)?;
    match (plain, &opts.secure) {
        (Some(t), Some(sec)) => Ok(Some(super::secure::secure_link(
            t,
            end.me,
            end.peer,
            end.dialer,
            sec,
            end.deadline,
            end.abort,
        )?)),
        (t, _) => Ok(t),
    }
}

fn plain_transport_of(mut lanes: Vec<TcpStream>, opts: &SocketOptions) -> Result<Option<Box<dyn Transport>>> {
    if let Some(threads) = opts.progress.as_ref().filter(|_| !lanes.is_empty()) {
        let lanes = lanes.into_iter().map(|s| super::configure(s, opts)).collect::<Result<Vec<_>>>()?;
        return Ok(Some(Box::new(threads.attach(lanes)?)));
    }
    Ok(match lanes.len() {
        0 => None,
        1 => lanes
            .pop()
            .map(|s| TcpTransport::new(s, opts))
            .transpose()?
            .map(|t| Box::new(t) as Box<dyn Transport>),
        _ => Some(Box::new(StripedTransport::new(lanes, opts)?) as Box<dyn Transport>),
    })
}

/// Who one entry of the poll set belongs to.
#[derive(Clone, Copy)]
enum Who {
    Listener,
    Out(usize),
    In(usize),
}

/// The state of one rank's set-up.
struct MeshLoop<'a> {
    ctx: Ctx<'a>,
    listener: &'a TcpListener,
    deadline: Instant,
    outgoing: Vec<Outgoing>,
    incoming: Vec<Incoming>,
    /// `claimed[r]`: the lanes (bit `l` for lane `l`) that incoming connections have proved
    /// to be rank `r`'s.
    claimed: Vec<u16>,
    dropped: usize,
    /// [`HANDSHAKE_ALLOWANCE`] (shorter in tests).
    allowance: Duration,
}

impl<'a> MeshLoop<'a> {
    fn new(ctx: Ctx<'a>, addrs: &[SocketAddr], listener: &'a TcpListener, deadline: Instant) -> Result<Self> {
        let outgoing = addrs
            .iter()
            .enumerate()
            .take(ctx.rank)
            .flat_map(|(p, a)| (0..ctx.lanes[p]).map(move |l| (p, l, *a)))
            .map(|(p, l, a)| Outgoing::new(ctx, p, l, a))
            .collect::<Result<_>>()?;
        let claimed = vec![0; ctx.size];
        let allowance = HANDSHAKE_ALLOWANCE;
        Ok(MeshLoop {
            ctx,
            listener,
            deadline,
            outgoing,
            incoming: Vec::new(),
            claimed,
            dropped: 0,
            allowance,
        })
    }

    /// Connections from ranks above this one that no connection has proved to be yet.
    fn unclaimed(&self) -> usize {
        (self.ctx.rank + 1..self.ctx.size)
            .map(|r| self.ctx.lanes[r] - self.claimed[r].count_ones() as usize)
            .sum()
    }

    fn finished(&self) -> bool {
        self.outgoing.iter().all(Outgoing::is_done)
            && self.unclaimed() == 0
            && self.incoming.iter().all(|c| c.claimed().is_none() || c.interest().is_none())
    }

    /// Runs until every link is checked both ways; returns them by rank.
    fn run(mut self) -> Result<Vec<Vec<TcpStream>>> {
        let mut fds: Vec<PollFd> = Vec::new();
        let mut who: Vec<Who> = Vec::new();
        loop {
            let now = Instant::now();
            for o in &mut self.outgoing {
                o.advance(self.ctx, now)?;
            }
            self.expire(now);
            if self.finished() {
                return Ok(self.links());
            }
            if now >= self.deadline {
                return Err(self.timeout());
            }
            crate::cancel::check("connecting to the other ranks")?;
            fds.clear();
            who.clear();
            if self.unclaimed() > 0 {
                fds.push(PollFd::new(self.listener.as_raw_fd(), PollFd::IN));
                who.push(Who::Listener);
            }
            for (i, o) in self.outgoing.iter().enumerate() {
                if let Some((fd, ev)) = o.interest() {
                    fds.push(PollFd::new(fd, ev));
                    who.push(Who::Out(i));
                }
            }
            for (i, c) in self.incoming.iter().enumerate() {
                if let Some((fd, ev)) = c.interest() {
                    fds.push(PollFd::new(fd, ev | PollFd::RDHUP));
                    who.push(Who::In(i));
                }
            }
            let wake = self
                .outgoing
                .iter()
                .filter_map(Outgoing::wake_at)
                .chain(self.incoming.iter().filter(|c| c.claimed().is_none()).map(|c| c.deadline))
                .fold(self.deadline, Instant::min);
            let max = if crate::cancel::active() { crate::cancel::SLICE } else { Duration::from_secs(1) };
            let ms = wake.saturating_duration_since(now).min(max).as_millis().max(1) as i32;
            poll(&mut fds, ms).map_err(|e| Error::system("poll during set-up", e))?;
            let now = Instant::now();
            let mut failed: Vec<(usize, String)> = Vec::new();
            for (f, w) in fds.iter().zip(&who) {
                if f.revents() == 0 {
                    continue;
                }
                match *w {
                    Who::Listener => self.accept_all()?,
                    Who::Out(i) => self.outgoing[i].advance(self.ctx, now)?,
                    Who::In(i) => {
                        if let Err(why) = self.incoming[i].advance(self.ctx, &mut self.claimed) {
                            failed.push((i, why));
                        }
                    }
                }
            }
            // Highest index first, so that the indices still to remove stay valid (accepts
            // only append).
            failed.sort_by_key(|f| std::cmp::Reverse(f.0));
            for (i, why) in failed {
                self.drop_incoming(i, &why);
            }
            self.make_room();
        }
    }

    /// Takes on a connection accepted on the listener: a stranger until its hello checks out.
    fn adopt(&mut self, s: TcpStream, from: SocketAddr) {
        if let Err(e) = s.set_nonblocking(true) {
            self.warn(from, &format!("O_NONBLOCK failed: {e}"));
            return;
        }
        // Its own accept instant, so that when too many are open the strangers queued first
        // go first; and a first read at once, since a genuine peer's hello is usually there
        // already.
        let at = Instant::now();
        let mut c = Incoming::new(s, from, at, (at + self.allowance).min(self.deadline));
        match c.advance(self.ctx, &mut self.claimed) {
            Ok(()) => self.incoming.push(c),
            Err(why) => {
                if let Some((r, l)) = c.claimed() {
                    self.claimed[r] &= !(1 << l);
                }
                self.warn(from, &why);
            }
        }
    }

    /// Accepts every connection pending on the listener (up to [`ACCEPTS_PER_ROUND`]), so
    /// strangers never fill the backlog in front of a genuine peer.
    fn accept_all(&mut self) -> Result<()> {
        for _ in 0..ACCEPTS_PER_ROUND {
            match self.listener.accept() {
                Ok((s, from)) => self.adopt(s, from),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                // The connection was reset before we took it, or descriptors ran out for a
                // moment (a flood): nothing to hand on, the loop polls again.
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted)
                        || crate::sys::errno::is_out_of_descriptors(&e) =>
                {
                    return Ok(());
                }
                Err(e) => return Err(Error::system("accept during set-up", e)),
            }
        }
        Ok(())
    }

    /// Drops the oldest connection still reading its hello when more are open than the ranks
    /// still expected plus [`MAX_STRANGERS`].
    fn make_room(&mut self) {
        let reading = |c: &Incoming| c.claimed().is_none();
        while self.incoming.iter().filter(|c| reading(c)).count() > self.unclaimed() + MAX_STRANGERS {
            let Some(i) = self
                .incoming
                .iter()
                .enumerate()
                .filter(|(_, c)| reading(c))
                .min_by_key(|(_, c)| c.accepted)
                .map(|(i, _)| i)
            else {
                return;
            };
            self.drop_incoming(i, "too many connections in handshake at once (the oldest goes)");
        }
    }

    /// Drops every incoming connection still reading its hello past its own deadline.
    fn expire(&mut self, now: Instant) {
        let mut i = self.incoming.len();
        while i > 0 {
            i -= 1;
            let c = &self.incoming[i];
            if c.claimed().is_none() && now >= c.deadline {
                self.drop_incoming(i, "no complete hello before its handshake deadline");
            }
        }
    }

    /// Drops incoming connection `i`, releasing the rank it held, with a WARN.
    fn drop_incoming(&mut self, i: usize, why: &str) {
        let c = self.incoming.swap_remove(i);
        if let Some((r, l)) = c.claimed() {
            self.claimed[r] &= !(1 << l);
        }
        self.warn(c.from_addr, why);
    }

    fn warn(&mut self, from: SocketAddr, why: &str) {
        self.dropped += 1;
        if self.dropped <= WARNS {
            tracing::warn!(target: "toroid::net", "rank {}: dropped connection from {from} during set-up: {why}", self.ctx.rank);
        }
    }

    /// The error at the set-up deadline: which ranks are missing and why.
    fn timeout(&self) -> Error {
        let rank = self.ctx.rank;
        let mut parts: Vec<String> =
            self.outgoing.iter().filter(|o| !o.is_done()).map(|o| o.describe_unfinished(rank)).collect();
        let missing: Vec<usize> = (rank + 1..self.ctx.size)
            .filter(|&r| (self.claimed[r].count_ones() as usize) < self.ctx.lanes[r])
            .collect();
        if !missing.is_empty() {
            parts.push(format!("rank {rank}: ranks {missing:?} never connected before the deadline"));
        }
        if parts.is_empty() {
            parts.push(format!("rank {rank}: acks to higher ranks not sent before the deadline"));
        }
        Error::Timeout(parts.join("; ").into())
    }

    /// The checked connections by rank, in lane order (none for this rank); what is left
    /// unfinished is closed.
    fn links(self) -> Vec<Vec<TcpStream>> {
        let rank = self.ctx.rank;
        let mut streams: Vec<Vec<Option<TcpStream>>> =
            (0..self.ctx.size).map(|r| (0..self.ctx.lanes[r]).map(|_| None).collect()).collect();
        let mut left = 0;
        for c in self.incoming {
            let from = c.from_addr;
            match c.into_link() {
                Some((r, l, s)) => streams[r][l] = Some(s),
                None => {
                    left += 1;
                    if self.dropped + left <= WARNS {
                        tracing::warn!(target: "toroid::net",
                            "rank {rank}: dropped connection from {from} during set-up: set-up ended before its handshake");
                    }
                }
            }
        }
        if self.dropped + left > WARNS {
            tracing::warn!(target: "toroid::net", "rank {rank}: {} connections dropped during set-up in all", self.dropped + left);
        }
        for o in self.outgoing {
            let (p, l) = (o.peer, o.lane);
            streams[p][l] = o.into_stream();
        }
        // `finished` holds: every lane of every other rank is there.
        streams
            .into_iter()
            .enumerate()
            .map(|(r, lanes)| if r == rank { Vec::new() } else { lanes.into_iter().flatten().collect() })
            .collect()
    }
}

#[cfg(test)]
mod tests;
