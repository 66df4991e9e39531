//! A whole ring schedule as one stream ([`RingRun`], [`Peers::ring`]): what arrives at step `k`
//! is forwarded as step `k + 1`'s send while it is still arriving, so there is no bubble between
//! steps and forwarded bytes leave while they are still in cache.

use std::time::Instant;

use super::frame::{KIND_DATA, encode};
use super::rx::Rx;
use super::stream::{Stream, Wants};
use super::tx::Tx;
use super::{Peers, RingPlan, Sink, Source, explain_send_failure, live_link};
use crate::collective::Fingerprint;
use crate::error::{Error, Result};

/// A [`RingPlan`] running on its buffers: `work` receives (and, for a reduce-scatter, holds
/// the partial results), `src` is read where given (out-of-place inputs).
pub struct RingRun<'a> {
    plan: &'a RingPlan<'a>,
    work: &'a mut [u8],
    src: Option<&'a [u8]>,
    /// Steps whose send / receive is complete.
    ts: usize,
    rs: usize,
    /// The current send and receive (`None` until the first pump opens the links).
    tx: Option<Tx<'static>>,
    rx: Option<Rx>,
    /// Bytes the current send could take at the last pump (all of it for step 0).
    tx_avail: usize,
}

impl std::fmt::Debug for RingRun<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingRun")
            .field("plan", self.plan)
            .field("ts", &self.ts)
            .field("rs", &self.rs)
            .finish()
    }
}

impl<'a> RingRun<'a> {
    /// The ring `plan` on `work` (and `src`).
    pub fn new(plan: &'a RingPlan<'a>, work: &'a mut [u8], src: Option<&'a [u8]>) -> RingRun<'a> {
        RingRun { plan, work, src, ts: 0, rs: 0, tx: None, rx: None, tx_avail: usize::MAX }
    }

    /// The receive of step `rs` may start: the send that last read its piece is done.
    fn may_receive(&self) -> bool {
        let p = self.plan;
        self.rs < p.steps && (self.rs < p.lag || self.ts > self.rs - p.lag)
    }
}

/// Bytes step `k` sends: its first piece, then what the step before received.
fn send_len(plan: &RingPlan<'_>, k: usize) -> usize {
    if k == 0 { plan.send0.len() } else { (plan.piece)(k - 1).len() }
}

impl Stream for RingRun<'_> {
    fn pump(
        &mut self,
        peers: &mut Peers,
        fp: &Fingerprint,
        deadline: Instant,
        scratch: &mut [u8],
    ) -> Result<bool> {
        let plan = self.plan;
        let header = |k: usize| encode(KIND_DATA, fp, (plan.first_step + k) as u16, 0);
        if self.done() {
            return Ok(false);
        }
        if self.tx.is_none() {
            peers.check_peer(plan.left)?;
            peers.check_peer(plan.right)?;
            peers.ensure(&[plan.left, plan.right], fp, plan.first_step as u16, deadline)?;
            self.tx = Some(Tx::new(plan.right, Source::Forward, send_len(plan, 0), header(0), peers.segment));
            self.rx = Some(Rx::new(plan.left, (plan.piece)(0).len(), peers.segment));
        }
        let mut progressed = false;
        // Send: step 0 reads its piece; step k > 0 forwards what step k - 1 received.
        if self.ts < plan.steps
            && let (Some(tx), Some(rx)) = (self.tx.as_mut(), self.rx.as_ref())
        {
            let ts = self.ts;
            let data: &[u8] = if ts == 0 {
                match self.src {
                    Some(s) => &s[plan.send0.clone()],
                    None => &self.work[plan.send0.clone()],
                }
            } else {
                let p = (plan.piece)(ts - 1);
                let ready = if self.rs > ts - 1 { p.len() } else { rx.final_len(ts - 1 < plan.reduce_steps) };
                &self.work[p.start..p.start + ready]
            };
            self.tx_avail = data.len();
            let link = live_link(&mut peers.links, plan.right)?;
            progressed |= tx.pump(link, Some(data)).map_err(|e| explain_send_failure(link, plan.right, e))?;
            if tx.done {
                self.ts += 1;
                if self.ts < plan.steps {
                    *tx = Tx::new(
                        plan.right,
                        Source::Forward,
                        send_len(plan, self.ts),
                        header(self.ts),
                        peers.segment,
                    );
                }
            }
        }
        // Receive step rs, once the send that last read its piece (step rs - lag) is done.
        if self.may_receive()
            && let Some(rx) = self.rx.as_mut()
        {
            let rs = self.rs;
            let p = (plan.piece)(rs);
            let mut sink = if rs < plan.reduce_steps {
                Sink::Reduce {
                    dst: &mut self.work[p.clone()],
                    other: self.src.map(|s| &s[p]),
                    dtype: plan.dtype,
                    op: plan.op,
                }
            } else {
                Sink::Copy(&mut self.work[p])
            };
            let link = live_link(&mut peers.links, plan.left)?;
            let step = (plan.first_step + rs) as u16;
            progressed |= rx
                .pump(&mut sink, peers.rank, link, fp, step, scratch)
                .map_err(|e| e.with_peer(plan.left))?;
            if rx.done {
                self.rs += 1;
                if self.rs < plan.steps {
                    *rx = Rx::new(plan.left, (plan.piece)(self.rs).len(), peers.segment);
                }
                progressed = true;
            }
        }
        Ok(progressed)
    }

    fn done(&self) -> bool {
        self.ts == self.plan.steps && self.rs == self.plan.steps
    }

    fn wants(&self, writes: &mut Wants, reads: &mut Wants) {
        // shm: a send waiting for forwarded bytes waits on the receive, not on its link
        let starved = self.tx.as_ref().is_some_and(|t| t.starved(self.tx_avail));
        if self.ts < self.plan.steps && !starved {
            writes.push(self.plan.right);
        }
        if self.may_receive() {
            reads.push(self.plan.left);
        }
    }

    fn waiting(&self) -> (Option<usize>, usize) {
        let p = self.plan;
        let peer = if self.may_receive() { Some(p.left) } else { (self.ts < p.steps).then_some(p.right) };
        (peer, p.first_step + self.rs.min(self.ts))
    }

    fn timeout_error(&self, peers: &Peers, fp: &Fingerprint) -> Error {
        let p = self.plan;
        let step = p.first_step + self.rs.min(self.ts);
        let tx = self.tx.as_ref().filter(|_| self.ts < p.steps);
        let rx = self.rx.as_ref().filter(|_| self.rs < p.steps);
        peers.timeout_error(fp, step as u16, tx, rx)
    }

    fn moved(&self) -> usize {
        let p = self.plan;
        if p.steps == 0 {
            return 0;
        }
        let received: usize = (0..p.steps).map(|k| (p.piece)(k).len()).sum();
        received + p.send0.len() + received - (p.piece)(p.steps - 1).len()
    }
}

impl Peers {
    /// Runs a whole ring schedule as one stream (see [`RingPlan`], [`RingRun`]).
    pub fn ring(
        &mut self,
        fp: &Fingerprint,
        deadline: Instant,
        plan: &RingPlan<'_>,
        work: &mut [u8],
        src: Option<&[u8]>,
    ) -> Result<()> {
        self.drive(fp, deadline, &mut [&mut RingRun::new(plan, work, src)])
    }
}
