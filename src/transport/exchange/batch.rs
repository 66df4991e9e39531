//! Sends and receives side by side ([`Peers::send_recv`]): NCCL's grouped `ncclSend` /
//! `ncclRecv`, the exchanges of a halo, a pipeline stage or an all-to-all written as
//! point-to-point calls.
//!
//! Each item travels exactly as the same send or receive issued alone would (its own
//! fingerprint, step 0), so a batch on one rank pairs with single calls on another. What a batch
//! adds is concurrency: every item is driven at once, so a batch in which every rank first sends
//! to its neighbour and then receives from the other completes whatever the sizes, where the
//! same calls one by one wait for each other (a send of more than the link buffers waits for its
//! receiver).
//!
//! Items of one direction to one peer run in the batch's order (a link carries one message at a
//! time in each direction, and the receiver matches them in order); all others at once. No
//! deadlock between batches: each item waits only for its peer's matching item and for the
//! items before it to the same peer in the same direction, and those pairs are matched in the
//! same order on both ends.

use std::time::Instant;

use super::frame::{KIND_DATA, encode};
use super::rx::Rx;
use super::stream::{Stream, Wants};
use super::tx::Tx;
use super::{Peers, Sink, Source, explain_send_failure, live_link};
use crate::collective::Fingerprint;
use crate::error::{Error, Result};

/// One send or receive of a batch, with the fingerprint it travels under.
#[derive(Debug)]
pub struct P2pTask<'a> {
    /// The other rank.
    pub peer: usize,
    /// Its fingerprint (as the call alone would have: the pair's own sequence number).
    pub fp: Fingerprint,
    /// What moves.
    pub dir: P2pDir<'a>,
}

/// The direction and buffer of a [`P2pTask`].
#[derive(Debug)]
pub enum P2pDir<'a> {
    /// Send these bytes.
    Send(&'a [u8]),
    /// Receive exactly this many bytes into this buffer.
    Recv(&'a mut [u8]),
}

/// Where a task is.
enum State<'a> {
    /// Waiting for the task before it on its link and direction.
    Waiting,
    Sending(Tx<'a>),
    Receiving(Rx),
    Done,
}

/// A task's progress.
struct Slot<'a> {
    state: State<'a>,
    /// The task before it on its peer and direction.
    prev: Option<usize>,
}

/// A batch running on its buffers (a [`Stream`]).
pub(super) struct BatchRun<'t, 'a> {
    tasks: &'t mut [P2pTask<'a>],
    slots: Vec<Slot<'a>>,
    /// Tasks not done.
    left: usize,
    /// The first task not done.
    lo: usize,
    moved: usize,
}

impl<'t, 'a> BatchRun<'t, 'a> {
    fn new(tasks: &'t mut [P2pTask<'a>]) -> BatchRun<'t, 'a> {
        let mut last = std::collections::HashMap::new();
        let slots = tasks
            .iter()
            .enumerate()
            .map(|(i, t)| Slot {
                state: State::Waiting,
                prev: last.insert((t.peer, matches!(t.dir, P2pDir::Send(_))), i),
            })
            .collect();
        let moved = tasks
            .iter()
            .map(|t| match &t.dir {
                P2pDir::Send(b) => b.len(),
                P2pDir::Recv(b) => b.len(),
            })
            .sum();
        BatchRun { left: tasks.len(), tasks, slots, lo: 0, moved }
    }

    fn done_at(&self, i: usize) -> bool {
        matches!(self.slots[i].state, State::Done)
    }
}

impl Stream for BatchRun<'_, '_> {
    fn pump(
        &mut self,
        peers: &mut Peers,
        _fp: &Fingerprint,
        _deadline: Instant,
        scratch: &mut [u8],
    ) -> Result<bool> {
        let mut progressed = false;
        for i in self.lo..self.tasks.len() {
            if matches!(self.slots[i].state, State::Waiting)
                && self.slots[i].prev.is_none_or(|p| self.done_at(p))
            {
                let t = &self.tasks[i];
                self.slots[i].state = match &t.dir {
                    // Step 0, as a send alone (`algorithm::pairwise::send`).
                    P2pDir::Send(b) => {
                        let header = encode(KIND_DATA, &t.fp, 0, 0);
                        State::Sending(Tx::new(t.peer, Source::Bytes(b), b.len(), header, peers.segment))
                    }
                    P2pDir::Recv(b) => State::Receiving(Rx::new(t.peer, b.len(), peers.segment)),
                };
                progressed = true;
            }
            let task = &mut self.tasks[i];
            let finished = match (&mut self.slots[i].state, &mut task.dir) {
                (State::Sending(tx), _) => {
                    let link = live_link(&mut peers.links, tx.peer)?;
                    progressed |= tx.pump(link, None).map_err(|e| explain_send_failure(link, tx.peer, e))?;
                    tx.done
                }
                (State::Receiving(rx), P2pDir::Recv(buf)) => {
                    let peer = rx.peer;
                    let link = live_link(&mut peers.links, peer)?;
                    let mut sink = Sink::Copy(buf);
                    progressed |= rx
                        .pump(&mut sink, peers.rank, link, &task.fp, 0, scratch)
                        .map_err(|e| e.with_peer(peer))?;
                    rx.done
                }
                _ => false,
            };
            if finished {
                self.slots[i].state = State::Done;
                self.left -= 1;
            }
        }
        while self.lo < self.tasks.len() && self.done_at(self.lo) {
            self.lo += 1;
        }
        Ok(progressed)
    }

    fn done(&self) -> bool {
        self.left == 0
    }

    fn wants(&self, writes: &mut Wants, reads: &mut Wants) {
        for s in &self.slots[self.lo..] {
            match &s.state {
                State::Sending(tx) => writes.push(tx.peer),
                State::Receiving(rx) => reads.push(rx.peer),
                State::Waiting | State::Done => {}
            }
        }
    }

    fn waiting(&self) -> (Option<usize>, usize) {
        (self.tasks.get(self.lo).map(|t| t.peer), 0)
    }

    fn timeout_error(&self, peers: &Peers, fp: &Fingerprint) -> Error {
        let Some(i) = (self.lo..self.tasks.len())
            .find(|&i| !matches!(self.slots[i].state, State::Waiting | State::Done))
        else {
            return Error::Internal(format!("a batch of sends and receives in {fp} timed out idle").into());
        };
        let (tx, rx) = match &self.slots[i].state {
            State::Sending(tx) => (Some(tx), None),
            State::Receiving(rx) => (None, Some(rx)),
            State::Waiting | State::Done => (None, None),
        };
        peers.timeout_error(&self.tasks[i].fp, 0, tx, rx)
    }

    fn moved(&self) -> usize {
        self.moved
    }
}

impl Peers {
    /// Runs `tasks` side by side (see the module documentation) until all are done or the
    /// deadline passes. Each task's peer is another rank of the communicator.
    pub fn send_recv(&mut self, deadline: Instant, tasks: &mut [P2pTask<'_>]) -> Result<()> {
        let Some(first) = tasks.first().map(|t| t.fp) else { return Ok(()) };
        for t in tasks.iter() {
            self.check_peer(t.peer)?;
        }
        // Links on demand: every peer of the batch is expected to be at its own side of it.
        if self.connector.is_some() {
            let mut linked: Vec<usize> = tasks.iter().map(|t| t.peer).collect();
            linked.sort_unstable();
            linked.dedup();
            self.ensure(&linked, &first, 0, deadline)?;
        }
        self.drive(&first, deadline, &mut [&mut BatchRun::new(tasks)])
    }
}
