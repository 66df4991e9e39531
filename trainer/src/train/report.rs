//! Reporting: the end of an epoch (BN averaging, identity check, evaluation), `steps.csv`,
//! `epochs.csv` and `evals.csv` rows (with the echoing measurements: fresh examples, t_up,
//! t_down, R; and the bytes all-reduced), log lines, plots, checkpoints, and the finish.

use std::path::Path;
use std::time::Instant;

use super::epoch::EpochRun;
use super::eval::evaluate;
use super::stats::{EpochStats, Window};
use super::{Trainer, log};
use crate::bail;
use crate::checkpoint::{self, Meta};
use crate::error::Result;
use crate::metrics::{self, EpochRow, EvalRow, StepRow};
use crate::parallel::{Replicas, hash};

/// `--replot DIR`: redraws `DIR/curves.png` from its CSV files.
pub(super) fn replot(dir: &Path) -> Result<()> {
    let (steps, epochs) = metrics::read_history(dir)?;
    if steps.is_empty() && epochs.is_empty() {
        bail!("{}: no steps.csv or epochs.csv rows to plot", dir.display());
    }
    let path = dir.join("curves.png");
    let title =
        dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    metrics::plot(&path, &title, &steps, &epochs)?;
    println!("{}", path.display());
    Ok(())
}

impl Trainer {
    /// Writes the `steps.csv` row of the steps in `window` (this rank's, begun at `since`),
    /// ending at fractional epoch `epoch` with global batch `batch` and learning rate `lr`.
    pub(super) fn log_step(
        &mut self,
        window: &Window,
        since: Instant,
        epoch: f64,
        batch: usize,
        lr: f64,
    ) -> Result<()> {
        let w = window.sum_over_ranks(&self.rep)?;
        let elapsed = since.elapsed().as_secs_f64();
        // t_up: the upstream busy time per fresh example since the last row, times the examples
        // of one per-rank step; averaged over the ranks that measured any.
        let now = self.clock.read();
        let per_example =
            now.since(&self.progress.clock_mark).upstream_per_example(self.echo.point, self.args.workers);
        self.progress.clock_mark = now;
        let t_up = per_example * (batch / self.world) as f64;
        let (up, measured) = if t_up.is_finite() { (t_up, 1.0) } else { (0.0, 0.0) };
        let [examples, fresh, bytes, up, measured] = self.progress_over_ranks([up, measured])?;
        if measured > 0.0 {
            self.progress.last_t_up = up / measured;
        }
        let (t_up, t_down) = (self.progress.last_t_up, w.mean_compute_s());
        self.progress.last_r = t_up / t_down;
        if let Some(m) = self.metrics.as_mut() {
            m.step(StepRow {
                step: self.step,
                epoch,
                batch,
                lr,
                loss: w.mean_loss(),
                images_per_s: w.images_per_s(elapsed),
                step_s: w.mean_step_s(),
                comm_s: w.mean_wait_s(),
                examples,
                fresh,
                bytes,
                echo: self.echo_factor,
                t_up_s: t_up,
                t_down_s: t_down,
                r: t_up / t_down,
            })?;
        }
        Ok(())
    }

    /// Examples and fresh examples consumed (summed over ranks), payload bytes all-reduced (per
    /// rank, the mean over ranks), then `extra` summed over ranks: one all-reduce.
    fn progress_over_ranks<const N: usize>(&self, extra: [f64; N]) -> Result<[f64; 5]> {
        let p = &self.progress;
        let mut v: Vec<f64> = vec![p.examples, p.fresh, p.bytes];
        v.extend(extra);
        self.rep.sum_f64(&mut v)?;
        v[2] /= self.world as f64;
        let mut out = [f64::NAN; 5];
        for (o, x) in out.iter_mut().zip(v) {
            *o = x;
        }
        Ok(out)
    }

    /// Evaluates the model on the test set at fractional epoch `epoch` (ending a BMUF block and
    /// averaging BN statistics first, so every rank holds one model) and writes an `evals.csv`
    /// row. Returns the test loss and accuracy, None without a test set.
    pub(super) fn evaluate_and_record(&mut self, epoch: f64, micro: usize) -> Result<Option<(f64, f64)>> {
        let Some(test) = self.test.clone() else { return Ok(None) };
        if let Some((step, loss, acc)) = self.progress.last_eval
            && step == self.step
        {
            return Ok(Some((loss, acc))); // --target-acc stopped the run right after this one
        }
        let t = Instant::now();
        self.finish_block()?;
        self.rep.average_vars(&Replicas::buffer_vars(&self.model.buffers))?;
        // The training pipeline waits too, so no upstream work hides in the evaluation's time.
        self.clock.stop(true);
        let result = evaluate(&self.model, &test, &self.rep, &self.args, &self.augment, micro.max(64));
        self.clock.stop(false);
        let (test_loss, test_acc) = result?;
        let [examples, fresh, bytes, ..] = self.progress_over_ranks([])?;
        let wall_s = self.start.elapsed().as_secs_f64();
        let train_s = wall_s - (t.elapsed().as_secs_f64() + self.progress.eval_s);
        self.progress.eval_s += t.elapsed().as_secs_f64();
        if let Some(m) = self.metrics.as_mut() {
            let train_loss = m.last_loss();
            m.eval(EvalRow {
                step: self.step,
                epoch,
                examples,
                fresh,
                bytes,
                wall_s,
                train_s,
                train_loss,
                test_loss,
                test_acc,
            })?;
        }
        log(
            self.rank,
            &format!(
                "toroid-train: eval at step {} ({fresh} fresh of {examples} examples, echo {}, R = t_up/t_down {:.2}, {:.1} MB all-reduced per rank): test top-1 {:.2}%",
                self.step,
                self.echo_factor,
                self.progress.last_r,
                bytes / 1e6,
                100.0 * test_acc
            ),
        );
        self.progress.last_eval = Some((self.step, test_loss, test_acc));
        Ok(Some((test_loss, test_acc)))
    }

    /// True when `acc` reaches `--target-acc` (logged).
    pub(super) fn reached(&self, acc: f64) -> bool {
        let hit = self.args.target_acc.is_some_and(|t| acc >= t);
        if hit {
            log(self.rank, &format!("toroid-train: target accuracy reached at step {}", self.step));
        }
        hit
    }

    /// After training epoch `epoch`: makes the replicas one model again, evaluates it, and
    /// reports the epoch (log line, `epochs.csv` row, plot). Returns true when the test accuracy
    /// reached `--target-acc`.
    pub(super) fn end_epoch(&mut self, epoch: u64, run: &EpochRun) -> Result<bool> {
        // BN running statistics differ per rank (each saw its own examples): average them so
        // evaluation and checkpoints see one model, identical on every rank.
        self.rep.average_vars(&Replicas::buffer_vars(&self.model.buffers))?;
        let what = format!("parameters at the end of epoch {epoch}");
        self.rep.check_identical(&self.host_values(), &what)?;
        let totals = run.stats.sum_over_ranks(&self.rep)?;
        let steps_done = totals.train.count / (run.plan.micro * run.plan.accum * self.world) as f64;
        let at = epoch as f64 + steps_done / run.steps as f64;
        let (test_loss, test_acc) =
            self.evaluate_and_record(at, run.plan.micro)?.unwrap_or((f64::NAN, f64::NAN));
        let row = self.epoch_row(epoch, run, &totals, steps_done, (test_loss, test_acc));
        log(self.rank, &self.epoch_line(&row, steps_done));
        if let Some(m) = self.metrics.as_mut() {
            m.epoch(row)?;
            if !self.args.no_plot
                && let Err(e) = m.plot(&self.title)
            {
                eprintln!("toroid-train: warning: {e}");
            }
        }
        Ok(test_acc.is_finite() && self.reached(test_acc))
    }

    /// The `epochs.csv` row of `epoch` from the `totals` over ranks and the `test` loss and
    /// accuracy.
    fn epoch_row(
        &self,
        epoch: u64,
        run: &EpochRun,
        totals: &EpochStats,
        steps_done: f64,
        test: (f64, f64),
    ) -> EpochRow {
        EpochRow {
            epoch,
            step: self.step,
            batch: run.global,
            lr: run.rate,
            train_loss: totals.train.mean_loss(),
            train_acc: totals.train.accuracy(),
            test_loss: test.0,
            test_acc: test.1,
            images_per_s: totals.train.count / run.epoch_s,
            comm_fraction: totals.comm_fraction(),
            epoch_s: run.epoch_s,
            wall_s: self.start.elapsed().as_secs_f64(),
            epochs_done: epoch as f64 + steps_done / run.steps as f64,
        }
    }

    /// The log line of an epoch.
    fn epoch_line(&self, row: &EpochRow, steps_done: f64) -> String {
        format!(
            "epoch {}/{} steps {:.0} batch {} lr {:.4} | loss {:.4} train {:.2}% | test loss {:.4} top-1 {:.2}% | {:.0} img/s, all-reduce wait {:.1}% of step | {:.1}s (total {:.1}s)",
            row.epoch + 1,
            self.args.epochs,
            steps_done,
            row.batch,
            row.lr,
            row.train_loss,
            100.0 * row.train_acc,
            row.test_loss,
            100.0 * row.test_acc,
            row.images_per_s,
            100.0 * row.comm_fraction,
            row.epoch_s,
            row.wall_s
        )
    }

    /// Saves a checkpoint (rank 0) that resumes at epoch `next_epoch`.
    pub(super) fn save_checkpoint(&self, next_epoch: u64) -> Result<()> {
        let momentum: Vec<Vec<f32>> = self.host.iter().map(|h| h.momentum.clone()).collect();
        let meta = Meta {
            next_epoch,
            step: self.step,
            model: format!("{:?}", self.model.config),
            num_params: self.model.num_params(),
        };
        let path = checkpoint::save(&self.args.out, &self.model, &momentum, &meta)?;
        log(self.rank, &format!("toroid-train: checkpoint {}", path.display()));
        Ok(())
    }

    /// The end of a run: every rank's parameter hash, a barrier, and the last log line.
    pub(super) fn finish(self) -> Result<()> {
        // Every rank reports its parameter hash (the tests compare them across ranks).
        let h = hash(&self.host_values());
        eprintln!("toroid-train: rank {} parameter hash {h:#018x}", self.rank);
        if let Some(comm) = self.rep.comm() {
            comm.barrier()?;
        }
        let secs = self.start.elapsed().as_secs_f64();
        log(self.rank, &format!("toroid-train: done, {} steps in {secs:.1}s", self.step));
        Ok(())
    }
}
