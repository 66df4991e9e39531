//! Command-line options of `toroid-train`.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use crate::data::slow::CostKind;
use crate::model::{Arch, Stem};

/// The local optimiser.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    /// SGD with momentum (or LARS with --lars).
    Sgd,
    /// Adam (Kingma and Ba); --lr is its step size.
    Adam,
}

/// Learning-rate decay choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DecayKind {
    /// Constant after warm-up.
    None,
    /// Multiply by --lr-gamma at each of --lr-steps.
    Step,
    /// Half cosine to zero at the last epoch.
    Cosine,
}

/// The type gradients travel in (`--wire`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WireKind {
    /// float32: uncompressed.
    F32,
    /// bfloat16: half the bytes, float32's range, 8 significant bits.
    Bf16,
    /// float16: half the bytes, 11 significant bits, magnitudes up to 65504.
    F16,
}

/// Data set formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Decide from the directory's contents.
    Auto,
    /// MNIST-style IDX files (train-*/t10k-* image and label files, gzip or not).
    Idx,
    /// Class-per-directory images under DATA/train and DATA/val (or DATA/test).
    Folder,
}

const EXAMPLES: &str = "\
Examples:
  toroid-train --model resnet50 --print-params
  toroid-run -n 2 -- target/release/toroid-train --model resnet18 --width 0.25 --stem small --epochs 4
  toroid-run -n 2 -- target/release/toroid-train --model resnet50 --input-size 32 --max-steps 300 --batch 64
  toroid-train --data /data/imagenet --format folder --input-size 224 --batch-schedule 0:256,5:512,20:1024
  toroid-train --echo example-before-aug:2 --echo-shuffle 1024 --decode-cost-us 2000 --eval-every 50
  toroid-run -n 4 -- target/release/toroid-train --optimizer adam --bmuf tau=8
  toroid-run -n 2 -- target/release/toroid-train --wire bf16 --error-feedback";

/// Synchronous data-parallel ResNet training on toroid (start ranks with toroid-run, torchrun,
/// srun or mpirun; without a launcher it runs as one process).
#[derive(Debug, Clone, Parser)]
#[command(name = "toroid-train", version, after_help = EXAMPLES)]
pub struct Args {
    /// Architecture: resnet18, resnet34, resnet50.
    #[arg(long, default_value = "resnet50")]
    pub model: Arch,
    /// Channel width multiplier (1.0 = the standard network).
    #[arg(long, default_value_t = 1.0)]
    pub width: f64,
    /// Stem: imagenet (7x7/2 conv + 3x3/2 max pool) or small (3x3/1 conv, no pool).
    #[arg(long, default_value = "imagenet")]
    pub stem: Stem,
    /// Side of the square model input; images are resized to it (default: the data's own size).
    #[arg(long)]
    pub input_size: Option<usize>,
    /// Draw a figure comparing runs (their evals.csv) to this PNG, then exit.
    #[arg(long, value_name = "PNG")]
    pub compare: Option<PathBuf>,
    /// Runs for --compare: LABEL=DIR, comma separated.
    #[arg(long, value_delimiter = ',', value_name = "LABEL=DIR")]
    pub compare_runs: Vec<String>,
    /// X axes for --compare (evals.csv columns: step, epoch, examples, fresh, bytes, wall_s,
    /// train_s; and mb, bytes in millions).
    #[arg(long, value_delimiter = ',', default_value = "examples")]
    pub compare_x: Vec<String>,
    /// Y axes for --compare (test_acc, test_loss, train_loss).
    #[arg(long, value_delimiter = ',', default_value = "test_acc")]
    pub compare_y: Vec<String>,
    /// Title of the --compare figure.
    #[arg(long, default_value = "")]
    pub compare_title: String,
    /// Redraw DIR/curves.png from DIR/steps.csv and DIR/epochs.csv, then exit.
    #[arg(long, value_name = "DIR")]
    pub replot: Option<PathBuf>,
    /// Print the parameter count (as the last line) and exit. Classes and channels default to
    /// ImageNet's 1000 and 3 unless --data is given.
    #[arg(long)]
    pub print_params: bool,
    /// Number of classes (default: from the data, 1000 for --print-params without data).
    #[arg(long)]
    pub num_classes: Option<usize>,
    /// Keep the last BN gamma of each residual block at 1 instead of 0.
    #[arg(long)]
    pub no_zero_init_residual: bool,
    /// Freeze batch norm: normalise with the running statistics (never updated), learn only
    /// gamma and beta. Makes the gradient independent of how the batch is split over ranks.
    #[arg(long)]
    pub frozen_bn: bool,

    /// Data directory (default: Fashion-MNIST from Debian's dataset-fashion-mnist).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Data format.
    #[arg(long, value_enum, default_value = "auto")]
    pub format: Format,
    /// Use only the first N training examples.
    #[arg(long)]
    pub train_limit: Option<usize>,
    /// Use only the first N test examples.
    #[arg(long)]
    pub test_limit: Option<usize>,
    /// Decode and augment threads per rank (each pool).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Shuffle buffer in examples after decoding (0: none; the epoch permutation already shuffles).
    #[arg(long, default_value_t = 0)]
    pub shuffle_buffer: usize,
    /// Batches prepared ahead of the trainer.
    #[arg(long, default_value_t = 4)]
    pub prefetch: usize,
    /// Random-crop padding in pixels (default: input size / 8; 0 disables cropping).
    #[arg(long)]
    pub crop_pad: Option<usize>,
    /// Disable random horizontal flips.
    #[arg(long)]
    pub no_flip: bool,
    /// Data echoing (Choi et al.): example-before-aug:E, example-after-aug:E, batch:E (E a
    /// whole number or auto), or auto (before augmentation, E = floor(R) from the previous
    /// epoch's measured R = t_up / t_down, at most 8).
    #[arg(long, value_name = "POINT:E|auto")]
    pub echo: Option<String>,
    /// Shuffle buffer after the echo stage: examples for example echoing, batches for batch
    /// echoing (default: 4 micro-batches of examples; no buffer for batch echoing).
    #[arg(long, value_name = "N")]
    pub echo_shuffle: Option<usize>,
    /// Add this many microseconds to every example read (to make the input pipeline the
    /// bottleneck on purpose, for echoing experiments).
    #[arg(long, default_value_t = 0, value_name = "US")]
    pub decode_cost_us: u64,
    /// How --decode-cost-us is spent: spin (CPU work) or sleep (waiting, like slow storage).
    #[arg(long, value_enum, default_value = "spin")]
    pub decode_cost: CostKind,

    /// Epochs to train.
    #[arg(long, default_value_t = 10)]
    pub epochs: u64,
    /// Stop after this many optimiser steps in total.
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Global batch size (all ranks together).
    #[arg(long, default_value_t = 256, conflicts_with = "batch_schedule")]
    pub batch: usize,
    /// Global batch size by epoch, e.g. 0:256,5:512,20:1024 (the LR follows the batch).
    #[arg(long)]
    pub batch_schedule: Option<String>,
    /// Largest per-rank forward/backward pass; bigger per-rank batches accumulate gradients.
    #[arg(long, default_value_t = 256)]
    pub max_micro_batch: usize,

    /// Learning rate for a global batch of --lr-ref-batch (scaled linearly with the batch).
    #[arg(long, default_value_t = 0.1)]
    pub lr: f64,
    /// The batch --lr is quoted for.
    #[arg(long, default_value_t = 256)]
    pub lr_ref_batch: usize,
    /// Gradual warm-up length in epochs (fractions allowed).
    #[arg(long, default_value_t = 0.0)]
    pub warmup_epochs: f64,
    /// Where the warm-up starts, as a fraction of the peak rate (0: from zero). Without it, the
    /// warm-up starts at --lr (Goyal et al.), so a run at --lr-ref-batch has no ramp.
    #[arg(long, value_name = "FRACTION", value_parser = fraction)]
    pub warmup_from: Option<f64>,
    /// Decay after warm-up.
    #[arg(long, value_enum, default_value = "cosine")]
    pub decay: DecayKind,
    /// Epochs at which step decay multiplies the rate by --lr-gamma.
    #[arg(long, value_delimiter = ',', default_value = "30,60,80")]
    pub lr_steps: Vec<f64>,
    /// Step decay factor.
    #[arg(long, default_value_t = 0.1)]
    pub lr_gamma: f64,
    /// Local optimiser.
    #[arg(long, value_enum, default_value = "sgd")]
    pub optimizer: OptimizerKind,
    /// Adam's beta1.
    #[arg(long, default_value_t = 0.9)]
    pub adam_beta1: f64,
    /// Adam's beta2.
    #[arg(long, default_value_t = 0.999)]
    pub adam_beta2: f64,
    /// Adam's epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub adam_eps: f64,
    /// BMUF (Chen and Huo): tau=T[,eta=auto|x][,zeta=x][,nesterov=bool][,form=paper|kept]
    /// [,local=reset|keep][,moments=corrected|naive][,first=reset|moments]. Each rank runs T
    /// local steps on its own data, then the models are averaged with one all-reduce and
    /// filtered with block momentum eta (auto: 1 - 1/N) and block learning rate zeta; Nesterov
    /// block momentum in the paper's form, local SGD momentum reset at every block, unless told
    /// otherwise. With --optimizer
    /// adam: BMUF-Adam (Chen, Ding and Huo), moments corrected or naively averaged, the first
    /// moment reset at every block unless first=moments. The LR follows the per-rank batch, as
    /// for one worker.
    #[arg(long, value_name = "SPEC")]
    pub bmuf: Option<String>,
    /// Momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Nesterov momentum.
    #[arg(long)]
    pub nesterov: bool,
    /// Weight decay on conv and linear weights (never on BN parameters or biases).
    #[arg(long, default_value_t = 5e-5)]
    pub weight_decay: f64,
    /// Use LARS layer-wise rate scaling.
    #[arg(long)]
    pub lars: bool,
    /// LARS trust coefficient.
    #[arg(long, default_value_t = 0.001)]
    pub lars_trust: f64,
    /// Label smoothing epsilon.
    #[arg(long, default_value_t = 0.0)]
    pub label_smoothing: f64,

    /// Gradient bucket size in MB.
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// Issue all-reduces only after the whole backward pass (to measure what overlap buys).
    #[arg(long)]
    pub no_overlap: bool,
    /// Type the gradient all-reduces travel in: bf16 or f16 halve the bytes (toroid's compressed
    /// all-reduce: reductions in float32, the same result on every rank).
    #[arg(long, value_enum, default_value_t = WireKind::F32)]
    pub wire: WireKind,
    /// With --wire bf16|f16: keep each bucket's rounding residual and add it to the next step's
    /// gradients (error feedback), so that no gradient is lost to rounding over time.
    #[arg(long)]
    pub error_feedback: bool,
    /// Check that all ranks hold identical parameters every N steps (0: only at epoch ends).
    #[arg(long, default_value_t = 100)]
    pub check_every: u64,
    /// Keep training when a rank dies: the survivors shrink the communicator, go back to the
    /// parameters before the step that failed, re-shard the data and go on (synchronous SGD or
    /// Adam; not with --bmuf or --echo).
    #[arg(long)]
    pub elastic: bool,
    /// Random seed (weights, permutations, augmentation).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Compute threads per rank (default: the CPUs this rank may run on).
    #[arg(long)]
    pub threads: Option<usize>,

    /// Write a Chrome/Perfetto trace: toroid's collectives plus this trainer's data, forward,
    /// backward and optimiser spans, to PATH.rank<R>.json (sets TOROID_TIMELINE=PATH; the spans
    /// are written whenever TOROID_TIMELINE is set). To have toroid-run merge the ranks' files
    /// into PATH, give it the variable instead: TOROID_TIMELINE=PATH toroid-run -n N -- toroid-train ...
    #[arg(long, value_name = "PATH")]
    pub timeline: Option<PathBuf>,

    /// Output directory: metrics CSVs, curves.png, checkpoint.
    #[arg(long, default_value = "toroid-train-out")]
    pub out: PathBuf,
    /// Write a checkpoint every N epochs (0: only at the end).
    #[arg(long, default_value_t = 1)]
    pub checkpoint_every: u64,
    /// Resume from a checkpoint (its .json file or directory).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Log a metrics row every N steps.
    #[arg(long, default_value_t = 20)]
    pub log_every: u64,
    /// Skip evaluation on the test split.
    #[arg(long)]
    pub no_eval: bool,
    /// Also evaluate every N optimiser steps (rows in evals.csv; 0: at epoch ends only).
    #[arg(long, default_value_t = 0)]
    pub eval_every: u64,
    /// Stop once the test top-1 accuracy reaches this fraction (e.g. 0.85).
    #[arg(long)]
    pub target_acc: Option<f64>,
    /// Do not draw curves.png.
    #[arg(long)]
    pub no_plot: bool,
}

/// A number in [0, 1] (clap value parser).
fn fraction(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
        _ => Err(format!("'{s}' is not a number in [0, 1]")),
    }
}
