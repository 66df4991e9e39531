//! An in-memory fake of the verbs ([`Verbs`]): two endpoints of one RC queue pair in one
//! process, so that the RDMA ring's protocol runs in unit tests without a NIC.
//!
//! It keeps RC's guarantees and nothing more: writes of one direction are delivered in the
//! order they were posted, each WRITE_WITH_IMM takes one posted receive at the target (with
//! none posted it waits, as an RNR retry would), the target sees its completion only after
//! the bytes are in its memory, and an error moves the queue pair to the error state, which
//! flushes what was outstanding. What it lets a test inject ([`FakeControl`]): a delay before
//! each write lands, send completions held back (a peer's credit may then arrive before the
//! local completion of the write it answers, which RC allows), a write that fails with a
//! remote access error (both sides then fail, as on hardware), and a peer that is gone
//! (writes to it fail with "retry exceeded"). It never reorders one direction's writes: RC
//! does not, and the ring relies on it.
//!
//! Delivery happens when a write or a receive is posted and when either endpoint polls, under
//! one lock, which also orders the target's reads of its memory after the fake's writes into
//! it. Each endpoint has an event descriptor ([`Verbs::notify_fd`]) signalled with every
//! completion queued for it, as a completion channel is, so a communicator's progress engine
//! sleeps on it. A write given a delay lands only when someone posts or polls after it is due:
//! delays are for tests that poll.
//!
//! [`FakeVerbs::fabric`] pairs endpoints across the ranks of one process (communicators whose
//! ranks are threads): the first of two ranks to open its end of a pair creates the pair and
//! leaves the other end for the second. Its queue pairs carry the process's fabric number as
//! their GID, and [`Verbs::connect`] refuses a peer from another fabric: ranks in different
//! processes cannot share memory, so they learn it at connection time and keep TCP.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::verbs::{Completion, QpInfo, Region, RemoteRegion, Verbs, WcOp, WriteImm};
use crate::sys::eventfd::EventFd;

const REM_ACCESS_ERR: &str = "remote access error";
const RETRY_EXC_ERR: &str = "transport retry counter exceeded";
const WR_FLUSH_ERR: &str = "Work Request Flushed Error";

/// One write on its way.
#[derive(Debug)]
struct Packet {
    wr_id: u64,
    bytes: Vec<u8>,
    remote: RemoteRegion,
    remote_offset: usize,
    imm: u32,
    due: Instant,
    fail: bool,
}

#[derive(Debug, Default)]
struct Ep {
    connected: bool,
    /// The queue pair is in the error state.
    error: bool,
    gone: bool,
    recvs: VecDeque<u64>,
    cq: VecDeque<Completion>,
    /// Send completions held back by [`FakeControl::hold_send_completions`].
    held: VecDeque<Completion>,
    /// Writes from this endpoint to the other, in posting order.
    wire: VecDeque<Packet>,
    /// Writes posted and not yet completed (the send queue's occupancy).
    outstanding: usize,
    /// (addr, len, key, live) of this endpoint's registrations.
    regions: Vec<(u64, usize, u32, bool)>,
    /// Signalled with every completion queued here.
    notify: Option<Arc<EventFd>>,
}

#[derive(Debug, Default)]
struct Net {
    eps: [Ep; 2],
    next_key: u32,
    delay: Duration,
    hold: bool,
    fail_next: [bool; 2],
    max_send: usize,
    /// Most writes with bytes seen on their way at once per direction (the tests' bounds).
    max_in_flight: [usize; 2],
}

impl Ep {
    /// Queues a completion and signals the endpoint's descriptor.
    fn push(&mut self, c: Completion) {
        self.cq.push_back(c);
        if let Some(n) = &self.notify {
            n.signal();
        }
    }

    /// A completion of one of this endpoint's writes: frees its send-queue entry.
    fn sent(&mut self, c: Completion) {
        self.outstanding = self.outstanding.saturating_sub(1);
        self.push(c);
    }
}

impl Net {
    /// The QP in error: outstanding receives are flushed with errors.
    fn break_qp(&mut self, ep: usize) {
        let e = &mut self.eps[ep];
        e.error = true;
        while let Some(wr_id) = e.recvs.pop_front() {
            e.push(Completion { wr_id, op: WcOp::Write, status: Err(WR_FLUSH_ERR.into()) });
        }
    }

    /// Delivers every due write, in order, per direction.
    fn deliver(&mut self) {
        let now = Instant::now();
        for from in 0..2 {
            let to = 1 - from;
            while let Some(p) = self.eps[from].wire.front() {
                if p.due > now {
                    break;
                }
                if self.eps[from].error {
                    // Flushed: the rest of the wire fails.
                    let p = self.eps[from].wire.pop_front().expect("front exists");
                    let c = Completion { wr_id: p.wr_id, op: WcOp::Write, status: Err(WR_FLUSH_ERR.into()) };
                    self.eps[from].sent(c);
                    continue;
                }
                if self.eps[to].gone {
                    let p = self.eps[from].wire.pop_front().expect("front exists");
                    let c = Completion { wr_id: p.wr_id, op: WcOp::Write, status: Err(RETRY_EXC_ERR.into()) };
                    self.eps[from].sent(c);
                    self.break_qp(from);
                    continue;
                }
                let region = self.eps[to].regions.iter().copied().find(|&(addr, len, key, live)| {
                    let r = Region { addr, len, lkey: key, rkey: key };
                    live && key == p.remote.rkey
                        && r.contains(p.remote.addr.saturating_add(p.remote_offset as u64), p.bytes.len())
                });
                if p.fail || self.eps[to].error || (region.is_none() && !p.bytes.is_empty()) {
                    let p = self.eps[from].wire.pop_front().expect("front exists");
                    let c =
                        Completion { wr_id: p.wr_id, op: WcOp::Write, status: Err(REM_ACCESS_ERR.into()) };
                    self.eps[from].sent(c);
                    self.break_qp(from);
                    self.break_qp(to);
                    continue;
                }
                let Some(recv) = self.eps[to].recvs.pop_front() else {
                    break; // receiver not ready: RNR, retried later
                };
                let p = self.eps[from].wire.pop_front().expect("front exists");
                if !p.bytes.is_empty() {
                    let dst = (p.remote.addr + p.remote_offset as u64) as *mut u8;
                    // SAFETY: `dst..dst + len` lies inside a live registration of the target
                    // (checked above), whose memory its owner keeps allocated until it
                    // deregisters, which takes this lock; the target reads it only after it
                    // polls this write's completion, also under this lock.
                    unsafe { std::ptr::copy_nonoverlapping(p.bytes.as_ptr(), dst, p.bytes.len()) };
                }
                let len = p.bytes.len() as u32;
                self.eps[to].push(Completion {
                    wr_id: recv,
                    op: WcOp::RecvImm { imm: p.imm, len },
                    status: Ok(()),
                });
                let sent = Completion { wr_id: p.wr_id, op: WcOp::Write, status: Ok(()) };
                if self.hold {
                    self.eps[from].held.push_back(sent);
                } else {
                    self.eps[from].sent(sent);
                }
            }
        }
    }
}

/// One endpoint of a fake queue pair.
#[derive(Debug)]
pub struct FakeVerbs {
    net: Arc<Mutex<Net>>,
    me: usize,
    notify: Arc<EventFd>,
    /// Set on an end [`FakeVerbs::fabric`] returned: dropping it withdraws the other end if
    /// no rank took it.
    fabric_key: Option<PairKey>,
}

/// A pair on the fabric: communicator id, lower rank, higher rank.
type PairKey = (u64, usize, usize);

/// Ends created by one rank and left for the other, per pair.
fn fabric_table() -> MutexGuard<'static, HashMap<PairKey, FakeVerbs>> {
    static TABLE: OnceLock<Mutex<HashMap<PairKey, FakeVerbs>>> = OnceLock::new();
    let t = TABLE.get_or_init(|| Mutex::new(HashMap::new()));
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// This process's fabric number (the GID of its fake queue pairs).
fn fabric_gid() -> [u8; 16] {
    static GID: OnceLock<[u8; 16]> = OnceLock::new();
    *GID.get_or_init(|| {
        let mut g = [0u8; 16];
        g[..8].copy_from_slice(b"toroidfk");
        g[8..].copy_from_slice(&crate::sys::random::id().to_le_bytes());
        g
    })
}

/// Fault injection for a fake pair.
#[cfg_attr(not(test), allow(dead_code))] // the unit tests' tools
#[derive(Debug, Clone)]
pub struct FakeControl {
    net: Arc<Mutex<Net>>,
}

fn lock(net: &Mutex<Net>) -> MutexGuard<'_, Net> {
    // A test thread that panicked while holding the lock leaves consistent state (every
    // mutation is a whole step), so a poisoned lock is used as it is.
    net.lock().unwrap_or_else(|p| p.into_inner())
}

impl FakeVerbs {
    /// Two endpoints of one queue pair (not yet connected) and their fault injection;
    /// `max_send` is each send queue's depth.
    ///
    /// # Panics
    ///
    /// When the process is out of descriptors for the endpoints' event descriptors (tests).
    #[cfg_attr(not(test), allow(dead_code))] // the unit tests' tools
    pub fn pair(max_send: usize) -> (FakeVerbs, FakeVerbs, FakeControl) {
        Self::try_pair(max_send).expect("event descriptors for a fake queue pair")
    }

    fn try_pair(max_send: usize) -> io::Result<(FakeVerbs, FakeVerbs, FakeControl)> {
        let net = Arc::new(Mutex::new(Net { max_send, next_key: 0x100, ..Net::default() }));
        let end = |me: usize| -> io::Result<FakeVerbs> {
            let notify = Arc::new(EventFd::new()?);
            lock(&net).eps[me].notify = Some(notify.clone());
            Ok(FakeVerbs { net: net.clone(), me, notify, fabric_key: None })
        };
        let (a, b) = (end(0)?, end(1)?);
        Ok((a, b, FakeControl { net: net.clone() }))
    }

    /// This rank's end of the queue pair between `rank` and `peer` of communicator `comm_id`
    /// on the process's fabric (see the module documentation); `max_send` is the send queue's
    /// depth. The lower rank holds endpoint 0.
    pub fn fabric(comm_id: u64, rank: usize, peer: usize, max_send: usize) -> io::Result<FakeVerbs> {
        let key = (comm_id, rank.min(peer), rank.max(peer));
        let mut table = fabric_table();
        if let Some(mine) = table.remove(&key) {
            return Ok(mine);
        }
        let (a, b, _) = Self::try_pair(max_send)?;
        let (mut mine, theirs) = if rank < peer { (a, b) } else { (b, a) };
        mine.fabric_key = Some(key);
        table.insert(key, theirs);
        Ok(mine)
    }
}

#[cfg_attr(not(test), allow(dead_code))] // the unit tests' tools
impl FakeControl {
    /// Every write posted from now on lands `d` after it was posted.
    pub fn set_delay(&self, d: Duration) {
        lock(&self.net).delay = d;
    }

    /// Holds back (`true`) or releases (`false`) the send completions of both endpoints.
    pub fn hold_send_completions(&self, hold: bool) {
        let mut n = lock(&self.net);
        n.hold = hold;
        if !hold {
            for e in &mut n.eps {
                while let Some(c) = e.held.pop_front() {
                    e.sent(c);
                }
            }
        }
    }

    /// The next write posted by endpoint `ep` fails with a remote access error.
    pub fn fail_next_write(&self, ep: usize) {
        lock(&self.net).fail_next[ep] = true;
    }

    /// The most writes carrying bytes seen on their way at once from endpoint `ep`.
    pub fn max_in_flight(&self, ep: usize) -> usize {
        lock(&self.net).max_in_flight[ep]
    }
}

impl Drop for FakeVerbs {
    fn drop(&mut self) {
        {
            let mut n = lock(&self.net);
            let e = &mut n.eps[self.me];
            e.gone = true;
            // Its memory is about to be freed: nothing may write it any more.
            for r in &mut e.regions {
                r.3 = false;
            }
        }
        // The other end, if no rank took it, goes too (dropped outside the table's lock).
        let left = self.fabric_key.and_then(|k| fabric_table().remove(&k));
        drop(left);
    }
}

impl Verbs for FakeVerbs {
    unsafe fn register(&mut self, ptr: *mut u8, len: usize) -> io::Result<Region> {
        let mut n = lock(&self.net);
        let key = n.next_key;
        n.next_key += 1;
        n.eps[self.me].regions.push((ptr as u64, len, key, true));
        Ok(Region { addr: ptr as u64, len, lkey: key, rkey: key })
    }

    fn deregister(&mut self, region: &Region) {
        let mut n = lock(&self.net);
        for r in &mut n.eps[self.me].regions {
            if r.2 == region.lkey {
                r.3 = false;
            }
        }
    }

    fn local_qp(&self) -> QpInfo {
        QpInfo { qpn: self.me as u32 + 1, psn: 0, lid: 0, gid: fabric_gid(), mtu: 5 }
    }

    fn connect(&mut self, peer: &QpInfo) -> io::Result<()> {
        if peer.gid != fabric_gid() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the peer's queue pair is on another process's fake fabric (TOROID_RDMA=fake joins only ranks that are threads of one process)",
            ));
        }
        if peer.qpn != (1 - self.me) as u32 + 1 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not this fake pair's other end"));
        }
        lock(&self.net).eps[self.me].connected = true;
        Ok(())
    }

    fn post_write_imm(&mut self, wr_id: u64, w: WriteImm<'_>) -> io::Result<()> {
        let WriteImm { local, offset, len, remote, remote_offset, imm } = w;
        let mut n = lock(&self.net);
        let max_send = n.max_send;
        let e = &n.eps[self.me];
        if !e.connected || e.error {
            return Err(io::Error::new(io::ErrorKind::NotConnected, "queue pair not ready to send"));
        }
        if e.outstanding >= max_send {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, "send queue full"));
        }
        let start = local.addr.checked_add(offset as u64).ok_or(io::ErrorKind::InvalidInput)?;
        let owned = e.regions.iter().any(|&(a, l, k, live)| {
            live && k == local.lkey && Region { addr: a, len: l, lkey: k, rkey: k }.contains(start, len)
        });
        if !owned && len > 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "local range not registered"));
        }
        let mut bytes = vec![0u8; len];
        if len > 0 {
            // SAFETY: `start..start + len` is inside a live registration of this endpoint,
            // whose memory stays allocated until it deregisters (under this lock); the poster
            // wrote it before posting, on this thread.
            unsafe { std::ptr::copy_nonoverlapping(start as *const u8, bytes.as_mut_ptr(), len) };
        }
        let fail = std::mem::take(&mut n.fail_next[self.me]);
        let due = Instant::now() + n.delay;
        let me = self.me;
        n.eps[me].wire.push_back(Packet { wr_id, bytes, remote: *remote, remote_offset, imm, due, fail });
        let data = n.eps[me].wire.iter().filter(|p| !p.bytes.is_empty()).count();
        n.max_in_flight[me] = n.max_in_flight[me].max(data);
        n.eps[me].outstanding += 1;
        n.deliver();
        Ok(())
    }

    fn post_recv(&mut self, wr_id: u64) -> io::Result<()> {
        let mut n = lock(&self.net);
        let e = &mut n.eps[self.me];
        if e.error {
            e.push(Completion { wr_id, op: WcOp::Write, status: Err(WR_FLUSH_ERR.into()) });
            return Ok(());
        }
        e.recvs.push_back(wr_id);
        // A write waiting for a receive (RNR) lands now.
        n.deliver();
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> io::Result<()> {
        let mut n = lock(&self.net);
        n.deliver();
        out.extend(n.eps[self.me].cq.drain(..));
        Ok(())
    }

    fn notify_fd(&self) -> RawFd {
        self.notify.as_raw_fd()
    }

    fn arm_notify(&mut self) -> io::Result<()> {
        // Level-triggered: the descriptor is readable while a signal is pending, and every
        // completion signals, so consuming what was signalled is all arming takes.
        self.notify.drain();
        Ok(())
    }
}
