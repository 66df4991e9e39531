//! The caller's side of an offloaded link ([`Offloaded`]): the stream dealt into and read out of
//! each lane's memory rings in [`CHUNK`]s, as [`super::super::striped`] deals it over sockets,
//! and the doorbell that wakes the lane's progress thread.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rtrb::{Consumer, CopyToUninit, Producer};

use super::super::striped::{CHUNK, Stripe};
use super::{Helper, LaneState, LinkState, ProgressThreads};
use crate::sys::poll::{Events, PollFd};
use crate::transport::Transport;

/// One lane as the caller holds it.
#[derive(Debug)]
pub(super) struct CallerLane {
    pub(super) state: Arc<LaneState>,
    pub(super) out: Producer<u8>,
    pub(super) inp: Consumer<u8>,
    pub(super) helper: Arc<Helper>,
}

/// The caller's side of a link whose lanes progress threads move.
#[derive(Debug)]
pub struct Offloaded {
    pub(super) lanes: Vec<CallerLane>,
    pub(super) link: Arc<LinkState>,
    pub(super) tx: Stripe,
    pub(super) rx: Stripe,
    pub(super) _pool: ProgressThreads,
}

/// Copies bytes `skip..skip + dst.len()` of the concatenation of `bufs` into `dst`.
fn gather(bufs: &[&[u8]], mut skip: usize, mut dst: &mut [MaybeUninit<u8>]) {
    for b in bufs {
        if dst.is_empty() {
            return;
        }
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        let take = (b.len() - skip).min(dst.len());
        let (head, rest) = dst.split_at_mut(take);
        b[skip..skip + take].copy_to_uninit(head);
        dst = rest;
        skip = 0;
    }
}

/// Copies `src` into bytes `skip..skip + src.len()` of the concatenation of `bufs`.
fn scatter(mut src: &[u8], bufs: &mut [&mut [u8]], mut skip: usize) {
    for b in bufs.iter_mut() {
        if src.is_empty() {
            return;
        }
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        let take = (b.len() - skip).min(src.len());
        b[skip..skip + take].copy_from_slice(&src[..take]);
        src = &src[take..];
        skip = 0;
    }
}

impl Transport for Offloaded {
    fn kind(&self) -> &'static str {
        if self.lanes.len() > 1 { "tcp-striped" } else { "tcp" }
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        if let Some(e) = self.link.error() {
            return Err(e);
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let n = self.lanes.len();
        let mut done = 0;
        while done < total {
            let lane = &mut self.lanes[self.tx.lane];
            let room = lane.out.slots().min(self.tx.left).min(total - done);
            if room == 0 {
                break;
            }
            let Ok(mut chunk) = lane.out.write_chunk_uninit(room) else { break };
            let (a, b) = chunk.as_mut_slices();
            let first = a.len();
            gather(bufs, done, a);
            gather(bufs, done + first, b);
            // SAFETY: `gather` filled both slices of the chunk (`room` bytes of `bufs`).
            unsafe { chunk.commit_all() };
            lane.helper.bell.ring();
            done += room;
            self.tx.advance(room, n);
        }
        if done == 0 && total > 0 { Err(io::ErrorKind::WouldBlock.into()) } else { Ok(done) }
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty read"));
        }
        let n = self.lanes.len();
        let mut done = 0;
        while done < total {
            let lane = &mut self.lanes[self.rx.lane];
            // Read the end mark first: the helper sets it after the lane's last byte.
            let ended = lane.state.ended.load(Ordering::Acquire);
            let avail = lane.inp.slots().min(self.rx.left).min(total - done);
            if avail == 0 {
                if done > 0 || ended {
                    break;
                }
                // Bytes that arrived before a failure are still delivered above.
                return Err(self.link.error().unwrap_or_else(|| io::ErrorKind::WouldBlock.into()));
            }
            let Ok(chunk) = lane.inp.read_chunk(avail) else { break };
            let (a, b) = chunk.as_slices();
            scatter(a, bufs, done);
            scatter(b, bufs, done + a.len());
            chunk.commit_all();
            lane.helper.bell.ring();
            done += avail;
            self.rx.advance(avail, n);
        }
        Ok(done)
    }

    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // The rest of the current chunk on its lane, then the head of the next lane, ... A lane
        // comes round again once every lane was visited (at the next visit, with one lane): what
        // the earlier visits peeked from its ring is skipped, not seen twice.
        let lanes = self.lanes.len();
        let (start, first) = (self.rx.lane, self.rx.left);
        let (mut left, mut got, mut visit) = (first, 0, 0);
        while got < buf.len() {
            let lane = (start + visit) % lanes;
            // Every earlier visit took all it was offered: `first` bytes on the first visit to
            // the starting lane, a whole chunk on every other.
            let earlier = visit / lanes;
            let skip = match (earlier, lane == start) {
                (0, _) => 0,
                (e, true) => first + (e - 1) * CHUNK,
                (e, false) => e * CHUNK,
            };
            let l = &mut self.lanes[lane];
            let want = left.min(buf.len() - got).min(l.inp.slots().saturating_sub(skip));
            if want == 0 {
                break;
            }
            let Ok(chunk) = l.inp.read_chunk(skip + want) else { break };
            let (a, b) = chunk.as_slices();
            let (a, b) = if skip < a.len() { (&a[skip..], b) } else { (&[][..], &b[skip - a.len()..]) };
            let from_a = a.len().min(want);
            buf[got..got + from_a].copy_from_slice(&a[..from_a]);
            buf[got + from_a..got + want].copy_from_slice(&b[..want - from_a]);
            // (Not committed: peeking consumes nothing.)
            got += want;
            if want < left {
                break;
            }
            visit += 1;
            left = CHUNK;
        }
        if got == 0
            && let Some(e) = self.link.error()
        {
            return Err(e);
        }
        Ok(got)
    }

    fn pollable(&self) -> RawFd {
        self.link.bell.event.as_raw_fd()
    }

    fn arm(&mut self, read: bool, write: bool) -> Option<Events> {
        self.link.bell.arm();
        let rx = &self.lanes[self.rx.lane];
        let ready = self.link.failed.load(Ordering::Acquire)
            || (read && (rx.state.ended.load(Ordering::Acquire) || !rx.inp.is_empty()))
            || (write && self.lanes[self.tx.lane].out.slots() > 0);
        if ready {
            self.link.bell.disarm();
            return None;
        }
        Some(PollFd::IN)
    }

    fn shutdown(&mut self) {
        for l in &self.lanes {
            l.state.shutdown.store(true, Ordering::Release);
            l.helper.bell.ring();
        }
    }
}

impl Drop for Offloaded {
    /// The helpers see the rings abandoned: wake them to flush what is left and let go.
    fn drop(&mut self) {
        for CallerLane { out, inp, helper, .. } in std::mem::take(&mut self.lanes) {
            drop((out, inp));
            helper.bell.event.signal();
        }
    }
}
