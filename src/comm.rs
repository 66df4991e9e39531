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

use std::any::Any;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::algorithm::{self, Algorithm, Bufs, Group, Scratch, Wire};
use crate::config::Config;
use crate::dtype::{DataType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::memory::{RawBuf, RawBufMut, RawBufs};
use crate::rendezvous::{self, Store};
use crate::topology::{Layout, Topology};
use crate::transport::exchange::{AbortSignal, SpinPolicy};
use crate::transport::{CollKind, Fingerprint, Peers, shm, tcp};
use crate::tuning::{self, AlgoFilter, CostModel, Shape};

/// Options of one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// Deadline of this call (default: the communicator's timeout).
    pub timeout: Option<Duration>,
    /// Force an algorithm (must be able to run the collective).
    pub algorithm: Option<Algorithm>,
}

/// What an operation does (the internal form of every collective call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// all_reduce
    AllReduce(ReduceOp),
    /// reduce_scatter (output = this rank's piece)
    ReduceScatter(ReduceOp),
    /// all_gather
    AllGather,
    /// broadcast from root
    Broadcast(usize),
    /// reduce to root
    Reduce(ReduceOp, usize),
    /// all_to_all
    AllToAll,
    /// barrier
    Barrier,
    /// send to peer
    Send(usize),
    /// receive from peer
    Recv(usize),
    /// the all-gather inside `split`
    SplitExchange,
    /// the cost model's link measurements (output: the probe results as 6 f64)
    Probe,
}

impl OpKind {
    fn coll(self) -> CollKind {
        match self {
            OpKind::AllReduce(_) => CollKind::AllReduce,
            OpKind::ReduceScatter(_) => CollKind::ReduceScatter,
            OpKind::AllGather => CollKind::AllGather,
            OpKind::Broadcast(_) => CollKind::Broadcast,
            OpKind::Reduce(..) => CollKind::Reduce,
            OpKind::AllToAll => CollKind::AllToAll,
            OpKind::Barrier => CollKind::Barrier,
            OpKind::Send(_) | OpKind::Recv(_) => CollKind::PointToPoint,
            OpKind::SplitExchange => CollKind::Split,
            OpKind::Probe => CollKind::Probe,
        }
    }
}

/// One operation with its buffers, ready to validate and run.
#[derive(Debug, Clone, Copy)]
pub struct RawOp {
    /// What to do.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DataType,
    /// The buffers.
    pub bufs: RawBufs,
    /// Per-call options.
    pub opts: CallOptions,
}

/// This machine's identity: `TOROID_HOST_ID`, else hostname plus boot id.
fn host_identity(cfg: &Config) -> String {
    cfg.host_id.clone().unwrap_or_else(machine_identity)
}

/// The physical machine: hostname plus boot id (ranks of emulated hosts share it).
fn machine_identity() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    format!("{}/{}", read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id"))
}

struct Engine {
    peers: Peers,
    scratch: Scratch,
    /// Collective sequence number (every rank counts the same).
    seq: u64,
    /// Point-to-point sequence numbers, per peer and direction.
    sent: Vec<u64>,
    received: Vec<u64>,
    splits: u64,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    running: bool,
    shutdown: bool,
}

struct Job {
    op: RawOp,
    done: Arc<Completion>,
    hooks: Hooks,
}

/// A step run on the worker thread next to an operation, in issue order (see
/// [`Communicator::submit_raw_with_hooks`]).
pub type Hook = Box<dyn FnOnce() + Send>;

/// Steps around one queued operation.
#[derive(Default)]
pub struct Hooks {
    /// Runs right before the operation starts.
    pub before: Option<Hook>,
    /// Runs right after the operation succeeded, before its work handle reports completion.
    pub after: Option<Hook>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("before", &self.before.is_some())
            .field("after", &self.after.is_some())
            .finish()
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
    abort: Arc<AbortSignal>,
    /// Every rank is on this host and maps the shared window (`shm_direct` can run). shm
    has_window: bool,
    engine: Mutex<Engine>,
    queue: Mutex<Queue>,
    queue_cv: Condvar,
    last_error: Mutex<Option<String>>,
    /// Rank 0 serves the TCP store; keep it alive while the communicator lives.
    _store: Option<Arc<dyn Store>>,
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
    /// Joins the job described by the environment (`TOROID_*`, torchrun, Slurm or MPI
    /// variables; see `docs/ENV.md`). Rank 0 serves the rendezvous store.
    pub fn from_env() -> Result<Communicator> {
        crate::config::init_logging();
        let cfg = Config::global()?;
        let launch = rendezvous::env::detect(cfg)?;
        Communicator::from_launch(&launch, cfg)
    }

    /// Joins the job described by `launch` (rank, size, store address) with settings `cfg`:
    /// rank 0 serves a TCP store (or everyone opens the file store) and the ranks connect.
    pub fn from_launch(launch: &rendezvous::env::Launch, cfg: &Config) -> Result<Communicator> {
        crate::config::init_logging();
        let store = rendezvous::env::open_store(launch, cfg.timeout)?;
        let store_host = match &launch.store {
            rendezvous::env::StoreAddr::Tcp { host, .. } => Some(host.clone()),
            rendezvous::env::StoreAddr::File(_) => None,
        };
        Communicator::build(launch.rank, launch.size, store, cfg, store_host.as_deref())
    }

    /// Joins a job of `size` ranks as `rank`, meeting the others through `store`.
    ///
    /// Every rank must call this the same number of times on the same store (each call creates
    /// a new communicator; keys are kept apart per generation).
    pub fn with_store(
        rank: usize,
        size: usize,
        store: Arc<dyn Store>,
        config: &Config,
    ) -> Result<Communicator> {
        crate::config::init_logging();
        Communicator::build(rank, size, store, config, None)
    }

    fn build(
        rank: usize,
        size: usize,
        store: Arc<dyn Store>,
        cfg: &Config,
        store_host: Option<&str>,
    ) -> Result<Communicator> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} is not in a world of {size}")));
        }
        let deadline = Instant::now() + cfg.timeout;
        // Reject a malformed TOROID_ALGO before touching the store.
        AlgoFilter::parse(cfg.algo.as_deref().unwrap_or(""))?;
        let generation = store.add(&format!("toroid/rank{rank}/generation"), 1)?;
        let prefix = format!("toroid/gen{generation}");
        let left = || deadline.saturating_duration_since(Instant::now());
        let id = if rank == 0 {
            let id = crate::sys::random::id();
            store.set(&format!("{prefix}/id"), &id.to_le_bytes())?;
            id
        } else {
            let v = store.get(&format!("{prefix}/id"), left())?;
            let b: [u8; 8] = v
                .as_slice()
                .try_into()
                .map_err(|_| Error::Internal("bad communicator id in store".into()))?;
            u64::from_le_bytes(b)
        };
        let iface =
            tcp::choose_address(cfg.socket_ifname.as_deref(), cfg.socket_family.as_deref(), store_host)?;
        let endpoint = tcp::listen(&iface, size)?;
        tracing::info!(target: "toroid::init", "rank {rank}/{size}: listening on {} ({}), communicator {id:#x}",
            endpoint.addr, if iface.name.is_empty() { "route to store" } else { &iface.name });
        // Logical host (what the algorithms group by) and physical machine (whose cores ranks
        // share), one per line.
        let host = format!("{}\n{}", host_identity(cfg), machine_identity());
        store.set(&format!("{prefix}/addr/{rank}"), endpoint.addr.to_string().as_bytes())?;
        store.set(&format!("{prefix}/host/{rank}"), host.as_bytes())?;
        let mut addrs = Vec::with_capacity(size);
        let (mut hosts, mut machines) = (Vec::with_capacity(size), Vec::with_capacity(size));
        for r in 0..size {
            let a = store.get(&format!("{prefix}/addr/{r}"), left())?;
            let a = String::from_utf8_lossy(&a)
                .parse::<SocketAddr>()
                .map_err(|e| Error::Remote(format!("rank {r} published a bad address: {e}")))?;
            addrs.push(a);
            let ids =
                String::from_utf8_lossy(&store.get(&format!("{prefix}/host/{r}"), left())?).into_owned();
            let (h, m) = ids.split_once('\n').unwrap_or((&ids, &ids));
            hosts.push(h.to_string());
            machines.push(m.to_string());
        }
        let transports = tcp::connect_mesh(
            rank,
            &addrs,
            &endpoint,
            id,
            &tcp::SocketOptions::from_config(cfg),
            cfg.auth_token.as_ref(),
            deadline,
        )?;
        let topology = Topology::from_ids(rank, &hosts, &machines);
        // shm: same-host links move to shared memory; one host gets the shared window
        let links = shm::connect(
            rank,
            &topology.host_of,
            transports,
            &shm::ShmOptions::from_config(cfg),
            id,
            deadline,
        )?;
        Communicator::assemble(rank, size, id, cfg.clone(), topology, iface, links, Some(store))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        rank: usize,
        size: usize,
        id: u64,
        config: Config,
        topology: Topology,
        iface: tcp::Interface,
        links: shm::ShmSetup,
        store: Option<Arc<dyn Store>>,
    ) -> Result<Communicator> {
        let shm::ShmSetup { links: transports, window, shm_peers } = links; // shm
        let cores = crate::sys::cpu::online_cpus();
        let oversubscribed = topology.machine_ranks(rank) > cores;
        let spin = SpinPolicy {
            spin: config.spin.unwrap_or(if oversubscribed {
                crate::config::DEFAULT_SPIN * 4
            } else {
                crate::config::DEFAULT_SPIN
            }),
            yield_between: true,
        };
        let abort = Arc::new(AbortSignal::new()?);
        let mut peers = Peers::new(rank, transports, abort.clone(), spin, config.segment_size);
        // shm: BEGIN
        let has_window = window.is_some();
        peers.set_window(window);
        // shm: END
        tracing::info!(target: "toroid::init",
            "rank {rank}/{size}: connected; host {} of {}, local rank {}/{}, spin {:?}{}; shared memory with {shm_peers} peers{}",
            topology.host_of[rank], topology.hosts, topology.local_rank, topology.local_size,
            spin.spin, if oversubscribed { " (more ranks than cores: yielding)" } else { "" },
            if has_window { ", shared window" } else { "" });
        let filter = AlgoFilter::parse(config.algo.as_deref().unwrap_or(""))?;
        let layout = Layout::new(&topology, rank, config.torus_shape)?;
        if let Some(note) = &layout.grid.note
            && rank == 0
        {
            tracing::info!(target: "toroid::init", "torus grid: {note}");
        }
        let shape = Shape {
            n: size,
            hosts: topology.hosts,
            per_host: layout.max_local,
            grid: (layout.grid.x, layout.grid.y),
            rows_are_hosts: matches!(layout.grid.placement, crate::topology::Placement::Hosts(_)),
            cpu_share: 1.0,
            nics: 1,
            segment: config.segment_size,
        };
        let explicit = CostModel::parse(config.cost_model.as_deref().unwrap_or(""))?;
        let core = Core {
            rank,
            size,
            id,
            timeout: config.timeout,
            filter,
            config,
            topology,
            layout,
            tuning: std::sync::OnceLock::new(),
            untuned: (CostModel::default(), shape),
            logged: Mutex::new(std::collections::HashSet::new()),
            iface,
            abort,
            has_window, // shm
            engine: Mutex::new(Engine {
                peers,
                scratch: Scratch::default(),
                seq: 0,
                sent: vec![0; size],
                received: vec![0; size],
                splits: 0,
            }),
            queue: Mutex::new(Queue::default()),
            queue_cv: Condvar::new(),
            last_error: Mutex::new(None),
            _store: store,
        };
        let comm = Communicator { core: Arc::new(core), worker: Mutex::new(None) };
        comm.calibrate(explicit)?;
        Ok(comm)
    }

    /// Sets the cost model: `explicit` when given, else the probe's measurements agreed by an
    /// all-reduce of maxima (a collective: every rank runs it at creation).
    fn calibrate(&self, explicit: Option<CostModel>) -> Result<()> {
        let shape = self.core.untuned.1.clone();
        let model = match explicit {
            Some(m) => (m, shape),
            None if self.size() == 1 => (CostModel::default(), shape),
            None => {
                let mut r = [0f64; 6];
                self.run(RawOp {
                    kind: OpKind::Probe,
                    dtype: DataType::F64,
                    bufs: RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(&mut r))),
                    opts: CallOptions::default(),
                })?;
                self.all_reduce(&mut r, ReduceOp::Max)?;
                (CostModel::from_probe(&r), Shape { cpu_share: r[5].max(1.0), ..shape })
            }
        };
        if self.rank() == 0 {
            tracing::info!(target: "toroid::tuning", "cost model: {} (cpu share {:.1})", model.0, model.1.cpu_share);
        }
        let _ = self.core.tuning.set(model);
        Ok(())
    }

    /// Seconds the cost model predicts for an all-reduce (broadcast and reduce for `chain` and
    /// `tree`) of `bytes` with `algo`.
    pub fn predict(&self, algo: Algorithm, bytes: usize) -> f64 {
        let (m, s) = self.cost_model();
        m.predict(algo, bytes, s).time
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
        self.core.abort.fire(Error::Aborted(format!("rank {} aborted the communicator", self.core.rank)));
        // Idle: close the links now. Busy: the running operation sees the signal and does it.
        if let Ok(mut engine) = self.core.engine.try_lock()
            && !engine.peers.is_closed()
        {
            engine.peers.poison(&format!("rank {} called abort", self.core.rank));
        }
        self.core.queue_cv.notify_all();
    }

    // shm: BEGIN
    /// The transport linking this rank to `peer` (`"shm"` or `"tcp"`); `None` for this rank
    /// itself and once the communicator is closed. Waits for a running operation to finish.
    pub fn transport_to(&self, peer: usize) -> Option<&'static str> {
        lock(&self.core.engine).peers.link_kind(peer)
    }

    /// True when every rank is on this host and maps the shared window, so that `shm_direct`
    /// can run.
    pub fn has_shared_window(&self) -> bool {
        self.core.has_window
    }
    // shm: END

    /// The algorithm that a call of `kind` moving `bytes` would use (what the benchmark shows).
    pub fn algorithm_for(&self, kind: OpKind, bytes: usize, opts: &CallOptions) -> Algorithm {
        self.core.choose(kind, bytes, opts)
    }

    /// Validates `op` and runs it, blocking until it completes.
    pub fn run(&self, op: RawOp) -> Result<()> {
        let r = self.run_inner(op);
        if let Err(e) = &r {
            *lock(&self.core.last_error) = Some(e.to_string());
        }
        r
    }

    fn run_inner(&self, op: RawOp) -> Result<()> {
        self.core.validate(&op)?;
        self.core.abort.check()?;
        {
            let mut q = lock(&self.core.queue);
            if q.jobs.is_empty() && !q.running {
                q.running = true;
                drop(q);
                let r = self.core.execute(&op);
                lock(&self.core.queue).running = false;
                self.core.queue_cv.notify_all();
                return r;
            }
        }
        // Queued behind async work: wait for it. The caller's borrows outlive this wait.
        let done = self.enqueue(op, None, Hooks::default())?;
        done.wait_done(&self.core.abort, self.core.timeout)
    }

    /// Validates `op` and queues it; the returned handle completes when it has run.
    ///
    /// # Safety
    /// The buffers of `op` must stay valid (and, for outputs, untouched by anything else) until
    /// the work completes, and `keep` (if any) must own them or otherwise keep them alive.
    pub unsafe fn submit_raw(&self, op: RawOp, keep: Option<Box<dyn Any + Send>>) -> Result<Work<()>> {
        // SAFETY: forwarded from the caller.
        unsafe { self.submit_raw_with_hooks(op, keep, Hooks::default()) }
    }

    /// As [`Communicator::submit_raw`], with steps run on the worker thread right before the
    /// operation and right after it succeeded, in issue order. The C ABI uses them to move a
    /// piece within the caller's buffer for NCCL's in-place layouts of reduce_scatter and
    /// all_gather, which must happen after earlier queued operations and before later ones.
    ///
    /// # Safety
    /// As [`Communicator::submit_raw`]; the hooks may touch only the operation's buffers.
    pub unsafe fn submit_raw_with_hooks(
        &self,
        op: RawOp,
        keep: Option<Box<dyn Any + Send>>,
        hooks: Hooks,
    ) -> Result<Work<()>> {
        let r = self
            .core
            .validate(&op)
            .and_then(|_| self.core.abort.check())
            .and_then(|_| self.enqueue(op, keep, hooks));
        match r {
            Ok(done) => Ok(Work {
                done,
                abort: self.core.abort.clone(),
                timeout: self.core.timeout,
                _buf: PhantomData,
            }),
            Err(e) => {
                *lock(&self.core.last_error) = Some(e.to_string());
                Err(e)
            }
        }
    }

    fn enqueue(&self, op: RawOp, keep: Option<Box<dyn Any + Send>>, hooks: Hooks) -> Result<Arc<Completion>> {
        self.ensure_worker()?;
        let done = Arc::new(Completion::new(keep));
        let mut q = lock(&self.core.queue);
        if q.shutdown {
            return Err(Error::Aborted("communicator is shutting down".into()));
        }
        q.jobs.push_back(Job { op, done: done.clone(), hooks });
        drop(q);
        self.core.queue_cv.notify_all();
        Ok(done)
    }

    fn ensure_worker(&self) -> Result<()> {
        let mut w = lock(&self.worker);
        if w.is_none() {
            let core = self.core.clone();
            let h = std::thread::Builder::new()
                .name(format!("toroid-r{}", self.core.rank))
                .spawn(move || core.worker_loop())
                .map_err(|e| Error::system("spawning the worker thread", e))?;
            *w = Some(h);
        }
        Ok(())
    }

    /// Splits into sub-communicators: ranks passing the same `color` form one, ordered by
    /// `key` (ties by current rank). Ranks passing `None` take part but get `None` back.
    /// Every rank must call it (it is a collective).
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let n = self.size();
        // 1. Everyone learns everyone's color and key.
        let mine: [i64; 2] = [color.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * n];
        all[2 * self.rank()..2 * self.rank() + 2].copy_from_slice(&mine);
        self.run(RawOp {
            kind: OpKind::SplitExchange,
            dtype: DataType::I64,
            bufs: RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(&mut all))),
            opts: CallOptions::default(),
        })?;
        let mut members: Vec<(i64, usize)> = Vec::new();
        if let Some(c) = color {
            for r in 0..n {
                if all[2 * r] == i64::from(c) {
                    members.push((all[2 * r + 1], r));
                }
            }
            members.sort();
        }
        let new_rank = members.iter().position(|(_, r)| *r == self.rank());
        // 2. Members listen on a fresh port; everyone exchanges addresses over this communicator.
        let endpoint = match new_rank {
            Some(_) => Some(tcp::listen(&self.core.iface, members.len())?),
            None => None,
        };
        const REC: usize = 64;
        let mut addrs = vec![0u8; REC * n];
        if let Some(ep) = &endpoint {
            let s = ep.addr.to_string();
            let rec = &mut addrs[REC * self.rank()..REC * (self.rank() + 1)];
            rec[..s.len()].copy_from_slice(s.as_bytes());
        }
        self.run(RawOp {
            kind: OpKind::SplitExchange,
            dtype: DataType::U8,
            bufs: RawBufs::InPlace(RawBufMut::new(&mut addrs)),
            opts: CallOptions::default(),
        })?;
        let (Some(new_rank), Some(endpoint)) = (new_rank, endpoint) else { return Ok(None) };
        let split_no = {
            let mut e = lock(&self.core.engine);
            e.splits += 1;
            e.splits
        };
        let mut member_addrs = Vec::with_capacity(members.len());
        for (_, r) in &members {
            let rec = &addrs[REC * r..REC * (r + 1)];
            let end = rec.iter().position(|b| *b == 0).unwrap_or(REC);
            let a = std::str::from_utf8(&rec[..end])
                .ok()
                .and_then(|s| s.parse::<SocketAddr>().ok())
                .ok_or_else(|| Error::Remote(format!("rank {r} sent a bad address in split")))?;
            member_addrs.push(a);
        }
        let id = {
            use std::hash::{DefaultHasher, Hash, Hasher};
            let mut h = DefaultHasher::new();
            (self.core.id, split_no, color).hash(&mut h);
            h.finish()
        };
        let deadline = Instant::now() + self.core.timeout;
        let transports = tcp::connect_mesh(
            new_rank,
            &member_addrs,
            &endpoint,
            id,
            &tcp::SocketOptions::from_config(&self.core.config),
            self.core.config.auth_token.as_ref(),
            deadline,
        )?;
        let t = &self.core.topology;
        let host_of: Vec<String> = members.iter().map(|(_, r)| t.host_of[*r].to_string()).collect();
        let machine_of: Vec<String> = members.iter().map(|(_, r)| t.machine_of[*r].to_string()).collect();
        let topology = Topology::from_ids(new_rank, &host_of, &machine_of);
        // shm: same-host links move to shared memory; one host gets the shared window
        let links = shm::connect(
            new_rank,
            &topology.host_of,
            transports,
            &shm::ShmOptions::from_config(&self.core.config),
            id,
            deadline,
        )?;
        tracing::info!(target: "toroid::init", "rank {} split (color {color:?}, key {key}) into rank {new_rank} of {}", self.rank(), members.len());
        Communicator::assemble(
            new_rank,
            members.len(),
            id,
            self.core.config.clone(),
            topology,
            self.core.iface.clone(),
            links,
            None,
        )
        .map(Some)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        lock(&self.core.queue).shutdown = true;
        self.core.queue_cv.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            let _ = h.join();
        }
        // Links close when the core (and its engine) goes away right after this.
    }
}

impl Core {
    fn choose(&self, kind: OpKind, bytes: usize, opts: &CallOptions) -> Algorithm {
        let coll = kind.coll();
        if let Some(a) = opts.algorithm {
            return a;
        }
        // shm: BEGIN (every rank on this host with the shared window: see tuning::choose_intra)
        if self.has_window
            && let Some(a) = self.filter.choose_intra(coll, bytes, self.size)
        {
            return a;
        }
        // shm: END
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

    /// Checks everything that can be checked locally, before any byte moves.
    fn validate(&self, op: &RawOp) -> Result<()> {
        let n = self.size;
        let es = op.dtype.size();
        let (inp, out) = (op.bufs.input_len(), op.bufs.output_len());
        let whole = |what: &str, len: usize| -> Result<usize> {
            if !len.is_multiple_of(es) {
                return Err(Error::InvalidArgument(format!(
                    "{what} of {len} bytes is not a whole number of {} elements",
                    op.dtype
                )));
            }
            Ok(len / es)
        };
        let in_place = matches!(op.bufs, RawBufs::InPlace(_));
        let rank_ok = |what: &str, r: usize| -> Result<()> {
            if r >= n {
                return Err(Error::InvalidArgument(format!(
                    "{what} {r} is not a rank of this communicator (size {n})"
                )));
            }
            Ok(())
        };
        match op.kind {
            OpKind::AllReduce(rop) | OpKind::Reduce(rop, _) => {
                rop.check(op.dtype)?;
                whole("buffer", out.max(inp))?;
                if inp != out && !(matches!(op.kind, OpKind::Reduce(..)) && out == 0) {
                    return Err(Error::InvalidArgument(format!("input is {inp} bytes but output is {out}")));
                }
                if let OpKind::Reduce(_, root) = op.kind {
                    rank_ok("root", root)?;
                }
            }
            OpKind::ReduceScatter(rop) => {
                rop.check(op.dtype)?;
                let c = whole("input", inp)?;
                if c % n != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "reduce_scatter input of {c} elements does not split into {n} equal pieces"
                    )));
                }
                if !in_place && out * n != inp {
                    return Err(Error::InvalidArgument(format!(
                        "reduce_scatter output is {out} bytes; expected input/size = {}",
                        inp / n
                    )));
                }
            }
            OpKind::AllGather | OpKind::SplitExchange => {
                let c = whole("output", out)?;
                if c % n != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "all_gather output of {c} elements does not split into {n} equal pieces"
                    )));
                }
                if !in_place && inp * n != out {
                    return Err(Error::InvalidArgument(format!(
                        "all_gather output is {out} bytes; expected size x input = {}",
                        inp * n
                    )));
                }
            }
            OpKind::Broadcast(root) => {
                rank_ok("root", root)?;
                whole("buffer", out)?;
                if !in_place && inp != out && (self.rank == root || inp != 0) {
                    return Err(Error::InvalidArgument(format!("input is {inp} bytes but output is {out}")));
                }
            }
            OpKind::AllToAll => {
                let c = whole("buffer", out)?;
                if c % n != 0 || inp != out {
                    return Err(Error::InvalidArgument(format!(
                        "all_to_all buffers must be equal and split into {n} blocks (input {inp}, output {out} bytes)"
                    )));
                }
            }
            OpKind::Barrier => {}
            OpKind::Probe => {
                if out != 6 * 8 {
                    return Err(Error::Internal("probe output must be 6 f64".into()));
                }
            }
            OpKind::Send(peer) | OpKind::Recv(peer) => {
                rank_ok("peer", peer)?;
                if peer == self.rank {
                    return Err(Error::InvalidArgument(format!(
                        "rank {peer} cannot send to or receive from itself"
                    )));
                }
                whole("buffer", inp.max(out))?;
            }
        }
        if let Some(a) = op.opts.algorithm {
            tuning::check_forced(op.kind.coll(), a)?;
            // shm: BEGIN
            if a == Algorithm::ShmDirect && !self.has_window {
                return Err(Error::InvalidArgument(
                    "algorithm shm_direct needs every rank on one host with a shared-memory window \
                     (not available on this communicator: see TOROID_SHM_DISABLE and the WARN lines at set-up)"
                        .into(),
                ));
            }
            // shm: END
        }
        Ok(())
    }

    /// Runs a validated operation (callers guarantee one at a time, in issue order).
    fn execute(&self, op: &RawOp) -> Result<()> {
        self.abort.check()?;
        let mut engine = lock(&self.engine);
        let engine = &mut *engine;
        let es = op.dtype.size();
        let n = self.size;
        let (count, root, rop, bytes) = match op.kind {
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
        };
        let algo = self.choose(op.kind, bytes, &op.opts);
        let seq = match op.kind {
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
            kind: op.kind.coll(),
            dtype: op.dtype,
            op: rop,
            count: count as u64,
            root,
            algo: algo as u8,
        };
        let timeout = op.opts.timeout.unwrap_or(self.timeout);
        tracing::debug!(target: "toroid::coll", "rank {}: {fp} ({bytes} bytes)", self.rank);
        engine.peers.begin_op();
        let mut wire = Wire { peers: &mut engine.peers, fp, deadline: Instant::now() + timeout };
        let scratch = &mut engine.scratch;
        // SAFETY: validated buffers; blocking callers hold their borrows until we return, async
        // callers keep them alive in the work handle (see `memory`). One operation runs at a time.
        let result = unsafe { dispatch(&mut wire, scratch, &self.topology, &self.layout, op, algo) };
        if let Err(e) = &result {
            tracing::warn!(target: "toroid::coll", "rank {}: {e}", self.rank);
            if !engine.peers.is_closed() {
                engine.peers.poison(&format!("rank {}: {e}", self.rank));
            }
            self.abort.fire(e.clone());
        }
        result
    }

    fn worker_loop(self: Arc<Core>) {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if !q.running {
                        if let Some(j) = q.jobs.pop_front() {
                            q.running = true;
                            break j;
                        }
                        if q.shutdown {
                            return;
                        }
                    }
                    q = self.queue_cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let mut job = job;
            if let Some(before) = job.hooks.before.take() {
                before();
            }
            let r = self.execute(&job.op);
            if r.is_ok()
                && let Some(after) = job.hooks.after.take()
            {
                after();
            }
            if let Err(e) = &r {
                *lock(&self.last_error) = Some(e.to_string());
            }
            job.done.complete(r);
            lock(&self.queue).running = false;
            self.queue_cv.notify_all();
        }
    }
}

/// Runs `op` with `algo`.
///
/// # Safety
/// `op`'s buffers must be valid as [`RawBufs::bufs`] requires.
unsafe fn dispatch(
    wire: &mut Wire<'_>,
    scratch: &mut Scratch,
    topology: &Topology,
    layout: &Layout,
    op: &RawOp,
    algo: Algorithm,
) -> Result<()> {
    let n = wire.size();
    let me = wire.rank();
    let dtype = op.dtype;
    // SAFETY: forwarded from the caller.
    let bufs = unsafe { op.bufs.bufs() };
    let need = || Error::Internal("operation without buffers".into());
    // shm: BEGIN
    if algo == Algorithm::ShmDirect {
        let bufs = bufs.ok_or_else(need)?;
        return match op.kind {
            OpKind::AllReduce(rop) => algorithm::intra::all_reduce(wire, bufs, dtype, rop),
            OpKind::ReduceScatter(rop) => algorithm::intra::reduce_scatter(wire, bufs, dtype, rop),
            OpKind::AllGather | OpKind::SplitExchange => algorithm::intra::all_gather(wire, bufs),
            OpKind::Broadcast(root) => algorithm::intra::broadcast(wire, bufs, root),
            _ => Err(Error::Internal(format!("shm_direct cannot run {:?}", op.kind))),
        };
    }
    // shm: END
    match op.kind {
        OpKind::AllReduce(rop) => match algo {
            Algorithm::Doubling => {
                algorithm::doubling::all_reduce(wire, scratch, bufs.ok_or_else(need)?, dtype, rop)
            }
            Algorithm::HalvingDoubling => {
                algorithm::halving_doubling::all_reduce(wire, bufs.ok_or_else(need)?, dtype, rop)
            }
            Algorithm::HierarchicalRing => {
                algorithm::hierarchical::all_reduce(wire, layout, bufs.ok_or_else(need)?, dtype, rop)
            }
            Algorithm::Torus2d => {
                algorithm::torus2d::all_reduce(wire, layout, bufs.ok_or_else(need)?, dtype, rop)
            }
            _ => {
                algorithm::ring::all_reduce(wire, Group::World(n), me, bufs.ok_or_else(need)?, dtype, rop, n)
            }
        },
        OpKind::ReduceScatter(rop) => algorithm::ring::reduce_scatter(
            wire,
            scratch,
            Group::World(n),
            me,
            bufs.ok_or_else(need)?,
            dtype,
            rop,
            n,
        ),
        OpKind::AllGather | OpKind::SplitExchange => {
            let buf = match bufs.ok_or_else(need)? {
                Bufs::InPlace(b) => b,
                Bufs::OutOfPlace { send, recv } => {
                    let piece = send.len();
                    recv[me * piece..(me + 1) * piece].copy_from_slice(send);
                    recv
                }
            };
            let count = buf.len() / dtype.size();
            algorithm::ring::all_gather_phase(wire, Group::World(n), me, count, dtype.size(), buf, 0)
        }
        OpKind::Broadcast(root) => algorithm::broadcast::broadcast(wire, algo, bufs.ok_or_else(need)?, root),
        OpKind::Reduce(rop, root) => {
            let bufs = match (bufs, op.bufs) {
                (Some(b), _) => b,
                // A non-root may pass no output at all.
                // SAFETY: forwarded from the caller.
                (None, RawBufs::Read(s)) => Bufs::OutOfPlace { send: unsafe { s.as_slice() }, recv: &mut [] },
                _ => return Err(need()),
            };
            algorithm::broadcast::reduce(wire, scratch, algo, bufs, dtype, rop, root)
        }
        OpKind::AllToAll => algorithm::pairwise::all_to_all(wire, scratch, bufs.ok_or_else(need)?),
        OpKind::Barrier => algorithm::pairwise::barrier(wire),
        OpKind::Probe => {
            let r = tuning::probe(wire, topology, scratch.one(tuning::PROBE_BYTES))?;
            match bufs.ok_or_else(need)? {
                Bufs::InPlace(out) => out.copy_from_slice(bytemuck::cast_slice(&r)),
                Bufs::OutOfPlace { .. } => return Err(need()),
            }
            Ok(())
        }
        OpKind::Send(peer) => {
            // SAFETY: forwarded from the caller.
            let buf = unsafe { op.bufs.read() }.ok_or_else(need)?;
            algorithm::pairwise::send(wire, buf, peer)
        }
        OpKind::Recv(peer) => match bufs.ok_or_else(need)? {
            Bufs::InPlace(b) => algorithm::pairwise::recv(wire, b, peer),
            Bufs::OutOfPlace { .. } => Err(need()),
        },
    }
}

/// Completion state of one queued operation.
pub(crate) struct Completion {
    result: Mutex<Option<Result<()>>>,
    cv: Condvar,
    done: AtomicBool,
    keep: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Completion {
    fn new(keep: Option<Box<dyn Any + Send>>) -> Completion {
        Completion {
            result: Mutex::new(None),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
            keep: Mutex::new(keep),
        }
    }

    fn complete(&self, r: Result<()>) {
        *lock(&self.result) = Some(r);
        self.done.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Waits for completion. Past `timeout` the communicator is aborted (so the operation
    /// fails fast) and the wait continues until it has actually stopped: a caller's buffers are
    /// never released while the operation may still touch them.
    fn wait_done(&self, abort: &AbortSignal, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        // Poll briefly first: waking a sleeping thread costs tens of microseconds.
        let spin_until = Instant::now() + Duration::from_micros(20);
        while !self.is_done() && Instant::now() < spin_until {
            std::hint::spin_loop();
        }
        let mut r = lock(&self.result);
        let mut timed_out = false;
        while r.is_none() {
            let now = Instant::now();
            if !timed_out && now >= deadline {
                timed_out = true;
                abort.fire(Error::Timeout(format!("work not completed within {timeout:?}")));
            }
            let wait = if timed_out { Duration::from_millis(50) } else { deadline - now };
            r = self.cv.wait_timeout(r, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
        let res = r.clone().unwrap_or(Ok(()));
        match res {
            // The operation stopped because this wait's deadline aborted the communicator.
            Err(Error::Aborted(_)) if timed_out => {
                Err(Error::Timeout(format!("work not completed within {timeout:?} (communicator aborted)")))
            }
            other => other,
        }
    }
}

/// A handle to an operation issued asynchronously.
///
/// The operation runs on the communicator's worker thread in issue order. Dropping the handle
/// does not cancel it; owned buffers stay alive until it has run.
pub struct Work<B = ()> {
    done: Arc<Completion>,
    abort: Arc<AbortSignal>,
    timeout: Duration,
    _buf: PhantomData<fn() -> B>,
}

impl<B> std::fmt::Debug for Work<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("done", &self.done.is_done()).finish()
    }
}

impl<B: 'static> Work<B> {
    /// True once the operation has finished (successfully or not). Never blocks.
    pub fn test(&self) -> bool {
        self.done.is_done()
    }

    /// The error, once finished with one.
    pub fn error(&self) -> Option<Error> {
        if !self.test() {
            return None;
        }
        lock(&self.done.result).clone().and_then(Result::err)
    }

    /// Waits up to `timeout`. Past it the communicator is aborted (this and every pending
    /// operation fail) and `Err(Timeout)` is returned once the operation has stopped.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let r = self.done.wait_done(&self.abort, timeout);
        if r.is_ok() && !self.test() {
            return Err(Error::Timeout(format!("work not completed within {timeout:?}")));
        }
        r
    }

    /// Waits (with the communicator's timeout) and returns the buffer the operation owned.
    pub fn wait(self) -> Result<B> {
        self.done.wait_done(&self.abort, self.timeout)?;
        let keep = lock(&self.done.keep).take();
        match keep.map(|b| b.downcast::<B>()) {
            Some(Ok(b)) => Ok(*b),
            _ => {
                // `B = ()` for raw submissions.
                let unit: Box<dyn Any> = Box::new(());
                unit.downcast::<B>()
                    .map(|b| *b)
                    .map_err(|_| Error::Internal("work buffer already taken".into()))
            }
        }
    }
}

/// Host memory an async operation can own: its heap data does not move when the value does.
pub trait OwnedBuffer<T>: Send + 'static {
    /// The elements.
    fn as_mut_elems(&mut self) -> &mut [T];
}

impl<T: Element> OwnedBuffer<T> for Vec<T> {
    fn as_mut_elems(&mut self) -> &mut [T] {
        self
    }
}

impl<T: Element> OwnedBuffer<T> for Box<[T]> {
    fn as_mut_elems(&mut self) -> &mut [T] {
        self
    }
}

fn bytes_of<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_of_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

/// The typed collectives. Each blocks until done (see [`Communicator::run`]); `*_into` forms
/// are out of place, the others in place.
impl Communicator {
    fn go(&self, kind: OpKind, dtype: DataType, bufs: RawBufs) -> Result<()> {
        self.run(RawOp { kind, dtype, bufs, opts: CallOptions::default() })
    }

    /// Reduces `buf` across all ranks in place: afterwards every rank holds the result.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.go(OpKind::AllReduce(op), T::DTYPE, RawBufs::InPlace(RawBufMut::new(bytes_of_mut(buf))))
    }

    /// Reduces `send` across all ranks into `recv` (same length).
    pub fn all_reduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.go(
            OpKind::AllReduce(op),
            T::DTYPE,
            RawBufs::OutOfPlace(RawBuf::new(bytes_of(send)), RawBufMut::new(bytes_of_mut(recv))),
        )
    }

    /// Reduces `send` (`size` equal pieces) across ranks; rank `r` receives piece `r` in `recv`.
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.go(
            OpKind::ReduceScatter(op),
            T::DTYPE,
            RawBufs::OutOfPlace(RawBuf::new(bytes_of(send)), RawBufMut::new(bytes_of_mut(recv))),
        )
    }

    /// In-place reduce-scatter: `buf` holds `size` equal pieces; afterwards piece `rank` holds
    /// the reduction of everyone's piece `rank` (other pieces hold intermediate values).
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.go(OpKind::ReduceScatter(op), T::DTYPE, RawBufs::InPlace(RawBufMut::new(bytes_of_mut(buf))))
    }

    /// Gathers every rank's `send` into `recv` (`size` pieces in rank order).
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.go(
            OpKind::AllGather,
            T::DTYPE,
            RawBufs::OutOfPlace(RawBuf::new(bytes_of(send)), RawBufMut::new(bytes_of_mut(recv))),
        )
    }

    /// In-place all-gather: this rank's piece is already at position `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.go(OpKind::AllGather, T::DTYPE, RawBufs::InPlace(RawBufMut::new(bytes_of_mut(buf))))
    }

    /// Broadcasts `root`'s `buf` to every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.go(OpKind::Broadcast(root), T::DTYPE, RawBufs::InPlace(RawBufMut::new(bytes_of_mut(buf))))
    }

    /// Broadcasts `root`'s `send` into every rank's `recv` (`send` is read on the root only).
    pub fn broadcast_into<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.go(
            OpKind::Broadcast(root),
            T::DTYPE,
            RawBufs::OutOfPlace(RawBuf::new(bytes_of(send)), RawBufMut::new(bytes_of_mut(recv))),
        )
    }

    /// Reduces every rank's `buf` into `root`'s `buf`; other ranks' buffers are left untouched.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.go(OpKind::Reduce(op, root), T::DTYPE, RawBufs::InPlace(RawBufMut::new(bytes_of_mut(buf))))
    }

    /// Reduces every rank's `send` into `root`'s `recv` (`recv` is written on the root only).
    pub fn reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.go(
            OpKind::Reduce(op, root),
            T::DTYPE,
            RawBufs::OutOfPlace(RawBuf::new(bytes_of(send)), RawBufMut::new(bytes_of_mut(recv))),
        )
    }

    /// All-to-all: block `j` of `send` goes to rank `j`, arriving as its block `rank`.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.go(
            OpKind::AllToAll,
            T::DTYPE,
            RawBufs::OutOfPlace(RawBuf::new(bytes_of(send)), RawBufMut::new(bytes_of_mut(recv))),
        )
    }

    /// In-place all-to-all.
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.go(OpKind::AllToAll, T::DTYPE, RawBufs::InPlace(RawBufMut::new(bytes_of_mut(buf))))
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.go(OpKind::Barrier, DataType::U8, RawBufs::None)
    }

    /// Sends `buf` to `peer` (which must post a matching `recv`).
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.go(OpKind::Send(peer), T::DTYPE, RawBufs::Read(RawBuf::new(bytes_of(buf))))
    }

    /// Receives `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.go(OpKind::Recv(peer), T::DTYPE, RawBufs::InPlace(RawBufMut::new(bytes_of_mut(buf))))
    }

    /// Any collective on untyped bytes with options (the form the benchmark and the C ABI use).
    pub fn run_bytes(
        &self,
        kind: OpKind,
        dtype: DataType,
        send: Option<&[u8]>,
        recv: Option<&mut [u8]>,
        opts: CallOptions,
    ) -> Result<()> {
        let bufs = match (send, recv) {
            (None, None) => RawBufs::None,
            (Some(s), None) => RawBufs::Read(RawBuf::new(s)),
            (None, Some(r)) => RawBufs::InPlace(RawBufMut::new(r)),
            (Some(s), Some(r)) => RawBufs::OutOfPlace(RawBuf::new(s), RawBufMut::new(r)),
        };
        self.run(RawOp { kind, dtype, bufs, opts })
    }

    /// Async in-place all-reduce of an owned buffer; `wait` gives it back.
    ///
    /// ```no_run
    /// # let comm = toroid::Communicator::from_env()?;
    /// let work = comm.all_reduce_async(vec![1.0f32; 1024], toroid::ReduceOp::Sum)?;
    /// // ... compute meanwhile ...
    /// let summed: Vec<f32> = work.wait()?;
    /// # Ok::<(), toroid::Error>(())
    /// ```
    pub fn all_reduce_async<T: Element, B: OwnedBuffer<T>>(&self, buf: B, op: ReduceOp) -> Result<Work<B>> {
        self.submit_owned(buf, |b| (OpKind::AllReduce(op), RawBufs::InPlace(RawBufMut::new(b))))
    }

    /// Async broadcast of an owned buffer.
    pub fn broadcast_async<T: Element, B: OwnedBuffer<T>>(&self, buf: B, root: usize) -> Result<Work<B>> {
        self.submit_owned(buf, |b| (OpKind::Broadcast(root), RawBufs::InPlace(RawBufMut::new(b))))
    }

    /// Async in-place reduce-scatter of an owned buffer (see [`Communicator::reduce_scatter_in_place`]).
    pub fn reduce_scatter_async<T: Element, B: OwnedBuffer<T>>(
        &self,
        buf: B,
        op: ReduceOp,
    ) -> Result<Work<B>> {
        self.submit_owned(buf, |b| (OpKind::ReduceScatter(op), RawBufs::InPlace(RawBufMut::new(b))))
    }

    /// Async in-place all-gather of an owned buffer (see [`Communicator::all_gather_in_place`]).
    pub fn all_gather_async<T: Element, B: OwnedBuffer<T>>(&self, buf: B) -> Result<Work<B>> {
        self.submit_owned(buf, |b| (OpKind::AllGather, RawBufs::InPlace(RawBufMut::new(b))))
    }

    /// Async barrier.
    pub fn barrier_async(&self) -> Result<Work<()>> {
        // SAFETY: a barrier has no buffers.
        unsafe {
            self.submit_raw(
                RawOp {
                    kind: OpKind::Barrier,
                    dtype: DataType::U8,
                    bufs: RawBufs::None,
                    opts: CallOptions::default(),
                },
                None,
            )
        }
    }

    fn submit_owned<T: Element, B: OwnedBuffer<T>>(
        &self,
        mut buf: B,
        make: impl FnOnce(&mut [u8]) -> (OpKind, RawBufs),
    ) -> Result<Work<B>> {
        let (kind, bufs) = make(bytes_of_mut(buf.as_mut_elems()));
        let op = RawOp { kind, dtype: T::DTYPE, bufs, opts: CallOptions::default() };
        // SAFETY: the work keeps `buf` alive until the operation completes, and its heap data
        // does not move when `buf` is moved into the box (OwnedBuffer's promise).
        let w = unsafe { self.submit_raw(op, Some(Box::new(buf)))? };
        Ok(Work { done: w.done, abort: w.abort, timeout: w.timeout, _buf: PhantomData })
    }
}
