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
//! | `compressed` | the compressed all-reduce (`TOROID_WIRE_DTYPE`) |
//! | `control`, `stall` | the control plane (listener, abort frames) and the stall report |
//! | `device` | the communicator as the GPU path sees it (`gpu::host_comm::HostComm`, cargo feature `cuda`) |

mod api;
mod argcheck;
mod compressed;
mod control;
mod core;
#[cfg(feature = "cuda")]
mod device;
mod enqueue;
mod health;
pub use health::{HEALTH_GRACE, query_dir};
mod setup;
mod stall;

pub use api::OwnedBuffer;
pub(crate) use argcheck::{split_offsets, validate};
pub use enqueue::group::Group;
pub use enqueue::persistent::{AllReducePlan, Persistent};
pub use enqueue::{Hook, Hooks, Work};
pub use setup::grow::{GrowOffer, JoinToken};
pub use setup::pending::PendingComm;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::collective::{Algorithm, CallOptions, OpKind};
use crate::dtype::DataType;
use crate::error::Error;
use crate::memory::RawBufs;
use crate::topology::Topology;
use crate::transport::REVOKED;
use crate::tuning::{CostModel, Shape};
use core::Core;

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
    /// An all-to-all-v's blocks ([`OpKind::AllToAllV`]): byte offsets, `n + 1` of the input's
    /// blocks then `n + 1` of the output's (see `transport::exchange::Splits`); `None` otherwise.
    pub splits: Option<Arc<[usize]>>,
    /// The sends and receives of an [`OpKind::SendRecv`], each a validated `Send` or `Recv` of
    /// its own (see `batch.rs`); `None` otherwise.
    pub batch: Option<Box<[RawOp]>>,
}

impl RawOp {
    /// `kind` on `bufs` with the default options and nothing beside the buffers.
    pub fn new(kind: OpKind, dtype: DataType, bufs: RawBufs) -> RawOp {
        RawOp { kind, dtype, bufs, opts: CallOptions::default(), source: None, splits: None, batch: None }
    }
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
            .field("rank", &self.core.ident.rank)
            .field("size", &self.core.ident.size)
            .field("id", &format_args!("{:#018x}", self.core.ident.id))
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
        compressed::compressible(dtype, wire, self.core.ident.size).then(|| {
            let p = m.predict_compressed(bytes, wire.size() as f64 / dtype.size() as f64, s);
            (p.algo, p.time)
        })
    }

    /// The cost model and shape the algorithm choice uses.
    pub fn cost_model(&self) -> (&CostModel, &Shape) {
        let (m, s) = self.core.tuning.current();
        (m, s)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.core.ident.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.core.ident.size
    }

    /// The default deadline of every call.
    pub fn timeout(&self) -> Duration {
        self.core.timeout
    }

    /// Where the ranks live.
    pub fn topology(&self) -> &Topology {
        &self.core.ident.topology
    }

    /// The communicator id (equal on all ranks; in logs and handshakes).
    pub fn id(&self) -> u64 {
        self.core.ident.id
    }

    /// True once aborted (by [`Communicator::abort`] or a failure).
    pub fn is_aborted(&self) -> bool {
        self.core.abort.is_fired()
    }

    /// The message of the last failed call, if any (what `toroid_get_last_error` returns).
    pub fn last_error(&self) -> Option<String> {
        lock(&self.core.watch.last_error).clone()
    }

    /// Records `message` as the last error (the C ABI's argument checks fail before any call
    /// reaches the communicator, yet `toroid_get_last_error` must show them).
    pub fn set_last_error(&self, message: impl Into<String>) {
        *lock(&self.core.watch.last_error) = Some(message.into());
    }

    /// Aborts: pending and later operations fail, peers are told, links close. Never blocks.
    pub fn abort(&self) {
        if self.core.forked().is_err() {
            return; // nothing of it is usable in a forked child, nor needs stopping
        }
        self.core
            .abort
            .fire(Error::Aborted(format!("rank {} aborted the communicator", self.core.ident.rank).into()));
        // Idle: close the links now. Busy: the running operation sees the signal and does it.
        if let Ok(mut engine) = self.core.engine.try_lock() {
            engine.fail(&format!("rank {} called abort", self.core.ident.rank));
        }
        self.core.queue.cv.notify_all();
        // Kernels of collectives on device memory waiting for peers end too (never blocks: a
        // call launching right now holds the state and its kernel ends at its deadline).
        #[cfg(feature = "cuda")]
        if let Ok(state) = self.core.device.try_lock()
            && let Some(state) = state.as_ref()
        {
            state.abort();
        }
    }

    /// Revokes the communicator (NCCL 2.28's `ncclCommRevoke`, MPI ULFM's `MPIX_Comm_revoke`):
    /// every operation queued or running on it fails, on this rank and, through abort frames
    /// (and the shared window's flag), on every other rank, which need not call it; later
    /// operations fail at once. Nothing a recovery needs is released: the handle, the control
    /// plane (its listener, [`Communicator::health`], [`Communicator::dump`]) and the ranks'
    /// addresses stay, so the framework can quiesce, ask, decide, then
    /// [`shrink`](Communicator::shrink) (which builds new links through the same listeners) and
    /// grow the result, or destroy it. The links are closed, as after any failure: a revoked
    /// communicator carries no more data. Idempotent; never blocks; callable from any thread.
    ///
    /// It differs from [`Communicator::abort`] in what every rank is told: the error names the
    /// revoke (`rank r revoked the communicator`), [`Communicator::is_revoked`] is true on every
    /// rank that has seen it, and no stall report is made (a revoke explains itself).
    pub fn revoke(&self) {
        if self.core.forked().is_err() {
            return;
        }
        let reason = format!("rank {} {REVOKED}", self.core.ident.rank);
        self.core.abort.fire(Error::Aborted(reason.clone().into()));
        // Idle: close the links now. Busy: the running operation sees the signal and does it
        // (with the same reason, which the abort frames carry to every peer).
        if let Ok(mut engine) = self.core.engine.try_lock() {
            engine.fail(&reason);
        }
        self.core.queue.cv.notify_all();
    }

    /// True once this communicator is revoked: by [`Communicator::revoke`] on this rank, or on
    /// another rank and seen here (an operation failed with its abort frame).
    pub fn is_revoked(&self) -> bool {
        self.core.abort.is_fired() && self.core.abort.error().to_string().contains(REVOKED)
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
        self.core.links.has_window
    }

    /// What this rank's flight recorder holds: its last operations (at most 16) and the one
    /// running now, with its phase, step, the rank it waits on and the bytes moved. Never waits
    /// for the running operation (another thread may call it while one is blocked).
    pub fn flight_record(&self) -> crate::trace::Snapshot {
        self.core.watch.recorder.snapshot()
    }

    /// Counts, bytes and times of the operations completed so far, per collective, algorithm
    /// and size class (empty with `TOROID_TRACE_BUFFER=0`).
    pub fn stats(&self) -> crate::trace::Stats {
        self.core.watch.recorder.stats()
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
        lock(&self.core.queue.jobs).shutdown = true;
        self.core.queue.cv.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            let _ = h.join();
        }
        // Links close when the core (and its engine) goes away right after this.
    }
}
