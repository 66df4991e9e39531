//! The control plane's sockets. After set-up every rank keeps its listener for the life of the
//! communicator, and a control thread (`comm::control`) serves it: a peer that needs to know
//! what this rank is doing (the stall report) connects, proves it belongs to the communicator
//! with the set-up handshake of [`super::handshake`] under the communicator's *control id*, asks,
//! and reads one bounded answer. Survivors that shrink the communicator connect to the same
//! listener with the hello of the new communicator: the control thread only peeks at its id and
//! parks the connection, untouched, for the shrink to take over.
//!
//! The listener is as open to strangers as it was during set-up, and held to the same bounds:
//! at most [`MAX_PENDING`] connections in progress (the oldest dropped first), each with
//! [`ALLOWANCE`] to finish, at most the hello, its nonce and MAC read before the checks, and
//! nothing answered before the hello (and with `TOROID_AUTH_TOKEN` its MAC) checked out. With
//! `TOROID_ENCRYPT` the request and the answer cross in TLS bound to the token ([`secure`]).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::handshake::{self, HELLO_LEN, Hello, KIND_HELLO, MAC_LEN, NONCE_LEN};
use super::handshaking::{fill, flush};
use crate::config::AuthToken;
use crate::sys::poll::{PollFd, poll};

/// Connections in progress at most; past this the oldest is dropped.
pub const MAX_PENDING: usize = 64;
/// Connections parked for a shrink at most (every survivor makes one; the rest are strangers).
pub const MAX_PARKED: usize = 4096;
/// How long one connection has to say what it wants and read the answer.
pub const ALLOWANCE: Duration = Duration::from_secs(5);
/// Shrink attempts of one communicator whose connections are parked.
pub const MAX_SHRINK_ATTEMPTS: u64 = 8;
/// The largest answer a client accepts.
pub const MAX_ANSWER: usize = 64 * 1024;
/// Dropped connections logged one by one (then every 1000th).
const WARNS: usize = 16;
/// Request: the rank's flight-recorder snapshot.
pub const REQUEST_SNAPSHOT: u8 = 1;
const REQUEST_LEN: usize = 8;
const REQUEST_MAGIC: [u8; 4] = *b"TRCQ";

fn derive(comm_id: u64, label: &[u8], n: u64) -> u64 {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"toroid ");
    h.update(label);
    h.update(comm_id.to_le_bytes());
    h.update(n.to_le_bytes());
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b)
}

/// The id a control connection's handshake carries (never a communicator's own id, so that a
/// control hello can never pass as a mesh hello or the other way round).
pub fn control_id(comm_id: u64) -> u64 {
    derive(comm_id, b"control", 0)
}

/// The id of the communicator that shrink attempt `attempt` (1, 2, ...) of `comm_id` builds.
pub fn shrink_id(comm_id: u64, attempt: u64) -> u64 {
    derive(comm_id, b"shrink", attempt)
}

/// Who this rank is, for the control handshake.
#[derive(Clone)]
pub struct ControlCtx {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub size: usize,
    /// The communicator's id (the control id and shrink ids derive from it).
    pub comm_id: u64,
    /// `TOROID_AUTH_TOKEN`.
    pub auth: Option<AuthToken>,
    /// After the hello and ack, the request and answer cross in TLS (`TOROID_ENCRYPT`;
    /// [`secure`]). Needs `auth`.
    pub encrypt: bool,
}

/// A connection a survivor made for a shrink, accepted and not read, with its shrink attempt
/// ([`UNIDENTIFIED`] when the control plane stopped before its whole hello arrived).
pub type Parked = (TcpStream, SocketAddr, u64);

/// The attempt of a parked connection whose hello had not all arrived when the control plane
/// stopped: possibly a survivor's, so it goes to the shrink, which checks it as any other.
pub const UNIDENTIFIED: u64 = 0;

enum Phase {
    /// Waiting for the whole hello to arrive (peeked, not consumed).
    Peek,
    /// A control hello: reading it with its nonce and MAC (`need` bytes).
    Hello { need: usize },
    /// Sending the ack, then reading the request.
    Ack { msg: Vec<u8>, sent: usize, from: usize },
    /// Reading the request of rank `from`.
    Request { from: usize },
    /// Sending the answer.
    Answer { msg: Vec<u8>, sent: usize },
    /// With encryption, after the ack: TLS, the bindings, the request and the answer.
    Secure { server: Box<secure::Server>, from: usize },
}

struct Conn {
    stream: TcpStream,
    from: SocketAddr,
    deadline: Instant,
    buf: [u8; HELLO_LEN + NONCE_LEN + MAC_LEN],
    got: usize,
    phase: Phase,
}

/// What to do with a connection after a step.
enum Next {
    Wait,
    Close(Option<String>),
    Park(u64),
    /// A hello of the communicator itself: a link on demand, for the inbox.
    Data,
}

/// Serves the listener until `stop` becomes readable; returns the connections parked for
/// shrinks. `answer(request, from_rank)` produces the bytes of an answer. With `inbox`
/// (connections on demand), a hello carrying the communicator's own id goes to the inbox,
/// which runs the rest of its handshake in this loop (`super::lazy`).
pub fn serve(
    listener: &TcpListener,
    ctx: &ControlCtx,
    stop: RawFd,
    answer: &dyn Fn(u8, usize) -> Vec<u8>,
    inbox: Option<&super::lazy::Inbox>,
) -> Vec<Parked> {
    let mut conns: Vec<Conn> = Vec::new();
    let mut parked: Vec<Parked> = Vec::new();
    let mut fds: Vec<PollFd> = Vec::new();
    // With encryption, the key this control plane presents (askers bind to it by the token).
    let tls = match ctx.encrypt {
        false => None,
        true => match crate::tls::Identity::generate().and_then(|id| crate::tls::bound_server(&id)) {
            Ok(cfg) => Some(cfg),
            Err(e) => {
                tracing::error!(target: "toroid::control", "no TLS for the control plane ({e}): its requests go unanswered");
                None
            }
        },
    };
    let mut warned = 0usize;
    let mut warn = |from: SocketAddr, why: &str| {
        // A flood of strangers must not flood the log: the first few, then every 1000th.
        warned += 1;
        if warned <= WARNS || warned.is_multiple_of(1000) {
            tracing::warn!(target: "toroid::control",
                "dropped a control connection from {from}: {why} ({warned} dropped so far)");
        }
    };
    loop {
        fds.clear();
        fds.push(PollFd::new(stop, PollFd::IN));
        fds.push(PollFd::new(listener.as_raw_fd(), PollFd::IN));
        for c in &conns {
            let ev = match &c.phase {
                Phase::Ack { .. } | Phase::Answer { .. } => PollFd::OUT,
                Phase::Secure { server, .. } if server.wants_write() => PollFd::IN | PollFd::OUT,
                _ => PollFd::IN,
            };
            fds.push(PollFd::new(c.stream.as_raw_fd(), ev | PollFd::RDHUP));
        }
        let data_from = fds.len();
        for (fd, ev) in inbox.map(|i| i.interest()).unwrap_or_default() {
            fds.push(PollFd::new(fd, ev | PollFd::RDHUP));
        }
        let now = Instant::now();
        let wake = conns
            .iter()
            .map(|c| c.deadline)
            .chain(inbox.and_then(|i| i.wake_at()))
            .min()
            .unwrap_or(now + Duration::from_secs(3600));
        let ms = wake.saturating_duration_since(now).as_millis().clamp(1, 60_000) as i32;
        if poll(&mut fds, ms).is_err() {
            std::thread::sleep(Duration::from_millis(10)); // EINTR or ENOMEM: try again
            continue;
        }
        if fds[0].revents() != 0 {
            // A survivor's hello may still be on its way, or unread for lack of a turn: closing
            // such a connection would reset a survivor's shrink. Every connection not yet
            // identified goes to the shrink, untouched (nothing of it was consumed).
            for c in conns.into_iter().filter(|c| matches!(c.phase, Phase::Peek)) {
                parked.push((c.stream, c.from, UNIDENTIFIED));
            }
            return parked;
        }
        let ready: Vec<bool> = fds[2..data_from].iter().map(|f| f.revents() != 0).collect();
        let now = Instant::now();
        if let Some(i) = inbox {
            // Cheap: only connections in handshake, each read or written once.
            i.advance(now);
        }
        let mut keep = Vec::with_capacity(conns.len());
        for (i, mut c) in conns.drain(..).enumerate() {
            let data = inbox.map(|i| i.comm_id());
            let next = if ready[i] { c.step(ctx, tls.as_ref(), answer, data) } else { Next::Wait };
            match next {
                Next::Wait if now < c.deadline => keep.push(c),
                Next::Wait => warn(c.from, "did not finish within its allowance"),
                Next::Close(Some(why)) => warn(c.from, &why),
                Next::Close(None) => {}
                Next::Data => {
                    if let Some(i) = inbox {
                        i.take(c.stream, c.from);
                    }
                }
                Next::Park(attempt) => {
                    if parked.len() >= MAX_PARKED {
                        parked.remove(0);
                    }
                    parked.push((c.stream, c.from, attempt));
                }
            }
        }
        conns = keep;
        if fds[1].revents() != 0 {
            accept_all(listener, &mut conns, &mut warn);
        }
    }
}

fn accept_all(listener: &TcpListener, conns: &mut Vec<Conn>, warn: &mut dyn FnMut(SocketAddr, &str)) {
    for _ in 0..256 {
        match listener.accept() {
            Ok((stream, from)) => {
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                if conns.len() >= MAX_PENDING {
                    let old = conns.remove(0);
                    warn(old.from, "too many control connections at once");
                }
                let deadline = Instant::now() + ALLOWANCE;
                conns.push(Conn {
                    stream,
                    from,
                    deadline,
                    buf: [0; HELLO_LEN + NONCE_LEN + MAC_LEN],
                    got: 0,
                    phase: Phase::Peek,
                });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(_) => return, // reset before accept, or descriptors short for a moment
        }
    }
}

impl Conn {
    fn step(
        &mut self,
        ctx: &ControlCtx,
        tls: Option<&std::sync::Arc<rustls::ServerConfig>>,
        answer: &dyn Fn(u8, usize) -> Vec<u8>,
        data: Option<u64>,
    ) -> Next {
        loop {
            match &mut self.phase {
                Phase::Peek => {
                    let mut h = [0u8; HELLO_LEN];
                    match self.stream.peek(&mut h) {
                        // Closed before sending a byte: a liveness probe ([`is_gone`]).
                        Ok(0) => return Next::Close(None),
                        Ok(n) if n < HELLO_LEN => return Next::Wait,
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Next::Wait,
                        Err(e) => return Next::Close(Some(format!("no hello ({e})"))),
                    }
                    let mut idb = [0u8; 8];
                    idb.copy_from_slice(&h[8..16]);
                    let id = u64::from_le_bytes(idb);
                    if let Some(a) = (1..=MAX_SHRINK_ATTEMPTS).find(|a| shrink_id(ctx.comm_id, *a) == id) {
                        return Next::Park(a);
                    }
                    if Some(id) == data {
                        return Next::Data;
                    }
                    if id != control_id(ctx.comm_id) {
                        return Next::Close(Some(format!("hello for communicator {id:#x}")));
                    }
                    self.phase = Phase::Hello { need: HELLO_LEN };
                }
                Phase::Hello { need } => {
                    let need = *need;
                    match fill(&mut self.stream, &mut self.buf[..need], &mut self.got) {
                        Ok(true) => {}
                        Ok(false) => return Next::Wait,
                        Err(e) => return Next::Close(Some(format!("hello cut short ({e})"))),
                    }
                    let mut h: Hello = [0; HELLO_LEN];
                    h.copy_from_slice(&self.buf[..HELLO_LEN]);
                    let cid = control_id(ctx.comm_id);
                    let from = match handshake::check_hello(&h, KIND_HELLO, cid, ctx.rank, ctx.size) {
                        Ok(f) => f,
                        Err(e) => return Next::Close(Some(e.to_string())),
                    };
                    let announced = handshake::announces_auth(&h);
                    if need == HELLO_LEN && announced {
                        self.phase = Phase::Hello { need: HELLO_LEN + NONCE_LEN + MAC_LEN };
                        continue;
                    }
                    let extra = &self.buf[HELLO_LEN..need];
                    if let Err(e) =
                        handshake::check_hello_auth(&h, announced.then_some(extra), ctx.auth.as_ref())
                    {
                        return Next::Close(Some(e.to_string()));
                    }
                    let msg = handshake::ack_message(cid, ctx.rank, from, ctx.auth.as_ref(), extra, 0);
                    self.got = 0;
                    self.phase = Phase::Ack { msg, sent: 0, from };
                }
                Phase::Ack { msg, sent, from } => match flush(&mut self.stream, msg, sent) {
                    Ok(true) if ctx.encrypt => {
                        let from = *from;
                        let Some(cfg) = tls else {
                            return Next::Close(Some("no TLS on this control plane (see its error)".into()));
                        };
                        match secure::Server::new(cfg) {
                            Ok(server) => self.phase = Phase::Secure { server: Box::new(server), from },
                            Err(e) => return Next::Close(Some(format!("TLS: {e}"))),
                        }
                    }
                    Ok(true) => {
                        self.phase = Phase::Request { from: *from };
                    }
                    Ok(false) => return Next::Wait,
                    Err(e) if gave_up(&e) => return Next::Close(None),
                    Err(e) => return Next::Close(Some(format!("ack failed: {e}"))),
                },
                Phase::Request { from } => {
                    let from = *from;
                    match fill(&mut self.stream, &mut self.buf[..REQUEST_LEN], &mut self.got) {
                        Ok(true) => {}
                        Ok(false) => return Next::Wait,
                        Err(e) => return Next::Close(Some(format!("rank {from}'s request cut short ({e})"))),
                    }
                    if self.buf[..4] != REQUEST_MAGIC || self.buf[4] != REQUEST_SNAPSHOT {
                        return Next::Close(Some(format!("rank {from} sent an unknown request")));
                    }
                    let body = answer(self.buf[4], from);
                    let mut msg = Vec::with_capacity(4 + body.len());
                    msg.extend_from_slice(&(body.len().min(MAX_ANSWER) as u32).to_le_bytes());
                    msg.extend_from_slice(&body[..body.len().min(MAX_ANSWER)]);
                    self.phase = Phase::Answer { msg, sent: 0 };
                }
                Phase::Answer { msg, sent } => match flush(&mut self.stream, msg, sent) {
                    Ok(true) => return Next::Close(None),
                    Ok(false) => return Next::Wait,
                    Err(e) if gave_up(&e) => return Next::Close(None),
                    Err(e) => return Next::Close(Some(format!("answer failed: {e}"))),
                },
                Phase::Secure { server, from } => {
                    let from = *from;
                    let Some(token) = ctx.auth.as_ref() else {
                        return Next::Close(Some("encryption without a token".into()));
                    };
                    return match server.step(&mut self.stream, token, &mut |req| answer(req, from)) {
                        secure::Progress::Wait => Next::Wait,
                        secure::Progress::Done => Next::Close(None),
                        secure::Progress::Failed(why) => Next::Close(Some(format!("rank {from}: {why}"))),
                    };
                }
            }
        }
    }
}

/// The asker closed the connection before the answer was out: it stopped waiting (its grace
/// passed while this rank was stopped or busy). Nothing to warn about.
fn gave_up(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset)
}

/// What asking one peer's control plane gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Its answer.
    Answer(Vec<u8>),
    /// Nothing listens at its address (the connection was refused): its process is gone.
    Dead(String),
    /// It took the connection (the kernel does, even for a stopped process) but did not answer
    /// within the time given: stopped, or stuck.
    Silent,
    /// Anything else.
    Failed(String),
}

/// Whether the process that listened at `addr` is gone: its connection refused (why, then), or
/// not (accepted: a live process's kernel accepts even when the process is stopped or its
/// listener is busy; or no verdict within `timeout`). Sends nothing and closes at once: the
/// control thread takes that for the probe it is, silently.
pub fn is_gone(addr: SocketAddr, timeout: Duration) -> Option<String> {
    match TcpStream::connect_timeout(&addr, timeout) {
        Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset) => {
            Some(format!("nothing listens at {addr} any more ({e})"))
        }
        _ => None,
    }
}

/// Asks rank `peer` at `addr` for `request`, within `grace`.
pub fn ask(ctx: &ControlCtx, peer: usize, addr: SocketAddr, request: u8, grace: Duration) -> Reply {
    let deadline = Instant::now() + grace;
    let mut s = match TcpStream::connect_timeout(&addr, grace) {
        Ok(s) => s,
        Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset) => {
            return Reply::Dead(format!("nothing listens at {addr} any more ({e})"));
        }
        Err(e) if e.kind() == io::ErrorKind::TimedOut => return Reply::Silent,
        Err(e) => return Reply::Failed(format!("connecting to {addr}: {e}")),
    };
    match exchange(&mut s, ctx, peer, request, deadline) {
        Ok(a) => Reply::Answer(a),
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => Reply::Silent,
        // Dead means nothing listens: a listener that took the connection and then dropped it
        // belongs to a live process (one whose listener went on to a shrink, say), or to one
        // that is exiting: the kernel put the connection in the backlog of a listener the exit
        // then closed. Asking the kernel again, briefly, tells the two apart.
        Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::UnexpectedEof) => {
            for _ in 0..4 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                std::thread::sleep(EXIT_RECHECK.min(left));
                if let Some(why) = is_gone(addr, deadline.saturating_duration_since(Instant::now())) {
                    return Reply::Dead(why);
                }
            }
            Reply::Failed(e.to_string())
        }
        Err(e) => Reply::Failed(e.to_string()),
    }
}

/// Pause before asking again whether a peer that dropped the connection still listens.
const EXIT_RECHECK: Duration = Duration::from_millis(25);

fn exchange(
    s: &mut TcpStream,
    ctx: &ControlCtx,
    peer: usize,
    request: u8,
    deadline: Instant,
) -> io::Result<Vec<u8>> {
    let left = |d: Instant| {
        let l = d.saturating_duration_since(Instant::now());
        if l.is_zero() { Err(io::Error::from(io::ErrorKind::TimedOut)) } else { Ok(l) }
    };
    let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    let cid = control_id(ctx.comm_id);
    let (hello, nonce) = handshake::hello_message(cid, ctx.rank, peer, ctx.auth.as_ref(), 0)
        .map_err(|e| invalid(e.to_string()))?;
    s.set_write_timeout(Some(left(deadline)?))?;
    s.write_all(&hello)?;
    let mut req = [0u8; REQUEST_LEN];
    req[..4].copy_from_slice(&REQUEST_MAGIC);
    req[4] = request;
    if !ctx.encrypt {
        // Sent at once: the rank reads it after its ack.
        s.write_all(&req)?;
    }
    let mut ack = [0u8; HELLO_LEN + MAC_LEN];
    let need = HELLO_LEN + if ctx.auth.is_some() { MAC_LEN } else { 0 };
    read_exact(s, &mut ack[..need], deadline)?;
    let mut h: Hello = [0; HELLO_LEN];
    h.copy_from_slice(&ack[..HELLO_LEN]);
    let from = handshake::check_hello(&h, handshake::KIND_ACK, cid, ctx.rank, ctx.size)
        .map_err(|e| invalid(e.to_string()))?;
    if from != peer {
        return Err(invalid(format!("rank {from} answered for rank {peer}")));
    }
    if let Some(t) = &ctx.auth
        && !handshake::ack_is_authentic(&h, &ack[HELLO_LEN..need], &nonce, t)
    {
        return Err(invalid(format!("rank {peer} failed authentication")));
    }
    if ctx.encrypt {
        let token = ctx.auth.as_ref().ok_or_else(|| invalid("encryption without a token".into()))?;
        return secure::ask(s, token, &req, deadline);
    }
    let mut len = [0u8; 4];
    read_exact(s, &mut len, deadline)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_ANSWER {
        return Err(invalid(format!("an answer of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    read_exact(s, &mut body, deadline)?;
    Ok(body)
}

fn read_exact(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::from(io::ErrorKind::TimedOut));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before answering")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl std::fmt::Debug for ControlCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlCtx")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("auth", &self.auth.is_some())
            .field("encrypt", &self.encrypt)
            .finish_non_exhaustive()
    }
}

mod secure;
#[cfg(test)]
mod tests;
