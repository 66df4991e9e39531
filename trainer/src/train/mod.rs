//! The training loop: data, model, replicas, optimiser, metrics, checkpoints.
//!
//! [`run`] handles the early exits (`--replot`, `--print-params`), then sets up a [`Trainer`],
//! runs its epochs and finishes. The phases live in their own files:
//!
//! ```text
//!  setup.rs   connect, data, augmentation, model, replicas, optimiser, checkpoint resume
//!  epoch.rs   one epoch: input pipeline, progress bar, the steps, --check-every, --max-steps
//!  step.rs    one optimiser step: segmented forward/backward, gradient all-reduce, update
//!  block.rs   BMUF: the block synchronisation between local steps, host <-> model copies
//!  eval.rs    test-set evaluation
//!  report.rs  steps.csv / epochs.csv rows, log lines, plots, checkpoints, the final hash
//!  stats.rs   the statistics the steps accumulate and the reports sum over ranks
//! ```

use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;

use crate::adam::AdamConfig;
use crate::bmuf::Bmuf;
use crate::cli::Args;
use crate::data::Dataset;
use crate::data::echo::{ClockReading, EchoSpec, StageClock};
use crate::data::pipeline::Augment;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::model::ResNet;
use crate::optim::{BatchSchedule, LrSchedule, OptConfig};
use crate::parallel::Replicas;

mod block;
mod elastic;
mod epoch;
mod eval;
mod report;
mod setup;
pub mod stats;
mod step;

pub use setup::{TestSet, model_config, open_data};
pub use step::loss_and_correct;

/// Runs `toroid-train` with `args`.
pub fn run(args: Args) -> Result<()> {
    if let Some(dir) = &args.replot {
        return report::replot(dir);
    }
    if let Some(out) = &args.compare {
        let runs: Vec<_> = args.compare_runs.iter().map(|r| crate::compare::parse_run(r)).collect();
        crate::compare::compare(out, &args.compare_title, &runs, &args.compare_x, &args.compare_y)?;
        println!("{}", out.display());
        return Ok(());
    }
    if args.print_params {
        return setup::print_params(&args);
    }
    let mut trainer = Trainer::new(args)?;
    trainer.train()?;
    trainer.finish()
}

/// What the phases of a run share: set up once by [`Trainer::new`], then advanced by the epochs.
struct Trainer {
    args: Args,
    /// When the run started (for `wall_s` and the last log line).
    start: Instant,
    rank: usize,
    world: usize,
    train: Arc<dyn Dataset>,
    /// None with `--no-eval`, or for an image folder without `val/` or `test/`.
    test: Option<TestSet>,
    augment: Augment,
    dev: Device,
    model: ResNet,
    rep: Replicas,
    /// The optimiser's copy of each parameter, in `model.params` order.
    host: Vec<HostParam>,
    schedule: BatchSchedule,
    lr: LrSchedule,
    opt: OptConfig,
    /// Adam, when it is the local optimiser (else SGD/LARS with `opt`).
    adam: Option<AdamConfig>,
    /// Adam's step counter (advanced by BMUF-Adam's eta * rho_n after each block).
    adam_t: f64,
    /// The first moment's step counter: `adam_t`, except that BMUF-Adam's `first=reset`
    /// restarts it every block.
    adam_t1: f64,
    /// BMUF state, when training with `--bmuf`.
    bmuf: Option<Bmuf>,
    /// Data echoing: insertion point and factor (no echoing: factor 1).
    echo: EchoSpec,
    /// The echo factor of the current epoch (the same on every rank).
    echo_factor: usize,
    /// The input pipeline's busy time, across epochs.
    clock: Arc<StageClock>,
    /// Counters behind the upstream and progress reports.
    progress: Progress,
    /// The CSV and plot writer: rank 0 only.
    metrics: Option<Metrics>,
    /// Title of the plots.
    title: String,
    /// The first epoch to train (after a resume, the checkpoint's next epoch).
    start_epoch: u64,
    /// Optimiser steps taken so far, a resumed run's included.
    step: u64,
    /// Under `--elastic`: what a failed step goes back to (saved before each step).
    elastic: Option<elastic::SavePoint>,
}

/// Host copy of one parameter: the master value the optimiser updates, its momentum (Adam's
/// first moment) and Adam's second moment (empty for SGD).
#[derive(Clone)]
struct HostParam {
    data: Vec<f32>,
    momentum: Vec<f32>,
    second: Vec<f32>,
}

/// What this rank has consumed and sent, and the measurements behind R = t_up / t_down.
#[derive(Debug, Default, Clone)]
struct Progress {
    /// Examples consumed by optimiser steps (echoes included).
    examples: f64,
    /// Fresh examples among them (first uses).
    fresh: f64,
    /// Training payload bytes this rank all-reduced (gradients, or BMUF's model and moments).
    bytes: f64,
    /// Seconds spent evaluating (left out of `train_s`).
    eval_s: f64,
    /// The clock at the last `steps.csv` row.
    clock_mark: ClockReading,
    /// R from the last `steps.csv` row (NaN before the first); all ranks hold the same value.
    last_r: f64,
    /// The last measured t_up (NaN before the first). A window in which no rank did upstream
    /// work (echoing served every batch from its buffer) reports this one instead of none.
    last_t_up: f64,
    /// The last evaluation: (step, test loss, test accuracy).
    last_eval: Option<(u64, f64, f64)>,
}

impl Trainer {
    /// The epoch loop: train, report, and checkpoint each epoch until `--epochs` or
    /// `--max-steps`.
    fn train(&mut self) -> Result<()> {
        let mut epoch = self.start_epoch;
        let mut stopped = false;
        while epoch < self.args.epochs && !stopped {
            let done = self.train_epoch(epoch)?;
            stopped = done.stopped;
            stopped |= self.end_epoch(epoch, &done)?;
            epoch += 1;
            let last = epoch >= self.args.epochs || stopped;
            let every = self.args.checkpoint_every;
            if self.rank == 0 && (last || (every > 0 && epoch.is_multiple_of(every))) {
                // A run stopped by --max-steps mid-epoch resumes at the next epoch.
                self.save_checkpoint(epoch)?;
            }
        }
        Ok(())
    }

    /// The parameters' host values, for identity checks and the final hash.
    fn host_values(&self) -> Vec<&[f32]> {
        self.host.iter().map(|h| h.data.as_slice()).collect()
    }
}

/// Prints `msg` to stderr on rank 0.
fn log(rank: usize, msg: &str) {
    if rank == 0 {
        eprintln!("{msg}");
    }
}
