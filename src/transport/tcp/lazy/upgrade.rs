//! Moving a link opened on demand off TCP before the engine takes it: to RDMA between hosts
//! (`transport::rdma::setup`) or to shared memory within one (`transport::shm::pair`).
//!
//! The accepting (lower) rank runs its half in the control thread's poll loop ([`Accepting`],
//! never blocking it), so a dial completes whatever the lower rank's engine is doing. The
//! dialing rank runs the shared-memory half here ([`dial_shm`]) on the new connection's first
//! lane, before the link is secured (the accepting rank reads the raw connection as well); its
//! RDMA half is `rdma::setup::dial_side`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sys::poll::{PollFd, poll};
use crate::transport::AbortSignal;
use crate::transport::rdma::setup as rdma;
use crate::transport::shm::ShmOptions;
use crate::transport::shm::pair::{self, Mapped};
use crate::transport::shm::setup::MSG_LEN;

/// Longest sleep while waiting for an answer, so that cancellation and aborts are seen.
const SLICE: Duration = Duration::from_millis(100);

/// What a link moves to once its exchange is done.
pub(crate) enum Upgrade {
    Rdma(rdma::Upgrade),
    Shm(Mapped),
}

/// Which exchange a link in [`Accepting`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Exchange {
    Rdma,
    Shm,
}

/// The accepting side of a link's exchange: RDMA (reading the offer, then the verdict) or
/// shared memory (reading the offer, answering).
pub(super) struct Accepting {
    pub(super) peer: usize,
    pub(super) lanes: Vec<TcpStream>,
    kind: Exchange,
    msg: Box<[u8; MSG_LEN]>,
    got: usize,
    /// Set once an RDMA offer is answered.
    answered: Option<rdma::Upgrade>,
    pub(super) deadline: Instant,
}

impl Accepting {
    pub(super) fn new(peer: usize, lanes: Vec<TcpStream>, kind: Exchange, deadline: Instant) -> Accepting {
        Accepting { peer, lanes, kind, msg: Box::new([0; MSG_LEN]), got: 0, answered: None, deadline }
    }

    /// Reads what arrived; `Ok(Some(msg))` once a whole message is in.
    pub(super) fn read(&mut self) -> std::result::Result<Option<[u8; MSG_LEN]>, String> {
        let Some(mut s) = self.lanes.first() else { return Err("no connection".into()) };
        while self.got < MSG_LEN {
            match s.read(&mut self.msg[self.got..]) {
                Ok(0) => return Err("closed during the exchange that moves the link".into()),
                Ok(n) => self.got += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("exchange that moves the link: {e}")),
            }
        }
        self.got = 0;
        Ok(Some(*self.msg))
    }

    /// Sends a whole message: a few hundred bytes into a fresh connection's empty buffer.
    pub(super) fn send(&self, msg: &[u8; MSG_LEN]) -> std::result::Result<(), String> {
        match self.lanes.first() {
            Some(s) => write_whole(s, msg),
            None => Err("no connection".into()),
        }
    }

    /// One step of the exchange on a whole message `m`: `Ok(Some(upgrade))` once the link is
    /// settled, `Ok(None)` while more is to come, `Err` when the peer broke it. `shm` is `None`
    /// once this rank failed.
    pub(super) fn step(
        &mut self,
        m: &[u8; MSG_LEN],
        rdma_cfg: Option<&crate::config::Config>,
        shm: Option<&ShmOptions>,
        comm_id: u64,
        rank: usize,
    ) -> std::result::Result<Option<Option<Upgrade>>, String> {
        match self.kind {
            Exchange::Rdma => {
                let cfg = rdma_cfg.ok_or("no RDMA settings")?;
                let m = rdma::decode_msg(m).map_err(|e| e.to_string())?;
                match self.answered.take() {
                    // The offer: answer it.
                    None => {
                        let (up, reply) =
                            rdma::answer(cfg, comm_id, rank, self.peer, &m).map_err(|e| e.to_string())?;
                        self.send(&reply)?;
                        self.answered = Some(up);
                        Ok(None)
                    }
                    // The verdict: the exchange is done.
                    Some(up) => {
                        let up = rdma::settle(up, self.peer, &m).map_err(|e| e.to_string())?;
                        if let Some(why) = &up.failure {
                            tracing::warn!(target: "toroid::net", "rank {rank}: link from rank {} stays TCP: {why}", self.peer);
                        }
                        Ok(Some(Some(Upgrade::Rdma(up))))
                    }
                }
            }
            // No settings: this rank failed; the offer is refused and the link then closed
            // with the abort frame, which the dialer reads as TCP.
            Exchange::Shm => {
                let Some(opts) = shm else {
                    if let Some(reply) = pair::refusal(m, &format!("rank {rank} failed")) {
                        self.send(&reply)?;
                    }
                    return Ok(Some(None));
                };
                let (reply, mapped) = pair::answer(opts, self.peer, m).map_err(|e| e.to_string())?;
                if let Some(reply) = reply {
                    self.send(&reply)?;
                }
                match mapped {
                    Ok(mapped) => Ok(Some(Some(Upgrade::Shm(mapped)))),
                    Err(why) => {
                        tracing::warn!(target: "toroid::net",
                            "rank {rank}: link from rank {} stays TCP, not shared memory: {why}", self.peer);
                        Ok(Some(None))
                    }
                }
            }
        }
    }
}

fn write_whole(mut s: &TcpStream, msg: &[u8]) -> std::result::Result<(), String> {
    match s.write(msg) {
        Ok(n) if n == msg.len() => Ok(()),
        Ok(n) => Err(format!("only {n} bytes of a {}-byte message went", msg.len())),
        Err(e) => Err(e.to_string()),
    }
}

/// The dialing side's shared-memory exchange on `lane`, the new link's first connection,
/// before it is secured: offers a segment and reads the answer, which the peer's control
/// thread gives within a round trip. `None`: the pair keeps TCP (with a WARN saying why).
pub(super) fn dial_shm(
    opts: &ShmOptions,
    comm_id: u64,
    rank: usize,
    peer: usize,
    lane: &TcpStream,
    deadline: Instant,
    abort: &AbortSignal,
) -> Result<Option<Mapped>> {
    let (offered, msg) = pair::offer(opts, comm_id, rank, peer);
    let fail = |why: String| Error::Remote(format!("shared-memory exchange with rank {peer}: {why}").into());
    write_whole(lane, &msg).map_err(fail)?;
    let offered = match offered {
        Ok(o) => o,
        Err(why) => {
            tracing::warn!(target: "toroid::net", "rank {rank}: link to rank {peer} stays TCP, not shared memory: {why}");
            return Ok(None);
        }
    };
    let mut buf = [0u8; MSG_LEN];
    let mut got = 0;
    let mut s = lane;
    while got < MSG_LEN {
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(
                    fail("the connection closed (its process exited or failed)".into()).with_peer(peer)
                );
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                abort.check()?;
                crate::cancel::check("in a shared-memory exchange")?;
                let now = Instant::now();
                if now >= deadline {
                    return Err(Error::Timeout(
                        format!("shared-memory exchange with rank {peer}: no answer before the deadline")
                            .into(),
                    )
                    .with_peer(peer));
                }
                let mut fds =
                    [PollFd::new(lane.as_raw_fd(), PollFd::IN), PollFd::new(abort.event_fd(), PollFd::IN)];
                let ms = deadline.saturating_duration_since(now).min(SLICE).as_millis().max(1) as i32;
                poll(&mut fds, ms).map_err(|e| Error::system("poll in a shared-memory exchange", e))?;
            }
            Err(e) => return Err(fail(e.to_string()).with_peer(peer)),
        }
    }
    match pair::settle(offered, peer, &buf).map_err(|e| e.with_peer(peer))? {
        Ok(mapped) => Ok(Some(mapped)),
        Err(why) => {
            tracing::warn!(target: "toroid::net", "rank {rank}: link to rank {peer} stays TCP, not shared memory: {why}");
            Ok(None)
        }
    }
}
