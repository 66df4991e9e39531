//! Set-up: connecting, data, augmentation, model, replicas, optimiser and checkpoint resume.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Var};

use super::{HostParam, Progress, Trainer, log};
use crate::adam::AdamConfig;
use crate::bail;
use crate::bmuf::{Bmuf, BmufSpec};
use crate::checkpoint;
use crate::cli::{Args, DecayKind, Format, OptimizerKind};
use crate::data::Dataset;
use crate::data::echo::{EchoFactor, EchoSpec};
use crate::data::folder::FolderDataset;
use crate::data::idx::{FASHION_MNIST_DIR, IdxDataset, Split};
use crate::data::pipeline::Augment;
use crate::data::slow::SlowDataset;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::model::{BnMode, ModelConfig, ResNet};
use crate::optim::{BatchSchedule, Decay, LrSchedule, OptConfig, Rule};
use crate::parallel::Replicas;
use crate::wire::GradWire;

/// The model description for `args` given the data's channels and classes.
pub fn model_config(args: &Args, in_channels: usize, num_classes: usize) -> ModelConfig {
    ModelConfig {
        arch: args.model,
        width: args.width,
        in_channels,
        num_classes: args.num_classes.unwrap_or(num_classes),
        stem: args.stem,
        bn: if args.frozen_bn { BnMode::Frozen } else { BnMode::Batch },
        zero_init_residual: !args.no_zero_init_residual,
    }
}

/// A shared data set (the test split is optional for image folders).
pub type TestSet = Arc<dyn Dataset>;

/// Opens the training and test sets named by `args`.
pub fn open_data(args: &Args) -> Result<(Arc<dyn Dataset>, Option<TestSet>)> {
    let dir = args.data.clone().unwrap_or_else(|| PathBuf::from(FASHION_MNIST_DIR));
    let format = match args.format {
        Format::Auto if dir.join("train").is_dir() => Format::Folder,
        Format::Auto => Format::Idx,
        f => f,
    };
    match format {
        Format::Folder => {
            let train = FolderDataset::open(&dir.join("train"), 3)?;
            let test_dir = ["val", "test"].iter().map(|d| dir.join(d)).find(|d| d.is_dir());
            let test = match test_dir {
                Some(d) => {
                    let t = FolderDataset::open(&d, 3)?;
                    if t.class_names() != train.class_names() {
                        bail!(
                            "{} and {} have different class directories",
                            dir.join("train").display(),
                            d.display()
                        );
                    }
                    Some(Arc::new(t) as Arc<dyn Dataset>)
                }
                None => None,
            };
            if args.train_limit.is_some() || args.test_limit.is_some() {
                bail!("--train-limit/--test-limit apply to IDX data only");
            }
            Ok((Arc::new(train), test))
        }
        _ => {
            let mut train = IdxDataset::open(&dir, Split::Train)?;
            let mut test = IdxDataset::open(&dir, Split::Test)?;
            if let Some(n) = args.train_limit {
                train.truncate(n);
            }
            if let Some(n) = args.test_limit {
                test.truncate(n);
            }
            Ok((Arc::new(train), Some(Arc::new(test))))
        }
    }
}

/// `--print-params`: prints the model description and its parameter count.
pub(super) fn print_params(args: &Args) -> Result<()> {
    let (c, k) = if args.data.is_some() {
        let (train, _) = open_data(args)?;
        (train.channels(), train.num_classes())
    } else {
        (3, 1000)
    };
    let model = ResNet::new(model_config(args, c, k), args.seed, &Device::Cpu)?;
    println!("{:?}", model.config);
    println!("{}", model.num_params());
    Ok(())
}

fn connect() -> Result<Option<toroid::Communicator>> {
    match toroid::Communicator::from_env() {
        Ok(c) => Ok(Some(c)),
        Err(toroid::Error::InvalidUsage(m)) if m.starts_with("no launcher found") => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Input size, crop, flip and normalisation for `train` (which must not be empty).
fn augment(args: &Args, train: &dyn Dataset) -> Result<Augment> {
    let first = train.get(0)?;
    let size = args.input_size.unwrap_or(first.image.height.max(first.image.width));
    let (mean, std) = if train.channels() == 1 {
        // Fashion-MNIST's training-set statistics.
        (vec![0.2860], vec![0.3530])
    } else {
        (vec![0.485, 0.456, 0.406], vec![0.229, 0.224, 0.225])
    };
    Ok(Augment { size, crop_pad: args.crop_pad.unwrap_or(size / 8), flip: !args.no_flip, mean, std })
}

/// The model's weights and BN buffers: what rank 0 broadcasts.
fn all_vars(model: &ResNet) -> Vec<&Var> {
    let mut vars: Vec<&Var> = model.params.iter().map(|p| &p.var).collect();
    vars.extend(Replicas::buffer_vars(&model.buffers));
    vars
}

impl Trainer {
    /// Connects, opens the data, builds the model and its replicas (with rank 0's weights
    /// everywhere), resumes from `--resume`, and sets up the schedules and the metrics.
    pub(super) fn new(args: Args) -> Result<Trainer> {
        let start = Instant::now();
        let comm = connect()?;
        let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
        let (train, test) = open_data(&args)?;
        let train: Arc<dyn Dataset> = match args.decode_cost_us {
            0 => train,
            us => Arc::new(SlowDataset::new(train, std::time::Duration::from_micros(us), args.decode_cost)),
        };
        let test = if args.no_eval { None } else { test };
        let echo = match &args.echo {
            Some(s) => EchoSpec::parse(s)?,
            None => EchoSpec::OFF,
        };
        let bmuf_spec = args.bmuf.as_deref().map(BmufSpec::parse).transpose()?;
        if args.resume.is_some() && (bmuf_spec.is_some() || args.optimizer == OptimizerKind::Adam) {
            bail!(
                "--resume is supported for SGD without --bmuf only (checkpoints hold no Adam or BMUF state)"
            );
        }
        if args.elastic && (bmuf_spec.is_some() || echo != EchoSpec::OFF) {
            bail!("--elastic is supported for synchronous SGD and Adam only (not with --bmuf or --echo)");
        }
        if args.lars && args.optimizer == OptimizerKind::Adam {
            bail!("--lars and --optimizer adam exclude each other");
        }
        log(rank, &format!("toroid-train: {world} rank(s); train {}", train.describe()));
        if let Some(t) = &test {
            log(rank, &format!("toroid-train: test {}", t.describe()));
        }
        if train.is_empty() {
            bail!("the training set is empty");
        }
        let augment = augment(&args, train.as_ref())?;
        let (channels, size) = (train.channels(), augment.size);
        let dev = Device::Cpu;
        let model = ResNet::new(model_config(&args, channels, train.num_classes()), args.seed, &dev)?;
        let what = format!("{:?}, {} parameters", model.config, model.num_params());
        log(rank, &format!("toroid-train: {what}, input {channels}x{size}x{size}"));
        let bucket_bytes = (args.bucket_mb * 1024.0 * 1024.0) as usize;
        let mut rep = Replicas::new(comm, &model.params, bucket_bytes.max(4), !args.no_overlap);
        rep.wire = GradWire::new(args.wire, args.error_feedback)?;
        if bmuf_spec.is_some() && rep.wire.dtype.is_some() {
            bail!("--wire compresses gradient all-reduces; BMUF averages models (not with --bmuf)");
        }
        if bmuf_spec.is_none() {
            let wire = match rep.wire.dtype {
                Some(d) if rep.wire.error_feedback => format!(", on the wire as {d} with error feedback"),
                Some(d) => format!(", on the wire as {d}"),
                None => String::new(),
            };
            log(
                rank,
                &format!(
                    "toroid-train: {} gradient buckets, overlap {}{wire}",
                    rep.buckets.len(),
                    rep.overlap
                ),
            );
        }
        // Same starting point everywhere: rank 0's weights and BN buffers.
        rep.broadcast_vars(&all_vars(&model))?;
        let mut host = host_params(&model)?;
        let (start_epoch, step) = match &args.resume {
            Some(path) => resume(path, &model, &rep, &mut host)?,
            None => (0, 0),
        };
        let (schedule, lr, opt) = optimiser(&args)?;
        let adam = (args.optimizer == OptimizerKind::Adam).then_some(AdamConfig {
            beta1: args.adam_beta1,
            beta2: args.adam_beta2,
            eps: args.adam_eps,
            weight_decay: args.weight_decay,
        });
        if adam.is_some() {
            for h in &mut host {
                h.second = vec![0.0; h.data.len()];
            }
        }
        let bmuf = bmuf_spec.map(|spec| {
            let cfg = spec.resolve(world);
            rep.sync_grads = false;
            log(
                rank,
                &format!(
                    "toroid-train: BMUF {cfg:?} (no gradient all-reduce; one model all-reduce per block)"
                ),
            );
            Bmuf::new(cfg, host.iter().flat_map(|h| h.data.iter().copied()).collect())
        });
        if echo != EchoSpec::OFF {
            log(rank, &format!("toroid-train: data echoing {echo:?}"));
        }
        let echo_factor = match echo.factor {
            EchoFactor::Fixed(e) => e,
            EchoFactor::Auto => 1,
        };
        let metrics = if rank == 0 { Some(Metrics::create(&args.out, args.resume.is_some())?) } else { None };
        let data = train.describe().split(':').next().unwrap_or("data").to_string();
        let title = format!("{:?} x{} on {} rank(s), {}", args.model, args.width, world, data);
        Ok(Trainer {
            args,
            start,
            rank,
            world,
            train,
            test,
            augment,
            dev,
            model,
            rep,
            host,
            schedule,
            lr,
            opt,
            adam,
            adam_t: 0.0,
            adam_t1: 0.0,
            bmuf,
            echo,
            echo_factor,
            clock: Arc::default(),
            progress: Progress { last_r: f64::NAN, last_t_up: f64::NAN, ..Progress::default() },
            metrics,
            title,
            start_epoch,
            step,
            elastic: None,
        })
    }
}

/// The optimiser's host copies of `model`'s parameters, with zero momentum.
fn host_params(model: &ResNet) -> Result<Vec<HostParam>> {
    model
        .params
        .iter()
        .map(|p| {
            Ok(HostParam {
                data: p.var.as_tensor().flatten_all()?.to_vec1()?,
                momentum: vec![0.0; p.var.elem_count()],
                second: vec![],
            })
        })
        .collect()
}

/// Loads the checkpoint at `path` on rank 0 and broadcasts its weights, BN buffers, momentum and
/// progress to every rank; returns (next epoch, step).
fn resume(path: &Path, model: &ResNet, rep: &Replicas, host: &mut [HostParam]) -> Result<(u64, u64)> {
    let rank = rep.rank();
    let mut progress = [0f32; 2];
    if rank == 0 {
        let (meta, tensors) = checkpoint::load(path)?;
        let mut momentum: Vec<Vec<f32>> = host.iter().map(|h| h.momentum.clone()).collect();
        checkpoint::restore(model, &mut momentum, &meta, &tensors)?;
        for (h, m) in host.iter_mut().zip(momentum) {
            h.momentum = m;
        }
        // Epoch and step numbers travel as f32: exact below 2^24.
        progress = [meta.next_epoch as f32, meta.step as f32];
    }
    rep.broadcast_vars(&all_vars(model))?;
    let mut flat: Vec<f32> = host.iter().flat_map(|h| h.momentum.iter().copied()).collect();
    rep.broadcast_host(&mut flat)?;
    rep.broadcast_host(&mut progress)?;
    let mut off = 0;
    for (h, p) in host.iter_mut().zip(&model.params) {
        let n = h.momentum.len();
        h.momentum.copy_from_slice(&flat[off..off + n]);
        h.data = p.var.as_tensor().flatten_all()?.to_vec1()?;
        off += n;
    }
    let (start_epoch, step) = (progress[0] as u64, progress[1] as u64);
    log(rank, &format!("toroid-train: resumed from {} at epoch {start_epoch}, step {step}", path.display()));
    Ok((start_epoch, step))
}

/// The batch-size schedule, the learning-rate schedule and the update rule of `args`.
fn optimiser(args: &Args) -> Result<(BatchSchedule, LrSchedule, OptConfig)> {
    let schedule = match &args.batch_schedule {
        Some(s) => BatchSchedule::parse(s)?,
        None => BatchSchedule::constant(args.batch),
    };
    let lr = LrSchedule {
        base_lr: args.lr,
        ref_batch: args.lr_ref_batch.max(1),
        warmup_epochs: args.warmup_epochs,
        warmup_from: args.warmup_from,
        decay: match args.decay {
            DecayKind::None => Decay::None,
            DecayKind::Step => Decay::Step { milestones: args.lr_steps.clone(), gamma: args.lr_gamma },
            DecayKind::Cosine => Decay::Cosine,
        },
        total_epochs: args.epochs as f64,
    };
    let opt = OptConfig {
        rule: if args.lars { Rule::Lars { trust: args.lars_trust } } else { Rule::Sgd },
        momentum: args.momentum,
        nesterov: args.nesterov,
        weight_decay: args.weight_decay,
    };
    Ok((schedule, lr, opt))
}
