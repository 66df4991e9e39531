//! Creating communicators: joining a job through a store, and splitting one. Both (and
//! `shrink`, in `shrink.rs`) end in the same connect sequence ([`Communicator::connect`]): TCP
//! links, the topology, same-host links moved to shared memory, the communicator, and its cost
//! model (probed or given).
//!
//! Two ways to link the ranks (`TOROID_CONNECT`):
//!
//! - `lazy` (default): set-up opens only the links shared memory pairs over (ranks of one host,
//!   both allowing it); every other pair connects the first time an operation needs it
//!   (`transport::tcp::lazy`), so a torus2d all-reduce opens its row and column, a ring its two
//!   neighbours. The store's load per rank stays constant: each rank publishes its address and
//!   host once and reads one roster that rank 0 assembles (in chunks of at most
//!   [`ROSTER_CHUNK`] bytes, the TCP store's value limit), instead of every rank reading
//!   every rank's keys (`N^2` reads in all).
//! - `mesh`: every pair connects at set-up and every rank reads every rank's keys, as before.

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use super::control::Control;
use super::{Communicator, Core, Engine, Queue, lock};
use crate::algorithm::Scratch;
use crate::collective::{CallOptions, OpKind};
use crate::config::Config;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::rendezvous::{self, Store};
use crate::topology::{Layout, Topology};
use crate::trace::Recorder;
use crate::transport::exchange::{AbortSignal, SpinPolicy};
use crate::transport::tcp::control::ControlCtx;
use crate::transport::tcp::lazy::{Dialer, Inbox, LazyCtx};
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
}

/// Largest roster chunk in the store (below the TCP store's 64 KiB value limit).
const ROSTER_CHUNK: usize = 60 << 10;

/// What every rank publishes at set-up: where it listens and its host record.
struct Published {
    addrs: Vec<SocketAddr>,
    hosts: Vec<String>,
    machines: Vec<String>,
    prefs: Vec<LinkPrefs>,
}

impl Published {
    fn with_capacity(n: usize) -> Published {
        Published {
            addrs: Vec::with_capacity(n),
            hosts: Vec::with_capacity(n),
            machines: Vec::with_capacity(n),
            prefs: Vec::with_capacity(n),
        }
    }

    /// Adds rank `r`'s address and host record as published in the store, checking that it
    /// links its pairs as this rank does (`lazy`: `TOROID_CONNECT`).
    fn push(&mut self, r: usize, addr: &[u8], host: &[u8], lazy: bool) -> Result<()> {
        let a = String::from_utf8_lossy(addr)
            .parse::<SocketAddr>()
            .map_err(|e| Error::Remote(format!("rank {r} published a bad address: {e}").into()))?;
        self.addrs.push(a);
        let ids = String::from_utf8_lossy(host).into_owned();
        let mut lines = ids.splitn(4, '\n');
        let (h, m, p) = (lines.next().unwrap_or(""), lines.next(), lines.next());
        if let Some(theirs) = lines.next().and_then(|c| c.strip_prefix("connect="))
            && theirs != connect_mode(lazy)
        {
            return Err(connect_mismatch(r, theirs, lazy));
        }
        self.hosts.push(h.to_string());
        self.machines.push(m.unwrap_or(h).to_string());
        self.prefs.push(p.and_then(LinkPrefs::decode).ok_or_else(|| {
            Error::Remote(format!("rank {r} published malformed link settings {p:?}").into())
        })?);
        Ok(())
    }
}

/// `TOROID_CONNECT`'s value as published in the host record.
fn connect_mode(lazy: bool) -> &'static str {
    if lazy { "lazy" } else { "mesh" }
}

/// Rank `r` links its pairs another way (`theirs`) than this rank.
fn connect_mismatch(r: usize, theirs: &str, lazy: bool) -> Error {
    Error::InvalidUsage(
        format!(
            "rank {r} uses TOROID_CONNECT={theirs} and this rank {}: every rank must use the same",
            connect_mode(lazy)
        )
        .into(),
    )
    .with_peer(r)
}

/// Every rank's keys, each rank reading all of them (`TOROID_CONNECT=mesh`). Rank 0 that finds
/// a rank linking on demand says so in place of the roster that rank waits for, so that it
/// fails at once too.
fn read_all(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    size: usize,
    deadline: Instant,
) -> Result<Published> {
    let mut out = Published::with_capacity(size);
    for r in 0..size {
        let a = get_key(store, &format!("{prefix}/addr/{r}"), deadline).map_err(|e| not_joined(e, r))?;
        let h = get_key(store, &format!("{prefix}/host/{r}"), deadline).map_err(|e| not_joined(e, r))?;
        if let Err(e) = out.push(r, &a, &h, false) {
            if rank == 0 && matches!(e, Error::InvalidUsage(_)) {
                let _ = store.set(&format!("{prefix}/roster/n"), format!("mismatch {r} {e}").as_bytes());
            }
            return Err(e);
        }
    }
    Ok(out)
}

/// Every rank's keys through the roster (`TOROID_CONNECT=lazy`): rank 0 reads every rank's keys
/// and publishes them ([`parse_roster`] for the bytes) as `roster/<c>` chunks of at most
/// [`ROSTER_CHUNK`] bytes and then `roster/n`, their number; the others read `roster/n` and the
/// chunks, a constant number of reads per rank up to a couple of thousand ranks (one more per
/// 60 KiB).
/// Each non-zero rank then sets `roster/read/<r>`, which rank 0 waits for before its store may
/// stop serving ([`finish_roster`]).
fn read_roster(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    size: usize,
    deadline: Instant,
) -> Result<Published> {
    let stream: Vec<u8> = if rank == 0 {
        // A rank that never publishes fails rank 0 at its deadline: it tells the others which
        // one (they wait for the roster, and its store goes away as it exits).
        // It gives up a little before its own deadline, so that the others, which started
        // waiting at about the same time, are still waiting when it tells them.
        let left = deadline.saturating_duration_since(Instant::now());
        let early =
            deadline.checked_sub((left / 10).min(std::time::Duration::from_secs(1))).unwrap_or(deadline);
        let gather = |key: String, r: usize| {
            get_key(store, &key, early).map_err(|e| {
                let e = not_joined(e, r);
                let _ = store.set(&format!("{prefix}/roster/n"), format!("error {r} {e}").as_bytes());
                e
            })
        };
        // Host records repeat (every rank of a host publishes the same one): each goes in once
        // and ranks refer to it by index, so the roster stays about 25 bytes a rank.
        let mut records: Vec<Vec<u8>> = Vec::new();
        let mut index: std::collections::HashMap<Vec<u8>, u32> = std::collections::HashMap::new();
        let mut ranks: Vec<u8> = Vec::with_capacity(size * 28);
        for r in 0..size {
            let a = gather(format!("{prefix}/addr/{r}"), r)?;
            let h = gather(format!("{prefix}/host/{r}"), r)?;
            let i = *index.entry(h.clone()).or_insert_with(|| {
                records.push(h);
                (records.len() - 1) as u32
            });
            put(&mut ranks, &a);
            ranks.extend_from_slice(&i.to_le_bytes());
        }
        let mut stream =
            Vec::with_capacity(4 + ranks.len() + records.iter().map(|h| 4 + h.len()).sum::<usize>());
        stream.extend_from_slice(&(records.len() as u32).to_le_bytes());
        for h in &records {
            put(&mut stream, h);
        }
        stream.extend_from_slice(&ranks);
        let chunks: Vec<&[u8]> = stream.chunks(ROSTER_CHUNK).collect();
        for (c, bytes) in chunks.iter().enumerate() {
            store.set(&format!("{prefix}/roster/{c}"), bytes)?;
        }
        store.set(&format!("{prefix}/roster/n"), chunks.len().to_string().as_bytes())?;
        stream
    } else {
        let n = match get_key(store, &format!("{prefix}/roster/n"), deadline) {
            Ok(n) => n,
            Err(e) => return Err(missing_rank(store, prefix, size, e)),
        };
        let n = String::from_utf8_lossy(&n).into_owned();
        if let Some(e) = roster_error(&n) {
            return Err(e);
        }
        let n: usize = n.parse().map_err(|_| Error::Remote("rank 0 published a bad roster".into()))?;
        let mut stream = Vec::new();
        for c in 0..n {
            stream.extend(
                get_key(store, &format!("{prefix}/roster/{c}"), deadline).map_err(|e| not_joined(e, 0))?,
            );
        }
        // A key of its own (a caller's store may not add atomically, `ffi::store`).
        store.set(&format!("{prefix}/roster/read/{rank}"), b"1")?;
        stream
    };
    parse_roster(&stream, size, true)
}

/// Appends `v` as a `u32` length and its bytes.
fn put(out: &mut Vec<u8>, v: &[u8]) {
    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    out.extend_from_slice(v);
}

/// The roster's bytes (the chunks joined): `u32` H, H host records (`u32` length + bytes),
/// then per rank its address (`u32` length + bytes) and the `u32` index of its host record.
fn parse_roster(mut rest: &[u8], size: usize, lazy: bool) -> Result<Published> {
    let bad = || Error::Remote("rank 0 published a malformed roster".into());
    let u32_of = |rest: &mut &[u8]| -> Result<usize> {
        let b = rest.get(..4).ok_or_else(bad)?;
        let v = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        *rest = &rest[4..];
        Ok(v)
    };
    let field = |rest: &mut &[u8]| -> Result<Vec<u8>> {
        let len = u32_of(rest)?;
        let v = rest.get(..len).ok_or_else(bad)?.to_vec();
        *rest = &rest[len..];
        Ok(v)
    };
    let h = u32_of(&mut rest)?;
    if h > size {
        return Err(bad());
    }
    let records = (0..h).map(|_| field(&mut rest)).collect::<Result<Vec<_>>>()?;
    let mut out = Published::with_capacity(size);
    for r in 0..size {
        let a = field(&mut rest)?;
        let i = u32_of(&mut rest)?;
        out.push(r, &a, records.get(i).ok_or_else(bad)?, lazy)?;
    }
    if !rest.is_empty() {
        return Err(bad());
    }
    Ok(out)
}

/// Why the roster did not come: the first rank whose address is not in the store (rank 0
/// waits for it), found by asking for each key in turn without waiting (this runs only once
/// set-up has failed, so its `N` reads cost nothing while the job is healthy), else rank 0.
fn missing_rank(store: &dyn Store, prefix: &str, size: usize, e: Error) -> Error {
    if !matches!(e, Error::Timeout(_)) {
        return not_joined(e, 0);
    }
    let quick = std::time::Duration::from_millis(1);
    // Rank 0 may have named the missing rank just now.
    if let Ok(v) = store.get(&format!("{prefix}/roster/n"), quick)
        && let Some(e) = roster_error(&String::from_utf8_lossy(&v))
    {
        return e;
    }
    for r in 0..size {
        match store.get(&format!("{prefix}/addr/{r}"), quick) {
            Ok(_) => {}
            Err(Error::Timeout(_)) => return not_joined(e, r),
            Err(_) => break, // the store went away: rank 0 gave up
        }
    }
    not_joined(e, 0)
}

/// The failure rank 0 published in place of the roster, if any: `error <rank> <message>` (a
/// rank that never joined) or `mismatch <rank> <message>` (a rank with another
/// `TOROID_CONNECT`).
fn roster_error(n: &str) -> Option<Error> {
    let (mismatch, why) = match (n.strip_prefix("error "), n.strip_prefix("mismatch ")) {
        (Some(why), _) => (false, why),
        (None, Some(why)) => (true, why),
        (None, None) => return None,
    };
    let (r, why) = why.split_once(' ').unwrap_or(("0", why));
    let why = format!("rank 0's set-up failed: {why}");
    let e = if mismatch { Error::InvalidUsage(why.into()) } else { Error::Timeout(why.into()) };
    Some(e.with_peer(r.parse().unwrap_or(0)))
}

/// Rank 0 of a lazy set-up: waits until every rank has read the roster, so that the store it
/// serves can stop (`Communicator::from_launch`).
fn finish_roster(store: &dyn Store, prefix: &str, rank: usize, size: usize, deadline: Instant) -> Result<()> {
    if rank != 0 || size < 2 {
        return Ok(());
    }
    for r in 1..size {
        get_key(store, &format!("{prefix}/roster/read/{r}"), deadline)
            .map_err(|e| e.context(&format!("waiting for rank {r} to read the roster")).with_peer(r))?;
    }
    Ok(())
}

/// A failed wait for rank `r`'s keys in the store becomes an error naming that rank: it did not
/// join in time, or the store went away (rank 0 gave up) while this rank waited for it.
fn not_joined(e: Error, r: usize) -> Error {
    match e {
        Error::Timeout(d) => Error::Timeout(
            format!("rank {r} did not join within the set-up deadline (TOROID_TIMEOUT): {d}").into(),
        )
        .with_peer(r),
        e => e.context(&format!("waiting for rank {r} to join")).with_peer(r),
    }
}

/// `store.get(key)` bounded by `deadline`. A set-up that can be cancelled (`cancel.rs`) asks in
/// slices and checks between them; any other waits in one call.
fn get_key(store: &dyn Store, key: &str, deadline: Instant) -> Result<Vec<u8>> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if !crate::cancel::active() {
            return store.get(key, left);
        }
        crate::cancel::check("waiting for the other ranks in the store")?;
        match store.get(key, left.min(crate::cancel::SLICE)) {
            Err(Error::Timeout(_)) if left > crate::cancel::SLICE => continue,
            r => return r,
        }
    }
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
        let opened = rendezvous::env::open_store(launch, cfg.timeout, cfg.auth_token.as_ref())?;
        let store_host = match &launch.store {
            rendezvous::env::StoreAddr::Tcp { host, .. } => Some(host.clone()),
            rendezvous::env::StoreAddr::File(_) => None,
        };
        let comm =
            Communicator::build(launch.rank, launch.size, opened.store.clone(), cfg, store_host.as_deref())?;
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
        let host = format!(
            "{}\n{}\n{}\nconnect={}",
            host_identity(cfg),
            machine_identity(),
            prefs.encode(),
            connect_mode(lazy)
        );
        store.set(&format!("{prefix}/addr/{rank}"), endpoint.addr.to_string().as_bytes())?;
        store.set(&format!("{prefix}/host/{rank}"), host.as_bytes())?;
        let Published { addrs, hosts, machines, prefs: all_prefs } = if lazy {
            read_roster(&*store, &prefix, rank, size, deadline)?
        } else {
            read_all(&*store, &prefix, rank, size, deadline)?
        };
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
        };
        let comm = Communicator::connect(
            members,
            endpoint,
            Vec::new(),
            id,
            cfg,
            iface,
            Some(store.clone()),
            deadline,
        )?;
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
    #[allow(clippy::too_many_arguments)]
    pub(super) fn connect(
        members: Members<'_>,
        endpoint: tcp::Endpoint,
        accepted: Vec<(std::net::TcpStream, SocketAddr)>,
        id: u64,
        cfg: &Config,
        iface: tcp::Interface,
        store: Option<Arc<dyn Store>>,
        deadline: Instant,
    ) -> Result<Communicator> {
        let Members { rank, addrs, hosts, machines, lanes, shm_ok, rdma_ok, lazy } = members;
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
        let snapshot: super::control::SnapshotFn = Arc::new(move || snapshot.snapshot());
        let ctl_ctx = ControlCtx { rank, size, comm_id: id, auth: cfg.auth_token.clone() };
        let shared_addrs: Arc<[SocketAddr]> = addrs.into();
        let opts = tcp::SocketOptions::from_config(cfg);
        let topology = Topology::from_ids(rank, hosts, machines);
        // RDMA between hosts, where both ranks of a pair can (docs/ARCHITECTURE.md 5.6).
        let rdma_peer = |p: usize| {
            p != rank && rdma_ok[p] && rdma_ok[rank] && topology.host_of[p] != topology.host_of[rank]
        };
        let (transports, control, dialer, shm_host_of) = if lazy {
            // The listener serves the control plane and takes the links peers open from the
            // start: a peer may dial as soon as its own set-up is done.
            let rdma: Vec<bool> = (0..size).map(rdma_peer).collect();
            let rdma_cfg = rdma.contains(&true).then(|| Arc::new(cfg.clone()));
            let lctx = LazyCtx {
                rank,
                size,
                comm_id: id,
                auth: cfg.auth_token.clone(),
                lanes: lanes.to_vec(),
                rdma,
                rdma_cfg,
            };
            let inbox = Arc::new(Inbox::new(lctx.clone())?);
            let control =
                Control::start(endpoint, ctl_ctx, shared_addrs.clone(), snapshot, Some(inbox.clone()))?;
            let mut dialer = Dialer::new(lctx, shared_addrs.clone(), opts, inbox);
            // Linked now: the ranks of this host that shared memory pairs with (both allow
            // it). Every other rank looks like another host to the shared-memory set-up.
            let shm_pair = |p: usize| {
                p != rank && topology.host_of[p] == topology.host_of[rank] && shm_ok[p] && shm_ok[rank]
            };
            let now: Vec<usize> = (0..size).filter(|&p| shm_pair(p)).collect();
            let transports = dialer.link_now(&now, deadline, &abort)?;
            let host_of: Vec<usize> = (0..size)
                .map(|p| if p == rank || shm_pair(p) { topology.host_of[p] } else { size + p })
                .collect();
            (transports, control, Some(dialer), host_of)
        } else {
            let mesh = tcp::MeshSpec { rank, addrs, comm_id: id, lanes, auth: cfg.auth_token.as_ref() };
            let transports = tcp::connect_mesh(&mesh, &endpoint, accepted, &opts, deadline)?;
            // Every peer is connected: from now on the listener serves the control plane.
            let control = Control::start(endpoint, ctl_ctx, shared_addrs.clone(), snapshot, None)?;
            (transports, control, None, topology.host_of.clone())
        };
        let links =
            shm::connect(rank, &shm_host_of, transports, &shm::ShmOptions::from_config(cfg), id, deadline)?;
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
            pipeline_chunk: config.pipeline_chunk.unwrap_or(crate::config::DEFAULT_PIPELINE_CHUNK),
            pipeline_forced: config.pipeline_chunk.is_some(),
        };
        let explicit = CostModel::parse(config.cost_model.as_deref().unwrap_or(""))?;
        let core = Core {
            rank,
            size,
            id,
            timeout: config.timeout.min(crate::config::MAX_TIMEOUT),
            filter,
            config,
            topology,
            layout,
            tuning: std::sync::OnceLock::new(),
            untuned: (CostModel::default(), shape),
            logged: Mutex::new(std::collections::HashSet::new()),
            iface,
            lanes: lanes.to_vec(),
            shm_ok: shm_ok.to_vec(),
            rdma_ok: rdma_ok.to_vec(),
            abort,
            has_window,
            engine: Mutex::new(Engine {
                peers,
                window,
                scratch: Scratch::default(),
                seq: 0,
                sent: vec![0; size],
                received: vec![0; size],
                splits: 0,
            }),
            queue: Mutex::new(Queue::default()),
            queue_cv: Condvar::new(),
            last_error: Mutex::new(None),
            fork_generation: crate::sys::fork::generation(),
            _store: store,
            control,
            recorder,
            pack: Mutex::new(Vec::new()),
            wire_scratch: Mutex::new(Vec::new()),
            #[cfg(feature = "cuda")]
            device: Mutex::new(None),
        };
        let comm = Communicator { core: Arc::new(core), worker: Mutex::new(None) };
        super::stall::watch(&comm.core);
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
                let mut r = [0f64; crate::tuning::PROBE_LEN];
                self.go(OpKind::Probe, DataType::F64, None, Some(bytemuck::cast_slice_mut(&mut r)))?;
                // Exact, whatever TOROID_WIRE_DTYPE says: f16 would flush the link costs
                // (microseconds, nanoseconds per byte) to zero.
                let exact = CallOptions { wire: Some(DataType::F64), ..CallOptions::default() };
                self.all_reduce_with(&mut r, ReduceOp::Max, exact)?;
                (CostModel::from_probe(&r), Shape { cpu_share: r[5].max(1.0), ..shape })
            }
        };
        if self.rank() == 0 {
            tracing::info!(target: "toroid::tuning", "cost model: {} (cpu share {:.1})", model.0, model.1.cpu_share);
        }
        let _ = self.core.tuning.set(model);
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
            (self.core.id, split_no, color).hash(&mut h);
            h.finish()
        };
        let deadline = crate::config::deadline_in(self.core.timeout);
        let t = &self.core.topology;
        let hosts: Vec<String> = members.iter().map(|(_, r)| t.host_of[*r].to_string()).collect();
        let machines: Vec<String> = members.iter().map(|(_, r)| t.machine_of[*r].to_string()).collect();
        let lanes: Vec<usize> = members.iter().map(|(_, r)| self.core.lanes[*r]).collect();
        let shm_ok: Vec<bool> = members.iter().map(|(_, r)| self.core.shm_ok[*r]).collect();
        let rdma_ok: Vec<bool> = members.iter().map(|(_, r)| self.core.rdma_ok[*r]).collect();
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
        };
        Communicator::connect(
            members,
            endpoint,
            Vec::new(),
            id,
            &self.core.config,
            self.core.iface.clone(),
            None,
            deadline,
        )
        .map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::MemStore;

    #[test]
    fn the_roster_gives_every_rank_every_address_and_host_in_several_chunks() {
        // 3000 ranks on 375 hosts: about 75 KB of roster, two chunks.
        let n = 3000;
        let store = MemStore::new();
        let p = "toroid/gen1";
        for r in 0..n {
            store
                .set(
                    &format!("{p}/addr/{r}"),
                    format!("10.0.{}.{}:{}", r / 250, r % 250, 20000 + r).as_bytes(),
                )
                .unwrap();
            let host = format!("h{}\nm{}\nnsocks=0 shm={} auto=1", r / 8, r / 8, r % 2);
            store.set(&format!("{p}/host/{r}"), host.as_bytes()).unwrap();
        }
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        let zero = read_roster(&store, p, 0, n, deadline).unwrap();
        let chunks: usize =
            String::from_utf8(store.get(&format!("{p}/roster/n"), deadline - Instant::now()).unwrap())
                .unwrap()
                .parse()
                .unwrap();
        assert_eq!(chunks, 2);
        let other = read_roster(&store, p, 1234, n, deadline).unwrap();
        for got in [&zero, &other] {
            assert_eq!(got.addrs.len(), n);
            for r in [0, 7, 8, 1999, n - 1] {
                assert_eq!(got.addrs[r].to_string(), format!("10.0.{}.{}:{}", r / 250, r % 250, 20000 + r));
                assert_eq!(got.hosts[r], format!("h{}", r / 8));
                assert_eq!(got.machines[r], format!("m{}", r / 8));
                assert_eq!(got.prefs[r].shm, r % 2 == 1);
            }
        }
        assert!(store.get(&format!("{p}/roster/read/1234"), std::time::Duration::ZERO).is_ok());
    }

    #[test]
    fn a_malformed_roster_is_an_error_not_a_panic() {
        let mut good = Vec::new();
        good.extend_from_slice(&1u32.to_le_bytes());
        put(&mut good, b"h\nm\nnsocks=0 shm=1 auto=1");
        put(&mut good, b"127.0.0.1:5");
        good.extend_from_slice(&0u32.to_le_bytes());
        assert!(parse_roster(&good, 1, true).is_ok());
        for cut in 0..good.len() {
            assert!(parse_roster(&good[..cut], 1, true).is_err(), "cut at {cut}");
        }
        assert!(parse_roster(&good, 2, true).is_err());
        let mut bad_index = good.clone();
        let l = bad_index.len();
        bad_index[l - 4] = 9;
        assert!(parse_roster(&bad_index, 1, true).is_err());
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_roster(&huge, 1, true).is_err());
    }
}
