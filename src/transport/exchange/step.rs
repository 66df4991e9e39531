//! One step of an algorithm ([`Peers::exchange`]): both directions driven without blocking
//! until done or the deadline.

use std::time::Instant;

use super::frame::{KIND_DATA, encode};
use super::rx::Rx;
use super::tx::Tx;
use super::{Peers, Sink, Source, explain_send_failure, live_link};
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
            if self.spin_once(last_progress, now) {
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
