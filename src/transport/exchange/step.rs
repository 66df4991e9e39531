//! One step of an algorithm ([`Peers::exchange`]) and a whole ring as one stream
//! ([`Peers::ring`]): both directions driven without blocking until done or the deadline.

use std::time::Instant;

use super::frame::{KIND_DATA, encode};
use super::rx::Rx;
use super::tx::Tx;
use super::{Peers, RingPlan, Sink, Source, explain_send_failure, live_link};
use crate::collective::Fingerprint;
use crate::error::{Error, Result};

impl Peers {
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
        let peers = [send.as_ref().map(|(p, _)| *p), recv.as_ref().map(|(p, _)| *p)];
        for p in peers.into_iter().flatten() {
            self.check_peer(p)?;
        }
        let (a, b) = (peers[0].or(peers[1]), peers[1].or(peers[0]));
        if let (Some(a), Some(b)) = (a, b) {
            self.ensure(&[a, b], fp, step, deadline)?;
        }
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
                let peer = r.peer;
                progressed |=
                    r.pump(sink, self.rank, link, fp, step, scratch).map_err(|e| e.with_peer(peer))?;
            }
            let mut forward_avail = usize::MAX;
            if forwarding {
                let out = match (rx.as_ref(), sink.as_ref()) {
                    (Some(r), Some(Sink::Copy(d))) => Some(&d[..r.final_len(false)]),
                    (Some(r), Some(Sink::Reduce { dst, .. })) => Some(&dst[..r.final_len(true)]),
                    _ => None,
                };
                forward_avail = out.map_or(0, <[u8]>::len);
                progressed |= self.pump_tx(tx.as_mut(), out)?;
            }
            let tx_done = tx.as_ref().is_none_or(|t| t.done);
            let rx_done = rx.as_ref().is_none_or(|r| r.done);
            if tx_done && rx_done {
                self.progress.moved(tx.as_ref().map_or(0, |t| t.total) + recv_len.unwrap_or(0));
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
            self.progress.waiting(want_read.or(want_write), step as usize);
            self.sleep(fp, want_write.as_slice(), want_read.as_slice(), deadline)?;
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
        self.ensure(&[plan.left, plan.right], fp, plan.first_step as u16, deadline)?;
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
            let mut tx_avail = usize::MAX;
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
                tx_avail = data.len();
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
                let peer = rx.peer;
                progressed |=
                    rx.pump(&mut sink, self.rank, link, fp, step, scratch).map_err(|e| e.with_peer(peer))?;
                if rx.done {
                    rs += 1;
                    if rs < plan.steps {
                        rx = Rx::new(plan.left, (plan.piece)(rs).len(), self.segment);
                    }
                    progressed = true;
                }
            }
            if ts == plan.steps && rs == plan.steps {
                let received: usize = (0..plan.steps).map(|k| (plan.piece)(k).len()).sum();
                let sent = plan.send0.len() + received - (plan.piece)(plan.steps - 1).len();
                self.progress.moved(sent + received);
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
            self.progress.waiting(want_read.or(want_write), plan.first_step + rs.min(ts));
            self.sleep(fp, want_write.as_slice(), want_read.as_slice(), deadline)?;
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

    pub(super) fn check_peer(&self, peer: usize) -> Result<()> {
        if peer == self.rank || peer >= self.links.len() {
            return Err(Error::Internal(
                format!("rank {} cannot exchange with rank {peer}", self.rank).into(),
            ));
        }
        Ok(())
    }

    pub(super) fn timeout_error(
        &self,
        fp: &Fingerprint,
        step: u16,
        tx: Option<&Tx<'_>>,
        rx: Option<&Rx>,
    ) -> Error {
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
        let awaited = rx.filter(|r| !r.done).map(|r| r.peer).or(tx.filter(|t| !t.done).map(|t| t.peer));
        let e = Error::Timeout(
            format!(
                "rank {} in {fp}, step {step}: deadline passed waiting for {}",
                self.rank,
                waits.join(" and ")
            )
            .into(),
        );
        match awaited {
            Some(p) => e.with_peer(p),
            None => e,
        }
    }
}
