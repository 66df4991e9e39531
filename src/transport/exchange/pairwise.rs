//! An all-to-all's pairwise exchanges, several in flight at once ([`Peers::all_to_all`]).
//!
//! Member `me` of a group of `n` sends its block for member `me + s` there and receives the
//! block of member `me - s` (mod `n`) at step `s = 1 .. n - 1`. Each ordered pair of members
//! meets at exactly one step, so the exchanges of different steps never share a direction of a
//! link and need not wait for each other: up to [`WINDOW`] steps are in flight together, step
//! `s` opening once step `s - WINDOW` is complete on this rank (both directions). One step at a
//! time left a host's link idle whenever its ranks' pairs of one step finished at different
//! times: the compressed column phase of the 2D torus ran at about 81% of a 1 Gbit/s link
//! (4 hosts x 2 ranks) that way.
//!
//! **No deadlock.** Step 1 is open on every rank from the start. If every step up to `k` is
//! complete on every rank, every rank has step `k + 1` open (its window then reaches
//! `k + WINDOW`), so both ends of each pair of step `k + 1` are driving it and it completes.
//! Opening a link on demand (`ensure`) waits only for the peer's acceptor thread or for the
//! peer to dial, never for the peer's own exchanges.
//!
//! The window bounds the streams a rank drives at once (and its poll set), as NCCL bounds an
//! all-to-all's concurrency by its channels. Receives are copies: a copying receive's use of
//! the engine's scratch ends within each pump (`rx.rs`), so concurrent receives can share it.

use std::ops::Range;
use std::time::Instant;

use super::frame::{KIND_DATA, encode};
use super::rx::Rx;
use super::stream::{Stream, Wants};
use super::tx::Tx;
use super::{Peers, Sink, Source, explain_send_failure, live_link};
use crate::collective::Fingerprint;
use crate::error::{Error, Result};

/// Steps of an all-to-all in flight at once at most.
pub const WINDOW: usize = 8;
// `tests/collectives.rs` slides the window with 10 to 19 ranks.
const _: () = assert!(WINDOW + 1 < 10);

/// The pairwise schedule of one all-to-all run by [`Peers::all_to_all`].
pub struct AllToAllPlan<'f> {
    /// Members of the group.
    pub n: usize,
    /// This rank's position in the group.
    pub me: usize,
    /// The communicator rank of each member.
    pub member: &'f dyn Fn(usize) -> usize,
    /// Step number on the wire of step `s = 1` (step `s` travels as `first_step + s - 1`).
    pub first_step: usize,
    /// Bytes of one block: block `j` of the source goes to member `j`, block `j` of the output
    /// comes from member `j` (unless `splits` gives each block its own place).
    pub block: usize,
    /// An all-to-all-v's blocks, where they differ in size.
    pub splits: Option<Splits<'f>>,
}

/// Where each member's block lies in an all-to-all-v's buffers: byte offsets, `n + 1` each
/// (block `j` of the source is `send[j]..send[j + 1]`, of the output `recv[j]..recv[j + 1]`),
/// never decreasing (checked by [`AllToAllRun::new`]).
#[derive(Debug, Clone, Copy)]
pub struct Splits<'f> {
    /// Offsets of the blocks to send.
    pub send: &'f [usize],
    /// Offsets of the blocks to receive.
    pub recv: &'f [usize],
}

impl std::fmt::Debug for AllToAllPlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllToAllPlan")
            .field("n", &self.n)
            .field("me", &self.me)
            .field("first_step", &self.first_step)
            .field("block", &self.block)
            .field("splits", &self.splits)
            .finish_non_exhaustive()
    }
}

impl AllToAllPlan<'_> {
    fn to(&self, s: usize) -> usize {
        (self.me + s) % self.n
    }

    fn from(&self, s: usize) -> usize {
        (self.me + self.n - s) % self.n
    }

    /// The source's block for member `j`.
    fn send_at(&self, j: usize) -> Range<usize> {
        match self.splits {
            Some(s) => s.send[j]..s.send[j + 1],
            None => j * self.block..(j + 1) * self.block,
        }
    }

    /// The output's block from member `j`.
    fn recv_at(&self, j: usize) -> Range<usize> {
        match self.splits {
            Some(s) => s.recv[j]..s.recv[j + 1],
            None => j * self.block..(j + 1) * self.block,
        }
    }

    /// Whether the blocks fit buffers of `src` and `dst` bytes.
    fn fits(&self, src: usize, dst: usize) -> bool {
        let n = self.n;
        match self.splits {
            None => src >= n * self.block && dst >= n * self.block,
            Some(s) => {
                let ordered = |o: &[usize], len: usize| {
                    o.len() == n + 1 && o.windows(2).all(|w| w[0] <= w[1]) && o[n] <= len
                };
                ordered(s.send, src) && ordered(s.recv, dst)
            }
        }
    }

    fn step(&self, s: usize) -> u16 {
        // Steps are compared modulo 2^16: enough to catch streams out of step.
        (self.first_step + s - 1) as u16
    }
}

/// An [`AllToAllPlan`] running on its buffers (a [`Stream`]).
pub struct AllToAllRun<'a> {
    plan: &'a AllToAllPlan<'a>,
    src: &'a [u8],
    dst: &'a mut [u8],
    txs: [Option<Tx<'a>>; WINDOW],
    rxs: [Option<Rx>; WINDOW],
    /// Steps `lo..open` are in flight; every step below `lo` is complete.
    lo: usize,
    open: usize,
    /// Bytes this rank sends and receives in all.
    moved: usize,
}

impl std::fmt::Debug for AllToAllRun<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllToAllRun")
            .field("plan", self.plan)
            .field("lo", &self.lo)
            .field("open", &self.open)
            .finish()
    }
}

impl<'a> AllToAllRun<'a> {
    /// The all-to-all `plan` from `src` into `dst` (at least `n` blocks each).
    pub fn new(plan: &'a AllToAllPlan<'a>, src: &'a [u8], dst: &'a mut [u8]) -> Result<AllToAllRun<'a>> {
        let n = plan.n;
        if plan.me >= n.max(1) || !plan.fits(src.len(), dst.len()) {
            return Err(Error::Internal(
                format!("all-to-all of {n} blocks ({:?}): buffers too short", plan).into(),
            ));
        }
        let (txs, rxs) = (std::array::from_fn(|_| None), std::array::from_fn(|_| None));
        let others = (0..n).filter(|&j| j != plan.me);
        let moved = others.map(|j| plan.send_at(j).len() + plan.recv_at(j).len()).sum();
        Ok(AllToAllRun { plan, src, dst, txs, rxs, lo: 1, open: 1, moved })
    }

    fn complete(&self, s: usize) -> bool {
        let i = s % WINDOW;
        self.txs[i].as_ref().is_some_and(|t| t.done) && self.rxs[i].as_ref().is_some_and(|r| r.done)
    }
}

impl Stream for AllToAllRun<'_> {
    fn pump(
        &mut self,
        peers: &mut Peers,
        fp: &Fingerprint,
        deadline: Instant,
        scratch: &mut [u8],
    ) -> Result<bool> {
        let plan = self.plan;
        let n = plan.n;
        if self.open == 1 {
            for j in (0..n).filter(|&j| j != plan.me) {
                peers.check_peer((plan.member)(j))?;
            }
        }
        while self.open < n && self.open < self.lo + WINDOW {
            let s = self.open;
            let (to, from) = ((plan.member)(plan.to(s)), (plan.member)(plan.from(s)));
            peers.ensure(&[to, from], fp, plan.step(s), deadline)?;
            let header = encode(KIND_DATA, fp, plan.step(s), 0);
            let data = &self.src[plan.send_at(plan.to(s))];
            self.txs[s % WINDOW] = Some(Tx::new(to, Source::Bytes(data), data.len(), header, peers.segment));
            self.rxs[s % WINDOW] = Some(Rx::new(from, plan.recv_at(plan.from(s)).len(), peers.segment));
            self.open += 1;
        }
        let mut progressed = false;
        for s in self.lo..self.open {
            if let Some(t) = self.txs[s % WINDOW].as_mut().filter(|t| !t.done) {
                let link = live_link(&mut peers.links, t.peer)?;
                progressed |= t.pump(link, None).map_err(|e| explain_send_failure(link, t.peer, e))?;
            }
            if let Some(r) = self.rxs[s % WINDOW].as_mut().filter(|r| !r.done) {
                let peer = r.peer;
                let link = live_link(&mut peers.links, peer)?;
                let mut sink = Sink::Copy(&mut self.dst[plan.recv_at(plan.from(s))]);
                progressed |= r
                    .pump(&mut sink, peers.rank, link, fp, plan.step(s), scratch)
                    .map_err(|e| e.with_peer(peer))?;
            }
        }
        while self.lo < self.open && self.complete(self.lo) {
            self.lo += 1;
            progressed = true;
        }
        Ok(progressed)
    }

    fn done(&self) -> bool {
        self.lo >= self.plan.n
    }

    fn wants(&self, writes: &mut Wants, reads: &mut Wants) {
        for s in self.lo..self.open {
            if let Some(t) = self.txs[s % WINDOW].as_ref().filter(|t| !t.done) {
                writes.push(t.peer);
            }
            if let Some(r) = self.rxs[s % WINDOW].as_ref().filter(|r| !r.done) {
                reads.push(r.peer);
            }
        }
    }

    fn waiting(&self) -> (Option<usize>, usize) {
        let i = self.lo % WINDOW;
        let rx = self.rxs[i].as_ref().filter(|r| !r.done).map(|r| r.peer);
        let tx = self.txs[i].as_ref().filter(|t| !t.done).map(|t| t.peer);
        (rx.or(tx), self.plan.step(self.lo.min(self.plan.n - 1)) as usize)
    }

    fn timeout_error(&self, peers: &Peers, fp: &Fingerprint) -> Error {
        let i = self.lo % WINDOW;
        peers.timeout_error(fp, self.plan.step(self.lo), self.txs[i].as_ref(), self.rxs[i].as_ref())
    }

    fn moved(&self) -> usize {
        self.moved
    }
}

impl Peers {
    /// Runs the pairwise all-to-all `plan` (see [`AllToAllRun`]): block `plan.to(s)` of `src`
    /// to that member and block `plan.from(s)` of `dst` from that one (of the sizes `plan.splits`
    /// gives, where it does: a size both ends disagree on is an error), for every step, up to
    /// [`WINDOW`] steps at once. This rank's own block is the caller's to copy.
    pub fn all_to_all(
        &mut self,
        fp: &Fingerprint,
        deadline: Instant,
        plan: &AllToAllPlan<'_>,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        self.drive(fp, deadline, &mut [&mut AllToAllRun::new(plan, src, dst)?])
    }
}
