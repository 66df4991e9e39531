//! The progress engine: framed, fingerprinted, deadline-bounded exchanges between ranks.
//!
//! Every algorithm moves data through [`Peers::exchange`]: "send these bytes to rank A while
//! receiving that many bytes from rank B, and reduce (or copy) what arrives into this buffer".
//! One thread drives both directions without blocking, so a step is full duplex; received bytes
//! are reduced as soon as whole elements are in, so the reduction of one piece overlaps the
//! transfer of the next; [`Source::Forward`] re-sends what was just received (pipelined chains).
//! Two schedules run as one stream instead of step by step: a whole ring ([`Peers::ring`]) and a
//! pairwise all-to-all with several steps in flight ([`Peers::all_to_all`], `pairwise.rs`).
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
//!
//! ## Links on demand
//!
//! With a [`Connector`] (`TOROID_CONNECT=lazy`) a rank starts with no links (or only its
//! shared-memory ones) and every step first makes sure its peers are linked (`connect.rs`):
//! the higher rank of a pair dials, the lower one waits for the link its acceptor hands over,
//! watching its other links, the abort event and whether the awaited peer's process still
//! exists while it waits.

mod abort;
mod any;
mod batch;
mod connect;
pub(crate) mod frame;
mod pairwise;
mod ring_run;
mod rx;
mod step;
mod stream;
mod tx;
mod wait;

pub use abort::{AbortSignal, REVOKED};
pub use batch::{P2pDir, P2pTask};
pub use frame::HEADER_LEN;
pub use pairwise::{AllToAllPlan, AllToAllRun, Splits, WINDOW};
pub use ring_run::RingRun;
pub use stream::{Stream, Then};

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Connector, Transport};
use crate::collective::{CollKind, Fingerprint};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::sys::poll::PollFd;
use crate::trace::Progress;
use frame::{KIND_ABORT, MAX_REASON, decode, encode, read_abort};

/// How long a failing rank tries to deliver its abort frames.
const ABORT_SEND_BUDGET: Duration = Duration::from_millis(200);
/// Upper bound of one `poll(2)` sleep, so a lost wake-up can never stall past this.
const MAX_SLEEP: Duration = Duration::from_millis(500);

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
    /// The transport lends received bytes in place (reducing sinks read straight from it).
    zero_copy: bool,
}

/// The connected peers of one rank and the engine that drives exchanges with them.
pub struct Peers {
    rank: usize,
    links: Vec<Option<Link>>,
    abort: Arc<AbortSignal>,
    spin: SpinPolicy,
    segment: usize,
    scratch: Vec<u64>,
    pollfds: Vec<PollFd>,
    poll_ranks: Vec<usize>,
    /// Per-link state of a receive from any source (kept to reuse its allocation).
    heads: Vec<any::Head>,
    token: u64,
    /// The running operation's live state for the flight recorder (`trace::Progress`).
    progress: Arc<Progress>,
    /// Opens missing links on demand (`None`: every link was made at set-up).
    connector: Option<Box<dyn Connector>>,
    /// Set by [`Peers::poison`]: no link is used or opened any more.
    closed: bool,
    /// When [`Peers::poll_idle_links`] last asked whether an unlinked peer's process exists.
    gone_checked: Option<std::time::Instant>,
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
            // Copied small frames are staged here until their header is checked (see `rx`).
            scratch: vec![0; rx::STAGE_MAX / 8],
            pollfds: Vec::new(),
            poll_ranks: Vec::new(),
            heads: Vec::new(),
            token: 0,
            progress: Arc::default(),
            connector: None,
            closed: false,
            gone_checked: None,
        }
    }

    /// Opens the links that are missing on demand through `connector` (`TOROID_CONNECT=lazy`).
    pub fn set_connector(&mut self, connector: Box<dyn Connector>) {
        self.connector = Some(connector);
    }

    /// The peers this rank has a link to now, in rank order.
    pub fn connected(&self) -> Vec<usize> {
        (0..self.links.len()).filter(|&r| self.links[r].is_some()).collect()
    }

    /// True when links are opened on demand.
    pub fn connects_on_demand(&self) -> bool {
        self.connector.is_some()
    }

    /// Reports the running operation's progress to `progress` (a communicator's recorder).
    pub fn set_progress(&mut self, progress: Arc<Progress>) {
        self.progress = progress;
    }

    /// Where the running operation's progress goes.
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// How waiting ranks spend their time before sleeping.
    pub fn spin_policy(&self) -> SpinPolicy {
        self.spin
    }

    /// The kind of transport to `peer` ("shm", "rdma", "tcp", "tcp-striped"), or `None`
    /// without a link.
    pub fn link_kind(&self, peer: usize) -> Option<&'static str> {
        match self.links.get(peer).and_then(Option::as_ref) {
            Some(l) => Some(l.transport.kind()),
            // Not linked yet: the connector opens a TCP link when an operation needs one.
            None if !self.closed && peer != self.rank && peer < self.links.len() => {
                self.connector.as_ref().map(|c| c.kind_of(peer))
            }
            None => None,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks (links, including the empty one for this rank).
    pub fn size(&self) -> usize {
        self.links.len()
    }

    /// The abort signal this engine watches.
    pub fn abort_signal(&self) -> &Arc<AbortSignal> {
        &self.abort
    }

    /// Marks the start of a new operation (resets idle-link bookkeeping).
    pub fn begin_op(&mut self) {
        self.token += 1;
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
        if let Some(c) = self.connector.as_mut() {
            let mut frame = header.to_vec();
            frame.extend_from_slice(text);
            c.close(&frame);
        }
        self.closed = true;
    }

    /// While the spin policy's time since `last_progress` lasts, polls once more (yielding the
    /// core when ranks outnumber cores) and returns true; false once it is over (time to sleep).
    fn spin_once(&self, last_progress: Instant, now: Instant) -> bool {
        if now.duration_since(last_progress) >= self.spin.spin {
            return false;
        }
        if self.spin.yield_between {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        true
    }

    /// True when every link is gone (after [`Peers::poison`]; without a connector, also when
    /// there never were any).
    pub fn is_closed(&self) -> bool {
        self.closed || (self.connector.is_none() && self.links.iter().all(Option::is_none))
    }
}

/// A send failed because the peer closed: if what it sent last is an abort frame, report its
/// reason instead (it says why).
fn explain_send_failure(link: &mut Link, peer: usize, err: Error) -> Error {
    explain(link, peer, err).with_peer(peer)
}

fn explain(link: &mut Link, peer: usize, err: Error) -> Error {
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
    links.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| {
        Error::Aborted(format!("no connection to rank {peer} (communicator closed)").into()).with_peer(peer)
    })
}

fn mismatch(rank: usize, peer: usize, mine: &Fingerprint, theirs: &Fingerprint) -> Error {
    Error::InvalidUsage(
        format!(
            "collective mismatch: rank {rank} called {mine} but rank {peer} called {theirs}; \
         every rank must issue the same collectives in the same order with the same \
         type, count, op, root and algorithm"
        )
        .into(),
    )
    .with_peer(peer)
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
