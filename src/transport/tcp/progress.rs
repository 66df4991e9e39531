//! Progress threads (`TOROID_NTHREADS`): helper threads that move the bytes of a
//! communicator's TCP connections, so that the kernel's side of sending and receiving (its
//! copies, TCP's per-byte work) runs on several cores while the calling thread only copies into
//! and out of memory rings. NCCL's socket transport does the same with `NCCL_SOCKET_NTHREADS`
//! helper threads of `NCCL_NSOCKS_PERTHREAD` sockets each; Gloo moves every byte on the calling
//! thread, as toroid does without this variable.
//!
//! ## How bytes move
//!
//! Every lane (TCP connection) of a link has two single-producer, single-consumer byte rings
//! (`rtrb`) of [`RING`] bytes. The caller writes the stream into the sending ring of the lane
//! whose chunk it is, dealt in [`CHUNK`]s round-robin exactly as [`super::striped`] deals them,
//! so the other end reads the same stream whether or not it uses threads. One helper thread
//! moves that ring into the socket, and the socket into the lane's receiving ring, which the
//! caller reads. The caller's side ([`Offloaded`]) is a [`Transport`] like the others: it never
//! blocks, and what `try_write` accepted reaches the peer (the helper sends it even after the
//! link is dropped, for up to [`FLUSH`]).
//!
//! The helpers never touch the caller's buffers. A collective lends its memory to the
//! transport only for one `try_write` or `try_read`; another thread using it later would
//! outlive the loan. The price is one memory copy per byte at each end, small next to the
//! kernel's copy and TCP's work that move to the helpers.
//!
//! ## Threads
//!
//! A communicator's threads start once, with its first TCP link (at set-up, or inside the first
//! collective that opens a link on demand), and stop when its last link and its connector are
//! gone; no collective after that starts a thread.
//! Lanes are dealt to threads round-robin. Threads are pinned as the launcher bound the rank:
//! when the rank may run on fewer CPUs than the machine has (`toroid-run --bind`, Slurm's
//! `--cpu-bind`, `mpirun --bind-to`), helper `i` runs on CPU `i + 1` of that set (wrapping),
//! leaving the first to the caller; an unbound rank's helpers are left to the scheduler.
//!
//! ## Waiting
//!
//! A helper with nothing to move yields for [`SPIN`], then sleeps in `poll(2)` on its lanes and
//! on an eventfd that the caller signals after filling a sending ring or draining a receiving
//! one, but only when the helper said it sleeps: each side publishes its change, fences, then
//! reads the other's flag, so one of them always sees the other and no wake-up is lost. The
//! caller's engine sleeps the same way on the link's eventfd ([`Transport::pollable`]), which
//! the helper signals when it moved bytes the caller waits for, and always when a lane ends or
//! fails.

use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rtrb::{Consumer, Producer, RingBuffer};

use super::striped::{CHUNK, Stripe};
use crate::error::{Error, Result};
use crate::sys::eventfd::EventFd;
use crate::sys::fork::ForkGuarded;
use crate::sys::poll::{Events, PollFd, poll};
use crate::sys::process::CpuSet;
use crate::sys::socket;

/// Most progress threads per communicator (`TOROID_NTHREADS`).
pub use crate::config::MAX_THREADS;

mod offloaded;

use offloaded::CallerLane;
pub use offloaded::Offloaded;
/// Bytes of each lane's ring, per direction: four chunks, so a helper can read ahead of the
/// caller by more than the chunk it is on.
pub const RING: usize = 4 * CHUNK;
/// How long a helper keeps sending what a dropped link left in its ring.
pub const FLUSH: Duration = Duration::from_secs(2);
/// How long a helper with nothing to move yields before it sleeps (as the engine does).
pub const SPIN: Duration = Duration::from_micros(50);
/// Longest sleep of a helper: it looks at its lanes at least this often.
const MAX_SLEEP_MS: i32 = 100;

/// A flag and an eventfd: the sleeper sets the flag, fences, checks for work and sleeps on the
/// eventfd; the waker publishes its work, fences, and signals only if the flag was set.
#[derive(Debug)]
struct Doorbell {
    event: EventFd,
    sleeping: AtomicBool,
}

impl Doorbell {
    fn new() -> io::Result<Doorbell> {
        Ok(Doorbell { event: EventFd::new()?, sleeping: AtomicBool::new(false) })
    }

    /// The sleeper, before its last look for work.
    fn arm(&self) {
        self.event.drain();
        self.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// The sleeper, awake (or not sleeping after all).
    fn disarm(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
    }

    /// The waker, after publishing its work.
    fn ring(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) && self.sleeping.swap(false, Ordering::AcqRel) {
            self.event.signal();
        }
    }
}

/// What the helper and the caller share about one lane.
#[derive(Debug)]
struct LaneState {
    socket: ForkGuarded<TcpStream>,
    /// The peer ended its stream on this lane (set after the last byte is in the ring).
    ended: AtomicBool,
    /// The caller asked to end our stream: shut the socket down once the ring is sent.
    shutdown: AtomicBool,
}

/// What the helper and the caller share about one link.
#[derive(Debug)]
struct LinkState {
    /// Wakes the caller's engine.
    bell: Doorbell,
    /// The first failure of any lane: the link is broken.
    failure: Mutex<Option<(io::ErrorKind, String)>>,
    failed: AtomicBool,
}

impl LinkState {
    fn fail(&self, e: &io::Error) {
        let mut f = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        f.get_or_insert_with(|| (e.kind(), e.to_string()));
        self.failed.store(true, Ordering::Release);
        drop(f);
        self.bell.event.signal();
    }

    fn error(&self) -> Option<io::Error> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        let f = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        f.as_ref().map(|(kind, msg)| io::Error::new(*kind, msg.clone()))
    }
}

/// One lane as its helper holds it.
struct HelperLane {
    state: Arc<LaneState>,
    link: Arc<LinkState>,
    /// The caller's bytes to send.
    out: Consumer<u8>,
    /// Received bytes for the caller.
    inp: Producer<u8>,
    shut: bool,
    abandoned_at: Option<Instant>,
}

impl HelperLane {
    /// Moves what can move now; true if anything did.
    fn pump(&mut self) -> bool {
        if self.link.failed.load(Ordering::Acquire) {
            return false;
        }
        let fd = self.state.socket.as_fd();
        let (mut sent, mut received) = (false, false);
        loop {
            let n = self.out.slots();
            if n == 0 {
                break;
            }
            let Ok(chunk) = self.out.read_chunk(n) else { break };
            let (a, b) = chunk.as_slices();
            match socket::send_vectored(fd, &[IoSlice::new(a), IoSlice::new(b)]) {
                Ok(k) => {
                    chunk.commit(k);
                    sent = true;
                    if k < n {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.link.fail(&e);
                    return true;
                }
            }
        }
        if self.out.is_empty() && !self.shut && self.state.shutdown.load(Ordering::Acquire) {
            let _ = self.state.socket.shutdown(std::net::Shutdown::Write);
            self.shut = true;
        }
        while !self.state.ended.load(Ordering::Relaxed) && self.abandoned_at.is_none() {
            let n = self.inp.slots();
            if n == 0 {
                break;
            }
            let Ok(mut chunk) = self.inp.write_chunk_uninit(n) else { break };
            let (a, b) = chunk.as_mut_slices();
            match socket::recv_uninit(fd, a, b) {
                Ok(0) => {
                    self.state.ended.store(true, Ordering::Release);
                    self.link.bell.event.signal();
                    received = true;
                }
                Ok(k) => {
                    // SAFETY: recvmsg wrote the first k bytes of the chunk (a, then b).
                    unsafe { chunk.commit(k) };
                    received = true;
                    if k < n {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.link.fail(&e);
                    return true;
                }
            }
        }
        if sent || received {
            self.link.bell.ring();
        }
        sent || received
    }

    /// True once the caller dropped the link and what it left is sent (or [`FLUSH`] passed,
    /// or the link failed): the helper lets go of the lane and its socket closes.
    fn finished(&mut self, now: Instant) -> bool {
        if self.abandoned_at.is_none() && self.out.is_abandoned() {
            self.abandoned_at = Some(now);
        }
        self.abandoned_at.is_some_and(|t| {
            self.out.is_empty() || self.link.failed.load(Ordering::Acquire) || now.duration_since(t) >= FLUSH
        })
    }

    /// What to poll the socket for.
    fn interest(&self) -> Events {
        if self.link.failed.load(Ordering::Acquire) {
            return 0;
        }
        let mut ev = 0;
        if !self.out.is_empty() {
            ev |= PollFd::OUT;
        }
        if self.abandoned_at.is_none() && !self.state.ended.load(Ordering::Relaxed) && self.inp.slots() > 0 {
            ev |= PollFd::IN;
        }
        ev
    }
}

/// What a helper thread and the callers share.
#[derive(Debug)]
struct Helper {
    bell: Doorbell,
    /// Lanes handed over and not yet taken.
    arrivals: Mutex<Vec<HelperLane>>,
    pending: AtomicBool,
    stop: AtomicBool,
}

impl std::fmt::Debug for HelperLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HelperLane").field("fd", &self.state.socket.as_raw_fd()).finish_non_exhaustive()
    }
}

impl Helper {
    /// The thread: pumps its lanes, sleeps when none moves, ends once stopped with no lane
    /// left to flush.
    fn run(&self) {
        let mut lanes: Vec<HelperLane> = Vec::new();
        let mut fds: Vec<PollFd> = Vec::new();
        let mut last_progress = Instant::now();
        loop {
            if self.pending.swap(false, Ordering::AcqRel) {
                lanes.append(&mut self.arrivals.lock().unwrap_or_else(PoisonError::into_inner));
            }
            let mut progressed = false;
            for lane in &mut lanes {
                progressed |= lane.pump();
            }
            let now = Instant::now();
            lanes.retain_mut(|l| !l.finished(now));
            if self.stop.load(Ordering::Acquire) && lanes.is_empty() && !self.pending.load(Ordering::Acquire)
            {
                return;
            }
            if progressed {
                last_progress = now;
                continue;
            }
            if now.duration_since(last_progress) < SPIN {
                std::thread::yield_now();
                continue;
            }
            self.bell.arm();
            fds.clear();
            fds.push(PollFd::new(self.bell.event.as_raw_fd(), PollFd::IN));
            let mut work = self.pending.load(Ordering::Acquire) || self.stop.load(Ordering::Acquire);
            for l in &mut lanes {
                // A dropped link shows as abandoned rings, with no event: look again soon.
                work |= l.out.is_abandoned() && l.abandoned_at.is_none();
                // A lane with nothing to wait for is left out (a negative descriptor): its
                // socket may show a hang-up, which poll reports whatever was asked.
                let ev = l.interest();
                fds.push(PollFd::new(if ev == 0 { -1 } else { l.state.socket.as_raw_fd() }, ev));
            }
            let flushing = lanes.iter().any(|l| l.abandoned_at.is_some());
            if !work {
                let _ = poll(&mut fds, if flushing { 10 } else { MAX_SLEEP_MS });
            }
            self.bell.disarm();
            last_progress = Instant::now();
        }
    }
}

/// The progress threads of one communicator (cheap to clone: a handle).
#[derive(Clone)]
pub struct ProgressThreads {
    pool: Arc<Pool>,
}

struct Pool {
    count: usize,
    /// The fork generation the pool was made in (`sys::fork`): a forked child has none of its
    /// threads, so it must not join them.
    generation: u64,
    /// CPUs to pin helper `i` to (`None`: the rank is not bound; leave them to the scheduler).
    cpus: Option<Vec<usize>>,
    helpers: Mutex<Vec<(Arc<Helper>, JoinHandle<()>)>>,
    next: AtomicUsize,
}

impl std::fmt::Debug for ProgressThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProgressThreads({})", self.pool.count)
    }
}

impl PartialEq for ProgressThreads {
    fn eq(&self, other: &ProgressThreads) -> bool {
        Arc::ptr_eq(&self.pool, &other.pool)
    }
}

impl Eq for ProgressThreads {}

impl ProgressThreads {
    /// `count` threads (1 to [`MAX_THREADS`]), started with the first lane handed over.
    pub fn new(count: usize) -> ProgressThreads {
        let cpus = CpuSet::allowed()
            .ok()
            .map(|s| s.cpus())
            .filter(|c| !c.is_empty() && c.len() < crate::sys::cpu::online_cpus());
        let count = count.clamp(1, MAX_THREADS);
        ProgressThreads {
            pool: Arc::new(Pool {
                count,
                generation: crate::sys::fork::generation(),
                cpus,
                helpers: Mutex::new(Vec::new()),
                next: AtomicUsize::new(0),
            }),
        }
    }

    /// Hands `lanes` (connected, configured, non-blocking, in lane order) to the threads and
    /// returns the caller's side of the link.
    pub fn attach(&self, lanes: Vec<TcpStream>) -> Result<Offloaded> {
        if lanes.is_empty() {
            return Err(Error::Internal("a link needs at least one lane".into()));
        }
        let helpers = self.pool.started()?;
        let link = Arc::new(LinkState {
            bell: Doorbell::new().map_err(|e| Error::system("eventfd", e))?,
            failure: Mutex::new(None),
            failed: AtomicBool::new(false),
        });
        let mut mine = Vec::with_capacity(lanes.len());
        for socket in lanes {
            let state = Arc::new(LaneState {
                socket: ForkGuarded::new(socket),
                ended: AtomicBool::new(false),
                shutdown: AtomicBool::new(false),
            });
            let (out_tx, out_rx) = RingBuffer::new(RING);
            let (in_tx, in_rx) = RingBuffer::new(RING);
            let helper = Arc::clone(&helpers[self.pool.next.fetch_add(1, Ordering::Relaxed) % helpers.len()]);
            let lane = HelperLane {
                state: Arc::clone(&state),
                link: Arc::clone(&link),
                out: out_rx,
                inp: in_tx,
                shut: false,
                abandoned_at: None,
            };
            helper.arrivals.lock().unwrap_or_else(PoisonError::into_inner).push(lane);
            helper.pending.store(true, Ordering::Release);
            helper.bell.ring();
            mine.push(CallerLane { state, out: out_tx, inp: in_rx, helper });
        }
        Ok(Offloaded { lanes: mine, link, tx: Stripe::start(), rx: Stripe::start(), _pool: self.clone() })
    }
}

impl Pool {
    /// The helpers, started on first use.
    fn started(&self) -> Result<Vec<Arc<Helper>>> {
        let mut helpers = self.helpers.lock().unwrap_or_else(PoisonError::into_inner);
        while helpers.len() < self.count {
            let i = helpers.len();
            let helper = Arc::new(Helper {
                bell: Doorbell::new().map_err(|e| Error::system("eventfd", e))?,
                arrivals: Mutex::new(Vec::new()),
                pending: AtomicBool::new(false),
                stop: AtomicBool::new(false),
            });
            let pin = self.cpus.as_ref().map(|c| CpuSet::new(&[c[(i + 1) % c.len()]]));
            let h = Arc::clone(&helper);
            let thread = std::thread::Builder::new()
                .name(format!("toroid-progress-{i}"))
                .spawn(move || {
                    if let Some(set) = pin
                        && let Err(e) = set.bind_current_thread()
                    {
                        tracing::debug!(target: "toroid::net", "progress thread {i}: not pinned: {e}");
                    }
                    h.run()
                })
                .map_err(|e| Error::system("starting a progress thread (TOROID_NTHREADS)", e))?;
            helpers.push((helper, thread));
        }
        Ok(helpers.iter().map(|(h, _)| Arc::clone(h)).collect())
    }
}

impl Drop for Pool {
    /// Every link is gone (each holds the pool): the threads flush what is left and end.
    fn drop(&mut self) {
        let helpers = std::mem::take(self.helpers.get_mut().unwrap_or_else(PoisonError::into_inner));
        if crate::sys::fork::generation() != self.generation {
            // A forked child: the threads stayed in the parent (joining them would wait on
            // threads that do not exist here).
            std::mem::forget(helpers);
            return;
        }
        for (h, _) in &helpers {
            h.stop.store(true, Ordering::Release);
            h.bell.event.signal();
        }
        for (_, t) in helpers {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests;
