//! Single-host jobs: whether the launcher says every rank runs on this host, and then the job's
//! private directory, `private_base()/job-<launcher>-<key>`, with `<key>` from the launcher's
//! job variables (see the module docs of `rendezvous::env`).

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::Launcher;
use super::hostlist::expand_hostlist;
use super::launchers::{JOB_VARS, OMPI_JOB_IDS, PMIX_JOB_IDS, SLURM_JOB_IDS};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::sys::user;

/// Prefix of the job directories under [`private_base`].
const JOB_DIR_PREFIX: &str = "job-";

/// Whether a job runs on one host, and which private store it then uses.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum OneHost {
    /// Every rank is on this host; the job's private store directory.
    Job(PathBuf),
    /// Every rank is on this host but none of these variables names the job.
    NoJobId(&'static [&'static str]),
    /// The launcher says the job spans several hosts (why).
    Several(String),
    /// The launcher does not say (or is not one that can).
    Unknown,
}

/// Whether the job of `launcher` runs on one host by what `cfg` says, and then its directory.
pub(super) fn one_host_job(cfg: &Config, launcher: Launcher) -> OneHost {
    let var = |n: &str| cfg.var(n);
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
                expand_hostlist(list).ok().map(|h| h.len())
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
    let uid = user::euid();
    PathBuf::from(format!("/tmp/toroid-{uid}"))
}

/// Creates `dir` with mode 0700 if it is missing, then checks that it is a directory (not a
/// link) owned by this user that no one else may enter.
pub(super) fn ensure_private_dir(dir: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::system(format!("file store: create {}", dir.display()), e)),
    }
    let meta = fs::symlink_metadata(dir)
        .map_err(|e| Error::system(format!("file store: stat {}", dir.display()), e))?;
    let uid = user::euid();
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

/// Whether `dir` is a single-host job directory that [`store_addr`](super::store_addr) chose.
pub(super) fn is_job_dir(dir: &Path) -> bool {
    dir.parent() == Some(private_base().as_path())
        && dir.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(JOB_DIR_PREFIX))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{RemoveOnDrop, detect_owned, job_dir, ompi, tcp, without};
    use super::super::{Launcher, SLURM_PORT_BASE};
    use super::*;
    use crate::error::Error;

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
