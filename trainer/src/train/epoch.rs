//! One epoch of training: the input pipeline, the progress bar, the steps, periodic identity
//! checks and `steps.csv` rows, and `--max-steps`.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

use super::Trainer;
use super::stats::{EpochStats, Window};
use crate::bail;
use crate::data::pipeline::{self, PipelineConfig, Seams};
use crate::data::shard;
use crate::error::{Error, Result};
use crate::optim::{BatchPlan, plan_batch};

/// What one epoch of training leaves for its report.
pub(super) struct EpochRun {
    /// Global batch size.
    pub global: usize,
    /// How each rank makes up its share of the global batch.
    pub plan: BatchPlan,
    /// Steps planned for the epoch.
    pub steps: usize,
    /// Learning rate of the last step.
    pub rate: f64,
    /// This rank's totals.
    pub stats: EpochStats,
    /// Seconds the epoch's training took.
    pub epoch_s: f64,
    /// True when `--max-steps` ended the run in this epoch.
    pub stopped: bool,
}

impl Trainer {
    /// Trains one epoch: one pass over this rank's shard, or up to `--max-steps`.
    pub(super) fn train_epoch(&mut self, epoch: u64) -> Result<EpochRun> {
        let global = self.schedule.at(epoch);
        let plan = plan_batch(global, self.world, self.args.max_micro_batch)?;
        let indices = shard(self.train.len(), epoch, self.args.seed, self.rank, self.world, true, true);
        let steps = indices.len() / (plan.micro * plan.accum);
        if steps == 0 {
            bail!(
                "epoch {epoch}: {} examples per rank cannot fill one step of {} x {}",
                indices.len(),
                plan.accum,
                plan.micro
            );
        }
        let mut batches = pipeline::start(self.train.clone(), indices, self.pipeline_config(epoch, &plan));
        let bar = self.progress_bar(epoch, steps)?;
        let epoch_start = Instant::now();
        let images = plan.micro * plan.accum * self.world;
        let (mut stats, mut window) = (EpochStats::default(), Window::default());
        let mut window_start = Instant::now();
        let mut rate = self.lr.at(epoch as f64, global);
        let mut stopped = false;
        for s in 0..steps {
            let t_step = Instant::now();
            rate = self.lr.at(epoch as f64 + s as f64 / steps as f64, global);
            let mut next_batch = || match batches.next() {
                Some(b) => b,
                None => bail!("input pipeline ended after {s} of {steps} steps in epoch {epoch}"),
            };
            let done = self.train_step(&plan, rate, epoch, &mut next_batch, &mut stats.train)?;
            self.step += 1;
            let dt = t_step.elapsed().as_secs_f64();
            stats.add_step_time(dt, done.wait_s);
            window.add_step(done.loss, images, dt, done.wait_s);
            bar.set_message(format!(
                "loss {:.4} | {:.0} img/s | lr {rate:.4}",
                done.loss,
                images as f64 / dt
            ));
            bar.inc(1);
            if self.args.check_every > 0 && self.step.is_multiple_of(self.args.check_every) {
                let what = format!("parameters after step {}", self.step);
                self.rep.check_identical(&self.host_values(), &what)?;
            }
            let at_max = self.args.max_steps.is_some_and(|m| self.step >= m);
            if self.step.is_multiple_of(self.args.log_every.max(1)) || at_max || s + 1 == steps {
                let at = epoch as f64 + (s + 1) as f64 / steps as f64;
                self.log_step(&window, window_start, at, global, rate)?;
                window = Window::default();
                window_start = Instant::now();
            }
            if at_max {
                stopped = true;
                break;
            }
        }
        bar.finish_and_clear();
        drop(batches);
        let epoch_s = epoch_start.elapsed().as_secs_f64();
        Ok(EpochRun { global, plan, steps, rate, stats, epoch_s, stopped })
    }

    /// The training input pipeline of `epoch`: shuffled, augmented, full micro-batches.
    fn pipeline_config(&self, epoch: u64, plan: &BatchPlan) -> PipelineConfig {
        PipelineConfig {
            batch_size: plan.micro,
            workers: self.args.workers,
            shuffle_buffer: self.args.shuffle_buffer,
            train: true,
            keep_partial: false,
            prefetch: self.args.prefetch,
            seed: self.args.seed,
            epoch,
            rank: self.rank,
            augment: self.augment.clone(),
            seams: Seams::default(),
            augment_shuffle: 0,
            batch_shuffle: 0,
            clock: None,
        }
    }

    /// The epoch's progress bar (hidden except on rank 0).
    fn progress_bar(&self, epoch: u64, steps: usize) -> Result<ProgressBar> {
        let bar = if self.rank == 0 { ProgressBar::new(steps as u64) } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({eta})")
                .map_err(|e| Error::msg(e.to_string()))?
                .progress_chars("=> "),
        );
        bar.set_prefix(format!("{}/{}", epoch + 1, self.args.epochs));
        Ok(bar)
    }
}
