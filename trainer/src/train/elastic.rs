//! `--elastic`: training goes on when a rank dies, on the survivors, from the last parameters
//! every survivor holds (what torchelastic does by restarting from a checkpoint, without the
//! restart: the survivors keep their processes, their data and their model in memory).
//!
//! Before each step the trainer keeps a copy of the optimiser's state ([`SavePoint`]): the
//! parameters' host values, momentum and Adam's moments, the step counters. When a step fails
//! because the communicator was aborted (a peer died: its sockets closed, or it stopped
//! answering until the deadline), every survivor
//!
//! 1. shrinks the communicator (`Communicator::shrink(&[])`: the dead ranks are found through
//!    the control plane, with no store and no new port) and learns who is gone;
//! 2. goes back to the save point. This is what makes the survivors agree: the failed step's
//!    all-reduces may have completed on some survivors and not on others (a ring all-reduce
//!    can finish on the ranks downstream of the dead one after it sent its last piece), and the
//!    optimiser applies each bucket as soon as it arrives, so after the failure the survivors'
//!    parameters may differ. Before the step they were bit-identical (the data-parallel
//!    invariant, which `--check-every` verifies), so every survivor going back to it agrees
//!    again; a hash comparison on the new communicator checks it before training goes on;
//! 3. rebuilds its gradient buckets over the new communicator and re-shards the data
//!    (`epoch.rs`): the global batch stays the same, so the learning rate and the steps per
//!    epoch do too, and each survivor takes a larger share. Because the shards are strided
//!    over one permutation per epoch, skipping the first `s` steps' worth of the new shards
//!    skips exactly the examples the old world had consumed, and the epoch goes on with the
//!    rest;
//! 4. retries the failed step. If rank 0 died, the new rank 0 takes over the metrics files
//!    (appending to them, after dropping any row the dead rank logged for the failed step) and the
//!    checkpoints.
//!
//! A failure elsewhere (outside the steps of an epoch: the end-of-epoch report, evaluation, a
//! checkpoint) still ends the run with the error, as does any failure that did not abort the
//! communicator (a bad flag, the data, a diverging loss).

use std::time::Instant;

use super::{HostParam, Progress, Trainer};
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// What a failed step goes back to: the optimiser's state before it.
pub(super) struct SavePoint {
    host: Vec<HostParam>,
    adam_t: f64,
    adam_t1: f64,
    step: u64,
    progress: Progress,
}

impl Trainer {
    /// Under `--elastic`, keeps the optimiser's state before a step (copied into buffers kept
    /// from the last step: no allocation after the first).
    pub(super) fn save_point(&mut self) {
        if !self.args.elastic {
            return;
        }
        match &mut self.elastic {
            Some(s) => {
                for (dst, src) in s.host.iter_mut().zip(&self.host) {
                    dst.data.copy_from_slice(&src.data);
                    dst.momentum.copy_from_slice(&src.momentum);
                    dst.second.copy_from_slice(&src.second);
                }
                s.adam_t = self.adam_t;
                s.adam_t1 = self.adam_t1;
                s.step = self.step;
                s.progress = self.progress.clone();
            }
            None => {
                self.elastic = Some(SavePoint {
                    host: self.host.clone(),
                    adam_t: self.adam_t,
                    adam_t1: self.adam_t1,
                    step: self.step,
                    progress: self.progress.clone(),
                });
            }
        }
    }

    /// After a step failed with `err`: under `--elastic`, when the failure aborted the
    /// communicator, shrinks to the survivors and goes back to the save point (the caller
    /// re-shards the data and retries the step); otherwise returns `err`.
    pub(super) fn recover(&mut self, err: Error) -> Result<()> {
        let aborted = self.rep.comm().is_some_and(|c| c.is_aborted());
        let (Some(save), Some(comm), true) = (self.elastic.as_ref(), self.rep.comm(), aborted) else {
            return Err(err);
        };
        let (old_rank, old_world, step) = (self.rank, self.world, save.step + 1);
        let t = Instant::now();
        let small = comm.shrink(&[]).map_err(|e| {
            Error(format!("{err}; --elastic could not shrink to the survivors at step {step}: {e}"))
        })?;
        // Who is gone: every survivor's old rank, gathered on the new communicator.
        let mut olds = vec![0u32; small.size()];
        olds[small.rank()] = old_rank as u32;
        small.all_gather_in_place(&mut olds)?;
        let lost: Vec<usize> = (0..old_world).filter(|r| !olds.contains(&(*r as u32))).collect();
        // Back to the state before the failed step, identical on every survivor.
        for (h, s) in self.host.iter_mut().zip(&save.host) {
            h.data.copy_from_slice(&s.data);
            h.momentum.copy_from_slice(&s.momentum);
            h.second.copy_from_slice(&s.second);
        }
        (self.adam_t, self.adam_t1) = (save.adam_t, save.adam_t1);
        (self.step, self.progress) = (save.step, save.progress.clone());
        for (p, h) in self.model.params.iter().zip(&self.host) {
            p.var.set(&candle_core::Tensor::from_slice(&h.data, p.var.shape(), &self.dev)?)?;
        }
        self.rank = small.rank();
        self.world = small.size();
        self.rep = self.rep.rebuilt(small, &self.model.params);
        if self.rank == 0 && self.metrics.is_none() {
            // Rank 0 died: this survivor takes its files over.
            self.metrics = Some(Metrics::take_over(&self.args.out, save.step)?);
        }
        self.rep.check_identical(&self.host_values(), &format!("parameters before step {step}"))?;
        eprintln!(
            "toroid-train: rank {old_rank}: ranks {lost:?} lost at step {step} ({err}); continuing on {} \
             ranks as rank {} from the parameters before step {step} (shrink and recovery took {:.0} ms)",
            self.world,
            self.rank,
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }
}
