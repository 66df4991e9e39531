//! Each launcher's variables: rank, size, local rank and local size in precedence order
//! ([`SOURCES`]), read by [`from_source`], and the variables that name a job ([`JOB_VARS`]).

use super::addr::store_addr;
use super::{Launch, Launcher};
use crate::config::Config;
use crate::error::{Error, Result};

/// Launcher variables that identify a job (and tell whether it runs on one host), in the order
/// they enter the job's key; [`Config`] captures them (they are among `config::LAUNCHER_VARS`).
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
pub(super) const OMPI_JOB_IDS: &[&str] = &["OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"];
pub(super) const SLURM_JOB_IDS: &[&str] = &["SLURM_JOB_ID", "SLURM_STEP_ID"];
pub(super) const PMIX_JOB_IDS: &[&str] = &["PMIX_NAMESPACE"];

/// The variables of one launcher, in precedence order.
pub(super) struct Source {
    pub(super) launcher: Launcher,
    pub(super) rank: &'static str,
    pub(super) size: &'static str,
    pub(super) local_rank: &'static str,
    pub(super) local_size: &'static str,
}

pub(super) const SOURCES: [Source; 5] = [
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

pub(super) fn num<T: std::str::FromStr>(cfg: &Config, name: &str) -> Result<Option<T>> {
    cfg.var(name)
        .map(|v| {
            v.parse()
                .map_err(|_| Error::InvalidArgument(format!("{name}={v}: not a non-negative integer").into()))
        })
        .transpose()
}

pub(super) fn from_source(cfg: &Config, src: &Source) -> Result<Launch> {
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

#[cfg(test)]
mod tests {
    use super::super::tests::{detect_with, tcp};
    use super::*;

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
    fn config_captures_every_job_variable() {
        for name in JOB_VARS.iter().chain(OMPI_JOB_IDS).chain(SLURM_JOB_IDS).chain(PMIX_JOB_IDS) {
            assert!(crate::config::LAUNCHER_VARS.contains(name), "{name}");
            let cfg = Config::from_lookup(|k| (k == *name).then(|| "x".into())).unwrap();
            assert_eq!(cfg.var(name), Some("x"), "{name}");
        }
    }
}
