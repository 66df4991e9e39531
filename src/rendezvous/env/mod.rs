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
//! The store address is `TOROID_STORE_ADDR` when set; otherwise, under torchrun
//! (`TORCHELASTIC_USE_AGENT_STORE=True`), torchrun's own TCP store (torch's, not ours) at
//! `MASTER_ADDR:MASTER_PORT`, where rank 0 publishes the free port it serves ours on
//! ([`StoreAddr::Torch`]); otherwise `MASTER_ADDR` and `MASTER_PORT + 1` (a torch store may
//! listen on `MASTER_PORT`). Under Slurm without `MASTER_ADDR` the host is
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
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`Launch`], [`StoreAddr`] and [`detect`] |
//! | `launchers.rs` | each launcher's variables, in precedence order, and the job variables |
//! | `addr.rs` | where the store is: [`store_addr`] |
//! | `hostlist.rs` | Slurm host lists: [`expand_hostlist`] |
//! | `job_dir.rs` | whether a job runs on one host, and its private directory |
//! | `store.rs` | opening the store: [`open_store`] |

mod addr;
mod hostlist;
mod job_dir;
mod launchers;
mod store;

use std::fmt;
use std::path::PathBuf;

use super::tcp_store::split_host_port;
use crate::config::Config;
use crate::error::{Error, Result};
use launchers::{SOURCES, from_source};

pub use addr::{SLURM_PORT_BASE, store_addr};
pub use hostlist::expand_hostlist;
pub use job_dir::private_base;
pub use launchers::JOB_VARS;
pub use store::{OpenedStore, open_store};

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
    /// torch's `TCPStore` at `host:port` (torchrun's agent store): rank 0 serves toroid's TCP
    /// store on a free port of `host` and publishes the port there (`rendezvous::torch_store`).
    Torch {
        /// Host name or address (rank 0's host).
        host: String,
        /// torch's store's port.
        port: u16,
        /// torchrun's restart count (`TORCHELASTIC_RESTART_COUNT`): the agent's store outlives a
        /// restart of the workers, so each attempt publishes under its own keys.
        restart: u32,
    },
}

impl fmt::Display for StoreAddr {
    /// `tcp://host:port` (IPv6 hosts in brackets) or `file:///path`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreAddr::Tcp { host, port } => write!(f, "tcp://{}", join_host_port(host, *port)),
            StoreAddr::File(p) => write!(f, "file://{}", p.display()),
            StoreAddr::Torch { host, port, .. } => write!(f, "torch://{}", join_host_port(host, *port)),
        }
    }
}

impl StoreAddr {
    /// Parses `host:port`, `tcp://host:port`, `[v6addr]:port`, `file:///absolute/dir` or
    /// `torch://host:port` (a torch `TCPStore` to publish toroid's store's port in).
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
        let (hostport, torch) = match s.split_once("://") {
            Some(("tcp", rest)) => (rest, false),
            Some(("torch", rest)) => (rest, true),
            Some((scheme, _)) => {
                return Err(Error::InvalidArgument(
                    format!(
                        "store address '{s}': unknown scheme '{scheme}' (use tcp://, file:// or torch://)"
                    )
                    .into(),
                ));
            }
            None => (s, false),
        };
        let (host, port) = split_host_port(hostport)?;
        if port == 0 {
            return Err(Error::InvalidArgument(
                format!("store address '{s}': port 0 cannot be agreed on").into(),
            ));
        }
        Ok(if torch { StoreAddr::Torch { host, port, restart: 0 } } else { StoreAddr::Tcp { host, port } })
    }
}

/// `host:port`, with brackets around an IPv6 host.
pub(crate) fn join_host_port(host: &str, port: u16) -> String {
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

#[cfg(test)]
mod tests {
    use super::job_dir::is_job_dir;
    use super::*;
    use std::collections::BTreeMap;
    use std::fs;

    /// `detect` on a configuration read from `pairs` alone (never the process environment).
    pub(super) fn detect_with(pairs: &[(&str, &str)]) -> Result<Launch> {
        let map: BTreeMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        detect(&Config::from_lookup(|k| map.get(k).cloned()).unwrap())
    }

    pub(super) fn tcp(host: &str, port: u16) -> StoreAddr {
        StoreAddr::Tcp { host: host.into(), port }
    }

    pub(super) fn invalid_arg_naming(r: Result<Launch>, needles: &[&str]) {
        match r {
            Err(Error::InvalidArgument(m)) => assert!(needles.iter().all(|n| m.contains(n)), "{m}"),
            other => panic!("expected InvalidArgument naming {needles:?}, got {other:?}"),
        }
    }

    pub(super) const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];

    /// Variables of rank `rank` of a 2-rank `mpirun` on one host (Open MPI 4.1, as printed by
    /// `env` in each rank), with mpirun's port `port`.
    pub(super) fn ompi(rank: &'static str, port: &str) -> Vec<(&'static str, String)> {
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

    pub(super) fn detect_owned(pairs: &[(&'static str, String)]) -> Result<Launch> {
        let v: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        detect_with(&v)
    }

    /// The job directory of a single-host launch, checked to be `private_base()/job-<tag>-<hex16>`.
    pub(super) fn job_dir(l: &Launch, tag: &str) -> PathBuf {
        let StoreAddr::File(dir) = &l.store else { panic!("expected a file store, got {}", l.store) };
        assert_eq!(dir.parent(), Some(private_base().as_path()), "{}", dir.display());
        let name = dir.file_name().unwrap().to_str().unwrap();
        let key = name.strip_prefix(&format!("job-{tag}-")).unwrap_or_else(|| panic!("{name}"));
        assert!(key.len() == 16 && key.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
        assert!(is_job_dir(dir));
        dir.clone()
    }

    /// Removes a directory tree on drop, so that a failing test leaves nothing behind.
    pub(super) struct RemoveOnDrop(pub(super) PathBuf);

    impl Drop for RemoveOnDrop {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    pub(super) fn without(pairs: &[(&'static str, String)], names: &[&str]) -> Vec<(&'static str, String)> {
        pairs.iter().filter(|(k, _)| !names.contains(k)).cloned().collect()
    }

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
        // torchrun's agent store, when torchrun says it serves one: our port is published there.
        let mut agent = all.clone();
        agent.extend_from_slice(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]);
        let torch = StoreAddr::Torch { host: "node0".into(), port: 29500, restart: 2 };
        assert_eq!(detect_with(&agent).unwrap().store, torch);
        assert_eq!(torch.to_string(), "torch://node0:29500");
        agent.retain(|(k, _)| *k != "TORCHELASTIC_RESTART_COUNT");
        agent.push(("TORCHELASTIC_RESTART_COUNT", "x"));
        invalid_arg_naming(detect_with(&agent), &["TORCHELASTIC_RESTART_COUNT"]);
        agent.retain(|(k, _)| !k.starts_with("TORCHELASTIC_"));
        agent.push(("TORCHELASTIC_USE_AGENT_STORE", "False"));
        assert_eq!(detect_with(&agent).unwrap().store, tcp("node0", 29501));

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
        assert_eq!(
            StoreAddr::parse("torch://[::1]:29500").unwrap(),
            StoreAddr::Torch { host: "::1".into(), port: 29500, restart: 0 }
        );
    }
}
