//! Links on demand: before a step uses a peer, make sure a link to it exists.
//!
//! Of each pair the higher rank dials (the peer's acceptor answers whatever the peer's own
//! threads are doing, so a dial never waits for the other rank's engine) and the lower rank
//! waits for the link its own acceptor hands over. Every step of every algorithm is paired
//! (both ranks of a link reach the step that first uses it), and a rank dials all the lower
//! peers of a step before it waits for a higher one, so no rank waits for a link that a rank
//! blocked on it would have to open. While it waits, a rank sleeps as in any step: on its
//! other links (an abort frame or a closed link of a peer ends the wait with that error), the
//! abort event and the connector's arrivals, and it asks every [`GONE_CHECK`] whether the
//! awaited peer's process still exists, so a dead peer is an error within a second, not at
//! the deadline.

use std::time::{Duration, Instant};

use super::{Link, Peers};
use crate::collective::Fingerprint;
use crate::error::{Error, Result};
use crate::transport::Transport;

/// How often a rank waiting for a peer's connection checks that the peer's process exists.
pub(super) const GONE_CHECK: Duration = Duration::from_secs(1);

impl Peers {
    /// Makes sure every rank of `peers` is linked, opening the links that are missing (see the
    /// module documentation). Without a connector it does nothing (a missing link is then the
    /// error of the step that uses it).
    pub(super) fn ensure(
        &mut self,
        peers: &[usize],
        fp: &Fingerprint,
        step: u16,
        deadline: Instant,
    ) -> Result<()> {
        if self.connector.is_none() || peers.iter().all(|&p| self.links.get(p).is_some_and(Option::is_some)) {
            return Ok(());
        }
        if self.closed {
            self.abort.check()?;
            return Err(Error::Aborted("communicator closed".into()));
        }
        self.adopt_arrived()?;
        for &p in peers {
            if self.links[p].is_some() {
                continue;
            }
            let Some(c) = self.connector.as_mut() else { return Ok(()) };
            if c.dials(p) {
                let t = c.dial(p, deadline, &self.abort).map_err(|e| e.with_peer(p))?;
                self.install(p, t);
            }
        }
        let mut next_check = Instant::now() + GONE_CHECK;
        loop {
            self.adopt_arrived()?;
            let Some(&p) = peers.iter().find(|&&p| self.links[p].is_none()) else { return Ok(()) };
            self.abort.check()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(
                    format!(
                        "rank {} in {fp}, step {step}: deadline passed waiting for rank {p} to connect \
                         (a pair connects the first time an operation needs it, the higher rank dialing)",
                        self.rank
                    )
                    .into(),
                )
                .with_peer(p));
            }
            if now >= next_check {
                next_check = now + GONE_CHECK;
                if let Some(why) = self.connector.as_ref().and_then(|c| c.peer_gone(p)) {
                    return Err(Error::Remote(
                        format!(
                            "rank {} waited for rank {p} to connect, but rank {p} is gone: {why}",
                            self.rank
                        )
                        .into(),
                    )
                    .with_peer(p));
                }
            }
            self.progress.waiting(Some(p), step as usize);
            self.sleep(fp, &[], &[], deadline.min(next_check))?;
        }
    }

    /// Installs the links peers opened to this rank since the last look.
    pub(super) fn adopt_arrived(&mut self) -> Result<()> {
        let Some(c) = self.connector.as_mut() else { return Ok(()) };
        if self.closed {
            return Ok(());
        }
        for (p, t) in c.arrived()? {
            if p == self.rank || p >= self.links.len() || self.links[p].is_some() {
                // The acceptor lets one connection per lane and peer through; anything else
                // would be a bug, and the link is dropped (closed).
                tracing::warn!(target: "toroid::net", "rank {}: dropped a second link from rank {p}", self.rank);
                continue;
            }
            self.install(p, t);
        }
        Ok(())
    }

    fn install(&mut self, peer: usize, transport: Box<dyn Transport>) {
        tracing::debug!(target: "toroid::net", "rank {}: linked to rank {peer} on demand", self.rank);
        self.links[peer] = Some(Link {
            zero_copy: transport.zero_copy(),
            transport,
            out_mid_frame: false,
            quiet_token: 0,
            hup_token: 0,
        });
    }

    /// Opens the links to every rank this rank dials (a receive from any source: whichever
    /// rank sends must find a link, and a lower sender waits for this rank to dial it).
    pub(super) fn dial_all(&mut self, deadline: Instant) -> Result<()> {
        if self.connector.is_none() || self.closed {
            return Ok(());
        }
        self.adopt_arrived()?;
        for p in 0..self.links.len() {
            if p == self.rank || self.links[p].is_some() {
                continue;
            }
            let Some(c) = self.connector.as_mut() else { return Ok(()) };
            if c.dials(p) {
                let t = c.dial(p, deadline, &self.abort).map_err(|e| e.with_peer(p))?;
                self.install(p, t);
            }
        }
        Ok(())
    }

    /// True when `peer` may still connect to this rank (links on demand, not linked yet).
    pub(super) fn may_connect(&self, peer: usize) -> bool {
        !self.closed && self.connector.as_ref().is_some_and(|c| !c.dials(peer)) && self.links[peer].is_none()
    }
}
