//! The store's server: one thread runs an `epoll(7)` loop over non-blocking sockets.
//!
//! A new connection must complete its hello (with a token, the challenge-response of `auth`)
//! within [`HANDSHAKE_DEADLINE`] or it is closed; until then its frames are capped at a few
//! dozen bytes, so a stranger that connects and stays silent, drips bytes or floods connections
//! costs a few hundred bytes per connection and delays no one: every connection is served by
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
//! output is under [`MAX_OUTPUT`] (backpressure: a peer that sends requests without reading the
//! answers gets one answer queued, then nothing is read from it). Dropping the [`ServerHandle`]
//! closes one end of a socket pair the loop watches; the thread then drops every connection and
//! is joined, and clients blocked on it see the connection close.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::auth::{self, Nonce};
use super::protocol::{
    FLAG_AUTH, HANDSHAKE_DEADLINE, Hello, MAX_FRAME, MAX_HELLO_FRAME, MAX_INPUT, MAX_OUTPUT, ST_BAD_REQUEST,
    ST_OK, VERSION, answer, parse_hello,
};
use super::requests::{Handled, Pending, Table, handle};
use crate::config::AuthToken;
use crate::error::{Error, Result};
use crate::sys::epoll::{self, EpollSet, Interest, ReadyList};

/// Starts the server thread on `listener` (bound to `bound`); it serves until the handle drops.
/// With `auth`, every connection must prove it holds that token before any request. At most
/// `max_connections` are served at once ([`MAX_CONNECTIONS`](super::MAX_CONNECTIONS); tests use fewer).
pub(super) fn start(
    listener: TcpListener,
    bound: SocketAddr,
    auth: Option<AuthToken>,
    max_connections: usize,
) -> Result<ServerHandle> {
    listener.set_nonblocking(true).map_err(|e| Error::system("store: set_nonblocking", e))?;
    let (wake_tx, wake_rx) = UnixStream::pair().map_err(|e| Error::system("store: socketpair", e))?;
    let ctx = Ctx { table: Table::default(), auth, log: Throttle::default() };
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
    stream: TcpStream,
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
        let interest =
            if c.wants_input() { epoll::IN } else { 0 } | if c.wpos < c.wbuf.len() { epoll::OUT } else { 0 };
        if interest != c.interest {
            self.epoll.modify(fd, interest)?;
            c.interest = interest;
        }
        if c.has_work() {
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
                            stream,
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

impl Conn {
    /// Largest frame accepted in the current state.
    fn frame_cap(&self) -> usize {
        match self.state {
            State::New | State::Proving { .. } => MAX_HELLO_FRAME,
            _ => MAX_FRAME,
        }
    }

    /// Whether a complete frame waits that `drive` would take now.
    fn has_work(&self) -> bool {
        let active = matches!(self.state, State::New | State::Proving { .. } | State::Open);
        let avail = &self.rbuf[self.rpos..];
        active
            && self.pending.is_none()
            && self.wbuf.len() - self.wpos <= MAX_OUTPUT
            && avail.first_chunk::<4>().is_some_and(|h| {
                let len = u32::from_le_bytes(*h) as usize;
                len > self.frame_cap() || avail.len() >= 4 + len
            })
    }

    /// Whether to read: always when closing (to discard), otherwise while the connection holds
    /// less than a frame and its unsent output is under the cap.
    fn wants_input(&self) -> bool {
        match self.state {
            State::Closing => !self.eof,
            State::Dead => false,
            _ => {
                !self.eof
                    && self.rbuf.len() - self.rpos < self.input_cap()
                    && self.wbuf.len() - self.wpos <= MAX_OUTPUT
            }
        }
    }

    fn input_cap(&self) -> usize {
        match self.state {
            State::New | State::Proving { .. } => MAX_HELLO_FRAME + 4,
            _ => MAX_INPUT,
        }
    }

    /// Reads what is available, up to the input cap.
    fn fill(&mut self) {
        let mut chunk = [0u8; 64 * 1024];
        if self.rpos > 0 {
            self.rbuf.drain(..self.rpos);
            self.rpos = 0;
        }
        loop {
            let room = match self.state {
                State::Closing => chunk.len(),
                State::Dead => return,
                _ => self.input_cap().saturating_sub(self.rbuf.len()).min(chunk.len()),
            };
            if room == 0 {
                return;
            }
            match self.stream.read(&mut chunk[..room]) {
                Ok(0) => {
                    self.eof = true;
                    return;
                }
                // Input after a rejected request is read only to be dropped.
                Ok(_) if matches!(self.state, State::Closing) => {}
                Ok(n) => self.rbuf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(target: "toroid::store", "store client {}: {e}", self.peer);
                    self.state = State::Dead;
                    return;
                }
            }
        }
    }

    fn send(&mut self, payload: &[u8]) {
        // Answers are bounded by MAX_FRAME: a value is at most MAX_VALUE.
        self.wbuf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        self.wbuf.extend_from_slice(payload);
    }

    /// Answers with an error, logs a warning naming the peer, then closes.
    fn reject(&mut self, log: &mut Throttle, msg: &str) {
        log.warn(self.peer, &format!("{msg}; closing"));
        self.send(&answer(ST_BAD_REQUEST, msg.as_bytes()));
        self.rbuf = Vec::new();
        self.rpos = 0;
        self.pending = None;
        self.state = State::Closing;
        self.deadline = Some(Instant::now() + HANDSHAKE_DEADLINE);
    }

    /// Answers every complete request it can; returns whether the table changed.
    fn drive(&mut self, ctx: &mut Ctx, now: Instant) -> bool {
        let mut mutated = false;
        while matches!(self.state, State::New | State::Proving { .. } | State::Open)
            && self.wbuf.len() - self.wpos <= MAX_OUTPUT
        {
            if let Some(p) = &self.pending {
                match p.answer(&ctx.table, now) {
                    Some(a) => {
                        self.pending = None;
                        self.send(&a);
                        continue;
                    }
                    None => break,
                }
            }
            let avail = &self.rbuf[self.rpos..];
            let Some(head) = avail.first_chunk::<4>() else {
                break;
            };
            let len = u32::from_le_bytes(*head) as usize;
            let cap = self.frame_cap();
            if len > cap {
                self.reject(&mut ctx.log, &format!("frame of {len} bytes exceeds the limit of {cap} bytes"));
                break;
            }
            if avail.len() < 4 + len {
                break;
            }
            let frame = avail[4..4 + len].to_vec();
            self.rpos += 4 + len;
            match &self.state {
                State::New => self.hello(ctx, &frame),
                State::Proving { hello, nonce } => {
                    let ok = ctx.auth.as_ref().is_some_and(|t| auth::client_tag_ok(t, hello, nonce, &frame));
                    if ok {
                        tracing::debug!(target: "toroid::store", "store client {} authenticated", self.peer);
                        self.open();
                    } else {
                        self.reject(&mut ctx.log, "authentication failed (a different TOROID_AUTH_TOKEN?)");
                    }
                }
                _ => match handle(&frame, &mut ctx.table, now) {
                    Ok(Handled::Answer(a, m)) => {
                        mutated |= m;
                        self.send(&a);
                    }
                    Ok(Handled::Park(p)) => self.pending = Some(p),
                    Ok(Handled::Refused(a, why)) => {
                        ctx.log.warn(self.peer, &why);
                        self.send(&a);
                    }
                    Err(msg) => self.send(&answer(ST_BAD_REQUEST, msg.as_bytes())),
                },
            }
        }
        if self.rpos == self.rbuf.len() {
            self.rpos = 0;
            if self.rbuf.capacity() > KEEP_CAPACITY {
                self.rbuf = Vec::new();
            } else {
                self.rbuf.clear();
            }
        }
        mutated
    }

    /// Handles the first frame: the hello, and with a token the server's challenge and proof.
    fn hello(&mut self, ctx: &mut Ctx, frame: &[u8]) {
        match (parse_hello(frame), &ctx.auth) {
            (Hello::Foreign, _) => {
                self.reject(&mut ctx.log, &format!("bad hello: not a toroid store client of protocol version {VERSION}"))
            }
            (Hello::Plain, None) => {
                self.open();
            }
            (Hello::Plain, Some(_)) => self.reject(
                &mut ctx.log,
                "the store requires authentication: TOROID_AUTH_TOKEN is set on the store's server, not on this client",
            ),
            (Hello::Auth(_), None) => self.reject(
                &mut ctx.log,
                "this client authenticates but the store's server has no TOROID_AUTH_TOKEN set",
            ),
            (Hello::Auth(_), Some(t)) => match auth::nonce() {
                Ok(nonce) => {
                    let tag = auth::server_tag(t, frame, &nonce);
                    let mut a = vec![ST_OK, FLAG_AUTH];
                    a.extend_from_slice(&nonce);
                    a.extend_from_slice(&tag);
                    self.send(&a);
                    self.state = State::Proving { hello: frame.to_vec(), nonce };
                }
                Err(e) => self.reject(&mut ctx.log, &format!("internal error: {e}")),
            },
        }
    }

    /// The hello (and proof) passed: requests may follow.
    fn open(&mut self) {
        self.state = State::Open;
        self.deadline = None;
        self.send(&answer(ST_OK, &[0]));
    }

    /// Drops a connection whose hello or closing took too long.
    fn expire(&mut self, log: &mut Throttle, now: Instant) {
        if self.deadline.is_some_and(|d| now >= d) {
            match self.state {
                State::New | State::Proving { .. } => {
                    log.warn(self.peer, &format!("no complete hello within {HANDSHAKE_DEADLINE:?}; closing"))
                }
                _ => {
                    tracing::debug!(target: "toroid::store", "store client {}: closed after rejection", self.peer)
                }
            }
            self.state = State::Dead;
        }
    }

    /// Writes what the socket takes now.
    fn flush(&mut self) {
        while self.wpos < self.wbuf.len() && !matches!(self.state, State::Dead) {
            match self.stream.write(&self.wbuf[self.wpos..]) {
                Ok(0) => self.state = State::Dead,
                Ok(n) => self.wpos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(target: "toroid::store", "store client {}: {e}", self.peer);
                    self.state = State::Dead;
                }
            }
        }
        if self.wpos == self.wbuf.len() {
            self.wpos = 0;
            if self.wbuf.capacity() > KEEP_CAPACITY {
                self.wbuf = Vec::new();
            } else {
                self.wbuf.clear();
            }
        } else if self.wpos > KEEP_CAPACITY {
            self.wbuf.drain(..self.wpos);
            self.wpos = 0;
        }
        if matches!(self.state, State::Closing) && self.wbuf.is_empty() && !self.write_shut {
            self.write_shut = true;
            let _ = self.stream.shutdown(Shutdown::Write);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::TcpStore;
    use super::super::auth::{NONCE_LEN, TAG_LEN, client_tag};
    use super::super::protocol::{Enc, MAX_KEY, MAX_VALUE, OP_DELETE, OP_GET, OP_SET};
    use super::super::tests::{T, raw_frame, raw_read, server};
    use super::*;
    use crate::rendezvous::Store;

    fn token(s: &[u8]) -> AuthToken {
        AuthToken::new(s)
    }

    fn raw(addr: SocketAddr) -> TcpStream {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s
    }

    /// Reads until the server closes; what it sent on the way.
    fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    }

    #[test]
    fn server_rejects_oversized_frames_and_bad_hellos_and_keeps_serving() {
        let s = server();
        let addr = s.server_addr().unwrap();

        let mut c = raw(addr);
        c.write_all(&Enc::hello(None).finish().unwrap()).unwrap();
        assert_eq!(raw_read(&mut c), [ST_OK, 0]);
        // Claim 1 GiB and send nothing more: the server must answer, not allocate and wait.
        c.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
        let a = raw_read(&mut c);
        assert_eq!(a[0], ST_BAD_REQUEST);
        assert!(String::from_utf8_lossy(&a[1..]).contains("exceeds"));
        assert!(read_to_close(&mut c).is_empty());

        let mut c = raw(addr);
        raw_frame(&mut c, b"HTTP/1.1");
        assert_eq!(raw_read(&mut c)[0], ST_BAD_REQUEST);

        // Before the hello, frames are capped at a few dozen bytes.
        let mut c = raw(addr);
        c.write_all(&(MAX_HELLO_FRAME as u32 + 1).to_le_bytes()).unwrap();
        assert_eq!(raw_read(&mut c)[0], ST_BAD_REQUEST);

        // A malformed request is answered and the connection stays open.
        let mut c = raw(addr);
        c.write_all(&Enc::hello(None).finish().unwrap()).unwrap();
        assert_eq!(raw_read(&mut c), [ST_OK, 0]);
        raw_frame(&mut c, &[OP_SET, 9, 0, 0]);
        assert_eq!(raw_read(&mut c)[0], ST_BAD_REQUEST);
        raw_frame(&mut c, &[OP_DELETE, 1, 0, 0, 0, b'z']);
        assert_eq!(raw_read(&mut c), [ST_OK, 0]);

        s.set("still", b"fine").unwrap();
        assert_eq!(s.get("still", T).unwrap(), b"fine");
    }

    #[test]
    fn keys_and_values_over_their_caps_get_a_clear_error() {
        let s = server();
        let err = s.set(&"k".repeat(MAX_KEY + 1), b"v").unwrap_err();
        assert!(matches!(&err, Error::Remote(m) if m.contains("key of 1025 bytes exceeds")), "{err}");
        // The client refuses a frame over the limit before sending it.
        let err = s.set("k", &vec![0; MAX_FRAME]).unwrap_err();
        assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("limit")), "{err}");
        let err = s.set("k", &vec![0; MAX_VALUE + 1]).unwrap_err();
        assert!(matches!(&err, Error::Remote(m) if m.contains("value of")), "{err}");
        // The connection is still in step.
        s.set("k", &vec![7; MAX_VALUE]).unwrap();
        assert_eq!(s.get("k", T).unwrap().len(), MAX_VALUE);
    }

    #[test]
    fn the_same_token_on_both_sides_authenticates() {
        let t = token(b"s3cret");
        let s = TcpStore::serve_with_token("127.0.0.1:0", T, Some(&t)).unwrap();
        let addr = s.server_addr().unwrap().to_string();
        let c = TcpStore::connect_with_token(&addr, T, Some(&t)).unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(s.get("k", T).unwrap(), b"v");
    }

    #[test]
    fn a_different_token_or_none_is_refused_on_both_sides() {
        let t = token(b"s3cret");
        let s = TcpStore::serve_with_token("127.0.0.1:0", T, Some(&t)).unwrap();
        let addr = s.server_addr().unwrap().to_string();
        for (who, tok) in [("another token", Some(token(b"guess"))), ("no token", None)] {
            let err = TcpStore::connect_with_token(&addr, T, tok.as_ref()).unwrap_err();
            assert!(matches!(&err, Error::Remote(m) if m.contains("TOROID_AUTH_TOKEN")), "{who}: {err}");
        }
        // A server without a token refuses a client with one, and the client refuses it.
        let plain = server();
        let addr = plain.server_addr().unwrap().to_string();
        let err = TcpStore::connect_with_token(&addr, T, Some(&t)).unwrap_err();
        assert!(matches!(&err, Error::Remote(m) if m.contains("TOROID_AUTH_TOKEN")), "{err}");
        // Nothing the strangers did reached the table.
        s.set("k", b"v").unwrap();
        assert_eq!(s.get("k", T).unwrap(), b"v");
    }

    #[test]
    fn a_stranger_without_the_token_gets_nothing_and_changes_nothing() {
        let t = token(b"s3cret");
        let s = TcpStore::serve_with_token("127.0.0.1:0", T, Some(&t)).unwrap();
        s.set("secret", b"value").unwrap();
        let addr = s.server_addr().unwrap();
        // A plain hello, then requests pipelined behind it.
        let mut c = raw(addr);
        c.write_all(&Enc::hello(None).finish().unwrap()).unwrap();
        let mut g = Enc::new(OP_GET);
        g.u64(0);
        g.bytes(b"secret");
        c.write_all(&g.finish().unwrap()).unwrap();
        let mut d = Enc::new(OP_DELETE);
        d.bytes(b"secret");
        c.write_all(&d.finish().unwrap()).unwrap();
        let a = raw_read(&mut c);
        assert_eq!(a[0], ST_BAD_REQUEST);
        assert!(String::from_utf8_lossy(&a).contains("TOROID_AUTH_TOKEN"));
        let rest = read_to_close(&mut c);
        assert!(!rest.windows(5).any(|w| w == b"value"), "{rest:?}");
        // A request in place of the proof is a failed proof.
        let mut c = raw(addr);
        c.write_all(&Enc::hello(Some(&[1; NONCE_LEN])).finish().unwrap()).unwrap();
        assert_eq!(raw_read(&mut c).len(), 2 + NONCE_LEN + TAG_LEN);
        let mut g = Enc::new(OP_GET);
        g.u64(0);
        g.bytes(b"secret");
        c.write_all(&g.finish().unwrap()).unwrap();
        let a = raw_read(&mut c);
        assert_eq!(a[0], ST_BAD_REQUEST);
        assert!(read_to_close(&mut c).is_empty());
        assert_eq!(s.get("secret", T).unwrap(), b"value");
    }

    /// Runs the client's side of the handshake by hand; returns the stream, the hello and the
    /// server's nonce, and the proof sent.
    fn handshake_by_hand(addr: SocketAddr, t: &AuthToken, nc: [u8; NONCE_LEN]) -> (TcpStream, Vec<u8>, u8) {
        let mut c = raw(addr);
        let hello = Enc::hello(Some(&nc));
        let payload = hello.payload().to_vec();
        c.write_all(&hello.finish().unwrap()).unwrap();
        let a = raw_read(&mut c);
        assert_eq!(a[..2], [ST_OK, FLAG_AUTH]);
        let ns: Nonce = a[2..2 + NONCE_LEN].try_into().unwrap();
        let proof = client_tag(t, &payload, &ns);
        raw_frame(&mut c, &proof);
        let status = raw_read(&mut c)[0];
        (c, proof.to_vec(), status)
    }

    #[test]
    fn replayed_messages_are_refused_on_both_sides() {
        let t = token(b"s3cret");
        let s = TcpStore::serve_with_token("127.0.0.1:0", T, Some(&t)).unwrap();
        let addr = s.server_addr().unwrap();
        let nc = [9; NONCE_LEN];
        let (_c, proof, status) = handshake_by_hand(addr, &t, nc);
        assert_eq!(status, ST_OK);
        // The same hello and proof on a new connection: the server drew a new nonce.
        let mut c = raw(addr);
        c.write_all(&Enc::hello(Some(&nc)).finish().unwrap()).unwrap();
        let _challenge = raw_read(&mut c);
        raw_frame(&mut c, &proof);
        let a = raw_read(&mut c);
        assert_eq!(a[0], ST_BAD_REQUEST);
        assert!(String::from_utf8_lossy(&a).contains("authentication failed"));

        // A fake server replaying a real server's challenge and proof to a new client: the
        // client drew a new nonce, so the proof does not verify.
        let mut c = raw(addr);
        c.write_all(&Enc::hello(Some(&nc)).finish().unwrap()).unwrap();
        let recorded = raw_read(&mut c);
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let fake_addr = fake.local_addr().unwrap().to_string();
        let th = std::thread::spawn(move || {
            let (mut f, _) = fake.accept().unwrap();
            f.set_read_timeout(Some(T)).unwrap();
            let _hello = raw_read(&mut f);
            raw_frame(&mut f, &recorded);
            read_to_close(&mut f) // the client sends no proof
        });
        let err = TcpStore::connect_with_token(&fake_addr, T, Some(&t)).unwrap_err();
        assert!(matches!(&err, Error::Remote(m) if m.contains("TOROID_AUTH_TOKEN")), "{err}");
        assert!(th.join().unwrap().is_empty());
    }

    #[test]
    fn pipelined_gets_of_a_large_value_are_answered_as_the_peer_reads() {
        let s = server();
        s.set("big", &vec![5; MAX_VALUE]).unwrap();
        let mut c = raw(s.server_addr().unwrap());
        c.write_all(&Enc::hello(None).finish().unwrap()).unwrap();
        assert_eq!(raw_read(&mut c), [ST_OK, 0]);
        let mut g = Enc::new(OP_GET);
        g.u64(0);
        g.bytes(b"big");
        let g = g.finish().unwrap();
        c.write_all(&g.repeat(200)).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        // Others are served while that peer does not read.
        s.set("other", b"x").unwrap();
        assert_eq!(s.get("other", T).unwrap(), b"x");
        // Every answer comes, in order, once the peer reads.
        for _ in 0..200 {
            let a = raw_read(&mut c);
            assert_eq!((a[0], a.len()), (ST_OK, 1 + MAX_VALUE));
        }
    }

    #[test]
    fn silent_and_dripping_strangers_are_dropped_at_the_handshake_deadline() {
        let s = server();
        let addr = s.server_addr().unwrap();
        let silent = std::thread::spawn(move || {
            let mut c = raw(addr);
            c.set_read_timeout(Some(HANDSHAKE_DEADLINE + T)).unwrap();
            let start = Instant::now();
            (read_to_close(&mut c), start.elapsed())
        });
        let mut drip = raw(addr);
        // One byte every 400 ms: the 13 bytes of a hello would take over 5 s.
        for b in Enc::hello(None).finish().unwrap() {
            if drip.write_all(&[b]).is_err() {
                break;
            }
            // Meanwhile real clients get through at once.
            let c = TcpStore::connect(&addr.to_string(), T).unwrap();
            c.set("k", b"v").unwrap();
            std::thread::sleep(Duration::from_millis(400));
        }
        // Closed without an answer.
        assert!(read_to_close(&mut drip).is_empty());
        let (got, took) = silent.join().unwrap();
        assert!(got.is_empty());
        assert!(took >= HANDSHAKE_DEADLINE && took < HANDSHAKE_DEADLINE + Duration::from_secs(2), "{took:?}");
    }

    #[test]
    fn past_the_connection_cap_new_connections_wait_for_a_slot() {
        // The cap of a real server is MAX_CONNECTIONS; 64 here keeps the test fast (thousands of
        // connections overflow the listen backlog, and the kernel retries those after seconds).
        let cap = 64;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let _server = start(listener, addr, None, cap).unwrap();
        let mut held: Vec<TcpStream> = Vec::new();
        let hello = Enc::hello(None).finish().unwrap();
        for _ in 0..cap {
            let mut c = raw(addr);
            c.write_all(&hello).unwrap();
            assert_eq!(raw_read(&mut c), [ST_OK, 0]);
            held.push(c);
        }
        // No slot: the connection waits in the backlog, unanswered.
        let err = TcpStore::connect(&addr.to_string(), Duration::from_millis(500)).unwrap_err();
        assert!(matches!(err, Error::Timeout(_)), "{err}");
        held.truncate(10);
        let c = TcpStore::connect(&addr.to_string(), T).unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(c.get("k", T).unwrap(), b"v");
        assert!(super::super::MAX_CONNECTIONS >= cap);
    }

    /// Sends a GET of `key` (parked until it is set, for at most a minute) without reading
    /// the answer.
    fn park_get(c: &mut TcpStream, key: &str) {
        let mut e = Enc::new(OP_GET);
        e.u64(60_000);
        e.bytes(key.as_bytes());
        c.write_all(&e.finish().unwrap()).unwrap();
    }

    #[test]
    fn a_set_read_in_the_same_round_as_the_get_it_answers_wakes_it() {
        let s = server();
        let addr = s.server_addr().unwrap();
        let hello = Enc::hello(None).finish().unwrap();
        let open = || {
            let mut c = raw(addr);
            c.write_all(&hello).unwrap();
            assert_eq!(raw_read(&mut c), [ST_OK, 0]);
            c
        };
        let (mut a, mut b) = (open(), open());
        // The GET parks; were it not woken by the SET read just after it in the same round,
        // it would be answered only at its deadline, a minute away, and reading its answer
        // would fail after T. Each answered GET leaves its deadline in the heap: 1,500 of them
        // pass the point where the heap is rebuilt from the live deadlines.
        for i in 0..1500 {
            park_get(&mut a, &format!("race/{i}"));
            let mut e = Enc::new(OP_SET);
            e.bytes(format!("race/{i}").as_bytes());
            e.bytes(b"v");
            b.write_all(&e.finish().unwrap()).unwrap();
            assert_eq!(raw_read(&mut b), [ST_OK]);
            assert_eq!(raw_read(&mut a), [ST_OK, b'v'], "round {i}");
        }
    }

    #[test]
    fn parked_requests_on_many_connections_each_get_their_own_key() {
        let s = server();
        let addr = s.server_addr().unwrap();
        let hello = Enc::hello(None).finish().unwrap();
        let n = 200;
        // Connection i parks a GET of key i, then (pipelined behind it) a GET of key "all".
        let mut conns: Vec<TcpStream> = (0..n)
            .map(|i| {
                let mut c = raw(addr);
                c.write_all(&hello).unwrap();
                assert_eq!(raw_read(&mut c), [ST_OK, 0]);
                park_get(&mut c, &format!("key/{i}"));
                park_get(&mut c, "all");
                c
            })
            .collect();
        // One more connection parks on a key and closes before it is set: its listing goes.
        let mut gone = raw(addr);
        gone.write_all(&hello).unwrap();
        assert_eq!(raw_read(&mut gone), [ST_OK, 0]);
        park_get(&mut gone, "key/0");
        drop(gone);
        // A WAIT on three keys that arrive one by one from different connections.
        let w = TcpStore::connect(&addr.to_string(), T).unwrap();
        let waiter = std::thread::spawn(move || w.wait(&["w/0", "w/1", "w/2"], T));
        // Set the keys in reverse order: each connection gets its own value, and nothing else
        // before "all".
        for i in (0..n).rev() {
            s.set(&format!("key/{i}"), format!("value {i}").as_bytes()).unwrap();
            let a = raw_read(&mut conns[i]);
            assert_eq!((a[0], &a[1..]), (ST_OK, format!("value {i}").as_bytes()), "connection {i}");
        }
        for i in 0..3 {
            TcpStore::connect(&addr.to_string(), T).unwrap().set(&format!("w/{i}"), b"").unwrap();
        }
        waiter.join().unwrap().unwrap();
        s.set("all", b"done").unwrap();
        for (i, c) in conns.iter_mut().enumerate() {
            let a = raw_read(c);
            assert_eq!((a[0], &a[1..]), (ST_OK, &b"done"[..]), "connection {i}");
        }
    }
}
