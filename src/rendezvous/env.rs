//! Launcher detection: rank, size, local rank and store address from the environment.
//!
//! Rank and size come from the first of these sources that sets both (local rank and size from
//! the same source); `docs/ENV.md` has the table.
//!
//! | launcher | rank, size | local rank, size |
//! |---|---|---|
//! | toroid-run / by hand | `TOROID_RANK`, `TOROID_WORLD_SIZE` | `TOROID_LOCAL_RANK`, `TOROID_LOCAL_SIZE` |
//! | torchrun | `RANK`, `WORLD_SIZE` | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` |
//! | Slurm srun | `SLURM_PROCID`, `SLURM_NTASKS` | `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE` (plain number only) |
//! | Open MPI | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` |
//! | MPICH / Intel MPI | `PMI_RANK`, `PMI_SIZE` | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` |
//!
//! The store address is `TOROID_STORE_ADDR` when set; otherwise `MASTER_ADDR` and
//! `MASTER_PORT + 1`: torchrun's own TCP store (torch's, not ours) already listens on
//! `MASTER_PORT`, so ours takes the next port. Under Slurm without `MASTER_ADDR` the host is
//! the first node of the job's node list and, without `MASTER_PORT`, the port is
//! [`SLURM_PORT_BASE`] + `SLURM_JOB_ID % 1000` (29600..=30599: clear of torch's default 29500 and
//! of Linux's ephemeral ports, and different for most pairs of jobs that share a node).
//!
//! A job of Open MPI, Slurm or a PMIx launcher whose ranks all run on one host (the launcher says
//! so: `OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE`, `SLURM_STEP_NUM_NODES == 1`,
//! `MPI_LOCALNRANKS == PMI_SIZE`) needs no address at all when none is given: its ranks meet in a
//! file store in a private directory of this user, [`private_base`]`/job-<launcher>-<key>`, where
//! `<key>` hashes the launcher's job identity ([`JOB_VARS`]: job id and step, plus the random
//! ports of the launcher's own sockets, so a later job never meets an earlier job's keys). Each
//! communicator created from it uses a fresh subdirectory `c<N>`, removed by the last rank to drop
//! it; the job directory goes with the last one.

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::io;
use std::net::ToSocketAddrs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::tcp_store::split_host_port;
use super::{FileStore, Store, TcpStore};
use crate::config::Config;
use crate::error::{Error, Result};

/// Base of the store port derived from `SLURM_JOB_ID` when no port is given (see module docs).
pub const SLURM_PORT_BASE: u16 = 29600;
const SLURM_PORT_SPAN: u64 = 1000;
/// More hosts than any job has: a longer expansion is a typo such as `node[1-99999999]`.
const MAX_HOSTS: usize = 1 << 20;

/// Launcher variables that identify a job (and tell whether it runs on one host), read besides
/// `config::LAUNCHER_VARS`: from the [`Config`] when it captured them, else from the process
/// environment (`Config` keeps only the names it lists).
pub const JOB_VARS: &[&str] = &[
    // Open MPI 4 (ORTE): job id, mpirun's URI (its random ports) and its session directory.
    "OMPI_MCA_ess_base_jobid",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_MCA_orte_jobfam_session_dir",
    // PMIx (Open MPI 4 and 5, srun --mpi=pmix, Intel MPI over PMIx): namespace and server URIs.
    "PMIX_NAMESPACE",
    "PMIX_SERVER_URI2",
    "PMIX_SERVER_URI21",
    "PMIX_SERVER_URI3",
    "PMIX_SERVER_URI4",
    "PMIX_SERVER_URI41",
    // Slurm: step id, nodes of the step, srun's random port, cluster.
    "SLURM_STEP_ID",
    "SLURM_STEP_NUM_NODES",
    "SLURM_SRUN_COMM_PORT",
    "SLURM_CLUSTER_NAME",
];
/// Of [`JOB_VARS`] (and `SLURM_JOB_ID`), the ones that must be set to name a job, per launcher.
const OMPI_JOB_IDS: &[&str] = &["OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"];
const SLURM_JOB_IDS: &[&str] = &["SLURM_JOB_ID", "SLURM_STEP_ID"];
const PMIX_JOB_IDS: &[&str] = &["PMIX_NAMESPACE"];
/// Prefix of the job directories under [`private_base`].
const JOB_DIR_PREFIX: &str = "job-";
/// Store key counting the ranks that dropped a job store.
const LEFT_KEY: &str = "toroid/left";

/// Where the rendezvous store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreAddr {
    /// A TCP store served by rank 0 at `host:port`.
    Tcp {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
    /// A file store in this directory.
    File(PathBuf),
}

impl fmt::Display for StoreAddr {
    /// `tcp://host:port` (IPv6 hosts in brackets) or `file:///path`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreAddr::Tcp { host, port } => write!(f, "tcp://{}", join_host_port(host, *port)),
            StoreAddr::File(p) => write!(f, "file://{}", p.display()),
        }
    }
}

impl StoreAddr {
    /// Parses `host:port`, `tcp://host:port`, `[v6addr]:port` or `file:///absolute/dir`.
    ///
    /// ```
    /// use toroid::rendezvous::env::StoreAddr;
    /// assert_eq!(
    ///     StoreAddr::parse("tcp://[::1]:29501").unwrap(),
    ///     StoreAddr::Tcp { host: "::1".into(), port: 29501 }
    /// );
    /// assert_eq!(StoreAddr::parse("file:///shared/rdv").unwrap(), StoreAddr::File("/shared/rdv".into()));
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the text when it is none of these forms or the port is 0.
    pub fn parse(s: &str) -> Result<StoreAddr> {
        let s = s.trim();
        if let Some(path) = s.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(Error::InvalidArgument(
                    format!(
                        "store address '{s}': a file store needs an absolute path, e.g. file:///shared/rdv"
                    )
                    .into(),
                ));
            }
            return Ok(StoreAddr::File(PathBuf::from(path)));
        }
        let hostport = match s.split_once("://") {
            Some(("tcp", rest)) => rest,
            Some((scheme, _)) => {
                return Err(Error::InvalidArgument(
                    format!("store address '{s}': unknown scheme '{scheme}' (use tcp:// or file://)").into(),
                ));
            }
            None => s,
        };
        let (host, port) = split_host_port(hostport)?;
        if port == 0 {
            return Err(Error::InvalidArgument(
                format!("store address '{s}': port 0 cannot be agreed on").into(),
            ));
        }
        Ok(StoreAddr::Tcp { host, port })
    }
}

/// `host:port`, with brackets around an IPv6 host.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// Which launcher's variables were used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `TOROID_*` (toroid-run or set by hand).
    Toroid,
    /// torchrun / torch.distributed.launch.
    Torchrun,
    /// Slurm's srun.
    Slurm,
    /// Open MPI's mpirun.
    OpenMpi,
    /// MPICH / Intel MPI (PMI).
    Pmi,
}

/// What the launcher told this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank among the processes of this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// Number of processes on this host, when the launcher says.
    pub local_size: Option<usize>,
    /// Where the store is.
    pub store: StoreAddr,
    /// Which launcher's variables were used.
    pub launcher: Launcher,
}

/// The variables of one launcher, in precedence order.
struct Source {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

const SOURCES: [Source; 5] = [
    Source {
        launcher: Launcher::Toroid,
        rank: "TOROID_RANK",
        size: "TOROID_WORLD_SIZE",
        local_rank: "TOROID_LOCAL_RANK",
        local_size: "TOROID_LOCAL_SIZE",
    },
    Source {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_size: "LOCAL_WORLD_SIZE",
    },
    Source {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_size: "SLURM_NTASKS_PER_NODE",
    },
    Source {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
    },
    Source {
        launcher: Launcher::Pmi,
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: "MPI_LOCALRANKID",
        local_size: "MPI_LOCALNRANKS",
    },
];

fn num<T: std::str::FromStr>(cfg: &Config, name: &str) -> Result<Option<T>> {
    cfg.var(name)
        .map(|v| {
            v.parse()
                .map_err(|_| Error::InvalidArgument(format!("{name}={v}: not a non-negative integer").into()))
        })
        .transpose()
}

/// Reads the launch description from `cfg`.
///
/// # Errors
/// [`Error::InvalidUsage`] when no launcher sets rank and size or no store address can be found;
/// [`Error::InvalidArgument`] naming the variable when a value does not parse or is out of range.
pub fn detect(cfg: &Config) -> Result<Launch> {
    let mut partial = Vec::new();
    for src in &SOURCES {
        match (cfg.var(src.rank), cfg.var(src.size)) {
            (Some(_), Some(_)) => {}
            (None, None) => continue,
            (Some(_), None) => {
                partial.push(format!("{} without {}", src.rank, src.size));
                continue;
            }
            (None, Some(_)) => {
                partial.push(format!("{} without {}", src.size, src.rank));
                continue;
            }
        }
        for p in &partial {
            tracing::warn!(target: "toroid::env", "ignoring {p}; using {:?}'s variables", src.launcher);
        }
        let launch = from_source(cfg, src)?;
        tracing::info!(
            target: "toroid::env",
            "rank {} of {} (local {:?} of {:?}) from {:?} variables; store {}",
            launch.rank,
            launch.size,
            launch.local_rank,
            launch.local_size,
            launch.launcher,
            launch.store
        );
        return Ok(launch);
    }
    let mut msg = String::from(
        "no launcher found: start the job with toroid-run, torchrun, srun or mpirun, or set \
         TOROID_RANK, TOROID_WORLD_SIZE and TOROID_STORE_ADDR (host:port served by rank 0, or \
         file:///shared/dir)",
    );
    if !partial.is_empty() {
        msg.push_str(&format!("; incomplete: {}", partial.join(", ")));
    }
    Err(Error::InvalidUsage(msg.into()))
}

fn from_source(cfg: &Config, src: &Source) -> Result<Launch> {
    let rank: usize = num(cfg, src.rank)?.unwrap_or_default();
    let size: usize = num(cfg, src.size)?.unwrap_or_default();
    if size == 0 {
        return Err(Error::InvalidArgument(
            format!("{}=0: the world needs at least one rank", src.size).into(),
        ));
    }
    if rank >= size {
        return Err(Error::InvalidArgument(
            format!("{}={rank} is not below {}={size}", src.rank, src.size).into(),
        ));
    }
    let local_rank: Option<usize> = num(cfg, src.local_rank)?;
    let local_size: Option<usize> = if src.launcher == Launcher::Slurm {
        // Forms like "2(x3),1" describe several nodes: only a plain number is this node's, and
        // with fewer tasks than that in the whole job, the job is the bound.
        cfg.var(src.local_size).and_then(|v| v.parse().ok()).map(|n: usize| n.min(size))
    } else {
        num(cfg, src.local_size)?
    };
    if local_size == Some(0) {
        return Err(Error::InvalidArgument(format!("{}=0: must be at least 1", src.local_size).into()));
    }
    if let (Some(lr), Some(ls)) = (local_rank, local_size)
        && lr >= ls
    {
        return Err(Error::InvalidArgument(
            format!("{}={lr} is not below {}={ls}", src.local_rank, src.local_size).into(),
        ));
    }
    Ok(Launch {
        rank,
        size,
        local_rank,
        local_size,
        store: store_addr(cfg, src.launcher)?,
        launcher: src.launcher,
    })
}

/// The store address from the environment alone (`TOROID_STORE_ADDR`, then `MASTER_ADDR` and
/// `MASTER_PORT`+1, then a private file store for a job of Open MPI, Slurm or PMIx on one host,
/// then Slurm's node list when `launcher` is Slurm), for callers that know rank and size some
/// other way (the C ABI's `toroid_comm_init` with a NULL `store_addr`).
///
/// # Errors
/// As [`detect`] for the store part.
pub fn store_addr(cfg: &Config, launcher: Launcher) -> Result<StoreAddr> {
    if let Some(v) = cfg.var("TOROID_STORE_ADDR") {
        return StoreAddr::parse(v)
            .map_err(|e| Error::InvalidArgument(format!("TOROID_STORE_ADDR: {}", e.detail()).into()));
    }
    if cfg.var("MASTER_ADDR").is_none() && cfg.var("MASTER_PORT").is_none() {
        match one_host_job(cfg, launcher) {
            OneHost::Job(dir) => {
                tracing::info!(target: "toroid::env", "{launcher:?} job on one host: file store in {}", dir.display());
                return Ok(StoreAddr::File(dir));
            }
            OneHost::NoJobId(ids) if launcher != Launcher::Slurm => {
                return Err(Error::InvalidUsage(
                    format!(
                        "{launcher:?} gives rank and size and every rank is on this host, but neither a \
                     store address nor a job id ({}) to name a private store: set TOROID_STORE_ADDR \
                     (host:port that rank 0 can listen on, or file:///fresh/dir)",
                        ids.join(" or ")
                    )
                    .into(),
                ));
            }
            OneHost::Several(why) if launcher != Launcher::Slurm => {
                return Err(Error::InvalidUsage(
                    format!(
                        "{launcher:?} gives rank and size but no store address, and the job spans \
                     several hosts ({why}): set TOROID_STORE_ADDR (host:port that rank 0 can listen \
                     on, or file:///shared/dir) or MASTER_ADDR and MASTER_PORT (the store then \
                     listens on MASTER_PORT+1)"
                    )
                    .into(),
                ));
            }
            _ => {}
        }
    }
    let slurm = launcher == Launcher::Slurm;
    let host = match cfg.var("MASTER_ADDR") {
        Some(h) => Some(h.trim_start_matches('[').trim_end_matches(']').to_string()),
        None if slurm => slurm_first_host(cfg)?,
        None => None,
    };
    let port = match cfg.var("MASTER_PORT") {
        // torchrun's own store already listens on MASTER_PORT.
        Some(v) => {
            let p: u16 = v
                .parse()
                .map_err(|_| Error::InvalidArgument(format!("MASTER_PORT={v}: not a port number").into()))?;
            Some(p.checked_add(1).filter(|_| p != 0).ok_or_else(|| {
                Error::InvalidArgument(
                    format!("MASTER_PORT={v}: must be in 1..=65534 (the store uses MASTER_PORT+1)").into(),
                )
            })?)
        }
        None if slurm => Some(slurm_port(cfg)?),
        None => None,
    };
    match (host, port) {
        (Some(host), Some(port)) => Ok(StoreAddr::Tcp { host, port }),
        (Some(_), None) => Err(Error::InvalidUsage(
            "MASTER_ADDR is set but MASTER_PORT is not (the store listens on MASTER_PORT+1); \
             set it or TOROID_STORE_ADDR"
                .into(),
        )),
        (None, Some(_)) if slurm => Err(Error::InvalidUsage(
            "no store host: set MASTER_ADDR or TOROID_STORE_ADDR (SLURM_JOB_NODELIST is not set)".into(),
        )),
        (None, _) => Err(Error::InvalidUsage(
            format!(
                "{launcher:?} gives rank and size but no store address: set TOROID_STORE_ADDR \
             (host:port that rank 0 can listen on, or file:///shared/dir) or MASTER_ADDR and \
             MASTER_PORT (the store then listens on MASTER_PORT+1)"
            )
            .into(),
        )),
    }
}

/// The first host of `SLURM_JOB_NODELIST` (or `SLURM_NODELIST`), where srun places rank 0.
fn slurm_first_host(cfg: &Config) -> Result<Option<String>> {
    let Some((name, list)) =
        ["SLURM_JOB_NODELIST", "SLURM_NODELIST"].iter().find_map(|n| Some((*n, cfg.var(n)?)))
    else {
        return Ok(None);
    };
    let hosts = expand_hostlist(list)
        .map_err(|e| Error::InvalidArgument(format!("{name}: {}", e.detail()).into()))?;
    Ok(hosts.into_iter().next())
}

fn slurm_port(cfg: &Config) -> Result<u16> {
    let job: u64 = num(cfg, "SLURM_JOB_ID")?.unwrap_or(0);
    // Below 1000, so the sum stays far below u16::MAX.
    Ok(SLURM_PORT_BASE + (job % SLURM_PORT_SPAN) as u16)
}

/// A launcher variable as [`Config::var`] reads it; the [`JOB_VARS`] that `Config` did not
/// capture come from the process environment (never in unit tests, which pass every variable).
fn launcher_var(cfg: &Config, name: &str) -> Option<String> {
    if let Some(v) = cfg.var(name) {
        return Some(v.to_string());
    }
    if cfg!(test) || !JOB_VARS.contains(&name) {
        return None;
    }
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// Whether a job runs on one host, and which private store it then uses.
#[derive(Debug, PartialEq, Eq)]
enum OneHost {
    /// Every rank is on this host; the job's private store directory.
    Job(PathBuf),
    /// Every rank is on this host but none of these variables names the job.
    NoJobId(&'static [&'static str]),
    /// The launcher says the job spans several hosts (why).
    Several(String),
    /// The launcher does not say (or is not one that can).
    Unknown,
}

fn one_host_job(cfg: &Config, launcher: Launcher) -> OneHost {
    let var = |n: &str| launcher_var(cfg, n);
    let count = |n: &str| var(n).and_then(|v| v.parse::<usize>().ok());
    // (job id variables, whether the launcher says the job is on one host)
    let (ids, one_host) = match launcher {
        Launcher::OpenMpi => {
            let (ls, s) = ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE");
            (OMPI_JOB_IDS, count(ls).zip(count(s)).map(|(l, n)| (l == n, format!("{ls}={l} < {s}={n}"))))
        }
        Launcher::Pmi => {
            let (ls, s) = ("MPI_LOCALNRANKS", "PMI_SIZE");
            (PMIX_JOB_IDS, count(ls).zip(count(s)).map(|(l, n)| (l == n, format!("{ls}={l} < {s}={n}"))))
        }
        Launcher::Slurm => {
            let nodes = count("SLURM_STEP_NUM_NODES").or_else(|| {
                let list = var("SLURM_JOB_NODELIST").or_else(|| var("SLURM_NODELIST"))?;
                expand_hostlist(&list).ok().map(|h| h.len())
            });
            (SLURM_JOB_IDS, nodes.map(|n| (n == 1, format!("{n} nodes"))))
        }
        Launcher::Toroid | Launcher::Torchrun => return OneHost::Unknown,
    };
    match one_host {
        None => OneHost::Unknown,
        Some((false, why)) => OneHost::Several(why),
        Some((true, _)) => {
            let present = |n: &&str| var(n).is_some();
            let named =
                if launcher == Launcher::Slurm { ids.iter().all(present) } else { ids.iter().any(present) };
            if !named {
                return OneHost::NoJobId(ids);
            }
            // Everything that tells this job from another, in a fixed order; identical on every
            // rank of the job (no rank-specific variable is among them).
            let mut h = Sha256::new();
            h.update(format!("{launcher:?}").as_bytes());
            for name in std::iter::once(&"SLURM_JOB_ID").chain(JOB_VARS) {
                if let Some(v) = var(name) {
                    h.update([0]);
                    h.update(name.as_bytes());
                    h.update([b'=']);
                    h.update(v.as_bytes());
                }
            }
            let key: String = h.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect();
            let tag = match launcher {
                Launcher::OpenMpi => "ompi",
                Launcher::Slurm => "slurm",
                _ => "pmi",
            };
            OneHost::Job(private_base().join(format!("{JOB_DIR_PREFIX}{tag}-{key}")))
        }
    }
}

/// This user's private directory for single-host job stores: `/tmp/toroid-<uid>`, mode 0700.
///
/// `/tmp` itself (not `TMPDIR`): every rank of a job must name the same directory.
pub fn private_base() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    PathBuf::from(format!("/tmp/toroid-{uid}"))
}

/// Creates `dir` with mode 0700 if it is missing, then checks that it is a directory (not a
/// link) owned by this user that no one else may enter.
fn ensure_private_dir(dir: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::system(format!("file store: create {}", dir.display()), e)),
    }
    let meta = fs::symlink_metadata(dir)
        .map_err(|e| Error::system(format!("file store: stat {}", dir.display()), e))?;
    // SAFETY: as in private_base.
    let uid = unsafe { libc::geteuid() };
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(Error::InvalidUsage(
            format!(
                "{} is not a private directory of this user (a {}owned by uid {} with mode {:o}; \
             wanted a directory of uid {uid} with mode 700): remove it, or set TOROID_STORE_ADDR",
                dir.display(),
                if meta.is_dir() {
                    "directory "
                } else if meta.file_type().is_symlink() {
                    "link "
                } else {
                    "file "
                },
                meta.uid(),
                meta.mode() & 0o7777
            )
            .into(),
        ));
    }
    Ok(())
}

/// A single-host job's store for one communicator: the file store `job/c<N>`; the last rank to
/// drop it removes it (and the job directory once empty).
struct JobStore {
    inner: FileStore,
    job_dir: PathBuf,
    size: usize,
}

impl Store for JobStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(key, delta)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.inner.wait(keys, timeout)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(key)
    }
}

impl Drop for JobStore {
    fn drop(&mut self) {
        match self.inner.add(LEFT_KEY, 1) {
            Ok(n) if usize::try_from(n).is_ok_and(|n| n >= self.size) => {
                if let Err(e) = fs::remove_dir_all(self.inner.path()) {
                    tracing::warn!(target: "toroid::store", "removing {}: {e}", self.inner.path().display());
                }
                // Only when empty: another communicator of the job may have started already.
                let _ = fs::remove_dir(&self.job_dir);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(target: "toroid::store", "leaving {}: {e}", self.inner.path().display()),
        }
    }
}

/// Opens the store of communicator number N (counted per job directory and rank in this process:
/// every rank creates its communicators in the same order) of a single-host job.
fn open_job_store(job_dir: &Path, launch: &Launch, timeout: Duration) -> Result<Arc<dyn Store>> {
    static OPENED: Mutex<Option<HashMap<(PathBuf, usize), u64>>> = Mutex::new(None);
    if let Some(base) = job_dir.parent() {
        ensure_private_dir(base)?;
    }
    let n = {
        let mut map = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        let c = map.get_or_insert_with(HashMap::new).entry((job_dir.to_path_buf(), launch.rank)).or_insert(0);
        *c += 1;
        *c
    };
    let dir = job_dir.join(format!("c{n}"));
    // The last rank of the previous communicator may remove the (then empty) job directory
    // while this one creates it: try again.
    let mut tries = 0;
    let inner = loop {
        match FileStore::new(&dir) {
            Ok(s) => break s.with_timeout(timeout),
            Err(_) if tries < 3 => tries += 1,
            Err(e) => return Err(e),
        }
    };
    Ok(Arc::new(JobStore { inner, job_dir: job_dir.to_path_buf(), size: launch.size }))
}

/// Whether `dir` is a single-host job directory that [`store_addr`] chose.
fn is_job_dir(dir: &Path) -> bool {
    dir.parent() == Some(private_base().as_path())
        && dir.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(JOB_DIR_PREFIX))
}

/// Expands a Slurm host list such as `node[01-04,07],gpu5` into host names, in order.
///
/// Ranges keep the zero padding of their lower bound (`[08-10]` gives `08 09 10`), and a name may
/// hold several bracket groups (`r[1-2]n[1-2]` gives `r1n1 r1n2 r2n1 r2n2`).
///
/// ```
/// use toroid::rendezvous::env::expand_hostlist;
/// assert_eq!(expand_hostlist("n[01-03,07],gpu5").unwrap(), ["n01", "n02", "n03", "n07", "gpu5"]);
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] for unbalanced brackets, ranges that are not numbers or run
/// backwards, and lists longer than a million hosts.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>> {
    let bad = |why: String| Error::InvalidArgument(format!("host list '{list}': {why}").into());
    let mut hosts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in list.char_indices().chain(std::iter::once((list.len(), ','))) {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(|| bad("unmatched ']'".into()))?,
            ',' if depth == 0 => {
                let item = list[start..i].trim();
                if !item.is_empty() {
                    expand_item(item, &mut hosts).map_err(bad)?;
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(bad("unclosed '['".into()));
    }
    Ok(hosts)
}

/// Appends the expansion of one host pattern (no top-level commas) to `out`.
fn expand_item(item: &str, out: &mut Vec<String>) -> std::result::Result<(), String> {
    let Some(open) = item.find('[') else {
        if item.contains(']') {
            return Err("unmatched ']'".into());
        }
        out.push(item.to_string());
        return Ok(());
    };
    let close = item[open..].find(']').map(|c| open + c).ok_or("unclosed '['")?;
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let mut tails = Vec::new();
    expand_item_or_empty(rest, &mut tails)?;
    for range in ranges.split(',').map(str::trim) {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let parse = |s: &str| -> std::result::Result<u64, String> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("'{range}' is not a number or a range a-b"));
            }
            s.parse().map_err(|_| format!("'{s}' is too large"))
        };
        let (a, b) = (parse(lo)?, parse(hi)?);
        if a > b {
            return Err(format!("range '{range}' runs backwards"));
        }
        let count = usize::try_from(b - a + 1).unwrap_or(usize::MAX).saturating_mul(tails.len());
        if out.len().saturating_add(count) > MAX_HOSTS {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
        let width = lo.len();
        for n in a..=b {
            for tail in &tails {
                out.push(format!("{prefix}{n:0width$}{tail}"));
            }
        }
    }
    Ok(())
}

/// Like [`expand_item`], with the empty pattern expanding to one empty string.
fn expand_item_or_empty(item: &str, out: &mut Vec<String>) -> std::result::Result<(), String> {
    if item.is_empty() {
        out.push(String::new());
        Ok(())
    } else {
        expand_item(item, out)
    }
}

/// Opens the store of `launch`: rank 0 serves a TCP store, the others connect; or everyone opens
/// the file store (for a single-host job's private directory, a fresh subdirectory per
/// communicator, removed by the last rank to drop it).
///
/// Rank 0 binds the loopback address when the store host is a loopback name or address (a
/// single-host job), and every interface (`0.0.0.0`, or `[::]` for an IPv6-only host) otherwise,
/// because the name the other ranks use for rank 0's host need not be an address rank 0 can
/// bind. `timeout` bounds connecting and every store call without its own timeout.
///
/// # Errors
/// As [`TcpStore::serve`], [`TcpStore::connect`] and [`FileStore::new`].
pub fn open_store(launch: &Launch, timeout: Duration) -> Result<Arc<dyn Store>> {
    match &launch.store {
        StoreAddr::File(dir) if is_job_dir(dir) => open_job_store(dir, launch, timeout),
        StoreAddr::File(dir) => Ok(Arc::new(FileStore::new(dir)?.with_timeout(timeout))),
        StoreAddr::Tcp { host, port } if launch.rank == 0 => {
            let bind = bind_addr(host, *port);
            tracing::info!(target: "toroid::store", "rank 0 serves the store on {bind} for {}", launch.store);
            Ok(Arc::new(TcpStore::serve(&bind, timeout)?))
        }
        StoreAddr::Tcp { host, port } => {
            Ok(Arc::new(TcpStore::connect(&join_host_port(host, *port), timeout)?))
        }
    }
}

/// The address rank 0 listens on for a store that the others reach at `host:port`.
fn bind_addr(host: &str, port: u16) -> String {
    let ips: Vec<_> = (host, port).to_socket_addrs().map(|a| a.map(|a| a.ip()).collect()).unwrap_or_default();
    if host.eq_ignore_ascii_case("localhost") || (!ips.is_empty() && ips.iter().all(|ip| ip.is_loopback())) {
        join_host_port(host, port)
    } else if !ips.is_empty() && ips.iter().all(|ip| ip.is_ipv6()) {
        format!("[::]:{port}")
    } else {
        format!("0.0.0.0:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn detect_with(pairs: &[(&str, &str)]) -> Result<Launch> {
        let map: BTreeMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut cfg = Config::from_lookup(|k| map.get(k).cloned()).unwrap();
        // What Config does not capture (JOB_VARS) is read the way the process environment would be.
        for (k, v) in map {
            cfg.vars.entry(k).or_insert(v);
        }
        detect(&cfg)
    }

    fn tcp(host: &str, port: u16) -> StoreAddr {
        StoreAddr::Tcp { host: host.into(), port }
    }

    fn invalid_arg_naming(r: Result<Launch>, needles: &[&str]) {
        match r {
            Err(Error::InvalidArgument(m)) => assert!(needles.iter().all(|n| m.contains(n)), "{m}"),
            other => panic!("expected InvalidArgument naming {needles:?}, got {other:?}"),
        }
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn nothing_set_explains_what_to_set() {
        match detect_with(&[]) {
            Err(Error::InvalidUsage(m)) => {
                assert!(
                    m.contains("toroid-run") && m.contains("TOROID_RANK") && m.contains("TOROID_STORE_ADDR"),
                    "{m}"
                )
            }
            other => panic!("{other:?}"),
        }
        // Only an address is not enough either; an incomplete pair is named.
        match detect_with(&[("TOROID_STORE_ADDR", "h:1"), ("TOROID_RANK", "0")]) {
            Err(Error::InvalidUsage(m)) => {
                assert!(m.contains("TOROID_RANK without TOROID_WORLD_SIZE"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn toroid_variables() {
        let l = detect_with(&[
            ("TOROID_RANK", "1"),
            ("TOROID_WORLD_SIZE", "4"),
            ("TOROID_LOCAL_RANK", "1"),
            ("TOROID_LOCAL_SIZE", "2"),
            ("TOROID_STORE_ADDR", "tcp://head:1234"),
        ])
        .unwrap();
        assert_eq!(
            l,
            Launch {
                rank: 1,
                size: 4,
                local_rank: Some(1),
                local_size: Some(2),
                store: tcp("head", 1234),
                launcher: Launcher::Toroid
            }
        );
    }

    #[test]
    fn torchrun_uses_master_port_plus_one() {
        let l = detect_with(TORCHRUN).unwrap();
        assert_eq!((l.rank, l.size, l.local_rank, l.local_size), (3, 8, Some(1), Some(4)));
        assert_eq!(l.launcher, Launcher::Torchrun);
        assert_eq!(l.store, tcp("node0", 29501));
        let mut v6 = TORCHRUN.to_vec();
        v6.push(("MASTER_ADDR", "[fe80::1]"));
        assert_eq!(detect_with(&v6).unwrap().store, tcp("fe80::1", 29501));
    }

    #[test]
    fn precedence_toroid_then_torchrun_then_slurm_then_mpi() {
        let mut all = vec![
            ("TOROID_RANK", "0"),
            ("TOROID_WORLD_SIZE", "2"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("OMPI_COMM_WORLD_RANK", "6"),
            ("OMPI_COMM_WORLD_SIZE", "7"),
            ("PMI_RANK", "7"),
            ("PMI_SIZE", "8"),
        ];
        all.extend_from_slice(TORCHRUN);
        let l = detect_with(&all).unwrap();
        assert_eq!((l.launcher, l.rank, l.size), (Launcher::Toroid, 0, 2));
        // Local values come from the same source: TOROID_LOCAL_* are unset, so none.
        assert_eq!((l.local_rank, l.local_size), (None, None));
        // Without TOROID_STORE_ADDR the torchrun address is used.
        assert_eq!(l.store, tcp("node0", 29501));

        let drop_keys = |keys: &[&str]| -> Vec<(&str, &str)> {
            all.iter().filter(|(k, _)| !keys.iter().any(|d| k.starts_with(d))).copied().collect()
        };
        // An incomplete TOROID pair falls through to torchrun.
        let l = detect_with(&drop_keys(&["TOROID_WORLD_SIZE"])).unwrap();
        assert_eq!((l.launcher, l.rank), (Launcher::Torchrun, 3));
        let l = detect_with(&drop_keys(&["TOROID_", "RANK", "WORLD_SIZE", "LOCAL_"])).unwrap();
        assert_eq!((l.launcher, l.rank, l.size), (Launcher::Slurm, 5, 6));
        let l = detect_with(&drop_keys(&["TOROID_", "RANK", "WORLD_SIZE", "LOCAL_", "SLURM_"])).unwrap();
        assert_eq!((l.launcher, l.rank, l.size), (Launcher::OpenMpi, 6, 7));
        let l =
            detect_with(&drop_keys(&["TOROID_", "RANK", "WORLD_SIZE", "LOCAL_", "SLURM_", "OMPI_"])).unwrap();
        assert_eq!((l.launcher, l.rank, l.size), (Launcher::Pmi, 7, 8));
    }

    #[test]
    fn slurm_derives_host_and_port_from_the_job() {
        let base = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("SLURM_JOB_NODELIST", "gpu[07-09],cpu1"),
            ("SLURM_JOB_ID", "123456"),
        ];
        let l = detect_with(&base).unwrap();
        assert_eq!(
            (l.launcher, l.rank, l.size, l.local_rank, l.local_size),
            (Launcher::Slurm, 3, 8, Some(1), Some(4))
        );
        assert_eq!(l.store, tcp("gpu07", SLURM_PORT_BASE + 456));

        // Per-node counts that vary by node give no local size; SLURM_NODELIST is the fallback.
        let mut v: Vec<_> =
            base.iter().filter(|(k, _)| !k.starts_with("SLURM_JOB_NODELIST")).copied().collect();
        v.retain(|(k, _)| *k != "SLURM_NTASKS_PER_NODE");
        v.push(("SLURM_NTASKS_PER_NODE", "2(x3),1"));
        v.push(("SLURM_NODELIST", "a1"));
        let l = detect_with(&v).unwrap();
        assert_eq!((l.local_size, l.store.clone()), (None, tcp("a1", SLURM_PORT_BASE + 456)));

        // MASTER_ADDR / MASTER_PORT win over the derived values, each on its own.
        let mut v = base.to_vec();
        v.push(("MASTER_PORT", "40000"));
        assert_eq!(detect_with(&v).unwrap().store, tcp("gpu07", 40001));
        v.push(("MASTER_ADDR", "head"));
        assert_eq!(detect_with(&v).unwrap().store, tcp("head", 40001));

        // No node list and no MASTER_ADDR.
        let v: Vec<_> = base.iter().filter(|(k, _)| *k != "SLURM_JOB_NODELIST").copied().collect();
        assert!(matches!(detect_with(&v), Err(Error::InvalidUsage(m)) if m.contains("MASTER_ADDR")));
    }

    #[test]
    fn mpi_without_an_address_asks_for_one() {
        let ompi = [("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")];
        match detect_with(&ompi) {
            Err(Error::InvalidUsage(m)) => {
                assert!(m.contains("TOROID_STORE_ADDR") && m.contains("MASTER_ADDR"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        let mut v = ompi.to_vec();
        v.push(("TOROID_STORE_ADDR", "[::1]:5000"));
        assert_eq!(detect_with(&v).unwrap().store, tcp("::1", 5000));

        let pmi = [
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "3"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "3"),
            ("TOROID_STORE_ADDR", "file:///shared/rdv"),
        ];
        let l = detect_with(&pmi).unwrap();
        assert_eq!((l.launcher, l.local_size), (Launcher::Pmi, Some(3)));
        assert_eq!(l.store, StoreAddr::File("/shared/rdv".into()));
        // MASTER_ADDR alone is not enough outside Slurm.
        let v = [("PMI_RANK", "0"), ("PMI_SIZE", "3"), ("MASTER_ADDR", "h")];
        assert!(matches!(detect_with(&v), Err(Error::InvalidUsage(m)) if m.contains("MASTER_PORT")));
    }

    #[test]
    fn bad_values_name_the_variable_and_value() {
        let addr = ("TOROID_STORE_ADDR", "h:1");
        invalid_arg_naming(
            detect_with(&[("TOROID_RANK", "4"), ("TOROID_WORLD_SIZE", "4"), addr]),
            &["TOROID_RANK=4"],
        );
        invalid_arg_naming(
            detect_with(&[("TOROID_RANK", "0"), ("TOROID_WORLD_SIZE", "0"), addr]),
            &["TOROID_WORLD_SIZE=0"],
        );
        invalid_arg_naming(detect_with(&[("RANK", "-1"), ("WORLD_SIZE", "2"), addr]), &["RANK=-1"]);
        invalid_arg_naming(detect_with(&[("RANK", "0"), ("WORLD_SIZE", "two"), addr]), &["WORLD_SIZE=two"]);
        invalid_arg_naming(
            detect_with(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
                addr,
            ]),
            &["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"],
        );
        let ok = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")];
        for (port, needle) in
            [("65535", "MASTER_PORT=65535"), ("0", "MASTER_PORT=0"), ("http", "MASTER_PORT=http")]
        {
            let mut v = ok.to_vec();
            v.push(("MASTER_PORT", port));
            invalid_arg_naming(detect_with(&v), &[needle]);
        }
        for a in ["file://relative/dir", "h", "h:0", "udp://h:1", "::1:5"] {
            invalid_arg_naming(
                detect_with(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("TOROID_STORE_ADDR", a)]),
                &["TOROID_STORE_ADDR", a],
            );
        }
        let slurm = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1"), ("SLURM_JOB_NODELIST", "n[1-")];
        invalid_arg_naming(detect_with(&slurm), &["SLURM_JOB_NODELIST", "n[1-"]);
    }

    #[test]
    fn store_addr_forms() {
        assert_eq!(StoreAddr::parse("h:1").unwrap(), tcp("h", 1));
        assert_eq!(StoreAddr::parse("tcp://10.0.0.1:29501").unwrap(), tcp("10.0.0.1", 29501));
        assert_eq!(StoreAddr::parse("[::1]:7").unwrap(), tcp("::1", 7));
        assert_eq!(StoreAddr::parse("tcp://[fe80::2]:8").unwrap().to_string(), "tcp://[fe80::2]:8");
        assert_eq!(StoreAddr::parse("file:///a/b").unwrap().to_string(), "file:///a/b");
    }

    #[test]
    fn hostlists() {
        assert_eq!(
            expand_hostlist("node[01-04,07],gpu5").unwrap(),
            ["node01", "node02", "node03", "node04", "node07", "gpu5"]
        );
        assert_eq!(expand_hostlist("a[8-10]").unwrap(), ["a8", "a9", "a10"]);
        assert_eq!(expand_hostlist("a[098-101]").unwrap(), ["a098", "a099", "a100", "a101"]);
        assert_eq!(
            expand_hostlist("r[1-2]-n[01-02]x").unwrap(),
            ["r1-n01x", "r1-n02x", "r2-n01x", "r2-n02x"]
        );
        assert_eq!(expand_hostlist("single").unwrap(), ["single"]);
        assert_eq!(expand_hostlist(" a , b[3] ,,").unwrap(), ["a", "b3"]);
        assert!(expand_hostlist("").unwrap().is_empty());
        for bad in ["n[1-", "n]1", "n[3-1]", "n[a-b]", "n[1-2-3]", "n[]", "n[0-99999999]", "n[1]]"] {
            assert!(matches!(expand_hostlist(bad), Err(Error::InvalidArgument(_))), "{bad}");
        }
    }

    #[test]
    fn bind_addresses() {
        assert_eq!(bind_addr("127.0.0.1", 5), "127.0.0.1:5");
        assert_eq!(bind_addr("localhost", 5), "localhost:5");
        assert_eq!(bind_addr("::1", 5), "[::1]:5");
        assert_eq!(bind_addr("10.1.2.3", 5), "0.0.0.0:5");
        assert_eq!(bind_addr("fe80::1", 5), "[::]:5");
    }

    #[test]
    fn open_store_serves_on_rank_0_and_connects_the_others() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let launch = move |rank| Launch {
            rank,
            size: 2,
            local_rank: None,
            local_size: None,
            store: tcp("127.0.0.1", port),
            launcher: Launcher::Toroid,
        };
        let t = Duration::from_secs(5);
        let peer = std::thread::spawn(move || {
            // Rank 1 may start first: connect retries until rank 0 serves.
            let s = open_store(&launch(1), t).unwrap();
            s.set("from1", b"hi").unwrap();
            s.get("from0", t).unwrap()
        });
        std::thread::sleep(Duration::from_millis(50));
        let s0 = open_store(&launch(0), t).unwrap();
        s0.set("from0", b"yo").unwrap();
        assert_eq!(s0.get("from1", t).unwrap(), b"hi");
        assert_eq!(peer.join().unwrap(), b"yo");

        let dir = std::env::temp_dir().join(format!("toroid-env-open-{}", std::process::id()));
        let mut l = launch(1);
        l.store = StoreAddr::File(dir.clone());
        let fs = open_store(&l, t).unwrap();
        fs.set("k", b"v").unwrap();
        assert_eq!(fs.get("k", t).unwrap(), b"v");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Variables of rank `rank` of a 2-rank `mpirun` on one host (Open MPI 4.1, as printed by
    /// `env` in each rank), with mpirun's port `port`.
    fn ompi(rank: &'static str, port: &str) -> Vec<(&'static str, String)> {
        let uri = format!("1105920000.0;tcp://192.0.2.2:{port}");
        vec![
            ("OMPI_COMM_WORLD_RANK", rank.into()),
            ("OMPI_COMM_WORLD_SIZE", "2".into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", rank.into()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
            ("OMPI_MCA_ess_base_jobid", "1105920001".into()),
            ("OMPI_MCA_ess_base_vpid", rank.into()),
            ("OMPI_MCA_orte_hnp_uri", uri),
            ("OMPI_MCA_orte_jobfam_session_dir", "/tmp/ompi.vm.0/pid.11541".into()),
            ("PMIX_NAMESPACE", "1105920001".into()),
            ("PMIX_RANK", rank.into()),
            ("PMIX_SERVER_URI2", "1105920000.0;tcp4://127.0.0.1:45215".into()),
        ]
    }

    fn detect_owned(pairs: &[(&'static str, String)]) -> Result<Launch> {
        let v: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        detect_with(&v)
    }

    /// The job directory of a single-host launch, checked to be `private_base()/job-<tag>-<hex16>`.
    fn job_dir(l: &Launch, tag: &str) -> PathBuf {
        let StoreAddr::File(dir) = &l.store else { panic!("expected a file store, got {}", l.store) };
        assert_eq!(dir.parent(), Some(private_base().as_path()), "{}", dir.display());
        let name = dir.file_name().unwrap().to_str().unwrap();
        let key = name.strip_prefix(&format!("job-{tag}-")).unwrap_or_else(|| panic!("{name}"));
        assert!(key.len() == 16 && key.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
        assert!(is_job_dir(dir));
        dir.clone()
    }

    /// Removes a directory tree on drop, so that a failing test leaves nothing behind.
    struct RemoveOnDrop(PathBuf);

    impl Drop for RemoveOnDrop {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn without(pairs: &[(&'static str, String)], names: &[&str]) -> Vec<(&'static str, String)> {
        pairs.iter().filter(|(k, _)| !names.contains(k)).cloned().collect()
    }

    #[test]
    fn single_host_open_mpi_job_uses_a_private_file_store() {
        let (r0, r1) =
            (detect_owned(&ompi("0", "39003")).unwrap(), detect_owned(&ompi("1", "39003")).unwrap());
        assert_eq!((r1.launcher, r1.rank, r1.size, r1.local_size), (Launcher::OpenMpi, 1, 2, Some(2)));
        // Every rank names the same directory (rank-specific variables are not part of the key)...
        assert_eq!(job_dir(&r0, "ompi"), job_dir(&r1, "ompi"));
        // ...and another mpirun (its own random port) another one.
        assert_ne!(job_dir(&r0, "ompi"), job_dir(&detect_owned(&ompi("0", "39004")).unwrap(), "ompi"));
        // PMIX_NAMESPACE alone (Open MPI 5) names the job too.
        let v = without(&ompi("0", "1"), &["OMPI_MCA_ess_base_jobid"]);
        job_dir(&detect_owned(&v).unwrap(), "ompi");

        // Ranks on several hosts: no way to agree on a directory, so ask for an address.
        let mut v = ompi("1", "1");
        // (Rank 1 alone on the second host.)
        v.retain(|(k, _)| !k.starts_with("OMPI_COMM_WORLD_LOCAL_"));
        v.push(("OMPI_COMM_WORLD_LOCAL_SIZE", "1".into()));
        v.push(("OMPI_COMM_WORLD_LOCAL_RANK", "0".into()));
        match detect_owned(&v) {
            Err(Error::InvalidUsage(m)) => assert!(
                m.contains("several hosts")
                    && m.contains("OMPI_COMM_WORLD_LOCAL_SIZE=1 < OMPI_COMM_WORLD_SIZE=2")
                    && m.contains("TOROID_STORE_ADDR")
                    && m.contains("MASTER_ADDR"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
        // One host but nothing that names the job.
        let v = without(&ompi("0", "1"), &["OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"]);
        match detect_owned(&v) {
            Err(Error::InvalidUsage(m)) => assert!(
                m.contains("OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE") && m.contains("TOROID_STORE_ADDR"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
        // An explicit address wins.
        let mut v = ompi("0", "1");
        v.push(("TOROID_STORE_ADDR", "h:7".into()));
        assert_eq!(detect_owned(&v).unwrap().store, tcp("h", 7));
        let mut v = ompi("0", "1");
        v.push(("MASTER_ADDR", "h".into()));
        v.push(("MASTER_PORT", "7".into()));
        assert_eq!(detect_owned(&v).unwrap().store, tcp("h", 8));
    }

    #[test]
    fn single_host_slurm_step_uses_a_private_file_store() {
        // As srun -N1 -n 2 sets them (Slurm 22.05), less the per-task ones.
        let step = |id: &str, nodes: &str| -> Vec<(&'static str, String)> {
            vec![
                ("SLURM_PROCID", "1".into()),
                ("SLURM_NTASKS", "2".into()),
                ("SLURM_LOCALID", "1".into()),
                ("SLURM_JOB_ID", "77".into()),
                ("SLURM_STEP_ID", id.into()),
                ("SLURM_STEP_NUM_NODES", nodes.into()),
                ("SLURM_JOB_NODELIST", "n[1-2]".into()),
                ("SLURM_SRUN_COMM_PORT", "42423".into()),
                ("SLURM_CLUSTER_NAME", "c".into()),
            ]
        };
        let a = job_dir(&detect_owned(&step("0", "1")).unwrap(), "slurm");
        assert_ne!(a, job_dir(&detect_owned(&step("1", "1")).unwrap(), "slurm"));
        // A step on two nodes keeps the TCP store on the first node.
        assert_eq!(detect_owned(&step("0", "2")).unwrap().store, tcp("n1", SLURM_PORT_BASE + 77));
        // Without SLURM_STEP_NUM_NODES, a job list of one node means one host.
        let mut v = without(&step("0", "1"), &["SLURM_STEP_NUM_NODES", "SLURM_JOB_NODELIST"]);
        v.push(("SLURM_JOB_NODELIST", "n1".into()));
        job_dir(&detect_owned(&v).unwrap(), "slurm");
        // Without a step id: the TCP store, as before.
        let v = without(&v, &["SLURM_STEP_ID"]);
        assert_eq!(detect_owned(&v).unwrap().store, tcp("n1", SLURM_PORT_BASE + 77));
        // MASTER_PORT wins.
        let mut v = step("0", "1");
        v.push(("MASTER_PORT", "40000".into()));
        assert_eq!(detect_owned(&v).unwrap().store, tcp("n1", 40001));
    }

    #[test]
    fn single_host_pmix_job_uses_a_private_file_store() {
        let base: Vec<(&'static str, String)> = vec![
            ("PMI_RANK", "0".into()),
            ("PMI_SIZE", "2".into()),
            ("MPI_LOCALRANKID", "0".into()),
            ("MPI_LOCALNRANKS", "2".into()),
        ];
        match detect_owned(&base) {
            Err(Error::InvalidUsage(m)) => assert!(m.contains("PMIX_NAMESPACE"), "{m}"),
            other => panic!("{other:?}"),
        }
        let mut v = base.clone();
        v.push(("PMIX_NAMESPACE", "slurm.pmix.5.0".into()));
        job_dir(&detect_owned(&v).unwrap(), "pmi");
    }

    #[test]
    fn job_store_is_private_and_removed_by_the_last_rank() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let mut vars = ompi("0", &format!("{}{nanos}", std::process::id()));
        let dir = job_dir(&detect_owned(&vars).unwrap(), "ompi");
        let _cleanup = RemoveOnDrop(dir.clone());
        let t = Duration::from_secs(5);
        for round in 1..=2 {
            let peer = {
                vars.retain(|(k, _)| *k != "OMPI_COMM_WORLD_RANK");
                vars.push(("OMPI_COMM_WORLD_RANK", "1".into()));
                let l1 = detect_owned(&vars).unwrap();
                std::thread::spawn(move || {
                    let s = open_store(&l1, t).unwrap();
                    s.set("from1", b"hi").unwrap();
                    let got = s.get("from0", t).unwrap();
                    s.wait(&["done0"], t).unwrap();
                    got
                })
            };
            vars.retain(|(k, _)| *k != "OMPI_COMM_WORLD_RANK");
            vars.push(("OMPI_COMM_WORLD_RANK", "0".into()));
            let s0 = open_store(&detect_owned(&vars).unwrap(), t).unwrap();
            let sub = dir.join(format!("c{round}"));
            assert!(sub.is_dir(), "{} for communicator {round}", sub.display());
            let meta = fs::metadata(private_base()).unwrap();
            assert_eq!(meta.mode() & 0o777, 0o700);
            s0.set("from0", b"yo").unwrap();
            assert_eq!(s0.get("from1", t).unwrap(), b"hi");
            s0.set("done0", b"").unwrap();
            assert_eq!(peer.join().unwrap(), b"yo");
            // Rank 1 has dropped its store; the directory stays until rank 0 drops too.
            assert!(sub.is_dir());
            drop(s0);
            assert!(!dir.exists(), "{} left behind", dir.display());
        }
    }

    #[test]
    fn private_dir_is_created_0700_and_checked() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let root = std::env::temp_dir().join(format!("toroid-env-private-{}-{nanos}", std::process::id()));
        fs::create_dir(&root).unwrap();
        let _cleanup = RemoveOnDrop(root.clone());
        let d = root.join("base");
        ensure_private_dir(&d).unwrap();
        assert_eq!(fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        ensure_private_dir(&d).unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        match ensure_private_dir(&d) {
            Err(Error::InvalidUsage(m)) => {
                assert!(m.contains("mode 755") && m.contains("TOROID_STORE_ADDR"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        let link = root.join("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        match ensure_private_dir(&link) {
            Err(Error::InvalidUsage(m)) => assert!(m.contains("a link"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
