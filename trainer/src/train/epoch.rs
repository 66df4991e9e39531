//! One epoch of training: the input pipeline (with the epoch's echo factor), the progress bar,
//! the steps (and BMUF's block synchronisations), periodic identity checks, `steps.csv` rows,
//! `--eval-every`, `--target-acc` and `--max-steps`.

use std::sync::Arc;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

use super::stats::{EpochStats, Window};
use super::{Trainer, log};
use crate::bail;
use crate::data::echo::{AUTO_MAX, Echo, EchoFactor, EchoPoint, auto_factor, steps_per_epoch};
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
    /// True when `--max-steps` or `--target-acc` ended the run in this epoch.
    pub stopped: bool,
}

/// An epoch's input for this rank: how it makes up its share of the global batch, the steps of
/// the epoch, and the pipeline of its shard (from the step it starts at).
struct EpochInput {
    plan: BatchPlan,
    steps: usize,
    batches: pipeline::Pipeline,
    /// Images of one global step.
    images: usize,
}

/// What the steps of one epoch accumulate.
struct Running {
    stats: EpochStats,
    window: Window,
    window_start: Instant,
    rate: f64,
    /// The batch the learning rate follows.
    lr_batch: usize,
}

impl Trainer {
    /// Trains one epoch: one pass over this rank's shard, or up to `--max-steps`. Under
    /// `--elastic` a step that fails because a rank died is retried on the survivors
    /// (`elastic.rs`), with the rest of the epoch re-sharded over them.
    pub(super) fn train_epoch(&mut self, epoch: u64) -> Result<EpochRun> {
        let global = self.schedule.at(epoch);
        self.choose_echo_factor(epoch);
        let mut input = self.epoch_input(epoch, global, 0)?;
        let bar = self.progress_bar(epoch, input.steps)?;
        let epoch_start = Instant::now();
        // Under BMUF each rank is one worker of batch global / N, so the LR follows that batch.
        let lr_batch = if self.bmuf.is_some() { global / self.world } else { global };
        let mut run = Running {
            stats: EpochStats::default(),
            window: Window::default(),
            window_start: Instant::now(),
            rate: self.lr.at(epoch as f64, lr_batch),
            lr_batch,
        };
        let mut stopped = false;
        let mut s = 0;
        while s < input.steps {
            self.save_point();
            match self.epoch_step(epoch, global, s, &mut input, &mut run, &bar) {
                Ok(stop) => {
                    s += 1;
                    if stop {
                        stopped = true;
                        break;
                    }
                }
                Err(e) => {
                    self.recover(e)?;
                    input = self.epoch_input(epoch, global, s)?;
                    bar.set_length(input.steps as u64);
                }
            }
        }
        bar.finish_and_clear();
        let EpochInput { plan, steps, batches, .. } = input;
        drop(batches);
        self.finish_block()?;
        let epoch_s = epoch_start.elapsed().as_secs_f64();
        Ok(EpochRun { global, plan, steps, rate: run.rate, stats: run.stats, epoch_s, stopped })
    }

    /// This rank's input for `epoch` at global batch `global`, starting at step `from` (its
    /// shard of the epoch's permutation without the first `from` steps' examples).
    fn epoch_input(&self, epoch: u64, global: usize, from: usize) -> Result<EpochInput> {
        let plan = plan_batch(global, self.world, self.args.max_micro_batch)?;
        let indices = shard(self.train.len(), epoch, self.args.seed, self.rank, self.world, true, true);
        let steps = steps_per_epoch(self.echo.point, self.echo_factor, indices.len(), plan.micro, plan.accum);
        if steps == 0 {
            bail!(
                "epoch {epoch}: {} examples per rank cannot fill one step of {} x {}",
                indices.len(),
                plan.accum,
                plan.micro
            );
        }
        let skip = (from * plan.micro * plan.accum).min(indices.len());
        let indices = indices[skip..].to_vec();
        let batches = pipeline::start(self.train.clone(), indices, self.pipeline_config(epoch, &plan));
        let images = plan.micro * plan.accum * self.world;
        Ok(EpochInput { plan, steps, batches, images })
    }

    /// Step `s` of `epoch`: the optimiser step, BMUF's block end, the identity check, the
    /// `steps.csv` row, `--eval-every`. Returns true when the run stops here (`--max-steps`,
    /// `--target-acc`).
    fn epoch_step(
        &mut self,
        epoch: u64,
        global: usize,
        s: usize,
        input: &mut EpochInput,
        run: &mut Running,
        bar: &ProgressBar,
    ) -> Result<bool> {
        let EpochInput { plan, steps, batches, images } = input;
        let (steps, images) = (*steps, *images);
        let t_step = Instant::now();
        run.rate = self.lr.at(epoch as f64 + s as f64 / steps as f64, run.lr_batch);
        let (mut input_wait, mut fresh, mut examples) = (0f64, 0usize, 0usize);
        let mut next_batch = || {
            let t = Instant::now();
            let b = match batches.next() {
                Some(b) => b,
                None => bail!("input pipeline ended after {s} of {steps} steps in epoch {epoch}"),
            };
            input_wait += t.elapsed().as_secs_f64();
            if let Ok(b) = &b {
                (fresh, examples) = (fresh + b.fresh, examples + b.len());
            }
            b
        };
        let done = self.train_step(plan, run.rate, epoch, &mut next_batch, &mut run.stats.train)?;
        self.step += 1;
        self.progress.fresh += fresh as f64;
        self.progress.examples += examples as f64;
        self.after_local_step()?;
        let dt = t_step.elapsed().as_secs_f64();
        run.stats.add_step_time(dt, done.wait_s);
        run.window.add_step(done.loss, images, dt, done.wait_s);
        run.window.add_compute(dt - input_wait);
        bar.set_message(format!(
            "loss {:.4} | {:.0} img/s | lr {:.4} | R = t_up/t_down {:.2} | echo {}",
            done.loss,
            images as f64 / dt,
            run.rate,
            self.progress.last_r,
            self.echo_factor
        ));
        bar.inc(1);
        // Under BMUF the replicas differ inside a block; each block end is checked instead.
        if self.args.check_every > 0 && self.bmuf.is_none() && self.step.is_multiple_of(self.args.check_every)
        {
            let what = format!("parameters after step {}", self.step);
            self.rep.check_identical(&self.host_values(), &what)?;
        }
        let at_max = self.args.max_steps.is_some_and(|m| self.step >= m);
        if self.step.is_multiple_of(self.args.log_every.max(1)) || at_max || s + 1 == steps {
            let at = epoch as f64 + (s + 1) as f64 / steps as f64;
            self.log_step(&run.window, run.window_start, at, global, run.rate)?;
            run.window = Window::default();
            run.window_start = Instant::now();
        }
        let every = self.args.eval_every;
        if every > 0 && self.step.is_multiple_of(every) && s + 1 < steps {
            let at = epoch as f64 + (s + 1) as f64 / steps as f64;
            if self.evaluate_and_record(at, plan.micro)?.is_some_and(|(_, acc)| self.reached(acc)) {
                return Ok(true);
            }
        }
        Ok(at_max)
    }

    /// `--echo auto`: from the second epoch on, E = floor(R) of the last measurement (the same
    /// on every rank, since R comes from sums over ranks).
    fn choose_echo_factor(&mut self, epoch: u64) {
        if self.echo.factor != EchoFactor::Auto || epoch == self.start_epoch {
            return;
        }
        let e = auto_factor(self.progress.last_r, AUTO_MAX);
        if e != self.echo_factor {
            let r = self.progress.last_r;
            log(
                self.rank,
                &format!("toroid-train: echo auto: R = {r:.2}, echo factor {} -> {e}", self.echo_factor),
            );
        }
        self.echo_factor = e;
    }

    /// The training input pipeline of `epoch`: shuffled, augmented, full micro-batches, with the
    /// echo stage and the shuffle buffer after it.
    fn pipeline_config(&self, epoch: u64, plan: &BatchPlan) -> PipelineConfig {
        let mut cfg = PipelineConfig {
            batch_size: plan.micro,
            workers: self.args.workers,
            shuffle_buffer: self.args.shuffle_buffer,
            augment_shuffle: 0,
            batch_shuffle: 0,
            train: true,
            keep_partial: false,
            prefetch: self.args.prefetch,
            seed: self.args.seed,
            epoch,
            rank: self.rank,
            augment: self.augment.clone(),
            seams: Seams::default(),
            clock: Some(self.clock.clone()),
        };
        let e = self.echo_factor;
        if e > 1 {
            let echo = Echo { factor: e };
            let point = self.echo.point;
            let buffer =
                self.args.echo_shuffle.unwrap_or(if point == EchoPoint::Batch { 0 } else { 4 * plan.micro });
            match point {
                EchoPoint::BeforeAugment => {
                    cfg.seams.after_decode = Some(Arc::new(echo));
                    cfg.shuffle_buffer = cfg.shuffle_buffer.max(buffer);
                }
                EchoPoint::AfterAugment => {
                    cfg.seams.after_augment = Some(Arc::new(echo));
                    cfg.augment_shuffle = buffer;
                }
                EchoPoint::Batch => {
                    cfg.seams.after_batch = Some(Arc::new(echo));
                    cfg.batch_shuffle = buffer;
                }
            }
        }
        cfg
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
