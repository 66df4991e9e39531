//! The control plane: a thread per communicator that serves the rank's set-up listener for the
//! communicator's life, so that the ranks can still reach each other when their links are
//! stuck, broken or closed, and without a store (rank 0 stops serving it after set-up).
//!
//! Two things use it. The stall report asks every rank for its flight-recorder snapshot
//! ([`Core::ask_peers`]): a rank answers from this thread whatever its own threads are doing
//! (blocked in a collective, or in user code having skipped one); a rank whose process is gone
//! refuses the connection (nothing listens at its address), and a stopped one accepts it in the
//! kernel but never answers, which tells the two apart. Shrink builds the survivors' new
//! communicator through the same listeners ([`Core::take_listener_for_shrink`]): no new port
//! and no rendezvous. The bytes and bounds are in `transport::tcp::control`.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::health::StatusFile;
use super::{Core, lock};
use crate::error::{Error, Result};
use crate::sys::eventfd::EventFd;
use crate::sys::fork::ForkGuarded;
use crate::trace::{Asked, PeerAnswer, Snapshot, now_ns};
use crate::transport::tcp::{self, control as proto};

pub(crate) use proto::shrink_id;

/// Produces this rank's snapshot (from any thread, at any time).
pub(crate) type SnapshotFn = Arc<dyn Fn() -> Snapshot + Send + Sync>;

type Served = (ForkGuarded<TcpListener>, Vec<proto::Parked>);

/// The control thread of one communicator.
pub(crate) struct Control {
    ctx: proto::ControlCtx,
    /// Every rank's listening address (index = rank).
    addrs: Arc<[SocketAddr]>,
    ifname: String,
    stop: Arc<EventFd>,
    thread: Mutex<Option<JoinHandle<Served>>>,
    snapshot: SnapshotFn,
    /// This rank's entry for the health query (`TOROID_STATUS_DIR`), while it serves.
    status: Mutex<Option<StatusFile>>,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control").field("ctx", &self.ctx).finish_non_exhaustive()
    }
}

impl Control {
    /// Starts serving `endpoint` for the communicator of `ctx` whose ranks listen at `addrs`.
    ///
    /// With `inbox` (connections on demand) the thread also takes the links peers open to this
    /// rank and hands them to the engine (`transport::tcp::lazy`).
    pub(crate) fn start(
        endpoint: tcp::Endpoint,
        ctx: proto::ControlCtx,
        addrs: Arc<[SocketAddr]>,
        snapshot: SnapshotFn,
        inbox: Option<Arc<tcp::lazy::Inbox>>,
        status_dir: Option<&Path>,
    ) -> Result<Control> {
        let stop = Arc::new(EventFd::new().map_err(|e| Error::system("eventfd for the control thread", e))?);
        // A forked child must not keep the listener: a peer would then find it listening after
        // this process died, and take the dead rank for a stopped one.
        let listener = ForkGuarded::new(endpoint.listener);
        let (t_ctx, t_stop, t_snap) = (ctx.clone(), stop.clone(), snapshot.clone());
        let thread = std::thread::Builder::new()
            .name(format!("toroid-ctl{}", ctx.rank))
            .spawn(move || {
                let answer = |_request: u8, _from: usize| t_snap().encode();
                let parked = proto::serve(&listener, &t_ctx, t_stop.as_raw_fd(), &answer, inbox.as_deref());
                (listener, parked)
            })
            .map_err(|e| Error::system("spawning the control thread", e))?;
        let status = status_dir.and_then(|d| {
            StatusFile::write(d, ctx.comm_id, ctx.rank, ctx.size, addrs[ctx.rank], ctx.encrypt)
        });
        Ok(Control {
            ctx,
            addrs,
            ifname: endpoint.ifname,
            stop,
            thread: Mutex::new(Some(thread)),
            snapshot,
            status: Mutex::new(status),
        })
    }

    /// Stops the thread; returns the listener and what it parked (`None` once stopped before).
    fn stop(&self) -> Option<Served> {
        // Nobody answers at this address for this communicator any more.
        drop(lock(&self.status).take());
        let h = lock(&self.thread).take()?;
        self.stop.signal();
        h.join().ok()
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        // (In a forked child the communicator is leaked, so this never runs there.)
        let _ = self.stop();
    }
}

impl Core {
    /// This rank's own snapshot.
    pub(crate) fn own_snapshot(&self) -> Snapshot {
        (self.watch.control.snapshot)()
    }

    /// Asks every other rank for its snapshot, all at once, each within `grace`.
    pub(crate) fn ask_peers(&self, grace: Duration) -> Vec<(usize, PeerAnswer)> {
        self.ask_peers_timed(grace).into_iter().map(|a| (a.rank, a.answer)).collect()
    }

    /// [`Core::ask_peers`], with this rank's clock around each question.
    pub(crate) fn ask_peers_timed(&self, grace: Duration) -> Vec<Asked> {
        let c = &self.watch.control;
        let peers: Vec<usize> = (0..c.addrs.len()).filter(|r| *r != c.ctx.rank).collect();
        ask_all(&|_| c.ctx.clone(), &peers, &c.addrs, grace)
    }

    /// The other ranks whose process is gone (their listener refuses connections), with why;
    /// each probe bounded by `timeout`. Cheaper and quicker than [`Core::ask_peers`]: a live
    /// rank's kernel accepts at once, whatever the rank is doing (even setting up a shrink,
    /// when its listener is not served).
    pub(crate) fn gone_peers(&self, timeout: Duration) -> Vec<(usize, String)> {
        let c = &self.watch.control;
        let peers: Vec<usize> = (0..c.addrs.len()).filter(|r| *r != c.ctx.rank).collect();
        let mut out = Vec::new();
        for batch in peers.chunks(64) {
            std::thread::scope(|s| {
                let hs: Vec<_> = batch
                    .iter()
                    .map(|&p| s.spawn(move || (p, proto::is_gone(c.addrs[p], timeout))))
                    .collect();
                for h in hs {
                    if let Ok((p, Some(why))) = h.join() {
                        out.push((p, why));
                    }
                }
            });
        }
        out
    }

    /// Whether rank `p`'s process is gone (its listener refuses connections), with why; within
    /// `timeout`.
    pub(crate) fn peer_gone(&self, p: usize, timeout: Duration) -> Option<String> {
        let c = &self.watch.control;
        (p != c.ctx.rank).then(|| c.addrs.get(p).and_then(|a| proto::is_gone(*a, timeout))).flatten()
    }

    /// Stops the control thread and hands over this rank's listener for shrink attempt
    /// `attempt`, with the connections other survivors already made to it for that attempt
    /// (accepted, their hello unread).
    pub(crate) fn take_listener_for_shrink(
        &self,
        attempt: u64,
    ) -> Result<(tcp::Endpoint, Vec<(TcpStream, SocketAddr)>)> {
        let c = &self.watch.control;
        let Some((listener, parked)) = c.stop() else {
            return Err(Error::InvalidUsage(
                format!(
                    "rank {}: this communicator's listener was already handed to an earlier shrink",
                    self.ident.rank
                )
                .into(),
            ));
        };
        let listener = listener.into_inner().ok_or_else(|| {
            Error::InvalidUsage("a forked child cannot shrink its parent's communicator".into())
        })?;
        let conns = parked
            .into_iter()
            .filter(|p| p.2 == attempt || p.2 == proto::UNIDENTIFIED)
            .map(|(s, a, _)| (s, a))
            .collect();
        let endpoint = tcp::Endpoint { listener, addr: c.addrs[c.ctx.rank], ifname: c.ifname.clone() };
        Ok((endpoint, conns))
    }

    /// Every rank's listening address (index = rank), as published at set-up.
    pub(crate) fn addrs(&self) -> &[SocketAddr] {
        &self.watch.control.addrs
    }
}

/// Asks every rank of `peers` (listening at `addrs[p]`) for its snapshot, all at once, each
/// within `grace`, as `ctx_of(p)`; notes the asker's clock around each question.
pub(crate) fn ask_all(
    ctx_of: &(dyn Fn(usize) -> proto::ControlCtx + Sync),
    peers: &[usize],
    addrs: &[SocketAddr],
    grace: Duration,
) -> Vec<Asked> {
    let mut out = Vec::with_capacity(peers.len());
    // One thread per peer in batches (this runs only when a job is stuck or on demand).
    for batch in peers.chunks(64) {
        std::thread::scope(|s| {
            let hs: Vec<_> = batch
                .iter()
                .filter(|&&p| p < addrs.len())
                .map(|&p| {
                    s.spawn(move || {
                        let sent_ns = now_ns();
                        let reply = proto::ask(&ctx_of(p), p, addrs[p], proto::REQUEST_SNAPSHOT, grace);
                        Asked { rank: p, answer: answer_of(p, reply), sent_ns, got_ns: now_ns() }
                    })
                })
                .collect();
            for h in hs {
                if let Ok(a) = h.join() {
                    out.push(a);
                }
            }
        });
    }
    out
}

fn answer_of(peer: usize, r: proto::Reply) -> PeerAnswer {
    match r {
        proto::Reply::Answer(b) => match Snapshot::decode(&b) {
            Ok(s) if s.rank as usize == peer => PeerAnswer::Report(s),
            Ok(s) => PeerAnswer::Failed(format!("rank {peer} answered with rank {}'s snapshot", s.rank)),
            Err(e) => PeerAnswer::Failed(format!("rank {peer} sent a bad snapshot: {e}")),
        },
        proto::Reply::Dead(w) => PeerAnswer::Dead(w),
        proto::Reply::Silent => PeerAnswer::Silent,
        proto::Reply::Failed(w) => PeerAnswer::Failed(w),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::{MemStore, Store};
    use crate::{Communicator, Config};
    use std::sync::mpsc::channel;

    #[test]
    fn every_rank_answers_and_a_dropped_rank_is_dead() {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let cfg = Config { timeout: Duration::from_secs(20), ..Config::default() };
        let wait = Duration::from_secs(30);
        // Rank 0 tells rank 2 to go, rank 2 says it is gone, rank 0 tells rank 1 to finish.
        let (go2, gone2) = (channel::<()>(), channel::<()>());
        let finish1 = channel::<()>();
        let (go2_tx, go2_rx) = go2;
        let (gone2_tx, gone2_rx) = gone2;
        let (finish1_tx, finish1_rx) = finish1;
        let comms: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let (store, cfg) = (store.clone(), cfg.clone());
                    s.spawn(move || Communicator::with_store(r, 3, store, &cfg).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut comms = comms.into_iter();
        let (c0, c1, c2) = (comms.next().unwrap(), comms.next().unwrap(), comms.next().unwrap());
        std::thread::scope(|s| {
            s.spawn(move || {
                go2_rx.recv_timeout(wait).unwrap();
                drop(c2);
                gone2_tx.send(()).unwrap();
            });
            s.spawn(move || {
                finish1_rx.recv_timeout(wait).unwrap();
                drop(c1);
            });
            let mut answers = c0.core.ask_peers(Duration::from_secs(3));
            answers.sort_by_key(|a| a.0);
            assert_eq!(answers.len(), 2);
            for (p, a) in &answers {
                let PeerAnswer::Report(snap) = a else { panic!("rank {p}: {a:?}") };
                assert_eq!((snap.rank as usize, snap.size, snap.comm_id), (*p, 3, c0.id()));
            }
            assert_eq!(c0.core.own_snapshot().rank, 0);
            go2_tx.send(()).unwrap();
            gone2_rx.recv_timeout(wait).unwrap();
            let answers = c0.core.ask_peers(Duration::from_secs(3));
            let two = answers.iter().find(|a| a.0 == 2).map(|a| a.1.clone());
            assert!(matches!(two, Some(PeerAnswer::Dead(_))), "{two:?}");
            let one = answers.iter().find(|a| a.0 == 1).map(|a| a.1.clone());
            assert!(matches!(one, Some(PeerAnswer::Report(_))), "{one:?}");
            finish1_tx.send(()).unwrap();
        });
    }
}
