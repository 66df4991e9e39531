//! Shrinking a communicator to its survivors: after a rank fails (or on purpose, on a healthy
//! communicator), every other rank builds a new communicator of the ranks that remain, in their
//! old order, as NCCL 2.27's `ncclCommShrink` and MPI ULFM's `MPI_Comm_shrink` do.
//!
//! There is no store to meet through any more (rank 0 stops serving it after set-up), and no
//! new port is opened: each survivor hands its set-up listener, which the control plane kept
//! open ([`Core::take_listener_for_shrink`]), to the connect sequence every communicator is made
//! by (`setup/mod.rs`), with the connections other survivors already made to it while it was not
//! yet shrinking. The new communicator's id derives from the parent's ([`control::shrink_id`]),
//! so the handshake keeps out anything that is not one of this shrink's survivors, and its
//! ranks are the survivors renumbered `0..k`, so a hello claiming a rank beyond `k` is dropped
//! as a stranger's.
//!
//! Every survivor must name the same failed ranks. Once connected they check it: an all-gather
//! of each one's set, compared with its own; a difference fails every survivor with an error
//! naming the ranks that disagree. Sets that differ in size usually stop the mesh itself (a
//! survivor expects a rank that never comes, or is refused): that error says so too.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use super::pending::PendingComm;
use super::{Calibration, Listening, Members};
use crate::comm::{Communicator, Core, control};
use crate::error::{Error, Result};

/// Shrink attempts of one communicator: the listener goes to the first, so there is one.
const ATTEMPT: u64 = 1;
/// How long a connection to a peer's listener may take when looking for the dead ranks.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl Communicator {
    /// Builds a new communicator of every rank not in `failed`, in this communicator's rank
    /// order (a survivor's new rank is the number of survivors below it). Every survivor must
    /// call it with the same `failed`; the failed ranks take no part. Works on an aborted
    /// communicator (the usual case, after a failure) as on a healthy one; either way this
    /// communicator stays as it was (destroy it as usual), and can be shrunk only once.
    ///
    /// An empty `failed` means the ranks that failed: those whose process is gone (their
    /// control plane refuses connections), else the rank the first error named. When neither
    /// names one, it is an [`Error::InvalidUsage`]: name them.
    ///
    /// Bounded by the communicator's timeout.
    pub fn shrink(&self, failed: &[usize]) -> Result<Communicator> {
        self.core.shrink(failed)
    }

    /// [`Communicator::shrink`] on a thread of its own: returns at once with a [`PendingComm`] to
    /// poll, wait for or abort (NCCL's non-blocking `ncclCommShrink`). Aborting it gives up this
    /// communicator's one shrink.
    pub fn shrink_async(&self, failed: &[usize]) -> Result<PendingComm> {
        self.core.forked()?;
        let core = self.core.clone();
        let failed = failed.to_vec();
        PendingComm::spawn(format!("shrink of communicator {:#x}", self.id()), move || core.shrink(&failed))
    }
}

impl Core {
    /// See [`Communicator::shrink`].
    fn shrink(&self, failed: &[usize]) -> Result<Communicator> {
        self.forked()?;
        let n = self.ident.size;
        let failed: BTreeSet<usize> =
            if failed.is_empty() { self.failed_ranks()? } else { failed.iter().copied().collect() };
        if let Some(bad) = failed.iter().find(|r| **r >= n) {
            return Err(Error::InvalidArgument(
                format!("shrink: rank {bad} is not in a world of {n}").into(),
            ));
        }
        if failed.contains(&self.ident.rank) {
            return Err(Error::InvalidUsage(
                format!("shrink: rank {} is among the failed ranks {failed:?} it was given", self.ident.rank)
                    .into(),
            ));
        }
        let survivors: Vec<usize> = (0..n).filter(|r| !failed.contains(r)).collect();
        let new_rank = survivors.iter().position(|r| *r == self.ident.rank).unwrap_or(0);
        let what = format!(
            "rank {}: shrink of communicator {:#x} to ranks {survivors:?} (without {failed:?})",
            self.ident.rank, self.ident.id
        );
        let deadline = crate::config::deadline_in(self.timeout);
        let id = control::shrink_id(self.ident.id, ATTEMPT);
        let (endpoint, accepted) = self.take_listener_for_shrink(ATTEMPT)?;
        let t = &self.ident.topology;
        let addrs: Vec<_> = survivors.iter().map(|r| self.addrs()[*r]).collect();
        let hosts: Vec<String> = survivors.iter().map(|r| t.host_of[*r].to_string()).collect();
        let machines: Vec<String> = survivors.iter().map(|r| t.machine_of[*r].to_string()).collect();
        tracing::info!(target: "toroid::init", "{what}: rank {new_rank} of {}", survivors.len());
        let lanes: Vec<usize> = survivors.iter().map(|r| self.links.lanes[*r]).collect();
        let shm_ok: Vec<bool> = survivors.iter().map(|r| self.links.shm_ok[*r]).collect();
        let rdma_ok: Vec<bool> = survivors.iter().map(|r| self.links.rdma_ok[*r]).collect();
        // The survivors connect as a full mesh: the connections other survivors already made
        // were parked for this shrink, and it must not wait for links on demand.
        let members = Members {
            rank: new_rank,
            addrs: &addrs,
            hosts: &hosts,
            machines: &machines,
            lanes: &lanes,
            shm_ok: &shm_ok,
            rdma_ok: &rdma_ok,
            lazy: false,
            security: self
                .links
                .security
                .as_ref()
                .map(|s| s.for_members(&survivors))
                .transpose()?
                .map(Arc::new),
        };
        let listening = Listening { iface: self.links.iface.clone(), endpoint, accepted };
        let comm = Communicator::connect(
            members,
            listening,
            id,
            &self.config,
            None,
            deadline,
            Calibration::Inherit(self.tuning.measured.get().copied()),
        )
        .map_err(|e| {
            e.context(&format!("{what} (every survivor must name the same failed ranks, and be alive)"))
        })?;
        comm.agree_on(n, &failed, &survivors).map_err(|e| e.context(&what))?;
        Ok(comm)
    }

    /// The ranks that failed: those whose process is gone, else the one the first error named.
    fn failed_ranks(&self) -> Result<BTreeSet<usize>> {
        let dead: BTreeSet<usize> = self.gone_peers(PROBE_TIMEOUT).into_iter().map(|(r, _)| r).collect();
        if !dead.is_empty() {
            return Ok(dead);
        }
        let named = self.abort.is_fired().then(|| self.abort.error().peer()).flatten();
        match named {
            Some(r) if r != self.ident.rank => Ok(BTreeSet::from([r])),
            _ => Err(Error::InvalidUsage(
                format!(
                    "rank {}: shrink was given no failed ranks, no rank's process is gone and no error \
                     names one: name the ranks to leave out",
                    self.ident.rank
                )
                .into(),
            )),
        }
    }
}

impl Communicator {
    /// Checks, on the new communicator, that every survivor left out the same ranks of a parent
    /// of `n`: an all-gather of each one's set as a bitmap. On a difference this communicator
    /// is aborted and the error names who disagrees.
    fn agree_on(&self, n: usize, failed: &BTreeSet<usize>, survivors: &[usize]) -> Result<()> {
        let k = self.size();
        let mut all = vec![0u8; n * k];
        let mine = &mut all[n * self.rank()..n * (self.rank() + 1)];
        for r in failed {
            mine[*r] = 1;
        }
        self.all_gather_in_place(&mut all)?;
        let mine = &all[n * self.rank()..n * (self.rank() + 1)];
        let set = |b: &[u8]| -> Vec<usize> { (0..n).filter(|r| b[*r] != 0).collect() };
        let differ: Vec<String> = (0..k)
            .filter(|s| all[n * s..n * (s + 1)] != *mine)
            .map(|s| format!("rank {} leaves out {:?}", survivors[s], set(&all[n * s..n * (s + 1)])))
            .collect();
        if differ.is_empty() {
            return Ok(());
        }
        self.abort();
        Err(Error::InvalidUsage(
            format!(
                "the survivors disagree on the failed ranks: this rank leaves out {:?} but {}",
                set(mine),
                differ.join(", ")
            )
            .into(),
        ))
    }
}
