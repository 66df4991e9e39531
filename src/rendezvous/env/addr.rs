//! Where the store is: `TOROID_STORE_ADDR`; torchrun's `MASTER_ADDR` and `MASTER_PORT`; a
//! single-host job's private directory; Slurm's first node and a port from the job id.

use super::hostlist::expand_hostlist;
use super::job_dir::{OneHost, one_host_job};
use super::launchers::num;
use super::{Launcher, StoreAddr};
use crate::config::Config;
use crate::error::{Error, Result};

/// Base of the store port derived from `SLURM_JOB_ID` when no port is given (see module docs).
pub const SLURM_PORT_BASE: u16 = 29600;
const SLURM_PORT_SPAN: u64 = 1000;

/// The store address from the environment alone (`TOROID_STORE_ADDR`, then torchrun's agent
/// store at `MASTER_ADDR:MASTER_PORT` when `TORCHELASTIC_USE_AGENT_STORE=True`, else
/// `MASTER_ADDR` and `MASTER_PORT`+1, then a private file store for a job of Open MPI, Slurm or
/// PMIx on one host, then Slurm's node list when `launcher` is Slurm), for callers that know
/// rank and size some other way (the C ABI's `toroid_comm_init` with a NULL `store_addr`).
///
/// # Errors
/// As [`detect`](super::detect) for the store part.
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
    // torchrun promises its agent's TCPStore at MASTER_ADDR:MASTER_PORT (torch trusts the same
    // flag for the same address, `torch.distributed.rendezvous._agent_store_serves`): rank 0
    // publishes our store's port there rather than guess that MASTER_PORT+1 is free.
    let agent = cfg.var("TORCHELASTIC_USE_AGENT_STORE") == Some("True") && cfg.var("MASTER_ADDR").is_some();
    let port = match cfg.var("MASTER_PORT") {
        Some(v) => {
            let p: u16 = v.parse().ok().filter(|p| *p != 0).ok_or_else(|| {
                Error::InvalidArgument(format!("MASTER_PORT={v}: not a port number").into())
            })?;
            if let Some(host) = host.as_ref().filter(|_| agent) {
                let restart = num::<u32>(cfg, "TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0);
                return Ok(StoreAddr::Torch { host: host.clone(), port: p, restart });
            }
            // A store of torch's (torchrun's, or init_process_group's) may listen on MASTER_PORT.
            Some(p.checked_add(1).ok_or_else(|| {
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

#[cfg(test)]
mod tests {
    use super::super::tests::{TORCHRUN, detect_with, tcp};
    use super::*;

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
}
