//! One connection whose handshake is under way, as a state machine on a non-blocking socket
//! that [`super::mesh`]'s poll loop drives: [`Outgoing`] (this rank connects to a lower rank,
//! says hello, reads the ack) and [`Incoming`] (a connection accepted on the listener: reads a
//! hello, checks it, acks it).
//!
//! The two are not symmetric in trust. An outgoing connection goes to the address a genuine
//! peer published, so its failure is that peer's failure and ends set-up with an error. An
//! incoming connection may come from anyone: until its hello (and MAC) has been checked it is
//! a stranger, owns nothing but a fixed buffer of [`IN_MAX`] bytes, and any fault of it only
//! drops it ([`Incoming::advance`] returns the reason).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::handshake::{self, HELLO_LEN, Hello, KIND_ACK, KIND_HELLO, MAC_LEN, NONCE_LEN, Nonce};
use crate::config::AuthToken;
use crate::error::{Error, Result};
use crate::sys::poll::{Events, PollFd};

/// The most bytes read from an incoming connection: a hello, its nonce and its MAC.
pub(super) const IN_MAX: usize = HELLO_LEN + NONCE_LEN + MAC_LEN;
/// The most bytes read on an outgoing connection: an ack and its MAC.
const ACK_MAX: usize = HELLO_LEN + MAC_LEN;
/// Pause before connecting again to a rank that is not listening yet.
const RETRY: Duration = Duration::from_millis(10);
/// A connect still unanswered after this starts over: a SYN dropped at a listener whose
/// backlog strangers had filled would otherwise wait for the kernel's retransmission (1 s,
/// then 3 s, 7 s, ... after the first).
const CONNECT_AGAIN: Duration = Duration::from_secs(1);

/// What every connection of one rank's set-up shares.
#[derive(Clone, Copy)]
pub(super) struct Ctx<'a> {
    pub rank: usize,
    pub size: usize,
    pub comm_id: u64,
    pub auth: Option<&'a AuthToken>,
    /// Connections to each rank (1, or the striped lanes).
    pub lanes: &'a [usize],
}

/// Reads into `buf[*got..]` what has arrived, never more than `buf` holds. `Ok(true)`: `buf`
/// is full; `Ok(false)`: nothing more for now. A closed connection is an error.
pub(super) fn fill(s: &mut TcpStream, buf: &mut [u8], got: &mut usize) -> io::Result<bool> {
    while *got < buf.len() {
        match s.read(&mut buf[*got..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed")),
            Ok(n) => *got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Writes `msg[*sent..]` as far as the socket takes it. `Ok(true)`: all of `msg` is sent.
pub(super) fn flush(s: &mut TcpStream, msg: &[u8], sent: &mut usize) -> io::Result<bool> {
    while *sent < msg.len() {
        match s.write(&msg[*sent..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed")),
            Ok(n) => *sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Why a genuine peer closes a connection during set-up: the hint every connector error gives.
fn dropped_by(peer: usize) -> String {
    format!(
        "rank {peer} drops connections whose TOROID_AUTH_TOKEN, communicator, TOROID_NSOCKS or protocol \
         version differ from its own, and stops listening for set-up once its own links are in; its log says which"
    )
}

fn hello_of(buf: &[u8]) -> Hello {
    let mut h = [0u8; HELLO_LEN];
    h.copy_from_slice(&buf[..HELLO_LEN]);
    h
}

enum OutPhase {
    /// Not connected; connect (again) at this instant.
    Retry(Instant),
    /// `connect` is under way since this instant.
    Connecting(Instant),
    /// Sending the hello.
    Sending,
    /// Reading the ack.
    Reading,
    /// Checked both ways.
    Done,
}

/// This rank's connection to a lower rank `peer`, on lane `lane` of the connections to it.
pub(super) struct Outgoing {
    pub peer: usize,
    pub lane: usize,
    addr: SocketAddr,
    stream: Option<TcpStream>,
    phase: OutPhase,
    msg: Vec<u8>,
    sent: usize,
    nonce: Nonce,
    ack: [u8; ACK_MAX],
    got: usize,
    /// Why the last attempt to connect failed (for the error at the deadline).
    last_refusal: Option<io::Error>,
}

impl Outgoing {
    pub fn new(ctx: Ctx<'_>, peer: usize, lane: usize, addr: SocketAddr) -> Result<Outgoing> {
        let (msg, nonce) = handshake::hello_message(ctx.comm_id, ctx.rank, peer, ctx.auth, lane)?;
        let phase = OutPhase::Retry(Instant::now());
        Ok(Outgoing {
            peer,
            lane,
            addr,
            stream: None,
            phase,
            msg,
            sent: 0,
            nonce,
            ack: [0; ACK_MAX],
            got: 0,
            last_refusal: None,
        })
    }

    pub fn is_done(&self) -> bool {
        matches!(self.phase, OutPhase::Done)
    }

    /// The connection, once done.
    pub fn into_stream(self) -> Option<TcpStream> {
        if self.is_done() { self.stream } else { None }
    }

    /// The descriptor and events to poll for, if any.
    pub fn interest(&self) -> Option<(RawFd, Events)> {
        let ev = match self.phase {
            OutPhase::Connecting(_) | OutPhase::Sending => PollFd::OUT,
            OutPhase::Reading => PollFd::IN,
            OutPhase::Retry(_) | OutPhase::Done => return None,
        };
        self.stream.as_ref().map(|s| (s.as_raw_fd(), ev))
    }

    /// Why the last connect failed, while it waits to try again (refused: nothing listens).
    pub fn refusal(&self) -> Option<&io::Error> {
        match self.phase {
            OutPhase::Retry(_) => self.last_refusal.as_ref(),
            _ => None,
        }
    }

    /// When this connection wants to run without an event (a retry).
    pub fn wake_at(&self) -> Option<Instant> {
        match self.phase {
            OutPhase::Retry(t) => Some(t),
            OutPhase::Connecting(since) => Some(since + CONNECT_AGAIN),
            _ => None,
        }
    }

    /// What is missing, for the error at the set-up deadline.
    pub fn describe_unfinished(&self, rank: usize) -> String {
        let (peer, addr) = (self.peer, self.addr);
        match (&self.phase, &self.last_refusal) {
            (OutPhase::Retry(_) | OutPhase::Connecting(_), Some(e)) => {
                format!(
                    "rank {rank}: could not connect to rank {peer} at {addr}: {e} (it never listened, died, or {})",
                    dropped_by(peer)
                )
            }
            (OutPhase::Retry(_) | OutPhase::Connecting(_), None) => {
                format!("rank {rank}: could not connect to rank {peer} at {addr}: no answer")
            }
            (OutPhase::Sending, _) => format!("rank {rank}: hello to rank {peer} at {addr} not sent"),
            _ => format!(
                "rank {rank}: waiting for rank {peer}'s ack: no handshake before the deadline ({})",
                dropped_by(peer)
            ),
        }
    }

    /// Moves on as far as the socket allows. An error is this genuine peer's failure.
    pub fn advance(&mut self, ctx: Ctx<'_>, now: Instant) -> Result<()> {
        let (rank, peer, addr) = (ctx.rank, self.peer, self.addr);
        loop {
            match self.phase {
                OutPhase::Done => return Ok(()),
                OutPhase::Retry(at) => {
                    if now < at {
                        return Ok(());
                    }
                    match crate::sys::socket::connect_nonblocking(&addr) {
                        Ok(s) => {
                            self.stream = Some(s);
                            self.phase = OutPhase::Connecting(now);
                        }
                        Err(e) => return self.refused(e, now, ctx),
                    }
                }
                OutPhase::Connecting(since) => {
                    let Some(s) = &self.stream else { return Err(Error::Internal("no stream".into())) };
                    // Writable (or failed) once the connection is made; until then `SO_ERROR`
                    // is 0 and the peer address unknown.
                    match s.take_error() {
                        Ok(Some(e)) | Err(e) => {
                            self.stream = None;
                            return self.refused(e, now, ctx);
                        }
                        Ok(None) if s.peer_addr().is_err() => {
                            if now >= since + CONNECT_AGAIN {
                                self.stream = None;
                                self.phase = OutPhase::Retry(now);
                            }
                            return Ok(());
                        }
                        Ok(None) => self.phase = OutPhase::Sending,
                    }
                }
                OutPhase::Sending => {
                    let Some(s) = &mut self.stream else { return Err(Error::Internal("no stream".into())) };
                    match flush(s, &self.msg, &mut self.sent) {
                        Ok(true) => self.phase = OutPhase::Reading,
                        Ok(false) => return Ok(()),
                        Err(e) => {
                            return Err(Error::Remote(
                                format!(
                                    "rank {rank}: hello to rank {peer} at {addr} failed: {e} ({})",
                                    dropped_by(peer)
                                )
                                .into(),
                            ));
                        }
                    }
                }
                OutPhase::Reading => return self.read_ack(ctx),
            }
        }
    }

    /// A failed connect: again after [`RETRY`] while nobody listens there, else an error.
    fn refused(&mut self, e: io::Error, now: Instant, ctx: Ctx<'_>) -> Result<()> {
        if matches!(
            e.kind(),
            io::ErrorKind::ConnectionRefused | io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
        ) {
            self.phase = OutPhase::Retry(now + RETRY);
            self.last_refusal = Some(e);
            return Ok(());
        }
        let why = match e.kind() {
            // Accepted by the kernel, then closed by the peer without a word.
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted => {
                format!(" ({})", dropped_by(self.peer))
            }
            _ => String::new(),
        };
        Err(Error::system(
            format!("rank {}: connecting to rank {} at {}{why}", ctx.rank, self.peer, self.addr),
            e,
        ))
    }

    fn read_ack(&mut self, ctx: Ctx<'_>) -> Result<()> {
        let (rank, peer) = (ctx.rank, self.peer);
        let what = format!("rank {rank}: waiting for rank {peer}'s ack");
        let Some(s) = &mut self.stream else { return Err(Error::Internal("no stream".into())) };
        let need = HELLO_LEN + if ctx.auth.is_some() { MAC_LEN } else { 0 };
        let before = self.got;
        let full = fill(s, &mut self.ack[..need], &mut self.got).map_err(|e| {
            // A peer that rejects our hello closes the connection without an ack.
            Error::Remote(format!("{what}: handshake failed: {e} ({})", dropped_by(peer)).into())
        })?;
        // Check the ack as soon as it is whole, before its MAC: the peer's error shows first.
        if before < HELLO_LEN && self.got >= HELLO_LEN {
            let from = handshake::check_hello(&hello_of(&self.ack), KIND_ACK, ctx.comm_id, rank, ctx.size)?;
            let lane = handshake::lane_of(&hello_of(&self.ack));
            if from != peer || lane != self.lane {
                return Err(Error::Remote(
                    format!(
                        "rank {rank}: ack from rank {from} lane {lane} on the connection to rank {peer} lane {}",
                        self.lane
                    )
                    .into(),
                ));
            }
        }
        if !full {
            return Ok(());
        }
        if let Some(t) = ctx.auth
            && !handshake::ack_is_authentic(&hello_of(&self.ack), &self.ack[HELLO_LEN..need], &self.nonce, t)
        {
            return Err(Error::Remote(
                format!("rank {rank}: rank {peer} failed authentication (a different TOROID_AUTH_TOKEN?)")
                    .into(),
            ));
        }
        self.phase = OutPhase::Done;
        Ok(())
    }
}

enum InPhase {
    /// Reading the hello (and its nonce and MAC); `need` bytes in all.
    Reading { need: usize },
    /// The hello checked out as rank `from`'s on `lane`: sending the ack.
    Acking { from: usize, lane: usize, msg: Vec<u8>, sent: usize },
    /// Acked: lane `lane` of the link to rank `from`.
    Done { from: usize, lane: usize },
}

/// A connection accepted on the listener, not trusted until its hello is checked.
pub(super) struct Incoming {
    stream: TcpStream,
    pub from_addr: SocketAddr,
    /// When it is dropped if not done; bytes arriving do not move it.
    pub deadline: Instant,
    /// When it was accepted (the oldest goes first when too many are open).
    pub accepted: Instant,
    buf: [u8; IN_MAX],
    got: usize,
    phase: InPhase,
}

impl Incoming {
    pub fn new(stream: TcpStream, from_addr: SocketAddr, accepted: Instant, deadline: Instant) -> Incoming {
        let phase = InPhase::Reading { need: HELLO_LEN };
        Incoming { stream, from_addr, deadline, accepted, buf: [0; IN_MAX], got: 0, phase }
    }

    pub fn interest(&self) -> Option<(RawFd, Events)> {
        let ev = match self.phase {
            InPhase::Reading { .. } => PollFd::IN,
            InPhase::Acking { .. } => PollFd::OUT,
            InPhase::Done { .. } => return None,
        };
        Some((self.stream.as_raw_fd(), ev))
    }

    /// The rank and lane it holds (checked and reserved), if any.
    pub fn claimed(&self) -> Option<(usize, usize)> {
        match self.phase {
            InPhase::Acking { from, lane, .. } | InPhase::Done { from, lane } => Some((from, lane)),
            InPhase::Reading { .. } => None,
        }
    }

    /// The rank it proved to be, its lane and the link, once acked.
    pub fn into_link(self) -> Option<(usize, usize, TcpStream)> {
        match self.phase {
            InPhase::Done { from, lane } => Some((from, lane, self.stream)),
            _ => None,
        }
    }

    /// Moves on as far as the socket allows. `claimed[r]`: the lanes of rank `r` (bit `l` for
    /// lane `l`) that a connection already holds; a checked hello sets its bit. `Err`: why this connection must be dropped (its claim, if any,
    /// is then released by the caller through [`Incoming::claimed`]).
    pub fn advance(&mut self, ctx: Ctx<'_>, claimed: &mut [u16]) -> std::result::Result<(), String> {
        loop {
            match &mut self.phase {
                InPhase::Done { .. } => return Ok(()),
                InPhase::Reading { need } => {
                    let need = *need;
                    match fill(&mut self.stream, &mut self.buf[..need], &mut self.got) {
                        Ok(true) => {}
                        Ok(false) => return Ok(()),
                        Err(e) if self.got == 0 => return Err(format!("no hello ({e})")),
                        Err(e) => return Err(format!("hello cut short after {} bytes ({e})", self.got)),
                    }
                    self.checked(ctx, claimed, need)?;
                }
                InPhase::Acking { from, lane, msg, sent } => {
                    let (from, lane) = (*from, *lane);
                    match flush(&mut self.stream, msg, sent) {
                        Ok(true) => self.phase = InPhase::Done { from, lane },
                        Ok(false) => return Ok(()),
                        Err(e) => return Err(format!("ack to rank {from} failed: {e}")),
                    }
                }
            }
        }
    }

    /// `need` bytes have arrived: checks them and moves to the next phase.
    fn checked(&mut self, ctx: Ctx<'_>, claimed: &mut [u16], need: usize) -> std::result::Result<(), String> {
        let h = hello_of(&self.buf);
        let from = handshake::check_hello(&h, KIND_HELLO, ctx.comm_id, ctx.rank, ctx.size)
            .map_err(|e| e.to_string())?;
        if from < ctx.rank {
            return Err(format!("claims rank {from}, which this rank connects to itself"));
        }
        let (lane, lanes) = (handshake::lane_of(&h), ctx.lanes.get(from).copied().unwrap_or(1));
        if lane >= lanes {
            return Err(format!(
                "rank {from} opens connection {} of {lanes} expected (a different TOROID_NSOCKS?)",
                lane + 1
            ));
        }
        let announced = handshake::announces_auth(&h);
        if need == HELLO_LEN && announced {
            // Only now, with a well-formed hello, are its nonce and MAC worth reading.
            self.phase = InPhase::Reading { need: IN_MAX };
            return Ok(());
        }
        let extra = &self.buf[HELLO_LEN..need];
        handshake::check_hello_auth(&h, announced.then_some(extra), ctx.auth).map_err(|e| e.to_string())?;
        if claimed[from] & (1 << lane) != 0 {
            return Err(format!("claims rank {from} lane {lane}, which is already connected"));
        }
        claimed[from] |= 1 << lane;
        let msg = handshake::ack_message(ctx.comm_id, ctx.rank, from, ctx.auth, extra, lane);
        self.phase = InPhase::Acking { from, lane, msg, sent: 0 };
        Ok(())
    }
}
