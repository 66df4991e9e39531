//! The communicator: rank, size, connected peers, an ordered work queue, split and abort.
//!
//! Operations run in the order they are issued, as on a CUDA stream. A blocking call runs on
//! the caller's thread when nothing is queued (no thread hop on the latency path); otherwise it
//! queues behind the async work and waits. Async calls return a [`Work`] and run on the
//! communicator's one worker thread, started on first use.
//!
//! Any failure while communicating (a peer that died, a deadline, a mismatched collective)
//! aborts the communicator: abort frames tell every peer, every link is closed, queued work
//! fails, and later calls fail fast with [`Error::Aborted`]. Argument errors found before any
//! byte moves leave it usable.
//!
//! Its parts, in the order a call meets them (NCCL's init / argcheck / enqueue split):
//!
//! | part | what it owns |
//! |---|---|
//! | `setup` | making communicators: joining through a store (`roster`), `split`, `shrink`, creation in the background (`pending`) |
//! | `api` | the typed calls (`all_reduce`, `send`, ...) that describe an operation as a [`RawOp`] |
//! | `argcheck` | every argument check: host operations (`validate`) and calls on device memory |
//! | `enqueue` | the ordered queue and its worker, [`Work`], groups, persistent requests |
//! | this file | the communicator, its shared state (`Core`, by concern) and running one operation |
//! | `wire` | the compressed all-reduce (`TOROID_WIRE_DTYPE`) |
//! | `control`, `stall` | the control plane (listener, abort frames) and the stall report |
//! | `device` | the communicator as the GPU path sees it (`gpu::host::HostComm`, cargo feature `cuda`) |

mod api;
mod argcheck;
mod control;
#[cfg(feature = "cuda")]
mod device;
mod enqueue;
mod setup;
mod stall;
mod wire;

pub use api::OwnedBuffer;
pub(crate) use argcheck::validate;
pub use enqueue::group::Group;
pub use enqueue::persistent::{AllReducePlan, Persistent};
pub use enqueue::{Hook, Hooks, Work};
pub use setup::pending::PendingComm;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::algorithm::{self, Scratch, Wire};
use crate::collective::{Algorithm, Bufs, CallOptions, CollKind, Fingerprint, OpKind};
use crate::config::Config;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::memory::RawBufs;
use crate::rendezvous::Store;
use crate::topology::{Layout, Topology};
use crate::transport::exchange::AbortSignal;
use crate::transport::window::Window;
use crate::transport::{Peers, tcp};
use crate::tuning::{self, AlgoFilter, CostModel, Shape};
use enqueue::Queue;

/// One operation with its buffers, ready to validate and run.
#[derive(Debug, Clone)]
pub struct RawOp {
    /// What to do.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DataType,
    /// The buffers.
    pub bufs: RawBufs,
    /// Per-call options.
    pub opts: CallOptions,
    /// Where a receive from any source ([`OpKind::RecvAny`]) records the rank its message came
    /// from, once it has one (`None`: not needed).
    pub source: Option<Arc<AtomicUsize>>,
}

/// What one running operation uses: the links, the shared window, scratch space, sequence
/// numbers. Locked by the operation that runs.
struct Engine {
    peers: Peers,
    /// The shared window when every rank is on this host (lent to `shm_direct` through the
    /// operation's [`Wire`]).
    window: Option<Window>,
    scratch: Scratch,
    /// Collective sequence number (every rank counts the same).
    seq: u64,
    /// Point-to-point sequence numbers, per peer and direction.
    sent: Vec<u64>,
    received: Vec<u64>,
    splits: u64,
}

impl Engine {
    /// After a failure: tells every peer (abort frames), closes every link and flags the shared
    /// window aborted, so every rank learns of it at once.
    fn fail(&mut self, reason: &str) {
        if !self.peers.is_closed() {
            self.peers.poison(reason);
        }
        if let Some(w) = self.window.take() {
            w.abort();
        }
    }
}

/// The shared state of a communicator (owned by the handle and its worker thread).
struct Core {
    rank: usize,
    size: usize,
    id: u64,
    timeout: Duration,
    filter: AlgoFilter,
    config: Config,
    topology: Topology,
    layout: Layout,
    /// The cost model and shape every choice uses: the untuned defaults until the probe (or
    /// `TOROID_COST_MODEL`) sets them, identically on every rank.
    tuning: std::sync::OnceLock<(CostModel, Shape)>,
    untuned: (CostModel, Shape),
    /// Sizes whose algorithm choice was already logged (log once per collective and size class).
    logged: Mutex<std::collections::HashSet<(CollKind, u32, Algorithm)>>,
    iface: tcp::Interface,
    /// TCP connections to each rank (1, or the lanes of a striped link).
    lanes: Vec<usize>,
    /// Whether each rank allows shared memory (`TOROID_SHM_DISABLE` unset there).
    shm_ok: Vec<bool>,
    /// Whether each rank can use RDMA towards other hosts (`transport::rdma::setup::wanted`).
    rdma_ok: Vec<bool>,
    abort: Arc<AbortSignal>,
    /// Every rank is on this host and maps the shared window (`shm_direct` can run).
    has_window: bool,
    engine: Mutex<Engine>,
    queue: Mutex<Queue>,
    queue_cv: Condvar,
    last_error: Mutex<Option<String>>,
    /// The fork generation this communicator was made in (see `sys::fork`): in a forked child
    /// it differs, and every call is refused.
    fork_generation: u64,
    /// Rank 0 serves the TCP store; keep it alive while the communicator lives.
    _store: Option<Arc<dyn Store>>,
    /// The control plane: this rank's listener, served for the communicator's life.
    control: control::Control,
    /// The flight recorder: the last operations and the running one's progress.
    recorder: Arc<crate::trace::Recorder>,
    /// Where grouped all-reduces are packed (`group.rs`): empty until a group packs, then
    /// kept (u64 for an alignment every element type accepts).
    pack: Mutex<Vec<u64>>,
    /// The wire-type pieces of a compressed all-reduce (`wire.rs`): empty until one runs.
    wire_scratch: Mutex<Vec<u16>>,
    /// Collectives on device memory (`gpu::stream`): the device and its staging, made by the
    /// first such call, and the IPC windows, by the first collective among them (not a send or
    /// a receive); kept for the communicator's life.
    #[cfg(feature = "cuda")]
    device: Mutex<Option<crate::gpu::stream::DeviceState>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its state consistent before anything can panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A group of ranks that run collectives together.
///
/// ```no_run
/// use toroid::{Communicator, ReduceOp};
/// let comm = Communicator::from_env()?;           // TOROID_* / torchrun / Slurm / MPI
/// let mut grads = vec![1.0f32; 1 << 20];
/// comm.all_reduce(&mut grads, ReduceOp::Avg)?;     // every rank now holds the mean
/// # Ok::<(), toroid::Error>(())
/// ```
pub struct Communicator {
    core: Arc<Core>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.core.rank)
            .field("size", &self.core.size)
            .field("id", &format_args!("{:#018x}", self.core.id))
            .field("aborted", &self.core.abort.is_fired())
            .finish()
    }
}

impl Communicator {
    /// Seconds the cost model predicts for an all-reduce (broadcast and reduce for `chain` and
    /// `tree`) of `bytes` with `algo`.
    pub fn predict(&self, algo: Algorithm, bytes: usize) -> f64 {
        let (m, s) = self.cost_model();
        m.predict(algo, bytes, s).time
    }

    /// How a float all-reduce of `bytes` of `dtype` compressed on the wire as the
    /// communicator's `TOROID_WIRE_DTYPE` asks would run (torus2d between several hosts of
    /// several ranks, else the flat form, shown as ring: its steps and bytes) and the seconds
    /// the cost model predicts; `None` when it would not be compressed (no wire type, not
    /// f32/f64, or one rank).
    pub fn predict_compressed(&self, bytes: usize, dtype: DataType) -> Option<(Algorithm, f64)> {
        let wire = self.core.config.wire?;
        let (m, s) = self.cost_model();
        wire::compressible(dtype, wire, self.core.size).then(|| {
            let p = m.predict_compressed(bytes, wire.size() as f64 / dtype.size() as f64, s);
            (p.algo, p.time)
        })
    }

    /// The cost model and shape the algorithm choice uses.
    pub fn cost_model(&self) -> (&CostModel, &Shape) {
        let (m, s) = self.core.tuning.get().unwrap_or(&self.core.untuned);
        (m, s)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.core.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.core.size
    }

    /// The default deadline of every call.
    pub fn timeout(&self) -> Duration {
        self.core.timeout
    }

    /// Where the ranks live.
    pub fn topology(&self) -> &Topology {
        &self.core.topology
    }

    /// The communicator id (equal on all ranks; in logs and handshakes).
    pub fn id(&self) -> u64 {
        self.core.id
    }

    /// True once aborted (by [`Communicator::abort`] or a failure).
    pub fn is_aborted(&self) -> bool {
        self.core.abort.is_fired()
    }

    /// The message of the last failed call, if any (what `toroid_get_last_error` returns).
    pub fn last_error(&self) -> Option<String> {
        lock(&self.core.last_error).clone()
    }

    /// Records `message` as the last error (the C ABI's argument checks fail before any call
    /// reaches the communicator, yet `toroid_get_last_error` must show them).
    pub fn set_last_error(&self, message: impl Into<String>) {
        *lock(&self.core.last_error) = Some(message.into());
    }

    /// Aborts: pending and later operations fail, peers are told, links close. Never blocks.
    pub fn abort(&self) {
        if self.core.forked().is_err() {
            return; // nothing of it is usable in a forked child, nor needs stopping
        }
        self.core
            .abort
            .fire(Error::Aborted(format!("rank {} aborted the communicator", self.core.rank).into()));
        // Idle: close the links now. Busy: the running operation sees the signal and does it.
        if let Ok(mut engine) = self.core.engine.try_lock() {
            engine.fail(&format!("rank {} called abort", self.core.rank));
        }
        self.core.queue_cv.notify_all();
    }

    /// The transport linking this rank to `peer` (`"shm"`, `"rdma"`, `"tcp"` or `"tcp-striped"`;
    /// a peer not linked yet: what its link will be); `None` for this rank
    /// itself and once the communicator is closed. Waits for a running operation to finish.
    pub fn transport_to(&self, peer: usize) -> Option<&'static str> {
        self.core.forked().ok()?;
        lock(&self.core.engine).peers.link_kind(peer)
    }

    /// The ranks this rank has a link to now, in rank order. With connections on demand
    /// (`TOROID_CONNECT=lazy`) these are the shared-memory peers plus the peers the operations
    /// so far needed; with a mesh, every other rank. Waits for a running operation to finish.
    pub fn connected_peers(&self) -> Vec<usize> {
        if self.core.forked().is_err() {
            return Vec::new();
        }
        lock(&self.core.engine).peers.connected()
    }

    /// True when this communicator opens its links on demand (`TOROID_CONNECT=lazy`).
    pub fn connects_on_demand(&self) -> bool {
        self.core.forked().is_ok() && lock(&self.core.engine).peers.connects_on_demand()
    }

    /// True when every rank is on this host and maps the shared window, so that `shm_direct`
    /// can run.
    pub fn has_shared_window(&self) -> bool {
        self.core.has_window
    }

    /// What this rank's flight recorder holds: its last operations (at most 16) and the one
    /// running now, with its phase, step, the rank it waits on and the bytes moved. Never waits
    /// for the running operation (another thread may call it while one is blocked).
    pub fn flight_record(&self) -> crate::trace::Snapshot {
        self.core.recorder.snapshot()
    }

    /// Counts, bytes and times of the operations completed so far, per collective, algorithm
    /// and size class (empty with `TOROID_TRACE_BUFFER=0`).
    pub fn stats(&self) -> crate::trace::Stats {
        self.core.recorder.stats()
    }

    /// The algorithm that a call of `kind` moving `bytes` would use (what the benchmark shows).
    pub fn algorithm_for(&self, kind: OpKind, bytes: usize, opts: &CallOptions) -> Algorithm {
        self.core.choose(kind, bytes, opts)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.core.forked().is_err() {
            // A forked child: the worker thread does not exist here (joining it would be
            // undefined), the links were closed at the fork and their numbers may name the
            // child's own files by now, and locks may be held forever by threads that did not
            // survive. Leak all of it; the parent still owns the real thing.
            std::mem::forget(self.core.clone());
            if let Some(h) = self.worker.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
                std::mem::forget(h);
            }
            return;
        }
        lock(&self.core.queue).shutdown = true;
        self.core.queue_cv.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            let _ = h.join();
        }
        // Links close when the core (and its engine) goes away right after this.
    }
}

impl Core {
    /// `InvalidUsage` in a child forked after this communicator was made.
    fn forked(&self) -> Result<()> {
        if crate::sys::fork::generation() == self.fork_generation {
            return Ok(());
        }
        Err(Error::InvalidUsage(
            format!(
                "rank {}: this communicator was created before fork(); a forked child (pid {}) cannot use \
                 it: its connections were closed in the child at the fork. Create a new communicator in \
                 the child, or fork before creating one",
                self.rank,
                std::process::id()
            )
            .into(),
        ))
    }

    fn choose(&self, kind: OpKind, bytes: usize, opts: &CallOptions) -> Algorithm {
        let coll = kind.coll();
        if let Some(a) = opts.algorithm {
            return a;
        }
        // Every rank on this host with the shared window: see tuning::choose_intra.
        if self.has_window
            && let Some(a) = self.filter.choose_intra(coll, bytes, self.size)
        {
            return a;
        }
        let (model, shape) = self.tuning.get().unwrap_or(&self.untuned);
        let algo = tuning::choose(&self.filter, model, shape, coll, bytes);
        if tracing::enabled!(target: "toroid::tuning", tracing::Level::INFO)
            && tuning::candidates(coll).len() > 1
        {
            let class = usize::BITS - bytes.leading_zeros();
            if lock(&self.logged).insert((coll, class, algo)) {
                let t = model.predict(algo, bytes, shape).time;
                tracing::info!(target: "toroid::tuning",
                    "rank {}: {} of {bytes} bytes on {} ranks: {algo} (predicted {:.1} us)",
                    self.rank, coll.name(), self.size, t * 1e6);
            }
        }
        algo
    }

    /// Runs a validated operation (callers guarantee one at a time, in issue order).
    fn execute(&self, op: &RawOp, issued_ns: u64) -> Result<()> {
        self.abort.check()?;
        let mut engine = lock(&self.engine);
        let engine = &mut *engine;
        let es = op.dtype.size();
        let n = self.size;
        let timeout = op.opts.timeout.unwrap_or(self.timeout).min(crate::config::MAX_TIMEOUT);
        let started = std::time::Instant::now();
        let deadline = crate::config::deadline_from(started, timeout);
        engine.peers.begin_op();
        let kind = match op.kind {
            OpKind::RecvAny => match engine.peers.wait_any_send(&engine.received, deadline) {
                Ok(p) => {
                    if let Some(slot) = &op.source {
                        slot.store(p, Ordering::Release);
                    }
                    OpKind::Recv(p)
                }
                Err(e) => return Err(self.failed(engine, e)),
            },
            k => k,
        };
        let (count, root, rop, bytes) = match kind {
            OpKind::AllReduce(o) => (op.bufs.output_len() / es, -1, o, op.bufs.output_len()),
            OpKind::ReduceScatter(o) => (op.bufs.input_len() / es / n, -1, o, op.bufs.input_len()),
            OpKind::AllGather | OpKind::SplitExchange => {
                (op.bufs.output_len() / es / n, -1, ReduceOp::Sum, op.bufs.output_len())
            }
            OpKind::Broadcast(r) => {
                (op.bufs.output_len() / es, r as i32, ReduceOp::Sum, op.bufs.output_len())
            }
            OpKind::Reduce(o, r) => (op.bufs.input_len() / es, r as i32, o, op.bufs.input_len()),
            OpKind::AllToAll => (op.bufs.output_len() / es / n, -1, ReduceOp::Sum, op.bufs.output_len()),
            OpKind::Barrier | OpKind::Probe => (0, -1, ReduceOp::Sum, 0),
            OpKind::Send(_) => (op.bufs.input_len() / es, -1, ReduceOp::Sum, op.bufs.input_len()),
            OpKind::Recv(_) => (op.bufs.output_len() / es, -1, ReduceOp::Sum, op.bufs.output_len()),
            OpKind::RecvAny => return Err(Error::Internal("receive from any source left unresolved".into())),
        };
        let algo = self.choose(kind, bytes, &op.opts);
        let seq = match kind {
            OpKind::Send(p) => {
                engine.sent[p] += 1;
                engine.sent[p]
            }
            OpKind::Recv(p) => {
                engine.received[p] += 1;
                engine.received[p]
            }
            _ => {
                engine.seq += 1;
                engine.seq
            }
        };
        let fp = Fingerprint {
            seq,
            kind: kind.coll(),
            dtype: op.dtype,
            op: rop,
            count: count as u64,
            root,
            algo: algo as u8,
        };
        tracing::debug!(target: "toroid::coll", "rank {}: {fp} ({bytes} bytes)", self.rank);
        let peer = match kind {
            OpKind::Send(p) | OpKind::Recv(p) => Some(p),
            _ => None,
        };
        self.recorder.start(&fp, peer, issued_ns, started);
        let mut wire = Wire { peers: &mut engine.peers, window: engine.window.as_mut(), fp, deadline };
        let scratch = &mut engine.scratch;
        // SAFETY: validated buffers; blocking callers hold their borrows until we return, async
        // callers keep them alive in the work handle (see `memory`). One operation runs at a time.
        let (bufs, input) = unsafe { (op.bufs.bufs(), op.bufs.read()) };
        let result = match (kind, bufs) {
            (OpKind::Probe, Some(Bufs::InPlace(out))) => {
                tuning::probe(&mut wire, &self.topology, scratch.one(tuning::PROBE_BYTES))
                    .map(|r| out.copy_from_slice(bytemuck::cast_slice(&r)))
            }
            (OpKind::Probe, _) => Err(Error::Internal("probe output must be one buffer".into())),
            (kind, bufs) => {
                let narrow_to = self.wire_of(op).filter(|_| algo == Algorithm::Torus2d);
                let torus_chunks = match algo {
                    Algorithm::Torus2d => {
                        let (model, shape) = self.tuning.get().unwrap_or(&self.untuned);
                        let ratio = narrow_to.map(|w| w.size() as f64 / op.dtype.size() as f64);
                        model.torus_chunks(bytes, shape, ratio)
                    }
                    _ => 1,
                };
                let call = algorithm::dispatch::Call {
                    kind,
                    dtype: op.dtype,
                    algo,
                    bufs,
                    input,
                    narrow_to,
                    torus_chunks,
                };
                algorithm::dispatch::run(&mut wire, scratch, &self.layout, call)
            }
        };
        result.map_err(|e| self.failed(engine, self.with_stall_report(e.with_seq(fp.seq))))
    }

    /// An operation failed: every link closes (peers learn why) and the communicator aborts.
    fn failed(&self, engine: &mut Engine, e: Error) -> Error {
        tracing::warn!(target: "toroid::coll", "rank {}: {e}", self.rank);
        engine.fail(&format!("rank {}: {e}", self.rank));
        self.abort.fire(e.clone());
        e
    }
}
