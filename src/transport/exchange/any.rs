//! Receive from any source: which peer's next frame is the send this rank may take now.
//!
//! Frames on one link arrive in the order the peer issued its operations, and send/recv are
//! numbered per pair (the `n`-th send of rank `p` to this rank matches this rank's `n`-th
//! receive from `p`). So a peer whose *next* frame is a point-to-point frame numbered
//! `received[p] + 1` has sent exactly the message a receive from it would take now; any other
//! head of a link (nothing yet, a frame of a later collective) says "not this peer, not yet".
//! This looks at link heads without consuming them ([`super::Transport::peek`]); the receive
//! itself then runs as an ordinary receive from the peer found. The first peer found wins, in
//! rank order among those ready at the same moment, as gloo's `recvFromAny` takes the first
//! pending send it finds.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Instant;

use super::frame::{HEADER_LEN, KIND_ABORT, decode, read_abort};
use super::{MAX_SLEEP, Peers};
use crate::collective::CollKind;
use crate::error::{Error, Result};
use crate::sys::poll::{PollFd, poll};

/// What the head of a link says during one wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Head {
    /// Nothing decisive yet: watch it.
    Open,
    /// A whole frame that is not the send (it cannot change before this rank reads it): watch
    /// only for the peer hanging up.
    Settled,
    /// The peer closed without the send: never a source in this wait.
    Closed,
}

impl Peers {
    /// Waits until some peer `p` has a send numbered `received[p] + 1` (the next this rank takes
    /// from it) at the head of its link, and returns `p`. Fails at `deadline` ([`Error::Timeout`]), on an abort frame or the abort
    /// signal, and when every peer has closed its link.
    pub fn wait_any_send(&mut self, received: &[u64], deadline: Instant) -> Result<usize> {
        let mut last_look = Instant::now();
        // Whichever rank sends must find a link: open those this rank dials (the others dial
        // this rank, and their links are taken in as they arrive).
        self.dial_all(deadline)?;
        let mut heads = std::mem::take(&mut self.heads);
        heads.clear();
        heads.resize(self.links.len(), Head::Open);
        let r = self.wait_any_loop(received, deadline, &mut heads, &mut last_look);
        self.heads = heads;
        r
    }

    fn wait_any_loop(
        &mut self,
        received: &[u64],
        deadline: Instant,
        heads: &mut [Head],
        last_look: &mut Instant,
    ) -> Result<usize> {
        loop {
            self.abort.check()?;
            if let Some(p) = self.find_send(received, heads)? {
                return Ok(p);
            }
            let live = |r: usize| {
                (self.links[r].is_some() && heads[r] != Head::Closed)
                    || (r != self.rank && self.may_connect(r))
            };
            if !(0..self.links.len()).any(live) {
                return Err(Error::Remote(
                    "receive from any source: every peer closed its connection without sending".into(),
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(
                    format!("receive from any source: no rank sent to rank {} within the timeout", self.rank)
                        .into(),
                ));
            }
            if now.duration_since(*last_look) < self.spin.spin {
                if self.spin.yield_between {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            self.sleep_any(heads, deadline)?;
            *last_look = Instant::now();
        }
    }

    /// The first peer whose link head is the expected send; marks the heads that are not.
    fn find_send(&mut self, received: &[u64], heads: &mut [Head]) -> Result<Option<usize>> {
        for (r, link) in self.links.iter_mut().enumerate() {
            let Some(link) = link else { continue };
            if heads[r] != Head::Open {
                continue;
            }
            let mut h = [0u8; HEADER_LEN];
            let n = match link.transport.peek(&mut h) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => {
                    return Err(
                        Error::Remote(format!("connection to rank {r} failed: {e}").into()).with_peer(r)
                    );
                }
            };
            if n < HEADER_LEN {
                continue;
            }
            let header = decode(&h)
                .map_err(|e| Error::Remote(format!("rank {r} sent a bad frame: {e}").into()).with_peer(r))?;
            if header.kind == KIND_ABORT {
                return Err(read_abort(link, r, false, &[], header.len as usize).with_peer(r));
            }
            let theirs = header
                .fp
                .map_err(|e| Error::Remote(format!("rank {r} sent a bad frame: {e}").into()).with_peer(r))?;
            if theirs.kind == CollKind::PointToPoint && Some(theirs.seq) == received.get(r).map(|n| n + 1) {
                return Ok(Some(r));
            }
            heads[r] = Head::Settled;
        }
        Ok(None)
    }

    /// Sleeps in poll(2) until a link shows something new, the abort event fires, or the
    /// deadline (capped) passes. Links that hang up without the send are marked closed.
    fn sleep_any(&mut self, heads: &mut [Head], deadline: Instant) -> Result<()> {
        self.adopt_arrived()?;
        self.pollfds.clear();
        self.poll_ranks.clear();
        self.pollfds.push(PollFd::new(self.abort.event.as_raw_fd(), PollFd::IN));
        self.poll_ranks.push(usize::MAX);
        if let Some(c) = self.connector.as_ref().filter(|_| !self.closed) {
            self.pollfds.push(PollFd::new(c.arrival_fd(), PollFd::IN));
            self.poll_ranks.push(super::wait::ARRIVAL);
        }
        for (r, link) in self.links.iter_mut().enumerate() {
            let Some(link) = link else { continue };
            if heads[r] == Head::Closed {
                continue;
            }
            if heads[r] == Head::Settled {
                self.pollfds.push(PollFd::new(link.transport.pollable(), PollFd::RDHUP));
                self.poll_ranks.push(r);
                continue;
            }
            match link.transport.arm(true, false) {
                // Something is there already: look again instead of sleeping.
                None => return Ok(()),
                Some(events) => {
                    self.pollfds.push(PollFd::new(link.transport.pollable(), events | PollFd::RDHUP));
                    self.poll_ranks.push(r);
                }
            }
        }
        let wait = deadline.saturating_duration_since(Instant::now()).min(MAX_SLEEP);
        let ms = wait.as_millis().clamp(1, i32::MAX as u128) as i32;
        poll(&mut self.pollfds, ms).map_err(|e| Error::system("poll", e))?;
        for i in 1..self.pollfds.len() {
            let revents = self.pollfds[i].revents();
            if revents & (PollFd::RDHUP | PollFd::HUP | PollFd::ERR) == 0 {
                continue;
            }
            let r = self.poll_ranks[i];
            if r == super::wait::ARRIVAL {
                continue;
            }
            let Some(link) = self.links[r].as_mut() else { continue };
            let mut h = [0u8; HEADER_LEN];
            // A peer that hung up right after sending is still a source until its bytes are
            // read (the next look decides); one whose head is not the send never will be.
            let whole = matches!(link.transport.peek(&mut h), Ok(n) if n >= HEADER_LEN);
            if !whole || heads[r] == Head::Settled {
                heads[r] = Head::Closed;
            }
        }
        Ok(())
    }
}
