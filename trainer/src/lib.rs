//! toroid-train: a reference synchronous data-parallel ResNet trainer on toroid.
//!
//! ```text
//!  main.rs / cli.rs     flags
//!  train/               the loop by phase: set-up, epoch, step (segmented backward, bucketed
//!                       async all-reduce, optimiser), evaluation, reports, statistics
//!  parallel.rs          the DDP contract: broadcast, buckets, averaging, identity checks
//!  model.rs, pool.rs    ResNet-18/34/50 on candle; overlapping max pool with a correct backward
//!  conv.rs              convolution as one GEMM over im2col columns, activations CNHW
//!  optim.rs             SGD / Nesterov / LARS, LR warm-up and decay, batch-size schedule
//!  adam.rs              Adam (the local optimiser of BMUF-Adam)
//!  bmuf.rs              BMUF and BMUF-Adam block synchronisation
//!  data/                IDX and ImageFolder readers, sharding, threaded pipeline, data echoing,
//!                       a slow-decode knob
//!  metrics.rs           CSV and PNG curves
//!  compare.rs           --compare: one PNG comparing several runs' evals.csv
//!  checkpoint.rs        rank-0 checkpoints and resume
//!  wire.rs              --wire bf16|f16 gradients and error feedback
//! ```

pub mod adam;
pub mod bmuf;
pub mod checkpoint;
pub mod cli;
pub mod compare;
pub mod conv;
pub mod data;
pub mod error;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod pool;
pub mod rng;
#[cfg(test)]
mod test_ranks;
pub mod train;
pub mod wire;

pub use error::{Error, Result};
