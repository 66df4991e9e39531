//! The store's server: one thread runs an `epoll(7)` loop over non-blocking sockets.
//!
//! A new connection must complete its hello (with a token, the challenge-response of `auth`)
//! within [`HANDSHAKE_DEADLINE`] or it is closed; until then its frames are capped at a few
//! dozen bytes (with encryption, the TLS handshake before them to 16 KiB), so a stranger that
//! connects and stays silent, drips bytes or floods connections costs a few hundred bytes (a
//! few KiB) per connection and delays no one: every connection is served by
//! the same loop from its own buffers, and none is ever read or written with blocking calls.
//!
//! A GET or WAIT whose keys are missing parks its connection (later requests on it stay
//! buffered) until a SET or ADD supplies them or its deadline passes, so clients never poll.
//!
//! A round of the loop costs what happened in it, not the number of connections: the epoll
//! set reports the connections with input or room for output, a SET or ADD wakes only the
//! connections parked on its key (each parked one is listed under the first key it lacks),
//! and deadlines wait in a heap. Rank 0 of a job of `N` ranks serves `O(N)` requests, so its
//! store costs `O(N)` in all rather than `O(N^2)` (a `poll(2)` over every connection per
//! request, which is what an earlier version did).
//! Input is read only while a connection holds less than one frame's worth and its unsent
//! output is under [`MAX_OUTPUT`](super::protocol::MAX_OUTPUT) (backpressure: a peer that sends
//! requests without reading the answers gets one answer queued, then nothing is read from it).
//! Dropping the [`ServerHandle`] closes one end of a socket pair the loop watches; the thread
//! then drops every connection and is joined, and clients blocked on it see the connection
//! close.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::auth::Nonce;
use super::protocol::HANDSHAKE_DEADLINE;
use super::requests::{Pending, Table};
use crate::config::AuthToken;
use crate::error::{Error, Result};
use crate::sys::epoll::{self, EpollSet, Interest, ReadyList};

mod conn;
mod conn_io;

use conn_io::ConnIo;

/// Starts the server thread on `listener` (bound to `bound`); it serves until the handle drops.
/// With `auth`, every connection must prove it holds that token before any request. At most
/// `max_connections` are served at once ([`MAX_CONNECTIONS`](super::MAX_CONNECTIONS); tests use fewer).
/// With `encrypt` (which needs `auth`), every connection continues in TLS after its plaintext
/// hello, under a key pair made here.
pub(super) fn start(
    listener: TcpListener,
    bound: SocketAddr,
    auth: Option<AuthToken>,
    encrypt: bool,
    max_connections: usize,
) -> Result<ServerHandle> {
    let tls = match (encrypt, &auth) {
        (false, _) => None,
        (true, Some(_)) => Some(crate::tls::bound_server(&crate::tls::Identity::generate()?)?),
        (true, None) => {
            return Err(Error::InvalidArgument(
                "an encrypted store needs a token (TOROID_AUTH_TOKEN)".into(),
            ));
        }
    };
    listener.set_nonblocking(true).map_err(|e| Error::system("store: set_nonblocking", e))?;
    let (wake_tx, wake_rx) = UnixStream::pair().map_err(|e| Error::system("store: socketpair", e))?;
    let ctx = Ctx { table: Table::default(), auth, tls, log: Throttle::default() };
    let epoll = EpollSet::new().map_err(|e| Error::system("store: epoll_create", e))?;
    epoll.add(wake_rx.as_raw_fd(), epoll::IN).map_err(|e| Error::system("store: epoll_ctl", e))?;
    epoll.add(listener.as_raw_fd(), epoll::IN).map_err(|e| Error::system("store: epoll_ctl", e))?;
    let server = Server {
        listener,
        wake: wake_rx,
        conns: HashMap::new(),
        epoll,
        accepting: true,
        waiters: HashMap::new(),
        deadlines: BinaryHeap::new(),
        ctx,
        max_connections,
    };
    let thread = std::thread::Builder::new()
        .name("toroid-store".into())
        .spawn(move || server.run())
        .map_err(|e| Error::system("store: spawn server thread", e))?;
    tracing::info!(target: "toroid::store", "store server listening on {bound}");
    Ok(ServerHandle { addr: bound, wake: Some(wake_tx), thread: Some(thread) })
}

/// The running server: dropping it stops the thread.
pub(super) struct ServerHandle {
    /// Where it listens.
    pub(super) addr: SocketAddr,
    /// Dropping this end of the socket pair tells the server thread to stop.
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        drop(self.wake.take());
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!(target: "toroid::store", "store server thread panicked");
        }
        tracing::info!(target: "toroid::store", "store server on {} stopped", self.addr);
    }
}

/// At most this many warnings a second; the rest are counted (a flood of strangers must not
/// turn into a flood of log lines, nor block the loop on a full stderr pipe).
const WARNINGS_PER_SECOND: u32 = 20;

/// Rate limit of the server's warnings.
struct Throttle {
    since: Instant,
    shown: u32,
    dropped: u64,
}

impl Default for Throttle {
    fn default() -> Throttle {
        Throttle { since: Instant::now(), shown: 0, dropped: 0 }
    }
}

impl Throttle {
    fn warn(&mut self, peer: SocketAddr, msg: &str) {
        let now = Instant::now();
        if now.saturating_duration_since(self.since) >= Duration::from_secs(1) {
            if self.dropped > 0 {
                tracing::warn!(target: "toroid::store", "store: {} more warnings about clients suppressed", self.dropped);
            }
            *self = Throttle { since: now, shown: 0, dropped: 0 };
        }
        if self.shown < WARNINGS_PER_SECOND {
            self.shown += 1;
            tracing::warn!(target: "toroid::store", "store client {peer}: {msg}");
        } else {
            self.dropped += 1;
        }
    }
}

/// What every connection's handling shares.
struct Ctx {
    table: Table,
    auth: Option<AuthToken>,
    /// The TLS configuration when the store encrypts.
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    log: Throttle,
}

struct Server {
    listener: TcpListener,
    wake: UnixStream,
    /// The connections, by descriptor (what the epoll set reports).
    conns: HashMap<RawFd, Conn>,
    epoll: EpollSet,
    /// Whether the listener is armed: off while `max_connections` are open, so that new
    /// connections wait in the backlog.
    accepting: bool,
    /// Parked connections by the first key they lack (a connection is under one key at most:
    /// [`Conn::parked_on`]).
    waiters: HashMap<Vec<u8>, HashSet<RawFd>>,
    /// Handshake, closing and parked-request deadlines: (when, connection). An entry comes due
    /// once; one whose connection has gone or moved its deadline only costs a look.
    deadlines: BinaryHeap<Reverse<(Instant, RawFd)>>,
    ctx: Ctx,
    max_connections: usize,
}

enum State {
    /// Waiting for the hello.
    New,
    /// Waiting for the client's proof: its hello (with its nonce) and the nonce we sent.
    Proving {
        hello: Vec<u8>,
        nonce: Nonce,
    },
    Open,
    /// Flush what is queued, then shut down writing and discard input until the peer closes
    /// (closing with unread input would send a reset that can destroy our last answer).
    Closing,
    Dead,
}

struct Conn {
    io: ConnIo,
    peer: SocketAddr,
    state: State,
    /// Input; bytes before `rpos` are consumed.
    rbuf: Vec<u8>,
    rpos: usize,
    /// Output; bytes before `wpos` are sent.
    wbuf: Vec<u8>,
    wpos: usize,
    pending: Option<Pending>,
    /// Until the hello (and proof) are done, and for a closing connection to go away.
    deadline: Option<Instant>,
    eof: bool,
    write_shut: bool,
    /// What the epoll set watches it for.
    interest: Interest,
    /// The key it is listed under in [`Server::waiters`].
    parked_on: Option<Vec<u8>>,
    /// Its earliest deadline in [`Server::deadlines`].
    scheduled: Option<Instant>,
}

/// Buffers that grew past this are freed once empty, so an idle connection costs little.
const KEEP_CAPACITY: usize = 64 << 10;

impl Server {
    fn run(mut self) {
        if let Err(e) = self.serve() {
            tracing::error!(target: "toroid::store", "store server failed: {e}; closing all connections");
        }
    }

    fn serve(&mut self) -> io::Result<()> {
        let mut ready = ReadyList::with_capacity(256);
        // Connections to look at this round; those with requests read but not yet answered
        // (their output was over the cap) carry over to the next round without waiting.
        let mut touched: Vec<RawFd> = Vec::new();
        let mut again: Vec<RawFd> = Vec::new();
        loop {
            let now = Instant::now();
            let timeout_ms = if again.is_empty() {
                self.deadlines.peek().map_or(-1, |Reverse((d, _))| {
                    // Rounded up, so that we wake after the deadline rather than just before.
                    let ms = d.saturating_duration_since(now).as_nanos().div_ceil(1_000_000);
                    i32::try_from(ms).unwrap_or(i32::MAX)
                })
            } else {
                0
            };
            self.epoll.wait(&mut ready, timeout_ms)?;
            touched.clear();
            touched.append(&mut again);
            for fd in &touched {
                // Input that TLS decrypted earlier and still holds: the socket shows nothing.
                if let Some(c) = self.conns.get_mut(fd)
                    && c.io.has_buffered_input()
                    && c.wants_input()
                {
                    c.fill();
                }
            }
            let mut accept = false;
            for (fd, _) in ready.iter() {
                if fd == self.wake.as_raw_fd() {
                    return Ok(()); // the owner dropped its end
                } else if fd == self.listener.as_raw_fd() {
                    accept = true;
                } else if let Some(c) = self.conns.get_mut(&fd) {
                    c.fill();
                    touched.push(fd);
                }
            }
            if accept {
                self.accept(&mut touched)?;
            }
            let now = Instant::now();
            while let Some(&Reverse((d, fd))) = self.deadlines.peek() {
                if d > now {
                    break;
                }
                self.deadlines.pop();
                if let Some(c) = self.conns.get_mut(&fd)
                    && c.scheduled == Some(d)
                {
                    c.scheduled = None;
                }
                touched.push(fd);
            }
            // A SET on one connection can complete a GET parked on another, whose buffered
            // requests may set more: the woken join the list as it is walked.
            let mut i = 0;
            while i < touched.len() {
                let fd = touched[i];
                i += 1;
                if let Some(c) = self.conns.get_mut(&fd) {
                    c.drive(&mut self.ctx, now);
                    // Listed at once, so that a SET later in this round wakes it.
                    self.list_parked(fd);
                    for key in self.ctx.table.take_changed() {
                        if let Some(parked) = self.waiters.get(&key) {
                            touched.extend(parked.iter().copied());
                        }
                    }
                }
            }
            touched.sort_unstable();
            touched.dedup();
            for &fd in &touched {
                self.settle(fd, now, &mut again)?;
            }
            self.arm_listener()?;
            if self.deadlines.len() > 4 * self.conns.len() + 1024 {
                // Entries left by deadlines that moved: rebuild from the live ones.
                self.deadlines =
                    self.conns.iter().filter_map(|(&fd, c)| c.scheduled.map(|d| Reverse((d, fd)))).collect();
            }
        }
    }

    /// After a round: sends what the connection's socket takes, drops it if it died or its
    /// deadline passed, and updates what it is listed under (waiters, deadlines, epoll).
    fn settle(&mut self, fd: RawFd, now: Instant, again: &mut Vec<RawFd>) -> io::Result<()> {
        let Some(c) = self.conns.get_mut(&fd) else { return Ok(()) };
        c.flush();
        c.expire(&mut self.ctx.log, now);
        if c.eof && !matches!(c.state, State::Dead) {
            match c.state {
                State::New | State::Proving { .. } => {
                    self.ctx.log.warn(c.peer, "closed the connection before completing the hello")
                }
                _ => tracing::debug!(target: "toroid::store", "store client {} disconnected", c.peer),
            }
            c.state = State::Dead;
        }
        if matches!(c.state, State::Dead) {
            self.list_parked(fd);
            // Dropping the stream closes it, which also takes it out of the epoll set.
            self.conns.remove(&fd);
            return Ok(());
        }
        self.list_parked(fd);
        let Some(c) = self.conns.get_mut(&fd) else { return Ok(()) };
        let next = [c.pending.as_ref().map(|p| p.deadline), c.deadline].into_iter().flatten().min();
        if next.is_some() && next != c.scheduled {
            if let Some(d) = next {
                self.deadlines.push(Reverse((d, fd)));
            }
            c.scheduled = next;
        }
        let unsent = c.wpos < c.wbuf.len() || c.io.wants_write();
        let interest = if c.wants_input() { epoll::IN } else { 0 } | if unsent { epoll::OUT } else { 0 };
        if interest != c.interest {
            self.epoll.modify(fd, interest)?;
            c.interest = interest;
        }
        if c.has_work() || (c.wants_input() && c.io.has_buffered_input()) {
            again.push(fd);
        }
        Ok(())
    }

    /// Lists connection `fd` in [`Server::waiters`] under the first key its parked request
    /// lacks, or nowhere (nothing parked, or it died).
    fn list_parked(&mut self, fd: RawFd) {
        let Some(c) = self.conns.get_mut(&fd) else { return };
        let want = match (&c.pending, &c.state) {
            (_, State::Dead) | (None, _) => None,
            (Some(p), _) => p.first_missing(&self.ctx.table).map(<[u8]>::to_vec),
        };
        if want == c.parked_on {
            return;
        }
        if let Some(old) = c.parked_on.take()
            && let Some(set) = self.waiters.get_mut(&old)
        {
            set.remove(&fd);
            if set.is_empty() {
                self.waiters.remove(&old);
            }
        }
        if let Some(key) = &want {
            self.waiters.entry(key.clone()).or_default().insert(fd);
        }
        c.parked_on = want;
    }

    /// Arms the listener while there is room for a connection, disarms it at the cap (new
    /// connections then wait in the backlog until a slot frees; a stranger's slot frees at its
    /// handshake deadline at the latest).
    fn arm_listener(&mut self) -> io::Result<()> {
        let accepting = self.conns.len() < self.max_connections;
        if accepting != self.accepting {
            self.epoll.modify(self.listener.as_raw_fd(), if accepting { epoll::IN } else { 0 })?;
            self.accepting = accepting;
        }
        Ok(())
    }

    fn accept(&mut self, touched: &mut Vec<RawFd>) -> io::Result<()> {
        while self.conns.len() < self.max_connections {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!(target: "toroid::store", "store: dropping client {peer}: {e}");
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let fd = stream.as_raw_fd();
                    self.epoll.add(fd, epoll::IN)?;
                    tracing::debug!(target: "toroid::store", "store client {peer} connected");
                    self.conns.insert(
                        fd,
                        Conn {
                            io: ConnIo::plain(stream),
                            peer,
                            state: State::New,
                            rbuf: Vec::new(),
                            rpos: 0,
                            wbuf: Vec::new(),
                            wpos: 0,
                            pending: None,
                            deadline: Some(Instant::now() + HANDSHAKE_DEADLINE),
                            eof: false,
                            write_shut: false,
                            interest: epoll::IN,
                            parked_on: None,
                            scheduled: None,
                        },
                    );
                    // Settled this round: its handshake deadline goes in the heap.
                    touched.push(fd);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning on epoll.
                    tracing::warn!(target: "toroid::store", "store: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    return Ok(());
                }
            }
        }
        tracing::warn!(target: "toroid::store",
            "store: {} connections open; new ones wait until one closes", self.max_connections);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
