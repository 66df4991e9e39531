//! The shared state of a communicator, by concern, and running one operation on it
//! ([`Core::execute`]): choosing the algorithm, numbering, recording, and failing the
//! communicator when the operation fails.
//!
//! `Core` is a short list of parts, each with one concern: who this rank is ([`Identity`]),
//! how algorithms are chosen ([`Tuning`]), what set-up learned about linking each rank
//! ([`Links`]), what a running operation uses ([`Engine`], locked while it runs), the ordered
//! queue ([`QueueSlot`]), what watches the communicator ([`Watch`]), the buffers some
//! operations keep between calls ([`Buffers`]), and the state of calls on device memory.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use super::enqueue::Queue;
use super::{RawOp, control, lock};
use crate::algorithm::{self, OpContext, Scratch};
use crate::collective::{Algorithm, Bufs, CallOptions, CollKind, Fingerprint, OpKind};
use crate::config::Config;
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};
use crate::memory::RawBufs;
use crate::rendezvous::Store;
use crate::topology::{Layout, Topology};
use crate::transport::exchange::{AbortSignal, P2pDir, P2pTask, Splits};
use crate::transport::window::Window;
use crate::transport::{Peers, tcp};
use crate::tuning::{self, AlgoFilter, CostModel, Shape};

/// What one running operation uses: the links, the shared window, scratch space, sequence
/// numbers. Locked by the operation that runs.
pub(super) struct Engine {
    pub peers: Peers,
    /// The shared window when every rank is on this host (lent to `shm_direct` through the
    /// operation's [`OpContext`]).
    pub window: Option<Window>,
    pub scratch: Scratch,
    /// Collective sequence number (every rank counts the same).
    pub seq: u64,
    /// Point-to-point sequence numbers, per peer and direction.
    pub sent: Vec<u64>,
    pub received: Vec<u64>,
    pub splits: u64,
}

impl Engine {
    /// After a failure: tells every peer (abort frames), closes every link and flags the shared
    /// window aborted, so every rank learns of it at once.
    pub fn fail(&mut self, reason: &str) {
        if !self.peers.is_closed() {
            self.peers.poison(reason);
        }
        if let Some(w) = self.window.take() {
            w.abort();
        }
    }
}

/// Who this rank is among whom: fixed at set-up, the same on every rank but `rank`.
pub(super) struct Identity {
    pub rank: usize,
    pub size: usize,
    /// The communicator id (equal on all ranks; in logs and handshakes).
    pub id: u64,
    pub topology: Topology,
    pub layout: Layout,
    /// The fork generation this communicator was made in (see `sys::fork`): in a forked child
    /// it differs, and every call is refused.
    pub fork_generation: u64,
}

/// How operations choose their algorithm: identically on every rank.
pub(super) struct Tuning {
    /// `TOROID_ALGO`: the algorithms allowed.
    pub filter: AlgoFilter,
    /// The cost model and shape every choice uses: the untuned defaults until the probe (or
    /// `TOROID_COST_MODEL`) sets them, identically on every rank.
    pub model: OnceLock<(CostModel, Shape)>,
    /// The agreed probe measurements the model came from (`setup::calibrate`), for the
    /// communicators made from this one.
    pub measured: OnceLock<crate::tuning::ProbeResult>,
    pub untuned: (CostModel, Shape),
    /// Sizes whose algorithm choice was already logged (log once per collective and size class).
    pub logged: Mutex<HashSet<(CollKind, u32, Algorithm)>>,
}

impl Tuning {
    /// The cost model and shape in force.
    pub fn current(&self) -> &(CostModel, Shape) {
        self.model.get().unwrap_or(&self.untuned)
    }
}

/// What set-up learned about linking each rank (what `split` and `shrink` reconnect with).
pub(super) struct Links {
    pub iface: tcp::Interface,
    /// TCP connections to each rank (1, or the lanes of a striped link).
    pub lanes: Vec<usize>,
    /// Whether each rank allows shared memory (`TOROID_SHM_DISABLE` unset there).
    pub shm_ok: Vec<bool>,
    /// Whether each rank can use RDMA towards other hosts (`transport::rdma::setup::wanted`).
    pub rdma_ok: Vec<bool>,
    /// Every rank is on this host and maps the shared window (`shm_direct` can run).
    pub has_window: bool,
    /// Encrypted links (`TOROID_ENCRYPT`): this rank's key pair and every rank's public key,
    /// which a split or shrink keeps.
    pub security: Option<std::sync::Arc<tcp::secure::LinkSecurity>>,
}

/// The ordered queue of operations and the signal its worker waits on.
pub(super) struct QueueSlot {
    pub jobs: Mutex<Queue>,
    pub cv: Condvar,
}

/// What watches the communicator from outside the operations.
pub(super) struct Watch {
    /// The control plane: this rank's listener, served for the communicator's life.
    pub control: control::Control,
    /// The flight recorder: the last operations and the running one's progress.
    pub recorder: Arc<crate::trace::Recorder>,
    /// The message of the last failed call (`toroid_get_last_error`).
    pub last_error: Mutex<Option<String>>,
}

/// Buffers some operations keep between calls: empty until first used, then kept.
#[derive(Default)]
pub(super) struct Buffers {
    /// Where grouped all-reduces are packed (`enqueue/group.rs`; u64 for an alignment every
    /// element type accepts).
    pub pack: Mutex<Vec<u64>>,
    /// The wire-type pieces of a compressed all-reduce (`compressed.rs`).
    pub wire: Mutex<Vec<u16>>,
}

/// The shared state of a communicator (owned by the handle and its worker thread).
pub(super) struct Core {
    pub ident: Identity,
    pub config: Config,
    /// The default deadline of every call.
    pub timeout: Duration,
    pub tuning: Tuning,
    pub links: Links,
    /// Fired on abort or failure: every wait checks it.
    pub abort: Arc<AbortSignal>,
    pub engine: Mutex<Engine>,
    pub queue: QueueSlot,
    pub watch: Watch,
    pub buffers: Buffers,
    /// Rank 0 serves the TCP store; keep it alive while the communicator lives.
    pub _store: Option<Arc<dyn Store>>,
    /// Collectives on device memory (`gpu::stream`): the device and its staging, made by the
    /// first such call, and the IPC windows, by the first collective among them (not a send or
    /// a receive); kept for the communicator's life.
    #[cfg(feature = "cuda")]
    pub device: Mutex<Option<crate::gpu::stream::DeviceState>>,
}

impl Core {
    /// `InvalidUsage` in a child forked after this communicator was made.
    pub(super) fn forked(&self) -> Result<()> {
        if crate::sys::fork::generation() == self.ident.fork_generation {
            return Ok(());
        }
        Err(Error::InvalidUsage(
            format!(
                "rank {}: this communicator was created before fork(); a forked child (pid {}) cannot use \
                 it: its connections were closed in the child at the fork. Create a new communicator in \
                 the child, or fork before creating one",
                self.ident.rank,
                std::process::id()
            )
            .into(),
        ))
    }

    pub(super) fn choose(&self, kind: OpKind, bytes: usize, opts: &CallOptions) -> Algorithm {
        let coll = kind.coll();
        if let Some(a) = opts.algorithm {
            return a;
        }
        // Every rank on this host with the shared window: see tuning::choose_intra.
        if self.links.has_window
            && let Some(a) = self.tuning.filter.choose_intra(coll, bytes, self.ident.size)
        {
            return a;
        }
        let (model, shape) = self.tuning.current();
        let algo = tuning::choose(&self.tuning.filter, model, shape, coll, bytes);
        if tracing::enabled!(target: "toroid::tuning", tracing::Level::INFO)
            && tuning::candidates(coll).len() > 1
        {
            let class = usize::BITS - bytes.leading_zeros();
            if lock(&self.tuning.logged).insert((coll, class, algo)) {
                let t = model.predict(algo, bytes, shape).time;
                tracing::info!(target: "toroid::tuning",
                    "rank {}: {} of {bytes} bytes on {} ranks: {algo} (predicted {:.1} us)",
                    self.ident.rank, coll.name(), self.ident.size, t * 1e6);
            }
        }
        algo
    }

    /// Runs a validated operation (callers guarantee one at a time, in issue order).
    pub(super) fn execute(&self, op: &RawOp, issued_ns: u64) -> Result<()> {
        self.abort.check()?;
        let mut engine = lock(&self.engine);
        let engine = &mut *engine;
        let es = op.dtype.size();
        let n = self.ident.size;
        let timeout = op.opts.timeout.unwrap_or(self.timeout).min(crate::config::MAX_TIMEOUT);
        let started = std::time::Instant::now();
        let deadline = crate::config::deadline_from(started, timeout);
        engine.peers.begin_op();
        if op.kind == OpKind::SendRecv {
            return self.execute_batch(engine, op, issued_ns, started, deadline);
        }
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
            // (its counts differ by rank: the fingerprint carries none, each frame its length)
            OpKind::AllToAllV => (0, -1, ReduceOp::Sum, op.bufs.input_len().max(op.bufs.output_len())),
            OpKind::Barrier | OpKind::Probe => (0, -1, ReduceOp::Sum, 0),
            OpKind::Send(_) => (op.bufs.input_len() / es, -1, ReduceOp::Sum, op.bufs.input_len()),
            OpKind::Recv(_) => (op.bufs.output_len() / es, -1, ReduceOp::Sum, op.bufs.output_len()),
            OpKind::RecvAny | OpKind::SendRecv => {
                return Err(Error::Internal(format!("{:?} left unresolved", op.kind).into()));
            }
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
        tracing::debug!(target: "toroid::coll", "rank {}: {fp} ({bytes} bytes)", self.ident.rank);
        let peer = match kind {
            OpKind::Send(p) | OpKind::Recv(p) => Some(p),
            _ => None,
        };
        self.watch.recorder.start(&fp, peer, issued_ns, started);
        let mut ctx = OpContext { peers: &mut engine.peers, window: engine.window.as_mut(), fp, deadline };
        let scratch = &mut engine.scratch;
        // SAFETY: validated buffers; blocking callers hold their borrows until we return, async
        // callers keep them alive in the work handle (see `memory`). One operation runs at a time.
        let (bufs, input) = unsafe { (op.bufs.bufs(), op.bufs.read()) };
        let result = match (kind, bufs) {
            (OpKind::Probe, Some(Bufs::InPlace(out))) => {
                tuning::probe(&mut ctx, &self.ident.topology, scratch.one(tuning::PROBE_BYTES))
                    .map(|r| out.copy_from_slice(bytemuck::cast_slice(&r)))
            }
            (OpKind::Probe, _) => Err(Error::Internal("probe output must be one buffer".into())),
            (kind, bufs) => {
                let narrow_to = self.wire_of(op).filter(|_| algo == Algorithm::Torus2d);
                let torus_chunks = match algo {
                    Algorithm::Torus2d => {
                        let (model, shape) = self.tuning.current();
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
                    splits: op.splits.as_deref().map(|s| {
                        let (send, recv) = s.split_at(s.len() / 2);
                        Splits { send, recv }
                    }),
                };
                algorithm::dispatch::run(&mut ctx, scratch, &self.ident.layout, call)
            }
        };
        result.map_err(|e| self.failed(engine, self.with_stall_report(e.with_seq(fp.seq))))
    }

    /// Runs a validated [`OpKind::SendRecv`]: its sends and receives side by side
    /// (`transport::exchange::batch`), each under the fingerprint it would have alone (the
    /// pair's next sequence number in its direction, counted in the batch's order).
    fn execute_batch(
        &self,
        engine: &mut Engine,
        op: &RawOp,
        issued_ns: u64,
        started: std::time::Instant,
        deadline: std::time::Instant,
    ) -> Result<()> {
        let items = op.batch.as_deref().unwrap_or_default();
        let mut tasks = Vec::with_capacity(items.len());
        for item in items {
            let (peer, bytes, counter) = match item.kind {
                OpKind::Send(p) => (p, item.bufs.input_len(), &mut engine.sent),
                OpKind::Recv(p) => (p, item.bufs.output_len(), &mut engine.received),
                k => return Err(Error::Internal(format!("{k:?} in a batch of sends and receives").into())),
            };
            counter[peer] += 1;
            let fp = Fingerprint {
                seq: counter[peer],
                kind: CollKind::PointToPoint,
                dtype: item.dtype,
                op: ReduceOp::Sum,
                count: (bytes / item.dtype.size()) as u64,
                root: -1,
                algo: self.choose(item.kind, bytes, &item.opts) as u8,
            };
            // SAFETY: validated buffers (no receive overlaps another buffer of the batch), valid
            // until the operation completes as for every operation (see `memory`).
            let dir = unsafe {
                match item.bufs {
                    RawBufs::Read(b) => P2pDir::Send(b.as_slice()),
                    RawBufs::InPlace(b) => P2pDir::Recv(b.as_mut_slice()),
                    _ => return Err(Error::Internal("a send or receive without its buffer".into())),
                }
            };
            tasks.push(P2pTask { peer, fp, dir });
        }
        let Some(first) = tasks.first().map(|t| (t.fp, t.peer)) else { return Ok(()) };
        tracing::debug!(target: "toroid::coll", "rank {}: {} sends and receives from {}", self.ident.rank, tasks.len(), first.0);
        self.watch.recorder.start(&first.0, Some(first.1), issued_ns, started);
        engine
            .peers
            .send_recv(deadline, &mut tasks)
            .map_err(|e| self.failed(engine, self.with_stall_report(e)))
    }

    /// An operation failed: every link closes (peers learn why) and the communicator aborts.
    pub(super) fn failed(&self, engine: &mut Engine, e: Error) -> Error {
        tracing::warn!(target: "toroid::coll", "rank {}: {e}", self.ident.rank);
        engine.fail(&format!("rank {}: {e}", self.ident.rank));
        self.abort.fire(e.clone());
        e
    }
}
