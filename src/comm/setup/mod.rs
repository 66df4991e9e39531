//! Set-up: creating communicators: joining a job through a store (what each rank publishes:
//! `roster.rs`), in the background (`pending.rs`), and splitting one. Both (and `shrink`, in
//! `shrink.rs`; `grow`, in `grow.rs`, meets through a store of its own) end in the same connect sequence ([`Communicator::connect`]): TCP
//! links, the topology, same-host links moved to shared memory, the communicator, and its cost
//! model (probed, given, or inherited from the parent: `calibrate.rs`).
//!
//! Two ways to link the ranks (`TOROID_CONNECT`):
//!
//! - `lazy` (default): set-up opens only the links shared memory pairs over (ranks of one host,
//!   both allowing it); every other pair connects the first time an operation needs it
//!   (`transport::tcp::lazy`), so a torus2d all-reduce opens its row and column, a ring its two
//!   neighbours. The store's load per rank stays constant: each rank publishes its address and
//!   host once and reads one roster that rank 0 assembles (in chunks of at most
//!   [`roster::ROSTER_CHUNK`] bytes, the TCP store's value limit), instead of every rank reading
//!   every rank's keys (`N^2` reads in all).
//! - `mesh`: every pair connects at set-up and every rank reads every rank's keys, as before.

mod calibrate;
pub(super) mod grow;
pub(super) mod pending;
pub(crate) use calibrate::Calibration;
mod roster;
mod shrink;

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};

use roster::{
    Published, connect_mode, finish_roster, get_key, host_identity, key_line, machine_identity, not_joined,
    read_all, read_roster,
};
use std::time::Instant;

use crate::algorithm::Scratch;
use crate::collective::OpKind;
use crate::comm::control::Control;
use crate::comm::core::{Buffers, Core, Engine, Identity, Links, QueueSlot, Tuning, Watch};
use crate::comm::enqueue::Queue;
use crate::comm::{Communicator, lock};
use crate::config::Config;
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::rendezvous::{self, Store};
use crate::topology::{Layout, Topology};
use crate::trace::Recorder;
use crate::transport::exchange::{AbortSignal, SpinPolicy};
use crate::transport::tcp::control::ControlCtx;
use crate::transport::tcp::lazy::{Dialer, Inbox, LazyCtx};
use crate::transport::tcp::secure::{Identity as LinkIdentity, LinkSecurity};
use crate::transport::tcp::striped::{LinkPrefs, lanes_for};
use crate::transport::{Peers, rdma, shm, tcp};
use crate::tuning::{AlgoFilter, CostModel, Shape};

/// The members of a communicator being connected, in rank order, and where each listens.
pub(super) struct Members<'a> {
    /// This rank in the new communicator.
    pub rank: usize,
    /// Every member's listening address.
    pub addrs: &'a [SocketAddr],
    /// Every member's logical host (what the algorithms group by).
    pub hosts: &'a [String],
    /// Every member's physical machine (whose cores ranks share).
    pub machines: &'a [String],
    /// TCP connections to each member (`transport::tcp::striped::lanes_for`; ignored at `rank`).
    pub lanes: &'a [usize],
    /// Whether each member allows shared memory.
    pub shm_ok: &'a [bool],
    /// Whether each member can use RDMA towards other hosts.
    pub rdma_ok: &'a [bool],
    /// Connect pairs on demand (`TOROID_CONNECT=lazy`) rather than all at set-up.
    pub lazy: bool,
    /// The members' keys when links are encrypted (`TOROID_ENCRYPT`).
    pub security: Option<Arc<LinkSecurity>>,
}

/// Where this rank listens for the members' connections: the interface, its listening
/// endpoint, and the connections already accepted on it (by `shrink`).
pub(super) struct Listening {
    /// The interface the endpoint is on.
    pub iface: tcp::Interface,
    /// This rank's listening socket.
    pub endpoint: tcp::Endpoint,
    /// Connections already accepted on it, with their peers' addresses.
    pub accepted: Vec<(std::net::TcpStream, SocketAddr)>,
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
        let opened = rendezvous::env::open_store(launch, cfg.timeout, cfg.auth_token.as_ref(), cfg.encrypt)?;
        let store_host = match &launch.store {
            rendezvous::env::StoreAddr::Tcp { host, .. } | rendezvous::env::StoreAddr::Torch { host, .. } => {
                Some(host.clone())
            }
            rendezvous::env::StoreAddr::File(_) => None,
        };
        let comm = Communicator::build(
            launch.rank,
            launch.size,
            opened.store.clone(),
            cfg,
            store_host.as_deref(),
            Calibration::Probe,
        )?;
        // Rank 0's store server is needed no longer: every rank reads every address from the
        // store (or the roster) before it connects to anyone, and rank 0's set-up returns only
        // after every higher rank has connected to it (a mesh: it accepts them all) or has
        // marked the roster read (on demand), so by now no rank has a read
        // left. Stopping it now closes the port a stranger could probe for the rest of the
        // job. (A failed set-up drops `opened`, which stops it too.)
        opened.stop_serving();
        Ok(comm)
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
        Communicator::build(rank, size, store, config, None, Calibration::Probe)
    }

    fn build(
        rank: usize,
        size: usize,
        store: Arc<dyn Store>,
        cfg: &Config,
        store_host: Option<&str>,
        calibration: Calibration,
    ) -> Result<Communicator> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} is not in a world of {size}").into()));
        }
        let deadline = crate::config::deadline_in(cfg.timeout);
        // Reject a malformed TOROID_ALGO before touching the store.
        AlgoFilter::parse(cfg.algo.as_deref().unwrap_or(""))?;
        let generation = store.add(&format!("toroid/rank{rank}/generation"), 1)?;
        let prefix = format!("toroid/gen{generation}");
        let id = if rank == 0 {
            let id = crate::sys::random::id();
            store.set(&format!("{prefix}/id"), &id.to_le_bytes())?;
            id
        } else {
            let v = get_key(&*store, &format!("{prefix}/id"), deadline).map_err(|e| not_joined(e, 0))?;
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
        // Logical host (what the algorithms group by), physical machine (whose cores ranks
        // share) and what the rank asks of its TCP links, one per line.
        let mut prefs = LinkPrefs::local(cfg, &iface.name, size);
        prefs.rdma = size > 1 && rdma::setup::wanted(cfg);
        let lazy = cfg.connect_lazy && size > 1;
        let identity = encryption_identity(cfg, prefs.rdma)?;
        let host = format!(
            "{}\n{}\n{}\nconnect={}{}",
            host_identity(cfg),
            machine_identity(),
            prefs.encode(),
            connect_mode(lazy),
            identity.as_ref().map(|i| format!("\n{}", key_line(i.public_key()))).unwrap_or_default()
        );
        store.set(&format!("{prefix}/addr/{rank}"), endpoint.addr.to_string().as_bytes())?;
        store.set(&format!("{prefix}/host/{rank}"), host.as_bytes())?;
        let Published { addrs, hosts, machines, prefs: all_prefs, keys } = if lazy {
            read_roster(&*store, &prefix, rank, size, deadline)?
        } else {
            read_all(&*store, &prefix, rank, size, deadline)?
        };
        let security = pinned_keys(identity, keys, cfg)?;
        let lanes: Vec<usize> = (0..size)
            .map(|r| {
                let loopback = addrs[r].ip().is_loopback() || addrs[rank].ip().is_loopback();
                lanes_for(&prefs, &all_prefs[r], hosts[r] == hosts[rank], loopback)
            })
            .collect();
        let shm_ok: Vec<bool> = all_prefs.iter().map(|p| p.shm).collect();
        let rdma_ok: Vec<bool> = all_prefs.iter().map(|p| p.rdma).collect();
        let members = Members {
            rank,
            addrs: &addrs,
            hosts: &hosts,
            machines: &machines,
            lanes: &lanes,
            shm_ok: &shm_ok,
            rdma_ok: &rdma_ok,
            lazy,
            security,
        };
        let listening = Listening { iface, endpoint, accepted: Vec::new() };
        let comm =
            Communicator::connect(members, listening, id, cfg, Some(store.clone()), deadline, calibration)?;
        if lazy {
            finish_roster(&*store, &prefix, rank, size, deadline)?;
        }
        Ok(comm)
    }

    /// The connect sequence that creation and `split` share: a full TCP mesh between the
    /// members (or the links to this host's ranks, with the rest on demand), their topology,
    /// same-host links moved to shared memory (and the window when every member is on one
    /// host), links to other hosts moved to RDMA where both ranks can, then the communicator
    /// around them and its cost model.
    pub(super) fn connect(
        members: Members<'_>,
        listening: Listening,
        id: u64,
        cfg: &Config,
        store: Option<Arc<dyn Store>>,
        deadline: Instant,
        calibration: Calibration,
    ) -> Result<Communicator> {
        let Members { rank, addrs, hosts, machines, lanes, shm_ok, rdma_ok, lazy, security } = members;
        let Listening { iface, endpoint, accepted } = listening;
        let size = addrs.len();
        let lazy = lazy && size > 1;
        // Before any link exists: a child forked from now on closes them (see `sys::fork`).
        crate::sys::fork::install();
        let recorder = Arc::new(Recorder::new(rank, size, id, cfg.trace_buffer));
        if let Some(hook) =
            cfg.timeline.as_deref().and_then(|p| crate::trace::timeline::hook(p, rank, size, id))
        {
            recorder.set_on_end(hook);
        }
        let abort = Arc::new(AbortSignal::new()?);
        // A non-blocking set-up cancelled from now on wakes the waits for links and the
        // calibration's too.
        let signal = abort.clone();
        crate::cancel::on_cancel(Box::new(move || {
            signal.fire(Error::Aborted("set-up aborted by its caller while connecting or calibrating".into()))
        }));
        let snapshot = recorder.clone();
        let snapshot: crate::comm::control::SnapshotFn = Arc::new(move || snapshot.snapshot());
        let ctl_ctx =
            ControlCtx { rank, size, comm_id: id, auth: cfg.auth_token.clone(), encrypt: cfg.encrypt };
        let shared_addrs: Arc<[SocketAddr]> = addrs.into();
        let mut opts = tcp::SocketOptions::from_config(cfg);
        opts.secure = security.clone();
        let topology = Topology::from_ids(rank, hosts, machines);
        // RDMA between hosts, where both ranks of a pair can (docs/reference/rdma.md).
        let rdma_peer = |p: usize| {
            p != rank && rdma_ok[p] && rdma_ok[rank] && topology.host_of[p] != topology.host_of[rank]
        };
        let (transports, control, dialer, shm_host_of) = if lazy {
            // The listener serves the control plane and takes the links peers open from the
            // start: a peer may dial as soon as its own set-up is done.
            let rdma: Vec<bool> = (0..size).map(rdma_peer).collect();
            let rdma_cfg = rdma.contains(&true).then(|| Arc::new(cfg.clone()));
            // Pairs of this host where both ranks allow shared memory move to it as their
            // links open. Every other rank looks like another host to the shared-memory set-up.
            let shm_pair = |p: usize| {
                p != rank && topology.host_of[p] == topology.host_of[rank] && shm_ok[p] && shm_ok[rank]
            };
            let shm: Vec<bool> = (0..size).map(shm_pair).collect();
            let shm_opts = shm.contains(&true).then(|| Arc::new(shm::ShmOptions::from_config(cfg)));
            let lctx = LazyCtx {
                rank,
                size,
                comm_id: id,
                auth: cfg.auth_token.clone(),
                lanes: lanes.to_vec(),
                rdma,
                rdma_cfg,
                shm,
                shm_opts,
            };
            let inbox = Arc::new(Inbox::new(lctx.clone())?);
            let control = Control::start(
                endpoint,
                ctl_ctx,
                shared_addrs.clone(),
                snapshot,
                Some(inbox.clone()),
                cfg.status_dir.as_deref(),
            )?;
            let mut dialer = Dialer::new(lctx, shared_addrs.clone(), opts, inbox);
            // Linked now: only what the shared window's set-up runs over, when every rank
            // shares this host (rank 0 and each other rank); every other pair, of this host or
            // not, links the first time an operation needs it.
            let window = cfg.shm_chunk_size > 0 && (0..size).all(|p| p == rank || shm_pair(p));
            let now: Vec<usize> = match (window, rank) {
                (false, _) => Vec::new(),
                (true, 0) => (1..size).collect(),
                (true, _) => vec![0],
            };
            let transports = dialer.link_now(&now, deadline, &abort)?;
            let host_of: Vec<usize> = (0..size)
                .map(|p| if p == rank || shm_pair(p) { topology.host_of[p] } else { size + p })
                .collect();
            (transports, control, Some(dialer), host_of)
        } else {
            let mesh = tcp::MeshSpec { rank, addrs, comm_id: id, lanes, auth: cfg.auth_token.as_ref() };
            let transports = tcp::connect_mesh(&mesh, &endpoint, accepted, &opts, deadline)?;
            // Every peer is connected: from now on the listener serves the control plane.
            let control = Control::start(
                endpoint,
                ctl_ctx,
                shared_addrs.clone(),
                snapshot,
                None,
                cfg.status_dir.as_deref(),
            )?;
            (transports, control, None, topology.host_of.clone())
        };
        let pairs = if lazy { shm::Pairs::OnDemand } else { shm::Pairs::AtSetUp };
        let links = shm::connect(
            rank,
            &shm_host_of,
            transports,
            &shm::ShmOptions::from_config(cfg),
            pairs,
            id,
            deadline,
        )?;
        let config = cfg.clone();
        let shm::ShmSetup { links: mut transports, window, shm_peers } = links;
        // Links on demand move to RDMA as they open (the connector's exchange).
        if !lazy {
            let rdma_peers: Vec<usize> = (0..size).filter(|&p| rdma_peer(p)).collect();
            rdma::setup::connect(rank, &rdma_peers, &mut transports, cfg, id, deadline)?;
        }
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
        let mut peers = Peers::new(rank, transports, abort.clone(), spin, config.segment_size);
        peers.set_progress(recorder.progress());
        if let Some(d) = dialer {
            peers.set_connector(Box::new(d));
        }
        let has_window = window.is_some();
        tracing::info!(target: "toroid::init",
            "rank {rank}/{size}: connected; host {} of {}, local rank {}/{}, spin {:?}{}; shared memory with {shm_peers} peers{}{}",
            topology.host_of[rank], topology.hosts, topology.local_rank, topology.local_size,
            spin.spin, if oversubscribed { " (more ranks than cores: yielding)" } else { "" },
            if lazy { " so far (the others of this host as their links open)" } else { "" },
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
            pipeline_chunk: config.pipeline_chunk.unwrap_or(crate::config::DEFAULT_PIPELINE_CHUNK),
            pipeline_forced: config.pipeline_chunk.is_some(),
        };
        let explicit = CostModel::parse(config.cost_model.as_deref().unwrap_or(""))?;
        let core = Core {
            ident: Identity {
                rank,
                size,
                id,
                topology,
                layout,
                fork_generation: crate::sys::fork::generation(),
            },
            timeout: config.timeout.min(crate::config::MAX_TIMEOUT),
            config,
            tuning: Tuning {
                filter,
                model: std::sync::OnceLock::new(),
                measured: std::sync::OnceLock::new(),
                untuned: (CostModel::default(), shape),
                logged: Mutex::new(std::collections::HashSet::new()),
            },
            links: Links {
                iface,
                lanes: lanes.to_vec(),
                shm_ok: shm_ok.to_vec(),
                rdma_ok: rdma_ok.to_vec(),
                has_window,
                security,
            },
            abort,
            engine: Mutex::new(Engine {
                peers,
                window,
                scratch: Scratch::default(),
                seq: 0,
                sent: vec![0; size],
                received: vec![0; size],
                splits: 0,
            }),
            queue: QueueSlot { jobs: Mutex::new(Queue::default()), cv: Condvar::new() },
            watch: Watch { control, recorder, last_error: Mutex::new(None) },
            buffers: Buffers::default(),
            _store: store,
            #[cfg(feature = "cuda")]
            device: Mutex::new(None),
        };
        let comm = Communicator { core: Arc::new(core), worker: Mutex::new(None) };
        crate::comm::stall::watch(&comm.core);
        comm.calibrate(explicit, calibration)?;
        Ok(comm)
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
        self.go(OpKind::SplitExchange, DataType::I64, None, Some(bytemuck::cast_slice_mut(&mut all)))?;
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
            Some(_) => Some(tcp::listen(&self.core.links.iface, members.len())?),
            None => None,
        };
        const REC: usize = 64;
        let mut addrs = vec![0u8; REC * n];
        if let Some(ep) = &endpoint {
            let s = ep.addr.to_string();
            let rec = &mut addrs[REC * self.rank()..REC * (self.rank() + 1)];
            rec[..s.len()].copy_from_slice(s.as_bytes());
        }
        self.go(OpKind::SplitExchange, DataType::U8, None, Some(&mut addrs))?;
        // Every rank counts every split, members or not, so that later splits agree on ids.
        let split_no = {
            let mut e = lock(&self.core.engine);
            e.splits += 1;
            e.splits
        };
        let (Some(new_rank), Some(endpoint)) = (new_rank, endpoint) else { return Ok(None) };
        let mut member_addrs = Vec::with_capacity(members.len());
        for (_, r) in &members {
            let rec = &addrs[REC * r..REC * (r + 1)];
            let end = rec.iter().position(|b| *b == 0).unwrap_or(REC);
            let a = std::str::from_utf8(&rec[..end])
                .ok()
                .and_then(|s| s.parse::<SocketAddr>().ok())
                .ok_or_else(|| Error::Remote(format!("rank {r} sent a bad address in split").into()))?;
            member_addrs.push(a);
        }
        let id = {
            use std::hash::{DefaultHasher, Hash, Hasher};
            let mut h = DefaultHasher::new();
            (self.core.ident.id, split_no, color).hash(&mut h);
            h.finish()
        };
        let deadline = crate::config::deadline_in(self.core.timeout);
        let t = &self.core.ident.topology;
        let hosts: Vec<String> = members.iter().map(|(_, r)| t.host_of[*r].to_string()).collect();
        let machines: Vec<String> = members.iter().map(|(_, r)| t.machine_of[*r].to_string()).collect();
        let lanes: Vec<usize> = members.iter().map(|(_, r)| self.core.links.lanes[*r]).collect();
        let shm_ok: Vec<bool> = members.iter().map(|(_, r)| self.core.links.shm_ok[*r]).collect();
        let rdma_ok: Vec<bool> = members.iter().map(|(_, r)| self.core.links.rdma_ok[*r]).collect();
        let old_ranks: Vec<usize> = members.iter().map(|(_, r)| *r).collect();
        tracing::info!(target: "toroid::init", "rank {} split (color {color:?}, key {key}) into rank {new_rank} of {}", self.rank(), members.len());
        let members = Members {
            rank: new_rank,
            addrs: &member_addrs,
            hosts: &hosts,
            machines: &machines,
            lanes: &lanes,
            shm_ok: &shm_ok,
            rdma_ok: &rdma_ok,
            lazy: self.core.config.connect_lazy,
            security: self
                .core
                .links
                .security
                .as_ref()
                .map(|s| s.for_members(&old_ranks))
                .transpose()?
                .map(Arc::new),
        };
        let listening = Listening { iface: self.core.links.iface.clone(), endpoint, accepted: Vec::new() };
        Communicator::connect(
            members,
            listening,
            id,
            &self.core.config,
            None,
            deadline,
            Calibration::Inherit(self.measured()),
        )
        .map(Some)
    }
}

/// This rank's key pair for encrypted links, when `TOROID_ENCRYPT` asks for them (made here,
/// or with `TOROID_TLS_*` the site's certificate and key); refuses what encryption cannot
/// cover.
fn encryption_identity(cfg: &Config, rdma: bool) -> Result<Option<Arc<LinkIdentity>>> {
    if !cfg.encrypt {
        if cfg.tls_files.is_some() {
            return Err(Error::InvalidUsage(
                "TOROID_TLS_CA/CERT/KEY are set but TOROID_ENCRYPT is not: set TOROID_ENCRYPT=1 to use them"
                    .into(),
            ));
        }
        return Ok(None);
    }
    if cfg.auth_token.is_none() {
        return Err(Error::InvalidUsage(
            "TOROID_ENCRYPT=1 needs TOROID_AUTH_TOKEN: the ranks' keys are pinned through the token-authenticated \
             store and every link is bound to the token"
                .into(),
        ));
    }
    if rdma {
        return Err(Error::InvalidUsage(
            "TOROID_ENCRYPT=1 does not cover RDMA links yet: set TOROID_RDMA=0 (or leave encryption off)"
                .into(),
        ));
    }
    let identity = match &cfg.tls_files {
        None => LinkIdentity::generate()?,
        Some(f) => LinkIdentity::from_files(&f.ca, &f.cert, &f.key)?,
    };
    Ok(Some(Arc::new(identity)))
}

/// Every rank's published key, pinned for this communicator's links; an error when ranks
/// disagree on `TOROID_ENCRYPT`.
fn pinned_keys(
    identity: Option<Arc<LinkIdentity>>,
    keys: Vec<Option<Vec<u8>>>,
    cfg: &Config,
) -> Result<Option<Arc<LinkSecurity>>> {
    let mismatch = |r: usize, theirs: bool| {
        Error::InvalidUsage(
            format!(
                "rank {r} {} TOROID_ENCRYPT and this rank {}: every rank must set it alike",
                if theirs { "sets" } else { "does not set" },
                if theirs { "does not" } else { "does" }
            )
            .into(),
        )
        .with_peer(r)
    };
    let Some(identity) = identity else {
        return match keys.iter().position(Option::is_some) {
            Some(r) => Err(mismatch(r, true)),
            None => Ok(None),
        };
    };
    let keys = keys
        .into_iter()
        .enumerate()
        .map(|(r, k)| k.ok_or_else(|| mismatch(r, false)))
        .collect::<Result<Vec<_>>>()?;
    let token = cfg.auth_token.clone().ok_or_else(|| Error::Internal("encryption without a token".into()))?;
    Ok(Some(Arc::new(LinkSecurity::new(identity, keys, token, cfg.timeout.min(crate::config::MAX_TIMEOUT)))))
}
