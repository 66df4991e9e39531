//! The progress engine: framed, fingerprinted, deadline-bounded exchanges between ranks.
//!
//! Every algorithm moves data through [`Peers::exchange`]: "send these bytes to rank A while
//! receiving that many bytes from rank B, and reduce (or copy) what arrives into this buffer".
//! One thread drives both directions without blocking, so a step is full duplex; received bytes
//! are reduced as soon as whole elements are in, so the reduction of one piece overlaps the
//! transfer of the next; [`Source::Forward`] re-sends what was just received (pipelined chains).
//!
//! ## Frames
//!
//! Each step's payload travels as frames of at most `segment_size` bytes, each behind a 40-byte
//! header (little-endian):
//!
//! ```text
//! magic u32 | kind u8 | 0 u8 | step u16 | len u32 | fingerprint (28 bytes, see
//! [`Fingerprint::encode`]: coll u8 | dtype u8 | op u8 | algo u8 | seq u64 | count u64 | root i32 | 0 u32)
//! ```
//!
//! The receiver knows the frame layout from the schedule and checks every header against its own
//! [`Fingerprint`], step and length before it uses the payload, so a mismatched collective, a
//! different algorithm choice or a desynchronised stream is an error, never wrong data.
//! A rank that fails sends `kind = ABORT` frames with the reason (where its stream is at a frame
//! boundary) and closes every link; the other ranks turn that into [`Error::Remote`].
//!
//! ## Waiting
//!
//! When nothing moves, the engine polls for `spin` (yielding the core when ranks outnumber
//! cores), then sleeps in `poll(2)` on the active links, the abort event and every idle link
//! (a peer that closes, aborts or sends a frame of another collective is noticed at once).
//! Every wait ends at the collective's deadline with [`Error::Timeout`] naming the awaited rank.

use std::fmt;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Transport;
use crate::collective::{CollKind, FINGERPRINT_LEN, Fingerprint};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce;

/// "TRD1" little-endian.
const MAGIC: u32 = u32::from_le_bytes(*b"TRD1");
const KIND_DATA: u8 = 1;
const KIND_ABORT: u8 = 2;
/// Size of a frame header on the wire.
pub const HEADER_LEN: usize = 40;
/// Longest abort reason carried on the wire.
const MAX_REASON: usize = 2048;
/// How long a failing rank tries to deliver its abort frames.
const ABORT_SEND_BUDGET: Duration = Duration::from_millis(200);
/// Upper bound of one `poll(2)` sleep, so a lost wake-up can never stall past this.
const MAX_SLEEP: Duration = Duration::from_millis(500);

/// A decoded frame header.
#[derive(Debug, Clone)]
struct Header {
    kind: u8,
    fp: Result<Fingerprint, String>,
    step: u16,
    len: u32,
}

/// Where the fingerprint starts in a frame header.
const FP_AT: usize = HEADER_LEN - FINGERPRINT_LEN;

fn encode(kind: u8, fp: &Fingerprint, step: u16, len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = kind;
    h[6..8].copy_from_slice(&step.to_le_bytes());
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h[FP_AT..].copy_from_slice(&fp.encode());
    h
}

fn decode(h: &[u8; HEADER_LEN]) -> std::result::Result<Header, String> {
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    if magic != MAGIC {
        return Err(format!("bad frame magic {magic:#010x}"));
    }
    let kind = h[4];
    if kind != KIND_DATA && kind != KIND_ABORT {
        return Err(format!("unknown frame kind {kind}"));
    }
    let mut fp = [0u8; FINGERPRINT_LEN];
    fp.copy_from_slice(&h[FP_AT..]);
    Ok(Header {
        kind,
        fp: Fingerprint::decode(&fp),
        step: u16::from_le_bytes([h[6], h[7]]),
        len: u32::from_le_bytes([h[8], h[9], h[10], h[11]]),
    })
}

/// Where the bytes of a send come from.
#[derive(Debug)]
pub enum Source<'a> {
    /// These bytes.
    Bytes(&'a [u8]),
    /// The bytes the receive of the same exchange produces, re-sent as they become final
    /// (a pipelined chain). The length is the receive's length.
    Forward,
}

/// What happens to received bytes.
#[derive(Debug)]
pub enum Sink<'a> {
    /// Store them here.
    Copy(&'a mut [u8]),
    /// `dst = first ⊕ incoming`, where `first` is `other` or, when `None`, `dst` itself.
    Reduce {
        /// Output (and first operand when `other` is `None`).
        dst: &'a mut [u8],
        /// First operand when it is not `dst`.
        other: Option<&'a [u8]>,
        /// Element type.
        dtype: DataType,
        /// Operation (never `Avg`: callers pre-scale).
        op: ReduceOp,
    },
}

impl Sink<'_> {
    fn len(&self) -> usize {
        match self {
            Sink::Copy(d) => d.len(),
            Sink::Reduce { dst, .. } => dst.len(),
        }
    }
}

/// A ring schedule run as one stream by [`Peers::ring`].
///
/// Every step receives piece `piece(k)` of the work buffer from `left` (reducing it for the
/// first `reduce_steps` steps: `work = (src or work) ⊕ incoming`, copying afterwards) and sends
/// to `right`: step 0 sends `send0` (of `src` when given, else of `work`), step `k > 0` what
/// step `k - 1` received. Frames carry step numbers `first_step + k`.
pub struct RingPlan<'f> {
    /// Rank that sends to us.
    pub left: usize,
    /// Rank we send to.
    pub right: usize,
    /// Number of steps.
    pub steps: usize,
    /// Step number of the first step on the wire.
    pub first_step: usize,
    /// Steps that reduce (the rest copy).
    pub reduce_steps: usize,
    /// A receive may overwrite a piece only when the send that last read it is complete: the
    /// receive of step `k` waits for the send of step `k - lag` (`lag = ring size - 1`).
    pub lag: usize,
    /// Element type of reductions.
    pub dtype: DataType,
    /// Reduction (never `Avg`).
    pub op: ReduceOp,
    /// Byte range sent at step 0.
    pub send0: std::ops::Range<usize>,
    /// Byte range of `work` received at step `k`.
    pub piece: &'f dyn Fn(usize) -> std::ops::Range<usize>,
}

impl fmt::Debug for RingPlan<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingPlan")
            .field("left", &self.left)
            .field("right", &self.right)
            .field("steps", &self.steps)
            .field("reduce_steps", &self.reduce_steps)
            .finish_non_exhaustive()
    }
}

/// The abort state shared by a communicator's threads: a flag, the first reason, and an event
/// descriptor that wakes a rank sleeping in `poll(2)`.
#[derive(Debug)]
pub struct AbortSignal {
    flag: AtomicBool,
    reason: Mutex<Option<Error>>,
    event: crate::sys::eventfd::EventFd,
}

impl AbortSignal {
    /// A signal that has not fired.
    pub fn new() -> Result<AbortSignal> {
        let event = crate::sys::eventfd::EventFd::new().map_err(|e| Error::system("eventfd", e))?;
        Ok(AbortSignal { flag: AtomicBool::new(false), reason: Mutex::new(None), event })
    }

    /// Fires the signal (the first reason is kept) and wakes every sleeping waiter. Never blocks.
    pub fn fire(&self, reason: Error) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                *r = Some(reason);
            }
        }
        self.flag.store(true, Ordering::Release);
        self.event.signal();
    }

    /// True once fired.
    pub fn is_fired(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// `Err(Aborted)` with the reason once fired.
    pub fn check(&self) -> Result<()> {
        if !self.is_fired() {
            return Ok(());
        }
        Err(self.error())
    }

    /// The error later calls report once fired.
    pub fn error(&self) -> Error {
        let r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        match &*r {
            Some(Error::Aborted(s)) => Error::Aborted(s.clone()),
            Some(e) => Error::Aborted(format!("communicator aborted after an earlier error: {e}")),
            None => Error::Aborted("communicator aborted".into()),
        }
    }
}

/// How a waiting rank spends its time before sleeping.
#[derive(Debug, Clone, Copy)]
pub struct SpinPolicy {
    /// How long to poll without sleeping after the last progress.
    pub spin: Duration,
    /// Yield the core between polls (more ranks than cores on this host).
    pub yield_between: bool,
}

#[derive(Debug)]
struct Link {
    transport: Box<dyn Transport>,
    /// Our outgoing stream stopped inside a frame (an abort frame cannot follow it).
    out_mid_frame: bool,
    /// Idle-link checks are off for the operation with this token (data of ours is queued).
    quiet_token: u64,
    /// The peer closed its sending side (seen by poll); do not poll this link again this op.
    hup_token: u64,
    // shm: BEGIN
    /// The transport lends received bytes in place (reducing sinks read straight from it).
    zero_copy: bool,
    // shm: END
}

/// The connected peers of one rank and the engine that drives exchanges with them.
pub struct Peers {
    rank: usize,
    links: Vec<Option<Link>>,
    abort: Arc<AbortSignal>,
    spin: SpinPolicy,
    segment: usize,
    scratch: Vec<u64>,
    pollfds: Vec<libc::pollfd>,
    poll_ranks: Vec<usize>,
    token: u64,
    // shm: BEGIN
    // shm: END
}

impl fmt::Debug for Peers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peers")
            .field("rank", &self.rank)
            .field("links", &self.links.iter().filter(|l| l.is_some()).count())
            .field("segment", &self.segment)
            .finish_non_exhaustive()
    }
}

impl Peers {
    /// Takes ownership of one transport per peer (`None` at `rank` and for unconnected peers).
    /// `segment` is rounded down to a multiple of 64 (every element size divides it).
    pub fn new(
        rank: usize,
        transports: Vec<Option<Box<dyn Transport>>>,
        abort: Arc<AbortSignal>,
        spin: SpinPolicy,
        segment: usize,
    ) -> Peers {
        let segment = (segment / 64).max(1) * 64;
        let links = transports
            .into_iter()
            .map(|t| {
                t.map(|transport| Link {
                    zero_copy: transport.zero_copy(),
                    transport,
                    out_mid_frame: false,
                    quiet_token: 0,
                    hup_token: 0,
                })
            })
            .collect();
        Peers {
            rank,
            links,
            abort,
            spin,
            segment,
            scratch: Vec::new(),
            pollfds: Vec::new(),
            poll_ranks: Vec::new(),
            token: 0,
        }
    }

    // shm: BEGIN
    /// How waiting ranks spend their time before sleeping.
    pub fn spin_policy(&self) -> SpinPolicy {
        self.spin
    }

    /// The kind of transport to `peer` ("shm", "tcp"), or `None` without a link.
    pub fn link_kind(&self, peer: usize) -> Option<&'static str> {
        self.links.get(peer).and_then(Option::as_ref).map(|l| l.transport.kind())
    }

    /// Checks, without blocking, every link for what an idle link can show (an abort frame, a
    /// frame of a mismatched collective, a closed connection) while this rank waits outside the
    /// engine (in the shared window). Returns true when the link to `watch` is closed.
    pub fn poll_idle_links(&mut self, fp: &Fingerprint, watch: usize) -> Result<bool> {
        self.abort.check()?;
        self.pollfds.clear();
        self.poll_ranks.clear();
        for (r, link) in self.links.iter_mut().enumerate() {
            let Some(link) = link else { continue };
            if link.hup_token == self.token {
                continue;
            }
            let mut events = libc::POLLRDHUP;
            if link.quiet_token != self.token {
                match link.transport.arm(true, false) {
                    Some(ev) => events |= ev,
                    None => events |= libc::POLLIN | libc::POLLPRI,
                }
            }
            self.pollfds.push(libc::pollfd { fd: link.transport.pollable(), events, revents: 0 });
            self.poll_ranks.push(r);
        }
        // SAFETY: `pollfds` is a live, initialised array of `len` pollfd structs.
        let n = unsafe { libc::poll(self.pollfds.as_mut_ptr(), self.pollfds.len() as libc::nfds_t, 0) };
        if n > 0 {
            for i in 0..self.pollfds.len() {
                let (r, ev, want) = (self.poll_ranks[i], self.pollfds[i].revents, self.pollfds[i].events);
                // POLLPRI marks "arm said data is there now": inspect without an event.
                let ev = if want & libc::POLLPRI != 0 { ev | libc::POLLIN } else { ev };
                if ev != 0 {
                    self.inspect_idle(r, fp, ev)?;
                }
            }
        } else {
            for i in 0..self.pollfds.len() {
                if self.pollfds[i].events & libc::POLLPRI != 0 {
                    self.inspect_idle(self.poll_ranks[i], fp, libc::POLLIN)?;
                }
            }
        }
        Ok(match self.links.get(watch).and_then(Option::as_ref) {
            None => true,
            Some(l) => l.hup_token == self.token,
        })
    }
    // shm: END

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks (links, including the empty one for this rank).
    pub fn size(&self) -> usize {
        self.links.len()
    }

    /// The largest frame payload.
    pub fn segment(&self) -> usize {
        self.segment
    }

    /// The abort signal this engine watches.
    pub fn abort_signal(&self) -> &Arc<AbortSignal> {
        &self.abort
    }

    /// Marks the start of a new operation (resets idle-link bookkeeping).
    pub fn begin_op(&mut self) {
        self.token += 1;
    }

    /// Sends `send` to one peer while receiving into `recv` from another (or the same) peer.
    ///
    /// Returns when both directions are complete. `step` numbers the exchanges of one
    /// operation; sender and receiver must pass the same fingerprint, step and length.
    pub fn exchange(
        &mut self,
        fp: &Fingerprint,
        step: u16,
        deadline: Instant,
        send: Option<(usize, Source<'_>)>,
        recv: Option<(usize, Sink<'_>)>,
    ) -> Result<()> {
        let recv_len = recv.as_ref().map(|(_, s)| s.len());
        let mut tx = match send {
            Some((peer, src)) => {
                self.check_peer(peer)?;
                let total = match (&src, recv_len) {
                    (Source::Bytes(b), _) => b.len(),
                    (Source::Forward, Some(n)) => n,
                    (Source::Forward, None) => {
                        return Err(Error::Internal("Source::Forward without a receive".into()));
                    }
                };
                Some(Tx::new(peer, src, total, encode(KIND_DATA, fp, step, 0), self.segment))
            }
            None => None,
        };
        let (mut rx, mut sink) = match recv {
            Some((peer, sink)) => {
                self.check_peer(peer)?;
                if let Sink::Reduce { dst, other: Some(o), .. } = &sink
                    && o.len() != dst.len()
                {
                    return Err(Error::Internal("reduce operand lengths differ".into()));
                }
                (Some(Rx::new(peer, sink.len(), self.segment)), Some(sink))
            }
            None => (None, None),
        };
        if matches!(sink, Some(Sink::Reduce { .. })) {
            let words = self.segment / 8;
            if self.scratch.len() < words {
                self.scratch.resize(words, 0);
            }
        }

        let mut last_progress = Instant::now();
        // Plain sends go out before we look for input (the peer can start sooner and we skip a
        // receive that would find nothing); forwarded sends follow the receive that feeds them.
        let forwarding = tx.as_ref().is_some_and(|t| matches!(t.src, Source::Forward));
        loop {
            self.abort.check()?;
            let mut progressed = false;
            if !forwarding {
                progressed |= self.pump_tx(tx.as_mut(), None)?;
            }
            if let (Some(r), Some(sink)) = (rx.as_mut(), sink.as_mut())
                && !r.done
            {
                let link = live_link(&mut self.links, r.peer)?;
                let scratch = bytemuck::cast_slice_mut::<u64, u8>(&mut self.scratch);
                progressed |= r.pump(sink, self.rank, link, fp, step, scratch)?;
            }
            let mut forward_avail = usize::MAX; // shm
            if forwarding {
                let out = match (rx.as_ref(), sink.as_ref()) {
                    (Some(r), Some(Sink::Copy(d))) => Some(&d[..r.final_len(false)]),
                    (Some(r), Some(Sink::Reduce { dst, .. })) => Some(&dst[..r.final_len(true)]),
                    _ => None,
                };
                forward_avail = out.map_or(0, <[u8]>::len); // shm
                progressed |= self.pump_tx(tx.as_mut(), out)?;
            }
            let tx_done = tx.as_ref().is_none_or(|t| t.done);
            let rx_done = rx.as_ref().is_none_or(|r| r.done);
            if tx_done && rx_done {
                return Ok(());
            }
            let now = Instant::now();
            if progressed {
                last_progress = now;
                continue;
            }
            if now >= deadline {
                return Err(self.timeout_error(fp, step, tx.as_ref(), rx.as_ref()));
            }
            if now.duration_since(last_progress) < self.spin.spin {
                if self.spin.yield_between {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            // shm: a send waiting for forwarded bytes waits on the receive, not on its link
            let want_write = tx.as_ref().filter(|t| !t.done && !t.starved(forward_avail)).map(|t| t.peer);
            let want_read = rx.as_ref().filter(|r| !r.done).map(|r| r.peer);
            self.sleep(fp, want_write, want_read, deadline)?;
            last_progress = Instant::now();
        }
    }

    /// Runs a whole ring schedule as one stream (see [`RingPlan`]): what arrives at step `k`
    /// is forwarded as step `k + 1`'s send while it is still arriving, so there is no bubble
    /// between steps and forwarded bytes leave while they are still in cache.
    pub fn ring(
        &mut self,
        fp: &Fingerprint,
        deadline: Instant,
        plan: &RingPlan<'_>,
        work: &mut [u8],
        src: Option<&[u8]>,
    ) -> Result<()> {
        if plan.steps == 0 {
            return Ok(());
        }
        self.check_peer(plan.left)?;
        self.check_peer(plan.right)?;
        if plan.reduce_steps > 0 {
            let words = self.segment / 8;
            if self.scratch.len() < words {
                self.scratch.resize(words, 0);
            }
        }
        let header = |k: usize, fp: &Fingerprint| encode(KIND_DATA, fp, (plan.first_step + k) as u16, 0);
        let send_len = |k: usize| if k == 0 { plan.send0.len() } else { (plan.piece)(k - 1).len() };
        let (mut ts, mut rs) = (0usize, 0usize);
        let mut tx = Tx::new(plan.right, Source::Forward, send_len(0), header(0, fp), self.segment);
        let mut rx = Rx::new(plan.left, (plan.piece)(0).len(), self.segment);
        let mut last_progress = Instant::now();
        loop {
            self.abort.check()?;
            let mut progressed = false;
            let mut tx_avail = usize::MAX; // shm
            // Send: step 0 reads its piece; step k > 0 forwards what step k - 1 received.
            if ts < plan.steps {
                let data: &[u8] = if ts == 0 {
                    match src {
                        Some(s) => &s[plan.send0.clone()],
                        None => &work[plan.send0.clone()],
                    }
                } else {
                    let p = (plan.piece)(ts - 1);
                    let ready = if rs > ts - 1 { p.len() } else { rx.final_len(ts - 1 < plan.reduce_steps) };
                    &work[p.start..p.start + ready]
                };
                tx_avail = data.len(); // shm
                let link = live_link(&mut self.links, plan.right)?;
                progressed |=
                    tx.pump(link, Some(data)).map_err(|e| explain_send_failure(link, plan.right, e))?;
                if tx.done {
                    ts += 1;
                    if ts < plan.steps {
                        tx = Tx::new(plan.right, Source::Forward, send_len(ts), header(ts, fp), self.segment);
                    }
                }
            }
            // Receive step rs, once the send that last read its piece (step rs - lag) is done.
            if rs < plan.steps && (rs < plan.lag || ts > rs - plan.lag) {
                let p = (plan.piece)(rs);
                let mut sink = if rs < plan.reduce_steps {
                    Sink::Reduce {
                        dst: &mut work[p.clone()],
                        other: src.map(|s| &s[p]),
                        dtype: plan.dtype,
                        op: plan.op,
                    }
                } else {
                    Sink::Copy(&mut work[p])
                };
                let link = live_link(&mut self.links, plan.left)?;
                let scratch = bytemuck::cast_slice_mut::<u64, u8>(&mut self.scratch);
                let step = (plan.first_step + rs) as u16;
                progressed |= rx.pump(&mut sink, self.rank, link, fp, step, scratch)?;
                if rx.done {
                    rs += 1;
                    if rs < plan.steps {
                        rx = Rx::new(plan.left, (plan.piece)(rs).len(), self.segment);
                    }
                    progressed = true;
                }
            }
            if ts == plan.steps && rs == plan.steps {
                return Ok(());
            }
            let now = Instant::now();
            if progressed {
                last_progress = now;
                continue;
            }
            if now >= deadline {
                let step = plan.first_step + rs.min(ts);
                let txr = (ts < plan.steps).then_some(&tx);
                let rxr = (rs < plan.steps).then_some(&rx);
                return Err(self.timeout_error(fp, step as u16, txr, rxr));
            }
            if now.duration_since(last_progress) < self.spin.spin {
                if self.spin.yield_between {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            // shm: a send waiting for forwarded bytes waits on the receive, not on its link
            let want_write = (ts < plan.steps && !tx.starved(tx_avail)).then_some(plan.right);
            let want_read = (rs < plan.steps && (rs < plan.lag || ts > rs - plan.lag)).then_some(plan.left);
            self.sleep(fp, want_write, want_read, deadline)?;
            last_progress = Instant::now();
        }
    }

    fn pump_tx(&mut self, tx: Option<&mut Tx<'_>>, forwarded: Option<&[u8]>) -> Result<bool> {
        match tx {
            Some(t) if !t.done => {
                let link = live_link(&mut self.links, t.peer)?;
                t.pump(link, forwarded).map_err(|e| explain_send_failure(link, t.peer, e))
            }
            _ => Ok(false),
        }
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer == self.rank || peer >= self.links.len() {
            return Err(Error::Internal(format!("rank {} cannot exchange with rank {peer}", self.rank)));
        }
        Ok(())
    }

    fn timeout_error(&self, fp: &Fingerprint, step: u16, tx: Option<&Tx<'_>>, rx: Option<&Rx>) -> Error {
        let mut waits = Vec::new();
        if let Some(r) = rx.filter(|r| !r.done) {
            waits.push(format!(
                "data from rank {} ({} of {} bytes received)",
                r.peer,
                r.frame_start + r.frame_got,
                r.total
            ));
        }
        if let Some(t) = tx.filter(|t| !t.done) {
            waits.push(format!(
                "rank {} to take our data ({} of {} bytes sent)",
                t.peer,
                t.sent_payload(),
                t.total
            ));
        }
        Error::Timeout(format!(
            "rank {} in {fp}, step {step}: deadline passed waiting for {}",
            self.rank,
            waits.join(" and ")
        ))
    }

    /// Sleeps in poll(2) until an active link can progress, an idle link shows something, the
    /// abort event fires, or the deadline (capped) passes.
    fn sleep(
        &mut self,
        fp: &Fingerprint,
        want_write: Option<usize>,
        want_read: Option<usize>,
        deadline: Instant,
    ) -> Result<()> {
        self.pollfds.clear();
        self.poll_ranks.clear();
        self.pollfds.push(libc::pollfd {
            fd: self.abort.event.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        self.poll_ranks.push(usize::MAX);
        // shm: BEGIN (transports say what to poll for: `Transport::arm`)
        let mut ready_idle: Option<usize> = None;
        let mut can_progress = false;
        for (r, link) in self.links.iter_mut().enumerate() {
            let Some(link) = link else { continue };
            let active = Some(r) == want_write || Some(r) == want_read;
            let mut events: libc::c_short = 0;
            if active {
                match link.transport.arm(Some(r) == want_read, Some(r) == want_write) {
                    Some(ev) => events |= ev,
                    // It can progress now: do not sleep (after arming the others, which is
                    // also where they notice a peer that is gone).
                    None => can_progress = true,
                }
            } else {
                if link.hup_token == self.token {
                    continue;
                }
                events |= libc::POLLRDHUP;
                if link.quiet_token != self.token {
                    match link.transport.arm(true, false) {
                        Some(ev) => events |= ev,
                        None => {
                            ready_idle.get_or_insert(r);
                        }
                    }
                }
            }
            self.pollfds.push(libc::pollfd { fd: link.transport.pollable(), events, revents: 0 });
            self.poll_ranks.push(r);
        }
        if let Some(r) = ready_idle {
            // Something arrived on an idle link already: look at it instead of sleeping.
            return self.inspect_idle(r, fp, libc::POLLIN);
        }
        if can_progress {
            return Ok(());
        }
        // shm: END
        let wait = deadline.saturating_duration_since(Instant::now()).min(MAX_SLEEP);
        let ms = wait.as_millis().max(1) as libc::c_int;
        // SAFETY: `pollfds` is a live, initialised array of `len` pollfd structs.
        let n = unsafe { libc::poll(self.pollfds.as_mut_ptr(), self.pollfds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(Error::system("poll", err));
        }
        self.abort.check()?;
        for i in 1..self.pollfds.len() {
            let r = self.poll_ranks[i];
            let revents = self.pollfds[i].revents;
            if revents == 0 || Some(r) == want_write || Some(r) == want_read {
                continue;
            }
            self.inspect_idle(r, fp, revents)?;
        }
        Ok(())
    }

    /// Something showed on a link this step does not use: find out what without consuming data
    /// that a later step needs.
    fn inspect_idle(&mut self, r: usize, fp: &Fingerprint, revents: libc::c_short) -> Result<()> {
        let token = self.token;
        let rank = self.rank;
        let Some(link) = self.links[r].as_mut() else { return Ok(()) };
        let mut h = [0u8; HEADER_LEN];
        let n = match link.transport.peek(&mut h) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
            Err(e) => return Err(Error::Remote(format!("connection to rank {r} failed: {e}"))),
        };
        let hup = revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0;
        // A peer that closed without an abort frame may simply have finished its last
        // operation and exited; that is an error only if this rank still needs data from it,
        // which the active read then reports. Stop watching it for this operation.
        if n < HEADER_LEN {
            link.quiet_token = token;
            if hup {
                link.hup_token = token;
            }
            return Ok(());
        }
        let header = decode(&h).map_err(|e| Error::Remote(format!("rank {r} sent a bad frame: {e}")))?;
        if header.kind == KIND_ABORT {
            return Err(read_abort(link, r, false, &[], header.len as usize));
        }
        let theirs = header.fp.map_err(|e| Error::Remote(format!("rank {r} sent a bad frame: {e}")))?;
        // Collectives share one sequence; send/recv count per pair, so only collective frames
        // can be compared. A frame of a later collective is a peer running ahead: fine.
        let collective = |k: CollKind| k != CollKind::PointToPoint;
        let conflicting = collective(theirs.kind)
            && collective(fp.kind)
            && (theirs.seq < fp.seq || (theirs.seq == fp.seq && theirs != *fp));
        if conflicting {
            return Err(mismatch(rank, r, fp, &theirs));
        }
        link.quiet_token = token;
        if hup {
            link.hup_token = token;
        }
        Ok(())
    }

    /// Tells every peer that this rank failed (abort frames where the stream allows) and closes
    /// every link. Later exchanges fail.
    pub fn poison(&mut self, reason: &str) {
        let text = reason.as_bytes();
        let text = &text[..text.len().min(MAX_REASON)];
        let fp = Fingerprint {
            seq: 0,
            kind: CollKind::Barrier,
            dtype: DataType::U8,
            op: ReduceOp::Sum,
            count: 0,
            root: -1,
            algo: 0,
        };
        let header = encode(KIND_ABORT, &fp, 0, text.len() as u32);
        let deadline = Instant::now() + ABORT_SEND_BUDGET;
        for link in self.links.iter_mut().flatten() {
            if !link.out_mid_frame {
                write_all_until(link.transport.as_mut(), &[&header, text], deadline);
            }
            link.transport.shutdown();
        }
        for l in self.links.iter_mut() {
            *l = None;
        }
    }

    /// True when every link is gone (after [`Peers::poison`]).
    pub fn is_closed(&self) -> bool {
        self.links.iter().all(Option::is_none)
    }
}

/// A send failed because the peer closed: if what it sent last is an abort frame, report its
/// reason instead (it says why).
fn explain_send_failure(link: &mut Link, peer: usize, err: Error) -> Error {
    let mut h = [0u8; HEADER_LEN];
    match link.transport.peek(&mut h) {
        Ok(HEADER_LEN) => match decode(&h) {
            Ok(header) if header.kind == KIND_ABORT => {
                read_abort(link, peer, false, &[], header.len as usize)
            }
            _ => err,
        },
        _ => err,
    }
}

fn live_link(links: &mut [Option<Link>], peer: usize) -> Result<&mut Link> {
    links
        .get_mut(peer)
        .and_then(Option::as_mut)
        .ok_or_else(|| Error::Aborted(format!("no connection to rank {peer} (communicator closed)")))
}

fn mismatch(rank: usize, peer: usize, mine: &Fingerprint, theirs: &Fingerprint) -> Error {
    Error::InvalidUsage(format!(
        "collective mismatch: rank {rank} called {mine} but rank {peer} called {theirs}; \
         every rank must issue the same collectives in the same order with the same \
         type, count, op, root and algorithm"
    ))
}

/// Writes every byte of `bufs` or gives up at `deadline` (best effort, for abort frames).
fn write_all_until(t: &mut dyn Transport, bufs: &[&[u8]], deadline: Instant) {
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let mut done = 0;
    while done < total && Instant::now() < deadline {
        let mut parts: [&[u8]; 2] = [&[], &[]];
        let mut skip = done;
        let mut k = 0;
        for b in bufs {
            if skip >= b.len() {
                skip -= b.len();
                continue;
            }
            if k < parts.len() {
                parts[k] = &b[skip..];
                k += 1;
            }
            skip = 0;
        }
        match t.try_write(&parts[..k]) {
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(_) => return,
        }
    }
}

/// Reads the reason of an abort frame from `peer` and returns the error to report.
///
/// `header_consumed` says whether the header was already read (or only peeked); `already` holds
/// the reason bytes read together with it.
fn read_abort(link: &mut Link, peer: usize, header_consumed: bool, already: &[u8], len: usize) -> Error {
    let len = len.min(MAX_REASON);
    let skip = if header_consumed { 0 } else { HEADER_LEN };
    let mut reason = already[..already.len().min(len)].to_vec();
    let mut buf = vec![0u8; skip + len - reason.len()];
    let deadline = Instant::now() + ABORT_SEND_BUDGET;
    let mut got = 0;
    while got < buf.len() && Instant::now() < deadline {
        match link.transport.try_read(&mut [&mut buf[got..]]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => break,
        }
    }
    if got == buf.len() {
        reason.extend_from_slice(&buf[skip..]);
        Error::Remote(format!("rank {peer} aborted: {}", String::from_utf8_lossy(&reason)))
    } else {
        Error::Remote(format!("rank {peer} aborted (its reason did not arrive)"))
    }
}

/// Number of frames for `total` bytes (a step with no bytes still sends one empty frame, so
/// every step carries a fingerprint).
fn frame_len(total: usize, start: usize, segment: usize) -> usize {
    (total - start).min(segment)
}

/// The sending half of an exchange.
struct Tx<'a> {
    peer: usize,
    src: Source<'a>,
    total: usize,
    header: [u8; HEADER_LEN],
    segment: usize,
    /// Payload offset where the current frame starts.
    frame_start: usize,
    /// Header bytes of the current frame sent.
    hdr_sent: usize,
    /// Payload bytes of the current frame sent.
    frame_sent: usize,
    frame_open: bool,
    done: bool,
}

impl<'a> Tx<'a> {
    fn new(peer: usize, src: Source<'a>, total: usize, header: [u8; HEADER_LEN], segment: usize) -> Tx<'a> {
        Tx {
            peer,
            src,
            total,
            header,
            segment,
            frame_start: 0,
            hdr_sent: 0,
            frame_sent: 0,
            frame_open: false,
            done: false,
        }
    }

    // shm: BEGIN
    /// True when the send cannot progress for want of bytes to forward (everything `avail`
    /// holds is sent): only the receive that produces them can unblock it.
    fn starved(&self, avail: usize) -> bool {
        !self.done && self.frame_open && self.hdr_sent == HEADER_LEN && self.sent_payload() >= avail
    }
    // shm: END

    fn sent_payload(&self) -> usize {
        self.frame_start + self.frame_sent
    }

    /// Writes what it can. `forwarded` is the receive's final output so far (for `Forward`).
    fn pump(&mut self, link: &mut Link, forwarded: Option<&[u8]>) -> Result<bool> {
        let mut progressed = false;
        while !self.done {
            let len = frame_len(self.total, self.frame_start, self.segment);
            if !self.frame_open {
                self.header[12..16].copy_from_slice(&(len as u32).to_le_bytes());
                self.hdr_sent = 0;
                self.frame_sent = 0;
                self.frame_open = true;
            }
            let data: &[u8] = match &self.src {
                Source::Bytes(b) => b,
                Source::Forward => forwarded.unwrap_or(&[]),
            };
            let end = (self.frame_start + len).min(data.len());
            let payload = &data[(self.frame_start + self.frame_sent).min(end)..end];
            let hdr = &self.header[self.hdr_sent..];
            if hdr.is_empty() && payload.is_empty() && self.frame_sent < len {
                break; // waiting for forwarded bytes
            }
            let n = if hdr.is_empty() && payload.is_empty() {
                0
            } else {
                match link.transport.try_write(&[hdr, payload]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        return Err(Error::Remote(format!(
                            "sending to rank {} failed: {e} (rank {} exited, crashed or aborted)",
                            self.peer, self.peer
                        )));
                    }
                }
            };
            progressed |= n > 0;
            let h = n.min(hdr.len());
            self.hdr_sent += h;
            self.frame_sent += n - h;
            link.out_mid_frame = true;
            if self.hdr_sent == HEADER_LEN && self.frame_sent == len {
                link.out_mid_frame = false;
                self.frame_open = false;
                self.frame_start += len;
                if self.frame_start == self.total {
                    self.done = true;
                }
            } else if n == 0 {
                break;
            }
        }
        Ok(progressed)
    }
}

/// The receiving half of an exchange.
struct Rx {
    peer: usize,
    total: usize,
    segment: usize,
    header: [u8; HEADER_LEN],
    hdr_got: usize,
    frame_start: usize,
    frame_len: usize,
    frame_got: usize,
    /// Bytes of the current frame already reduced into the output.
    processed: usize,
    frame_open: bool,
    done: bool,
}

impl Rx {
    /// A receive of `total` bytes from `peer`; the sink is passed to every `pump`.
    fn new(peer: usize, total: usize, segment: usize) -> Rx {
        Rx {
            peer,
            total,
            segment,
            header: [0; HEADER_LEN],
            hdr_got: 0,
            frame_start: 0,
            frame_len: 0,
            frame_got: 0,
            processed: 0,
            frame_open: false,
            done: false,
        }
    }

    /// How many leading output bytes are final (received, and reduced for reducing sinks).
    fn final_len(&self, reducing: bool) -> usize {
        if self.done {
            return self.total;
        }
        let in_frame = match (reducing, self.hdr_got == HEADER_LEN) {
            (_, false) => 0,
            (true, true) => self.processed,
            (false, true) => self.frame_got,
        };
        self.frame_start + in_frame
    }

    #[allow(clippy::too_many_arguments)]
    fn pump(
        &mut self,
        sink: &mut Sink<'_>,
        rank: usize,
        link: &mut Link,
        fp: &Fingerprint,
        step: u16,
        scratch: &mut [u8],
    ) -> Result<bool> {
        let mut progressed = false;
        while !self.done {
            if !self.frame_open {
                self.frame_len = frame_len(self.total, self.frame_start, self.segment);
                self.hdr_got = 0;
                self.frame_got = 0;
                self.processed = 0;
                self.frame_open = true;
            }
            let (fs, fl, fg) = (self.frame_start, self.frame_len, self.frame_got);
            // shm: BEGIN (zero copy: reduce straight out of the transport's memory)
            if link.zero_copy
                && self.hdr_got == HEADER_LEN
                && fg < fl
                && let Sink::Reduce { dst, other, dtype, op } = &mut *sink
            {
                let es = dtype.size();
                let (dtype, op) = (*dtype, *op);
                let mut at = fs + fg;
                let frame_end = fs + fl;
                let mut consume = |bytes: &[u8]| {
                    let take = if at + bytes.len() == frame_end {
                        bytes.len()
                    } else {
                        bytes.len() - bytes.len() % es
                    };
                    if take > 0 {
                        let (a, b) = (at, at + take);
                        match other {
                            Some(o) => {
                                reduce::reduce_into(dtype, op, &mut dst[a..b], &o[a..b], &bytes[..take])
                            }
                            None => reduce::reduce_inplace(dtype, op, &mut dst[a..b], &bytes[..take]),
                        }
                        at = b;
                    }
                    take
                };
                match link.transport.read_with(fl - fg, &mut consume) {
                    Ok(0) => {
                        return Err(Error::Remote(format!(
                            "rank {} closed its connection during {fp} (it exited, crashed or aborted)",
                            self.peer
                        )));
                    }
                    Ok(n) => {
                        progressed = true;
                        self.frame_got += n;
                        self.processed = self.frame_got;
                        if self.frame_got == self.frame_len {
                            self.frame_open = false;
                            self.frame_start += self.frame_len;
                            if self.frame_start == self.total {
                                self.done = true;
                            }
                        }
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        return Err(Error::Remote(format!(
                            "receiving from rank {} failed during {fp}: {e}",
                            self.peer
                        )));
                    }
                }
            }
            let zero_copy_header = link.zero_copy && matches!(sink, Sink::Reduce { .. });
            // shm: END
            let payload: &mut [u8] = match sink {
                Sink::Copy(d) => &mut d[fs + fg..fs + fl],
                Sink::Reduce { .. } => &mut scratch[fg..fl],
            };
            let hdr_missing = HEADER_LEN - self.hdr_got;
            let res = if hdr_missing > 0 && zero_copy_header {
                // shm: the payload is read in place once the header is validated
                link.transport.try_read(&mut [&mut self.header[self.hdr_got..]])
            } else if hdr_missing > 0 {
                let hdr = &mut self.header[self.hdr_got..];
                link.transport.try_read(&mut [hdr, payload])
            } else if !payload.is_empty() {
                link.transport.try_read(&mut [payload])
            } else {
                Ok(usize::MAX) // header complete and empty payload: frame complete
            };
            let n = match res {
                Ok(0) => {
                    return Err(Error::Remote(format!(
                        "rank {} closed its connection during {fp} (it exited, crashed or aborted)",
                        self.peer
                    )));
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    return Err(Error::Remote(format!(
                        "receiving from rank {} failed during {fp}: {e}",
                        self.peer
                    )));
                }
            };
            let n = if n == usize::MAX { 0 } else { n };
            progressed |= n > 0;
            let h = n.min(hdr_missing);
            self.hdr_got += h;
            if h > 0 && self.hdr_got == HEADER_LEN {
                self.frame_got += n - h;
                self.validate(sink, rank, link, fp, step, scratch)?;
            } else {
                self.frame_got += n - h;
            }
            if self.hdr_got == HEADER_LEN {
                self.process(sink, scratch);
                if self.frame_got == self.frame_len {
                    self.frame_open = false;
                    self.frame_start += self.frame_len;
                    if self.frame_start == self.total {
                        self.done = true;
                    }
                    continue;
                }
            }
            if n == 0 {
                break;
            }
        }
        Ok(progressed)
    }

    #[allow(clippy::too_many_arguments)]
    fn validate(
        &mut self,
        sink: &Sink<'_>,
        rank: usize,
        link: &mut Link,
        fp: &Fingerprint,
        step: u16,
        scratch: &[u8],
    ) -> Result<()> {
        let header = decode(&self.header)
            .map_err(|e| Error::Remote(format!("rank {} sent a bad frame during {fp}: {e}", self.peer)))?;
        if header.kind == KIND_ABORT {
            let already: &[u8] = match sink {
                Sink::Copy(d) => &d[self.frame_start..self.frame_start + self.frame_got],
                Sink::Reduce { .. } => &scratch[..self.frame_got],
            };
            let already = already.to_vec();
            return Err(read_abort(link, self.peer, true, &already, header.len as usize));
        }
        let theirs = header
            .fp
            .map_err(|e| Error::Remote(format!("rank {} sent a bad frame during {fp}: {e}", self.peer)))?;
        if theirs != *fp {
            return Err(mismatch(rank, self.peer, fp, &theirs));
        }
        if header.step != step || header.len as usize != self.frame_len {
            return Err(Error::Remote(format!(
                "rank {} sent step {} frame of {} bytes during {fp}, expected step {step} frame of {} bytes \
                 (streams out of step: ranks disagree on the schedule)",
                self.peer, header.step, header.len, self.frame_len
            )));
        }
        Ok(())
    }

    /// Reduces the whole elements of the current frame that arrived since the last call.
    fn process(&mut self, sink: &mut Sink<'_>, scratch: &[u8]) {
        if let Sink::Reduce { dst, other, dtype, op } = sink {
            let esize = dtype.size();
            let upto = if self.frame_got == self.frame_len {
                self.frame_got
            } else {
                self.frame_got - self.frame_got % esize
            };
            if upto > self.processed {
                let (a, b) = (self.frame_start + self.processed, self.frame_start + upto);
                let incoming = &scratch[self.processed..upto];
                match other {
                    Some(o) => reduce::reduce_into(*dtype, *op, &mut dst[a..b], &o[a..b], incoming),
                    None => reduce::reduce_inplace(*dtype, *op, &mut dst[a..b], incoming),
                }
                self.processed = upto;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Frames that fail validation, sent by a hand-driven peer over a real TCP connection.
    use super::*;
    use crate::transport::tcp::{Interface, connect_mesh, listen};
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};

    fn fingerprint(seq: u64, count: u64) -> Fingerprint {
        Fingerprint {
            seq,
            kind: CollKind::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            count,
            root: -1,
            algo: 1,
        }
    }

    /// Rank 1 receives 64 bytes at step 3 of `fingerprint(5, 16)` while rank 0 writes `wire`
    /// (raw bytes) and closes; returns what rank 1 received.
    fn receive_after(wire: Vec<u8>) -> Result<Vec<u8>> {
        let iface = Interface { name: "lo".into(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) };
        let eps: Vec<_> = (0..2).map(|_| listen(&iface, 2).expect("listening on loopback")).collect();
        let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr).collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut handles: Vec<_> = eps
            .into_iter()
            .enumerate()
            .map(|(r, ep)| {
                let addrs = addrs.clone();
                std::thread::spawn(move || {
                    connect_mesh(r, &addrs, &ep, 7, &Default::default(), None, deadline).expect("mesh")
                })
            })
            .collect();
        let mut mesh1 = handles.pop().expect("two").join().expect("rank 1 connects");
        let mut mesh0 = handles.pop().expect("two").join().expect("rank 0 connects");
        let writer = std::thread::spawn(move || {
            let t = mesh0[1].as_mut().expect("link to rank 1");
            let mut at = 0;
            while at < wire.len() {
                match t.try_write(&[&wire[at..]]) {
                    Ok(n) => at += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                    Err(e) => panic!("writing: {e}"),
                }
            }
            drop(mesh0);
        });
        let spin = SpinPolicy { spin: Duration::from_micros(50), yield_between: true };
        let mut peers = Peers::new(1, std::mem::take(&mut mesh1), AbortSignal::new()?.into(), spin, 1 << 16);
        peers.begin_op();
        let mut out = vec![0u8; 64];
        let fp = fingerprint(5, 16);
        let r = peers.exchange(&fp, 3, deadline, None, Some((0, Sink::Copy(&mut out))));
        writer.join().expect("writer");
        r.map(|()| out)
    }

    fn frame(fp: &Fingerprint, step: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = encode(KIND_DATA, fp, step, payload.len() as u32).to_vec();
        v.extend_from_slice(payload);
        v
    }

    fn message(r: Result<Vec<u8>>) -> String {
        match r {
            Ok(_) => panic!("a bad frame was accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_well_formed_frame_is_received() {
        let payload: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37)).collect();
        let got = receive_after(frame(&fingerprint(5, 16), 3, &payload)).expect("a valid frame");
        assert_eq!(got, payload);
    }

    #[test]
    fn bad_magic_is_a_bad_frame_error() {
        let mut wire = frame(&fingerprint(5, 16), 3, &[7u8; 64]);
        wire[0] ^= 0xff;
        let m = message(receive_after(wire));
        assert!(m.contains("bad frame") && m.contains("magic"), "{m}");
    }

    #[test]
    fn unknown_kind_and_undecodable_fields_are_bad_frames() {
        let mut wire = frame(&fingerprint(5, 16), 3, &[7u8; 64]);
        wire[4] = 77;
        let m = message(receive_after(wire));
        assert!(m.contains("unknown frame kind 77"), "{m}");
        let mut wire = frame(&fingerprint(5, 16), 3, &[7u8; 64]);
        wire[FP_AT + 1] = 200; // no such data type
        let m = message(receive_after(wire));
        assert!(m.contains("undecodable"), "{m}");
    }

    #[test]
    fn another_collective_is_a_mismatch_naming_both() {
        let m = message(receive_after(frame(&fingerprint(5, 17), 3, &[7u8; 68])));
        assert!(m.contains("collective mismatch"), "{m}");
        assert!(m.contains("rank 1 called all_reduce #5 (16 x float"), "{m}");
        assert!(m.contains("rank 0 called all_reduce #5 (17 x float"), "{m}");
    }

    #[test]
    fn wrong_step_or_length_is_out_of_step() {
        let m = message(receive_after(frame(&fingerprint(5, 16), 4, &[7u8; 64])));
        assert!(m.contains("out of step"), "{m}");
        let m = message(receive_after(frame(&fingerprint(5, 16), 3, &[7u8; 32])));
        assert!(m.contains("out of step"), "{m}");
    }

    #[test]
    fn a_truncated_frame_then_close_is_a_remote_error() {
        let mut wire = frame(&fingerprint(5, 16), 3, &[7u8; 64]);
        wire.truncate(HEADER_LEN + 10);
        let r = receive_after(wire);
        assert!(matches!(r, Err(Error::Remote(_))), "{r:?}");
        assert!(message(r).contains("closed its connection"));
    }
}
