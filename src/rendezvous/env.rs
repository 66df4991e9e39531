//! Launcher detection: rank, size, local rank and store address from the environment.
//! (Being written: see the rendezvous task.)

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::Store;
use crate::config::Config;
use crate::error::Result;

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
pub fn detect(_cfg: &Config) -> Result<Launch> {
    unimplemented!("env::detect")
}

/// Opens the store of `launch`: rank 0 serves a TCP store, the others connect.
pub fn open_store(_launch: &Launch, _timeout: Duration) -> Result<Arc<dyn Store>> {
    unimplemented!("env::open_store")
}
