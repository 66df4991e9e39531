//! Waiting: sleeping in `poll(2)` on the active links, the abort event and every idle link
//! (so a peer that closes, aborts or runs another collective is noticed at once), and
//! looking at an idle link without consuming what a later step needs.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Instant;

use super::connect::GONE_CHECK;
use super::frame::{HEADER_LEN, KIND_ABORT, decode, read_abort};
use super::{MAX_SLEEP, Peers, mismatch};
use crate::collective::{CollKind, Fingerprint};
use crate::error::{Error, Result};
use crate::sys::poll::{Events, PollFd, poll};

/// The entry of the poll set that is the connector's arrivals (not a rank).
pub(super) const ARRIVAL: usize = usize::MAX - 1;

impl Peers {
    /// Checks, without blocking, every link for what an idle link can show (an abort frame, a
    /// frame of a mismatched collective, a closed connection) while this rank waits outside the
    /// engine (in the shared window). Returns true when the link to `watch` is closed. With
    /// links on demand `watch` may have none yet (a window member this rank never exchanged
    /// with directly): then its process is asked about at most every [`GONE_CHECK`], and one
    /// that is gone is an error naming it.
    pub fn poll_idle_links(&mut self, fp: &Fingerprint, watch: usize) -> Result<bool> {
        self.abort.check()?;
        self.pollfds.clear();
        self.poll_ranks.clear();
        for (r, link) in self.links.iter_mut().enumerate() {
            let Some(link) = link else { continue };
            if link.hup_token == self.token {
                continue;
            }
            let mut events = PollFd::RDHUP;
            if link.quiet_token != self.token {
                match link.transport.arm(true, false) {
                    Some(ev) => events |= ev,
                    None => events |= PollFd::IN | PollFd::PRI,
                }
            }
            self.pollfds.push(PollFd::new(link.transport.pollable(), events));
            self.poll_ranks.push(r);
        }
        let n = poll(&mut self.pollfds, 0).map_err(|e| Error::system("poll", e))?;
        if n > 0 {
            for i in 0..self.pollfds.len() {
                let (r, ev, want) = (self.poll_ranks[i], self.pollfds[i].revents(), self.pollfds[i].events());
                // POLLPRI marks "arm said data is there now": inspect without an event.
                let ev = if want & PollFd::PRI != 0 { ev | PollFd::IN } else { ev };
                if ev != 0 {
                    self.inspect_idle(r, fp, ev).map_err(|e| e.with_peer(r))?;
                }
            }
        } else {
            for i in 0..self.pollfds.len() {
                if self.pollfds[i].events() & PollFd::PRI != 0 {
                    self.inspect_idle(self.poll_ranks[i], fp, PollFd::IN)
                        .map_err(|e| e.with_peer(self.poll_ranks[i]))?;
                }
            }
        }
        Ok(match self.links.get(watch).and_then(Option::as_ref) {
            Some(l) => l.hup_token == self.token,
            None if self.connector.is_some() && !self.closed => {
                self.check_gone(fp, watch)?;
                false
            }
            None => true,
        })
    }

    /// Asks whether unlinked `peer`'s process still exists (its listener refuses once it is
    /// gone), at most every [`GONE_CHECK`].
    fn check_gone(&mut self, fp: &Fingerprint, peer: usize) -> Result<()> {
        let now = Instant::now();
        if self.gone_checked.is_some_and(|t| now < t + GONE_CHECK) {
            return Ok(());
        }
        self.gone_checked = Some(now);
        match self.connector.as_ref().and_then(|c| c.peer_gone(peer)) {
            Some(why) => Err(Error::Remote(
                format!(
                    "rank {} waited for rank {peer} during {fp}, but rank {peer} is gone: {why}",
                    self.rank
                )
                .into(),
            )
            .with_peer(peer)),
            None => Ok(()),
        }
    }

    /// Sleeps in poll(2) until an active link can progress, an idle link shows something, the
    /// abort event fires, or the deadline (capped) passes.
    pub(super) fn sleep(
        &mut self,
        fp: &Fingerprint,
        want_write: &[usize],
        want_read: &[usize],
        deadline: Instant,
    ) -> Result<()> {
        // Links that peers opened meanwhile join the watched ones; more arriving wake us.
        self.adopt_arrived()?;
        self.pollfds.clear();
        self.poll_ranks.clear();
        self.pollfds.push(PollFd::new(self.abort.event.as_raw_fd(), PollFd::IN));
        self.poll_ranks.push(usize::MAX);
        if let Some(c) = self.connector.as_ref().filter(|_| !self.closed) {
            self.pollfds.push(PollFd::new(c.arrival_fd(), PollFd::IN));
            self.poll_ranks.push(ARRIVAL);
        }
        // Transports say what to poll for (`Transport::arm`).
        let mut ready_idle: Option<usize> = None;
        let mut can_progress = false;
        for (r, link) in self.links.iter_mut().enumerate() {
            let Some(link) = link else { continue };
            let (read, write) = (want_read.contains(&r), want_write.contains(&r));
            let mut events: Events = 0;
            if read || write {
                match link.transport.arm(read, write) {
                    Some(ev) => events |= ev,
                    // It can progress now: do not sleep (after arming the others, which is
                    // also where they notice a peer that is gone).
                    None => can_progress = true,
                }
            } else {
                if link.hup_token == self.token {
                    continue;
                }
                events |= PollFd::RDHUP;
                if link.quiet_token != self.token {
                    match link.transport.arm(true, false) {
                        Some(ev) => events |= ev,
                        None => {
                            ready_idle.get_or_insert(r);
                        }
                    }
                }
            }
            self.pollfds.push(PollFd::new(link.transport.pollable(), events));
            self.poll_ranks.push(r);
        }
        if let Some(r) = ready_idle {
            // Something arrived on an idle link already: look at it instead of sleeping.
            return self.inspect_idle(r, fp, PollFd::IN).map_err(|e| e.with_peer(r));
        }
        if can_progress {
            return Ok(());
        }
        let wait = deadline.saturating_duration_since(Instant::now()).min(MAX_SLEEP);
        let ms = wait.as_millis().clamp(1, i32::MAX as u128) as i32;
        // An interrupted sleep returns no events: the caller loops and re-checks.
        poll(&mut self.pollfds, ms).map_err(|e| Error::system("poll", e))?;
        self.abort.check()?;
        for i in 1..self.pollfds.len() {
            let r = self.poll_ranks[i];
            let revents = self.pollfds[i].revents();
            if revents == 0 || r == ARRIVAL || want_write.contains(&r) || want_read.contains(&r) {
                continue;
            }
            self.inspect_idle(r, fp, revents).map_err(|e| e.with_peer(r))?;
        }
        Ok(())
    }

    /// Something showed on a link this step does not use: find out what without consuming data
    /// that a later step needs.
    fn inspect_idle(&mut self, r: usize, fp: &Fingerprint, revents: Events) -> Result<()> {
        let token = self.token;
        let rank = self.rank;
        let Some(link) = self.links[r].as_mut() else { return Ok(()) };
        let mut h = [0u8; HEADER_LEN];
        let n = match link.transport.peek(&mut h) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
            Err(e) => return Err(Error::Remote(format!("connection to rank {r} failed: {e}").into())),
        };
        let hup = revents & (PollFd::RDHUP | PollFd::HUP | PollFd::ERR) != 0;
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
        let header =
            decode(&h).map_err(|e| Error::Remote(format!("rank {r} sent a bad frame: {e}").into()))?;
        if header.kind == KIND_ABORT {
            return Err(read_abort(link, r, false, &[], header.len as usize));
        }
        let theirs =
            header.fp.map_err(|e| Error::Remote(format!("rank {r} sent a bad frame: {e}").into()))?;
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
}
