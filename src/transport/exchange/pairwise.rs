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
    /// comes from member `j`.
    pub block: usize,
}

impl std::fmt::Debug for AllToAllPlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllToAllPlan")
            .field("n", &self.n)
            .field("me", &self.me)
            .field("first_step", &self.first_step)
            .field("block", &self.block)
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

    fn at(&self, j: usize) -> Range<usize> {
        j * self.block..(j + 1) * self.block
    }

    fn step(&self, s: usize) -> u16 {
        // Steps are compared modulo 2^16: enough to catch streams out of step.
        (self.first_step + s - 1) as u16
    }
}

/// The peers a sleeping all-to-all waits on (at most one per open step and direction).
#[derive(Default)]
struct Wants {
    ranks: [usize; WINDOW],
    len: usize,
}

impl Wants {
    fn push(&mut self, rank: usize) {
        if self.len < WINDOW {
            self.ranks[self.len] = rank;
            self.len += 1;
        }
    }

    fn as_slice(&self) -> &[usize] {
        &self.ranks[..self.len]
    }
}

impl Peers {
    /// Runs the pairwise all-to-all `plan`: block `plan.to(s)` of `src` to that member and
    /// block `plan.from(s)` of `dst` from that one, for every step, up to [`WINDOW`] steps at
    /// once. This rank's own block is the caller's to copy.
    pub fn all_to_all(
        &mut self,
        fp: &Fingerprint,
        deadline: Instant,
        plan: &AllToAllPlan<'_>,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        let n = plan.n;
        if n <= 1 {
            return Ok(());
        }
        if plan.me >= n || src.len() < n * plan.block || dst.len() < n * plan.block {
            return Err(Error::Internal(
                format!("all-to-all of {n} blocks of {} bytes: buffers too short", plan.block).into(),
            ));
        }
        for j in (0..n).filter(|&j| j != plan.me) {
            self.check_peer((plan.member)(j))?;
        }
        let mut txs: [Option<Tx<'_>>; WINDOW] = std::array::from_fn(|_| None);
        let mut rxs: [Option<Rx>; WINDOW] = std::array::from_fn(|_| None);
        // Steps `lo..open` are in flight; every step below `lo` is complete.
        let (mut lo, mut open) = (1, 1);
        let mut last_progress = Instant::now();
        loop {
            self.abort.check()?;
            while open < n && open < lo + WINDOW {
                let (to, from) = ((plan.member)(plan.to(open)), (plan.member)(plan.from(open)));
                self.ensure(&[to, from], fp, plan.step(open), deadline)?;
                let header = encode(KIND_DATA, fp, plan.step(open), 0);
                let data = &src[plan.at(plan.to(open))];
                txs[open % WINDOW] = Some(Tx::new(to, Source::Bytes(data), plan.block, header, self.segment));
                rxs[open % WINDOW] = Some(Rx::new(from, plan.block, self.segment));
                open += 1;
            }
            let mut progressed = false;
            for s in lo..open {
                if let Some(t) = txs[s % WINDOW].as_mut().filter(|t| !t.done) {
                    let link = live_link(&mut self.links, t.peer)?;
                    progressed |= t.pump(link, None).map_err(|e| explain_send_failure(link, t.peer, e))?;
                }
                if let Some(r) = rxs[s % WINDOW].as_mut().filter(|r| !r.done) {
                    let peer = r.peer;
                    let link = live_link(&mut self.links, peer)?;
                    let scratch = bytemuck::cast_slice_mut::<u64, u8>(&mut self.scratch);
                    let mut sink = Sink::Copy(&mut dst[plan.at(plan.from(s))]);
                    progressed |= r
                        .pump(&mut sink, self.rank, link, fp, plan.step(s), scratch)
                        .map_err(|e| e.with_peer(peer))?;
                }
            }
            let complete = |s: usize| {
                txs[s % WINDOW].as_ref().is_some_and(|t| t.done)
                    && rxs[s % WINDOW].as_ref().is_some_and(|r| r.done)
            };
            while lo < open && complete(lo) {
                lo += 1;
                progressed = true;
            }
            if lo == n {
                self.progress.moved(2 * (n - 1) * plan.block);
                return Ok(());
            }
            let now = Instant::now();
            if progressed {
                last_progress = now;
                continue;
            }
            let (tx, rx) = (txs[lo % WINDOW].as_ref(), rxs[lo % WINDOW].as_ref());
            if now >= deadline {
                return Err(self.timeout_error(fp, plan.step(lo), tx, rx));
            }
            if now.duration_since(last_progress) < self.spin.spin {
                if self.spin.yield_between {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let (mut writes, mut reads) = (Wants::default(), Wants::default());
            for s in lo..open {
                if let Some(t) = txs[s % WINDOW].as_ref().filter(|t| !t.done) {
                    writes.push(t.peer);
                }
                if let Some(r) = rxs[s % WINDOW].as_ref().filter(|r| !r.done) {
                    reads.push(r.peer);
                }
            }
            let oldest = rx.filter(|r| !r.done).map(|r| r.peer).or(tx.map(|t| t.peer));
            self.progress.waiting(oldest, plan.step(lo) as usize);
            self.sleep(fp, writes.as_slice(), reads.as_slice(), deadline)?;
            last_progress = Instant::now();
        }
    }
}
