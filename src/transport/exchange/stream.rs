//! Schedules that run as streams ([`Stream`]: a whole ring, an all-to-all), driven without
//! blocking by [`Peers::drive`], one alone or several side by side on one thread.
//!
//! Side by side is how an algorithm overlaps phases on different links: the pipelined 2D torus
//! (`algorithm/torus2d.rs`) reduces one chunk along the row, inside the host, while the previous
//! chunk crosses the hosts along the column. The streams of one drive must use different links
//! in each direction, or a link would carry two streams' frames interleaved (each frame is
//! checked against its stream's step, so that is an error, never wrong data).
//!
//! Each stream gets its own slice of the engine's scratch: a reducing receive keeps the bytes of
//! a partial element there between pumps.

use std::time::Instant;

use super::Peers;
use crate::collective::Fingerprint;
use crate::error::Result;

/// Streams side by side in one drive at most.
pub const MAX_STREAMS: usize = 4;

/// One schedule, pumped by [`Peers::drive`] until done.
pub trait Stream {
    /// Moves what can move now without blocking (opening the links it needs first); true when
    /// anything moved. `scratch` is this stream's own, at least a segment long.
    fn pump(
        &mut self,
        peers: &mut Peers,
        fp: &Fingerprint,
        deadline: Instant,
        scratch: &mut [u8],
    ) -> Result<bool>;

    /// True once every step is complete in both directions.
    fn done(&self) -> bool;

    /// The peers it waits for, to take its bytes and to send it bytes.
    fn wants(&self, writes: &mut Wants, reads: &mut Wants);

    /// Where it waits (the awaited peer, the step on the wire), for the flight recorder.
    fn waiting(&self) -> (Option<usize>, usize);

    /// The error when the deadline passes while it is not done.
    fn timeout_error(&self, peers: &Peers, fp: &Fingerprint) -> crate::error::Error;

    /// Bytes it sent and received (when done).
    fn moved(&self) -> usize;
}

/// Peers one direction of a sleeping drive watches at most (a batch of sends and receives
/// with more peers naps instead: `Wants::overflowed`).
const WANTS_MAX: usize = 64;
const _: () = assert!(WANTS_MAX >= 2 * super::WINDOW);
/// How long a drive whose peers did not all fit in its [`Wants`] sleeps at most.
const NAP: std::time::Duration = std::time::Duration::from_millis(1);

/// The peers a sleeping drive waits on.
#[derive(Debug)]
pub struct Wants {
    ranks: [usize; WANTS_MAX],
    len: usize,
    /// A rank did not fit (the sleep would not wake for it).
    overflowed: bool,
}

impl Default for Wants {
    fn default() -> Wants {
        Wants { ranks: [0; WANTS_MAX], len: 0, overflowed: false }
    }
}

impl Wants {
    /// Adds `rank` (once; past the capacity it is dropped, and the drive sleeps only briefly).
    pub fn push(&mut self, rank: usize) {
        if self.as_slice().contains(&rank) {
            return;
        }
        if self.len < self.ranks.len() {
            self.ranks[self.len] = rank;
            self.len += 1;
        } else {
            self.overflowed = true;
        }
    }

    /// The ranks added so far.
    pub fn as_slice(&self) -> &[usize] {
        &self.ranks[..self.len]
    }
}

impl Peers {
    /// Pumps `streams` side by side until every one is done, the deadline passes, or one fails.
    /// Spins for the spin policy's time after the last progress, then sleeps in `poll(2)` on
    /// every link a stream waits for (and the idle links, as every wait does).
    pub fn drive(
        &mut self,
        fp: &Fingerprint,
        deadline: Instant,
        streams: &mut [&mut dyn Stream],
    ) -> Result<()> {
        if streams.len() > MAX_STREAMS {
            return Err(crate::error::Error::Internal(
                format!("{} streams in one drive (at most {MAX_STREAMS})", streams.len()).into(),
            ));
        }
        // The streams borrow the engine; their scratch is taken out for the drive.
        let part = self.segment.max(super::rx::STAGE_MAX).next_multiple_of(8);
        let words = streams.len() * part / 8;
        let mut scratch = std::mem::take(&mut self.scratch);
        if scratch.len() < words {
            scratch.resize(words, 0);
        }
        let result =
            self.drive_with(fp, deadline, streams, bytemuck::cast_slice_mut(&mut scratch[..words]), part);
        self.scratch = scratch;
        result
    }

    fn drive_with(
        &mut self,
        fp: &Fingerprint,
        deadline: Instant,
        streams: &mut [&mut dyn Stream],
        scratch: &mut [u8],
        part: usize,
    ) -> Result<()> {
        let mut last_progress = Instant::now();
        loop {
            self.abort.check()?;
            let mut progressed = false;
            for (s, scratch) in streams.iter_mut().zip(scratch.chunks_mut(part)) {
                if !s.done() {
                    progressed |= s.pump(self, fp, deadline, scratch)?;
                }
            }
            let Some(waiting) = streams.iter().find(|s| !s.done()) else {
                self.progress.moved(streams.iter().map(|s| s.moved()).sum());
                return Ok(());
            };
            let now = Instant::now();
            if progressed {
                last_progress = now;
                continue;
            }
            if now >= deadline {
                return Err(waiting.timeout_error(self, fp));
            }
            if self.spin_once(last_progress, now) {
                continue;
            }
            let (mut writes, mut reads) = (Wants::default(), Wants::default());
            for s in streams.iter().filter(|s| !s.done()) {
                s.wants(&mut writes, &mut reads);
            }
            let (peer, step) = waiting.waiting();
            self.progress.waiting(peer, step);
            let until =
                if writes.overflowed || reads.overflowed { deadline.min(now + NAP) } else { deadline };
            self.sleep(fp, writes.as_slice(), reads.as_slice(), until)?;
            last_progress = Instant::now();
        }
    }
}

/// No stream: done from the start (an optional part of a [`Then`]).
impl<S: Stream> Stream for Option<S> {
    fn pump(
        &mut self,
        peers: &mut Peers,
        fp: &Fingerprint,
        deadline: Instant,
        scratch: &mut [u8],
    ) -> Result<bool> {
        self.as_mut().map_or(Ok(false), |s| s.pump(peers, fp, deadline, scratch))
    }

    fn done(&self) -> bool {
        self.as_ref().is_none_or(|s| s.done())
    }

    fn wants(&self, writes: &mut Wants, reads: &mut Wants) {
        if let Some(s) = self {
            s.wants(writes, reads);
        }
    }

    fn waiting(&self) -> (Option<usize>, usize) {
        self.as_ref().map_or((None, 0), |s| s.waiting())
    }

    fn timeout_error(&self, peers: &Peers, fp: &Fingerprint) -> crate::error::Error {
        match self {
            Some(s) => s.timeout_error(peers, fp),
            None => crate::error::Error::Internal("an absent stream timed out".into()),
        }
    }

    fn moved(&self) -> usize {
        self.as_ref().map_or(0, |s| s.moved())
    }
}

/// `first`, then `second` on the same links (two phases of one lane, one after the other).
#[derive(Debug)]
pub struct Then<A, B> {
    /// Runs first.
    pub first: A,
    /// Starts once `first` is done.
    pub second: B,
}

impl<A: Stream, B: Stream> Then<A, B> {
    fn current(&self) -> &dyn Stream {
        if self.first.done() { &self.second } else { &self.first }
    }
}

impl<A: Stream, B: Stream> Stream for Then<A, B> {
    fn pump(
        &mut self,
        peers: &mut Peers,
        fp: &Fingerprint,
        deadline: Instant,
        scratch: &mut [u8],
    ) -> Result<bool> {
        let mut progressed = false;
        if !self.first.done() {
            progressed = self.first.pump(peers, fp, deadline, scratch)?;
        }
        if self.first.done() {
            progressed |= self.second.pump(peers, fp, deadline, scratch)?;
        }
        Ok(progressed)
    }

    fn done(&self) -> bool {
        self.first.done() && self.second.done()
    }

    fn wants(&self, writes: &mut Wants, reads: &mut Wants) {
        self.current().wants(writes, reads);
    }

    fn waiting(&self) -> (Option<usize>, usize) {
        self.current().waiting()
    }

    fn timeout_error(&self, peers: &Peers, fp: &Fingerprint) -> crate::error::Error {
        self.current().timeout_error(peers, fp)
    }

    fn moved(&self) -> usize {
        self.first.moved() + self.second.moved()
    }
}
