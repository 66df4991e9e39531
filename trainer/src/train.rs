//! The training loop: data, model, replicas, optimiser, metrics, checkpoints.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{D, Device, Tensor, Var};
use indicatif::{ProgressBar, ProgressStyle};

use crate::bail;
use crate::checkpoint::{self, Meta};
use crate::cli::{Args, DecayKind, Format};
use crate::data::folder::FolderDataset;
use crate::data::idx::{FASHION_MNIST_DIR, IdxDataset, Split};
use crate::data::pipeline::{self, Augment, Batch, PipelineConfig, Seams};
use crate::data::{Dataset, shard};
use crate::error::{Error, Result};
use crate::metrics::{EpochRow, Metrics, StepRow};
use crate::model::{BnMode, ModelConfig, ResNet, SEGMENTS};
use crate::optim::{BatchSchedule, Decay, LrSchedule, OptConfig, Rule, plan_batch};
use crate::parallel::Replicas;

pub mod stats;

use stats::{EpochStats, ExampleSums, Window};

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

/// Mean cross-entropy with label smoothing `eps` and the number of correct top-1 predictions.
pub fn loss_and_correct(logits: &Tensor, labels: &[u32], eps: f64) -> Result<(Tensor, usize)> {
    let (n, k) = logits.dims2()?;
    let mut target = vec![(eps / k as f64) as f32; n * k];
    for (i, &y) in labels.iter().enumerate() {
        if y as usize >= k {
            bail!("label {y} out of range for a model with {k} classes");
        }
        target[i * k + y as usize] += (1.0 - eps) as f32;
    }
    let target = Tensor::from_vec(target, (n, k), logits.device())?;
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let loss = (target * logp)?.sum(1)?.mean(0)?.neg()?;
    let pred: Vec<u32> = logits.argmax(D::Minus1)?.to_vec1()?;
    let correct = pred.iter().zip(labels).filter(|(a, b)| a == b).count();
    Ok((loss, correct))
}

fn to_tensor(b: &Batch, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(&b.images, (b.len(), b.channels, b.size, b.size), dev)?)
}

/// Host copy of one parameter: the master value the optimiser updates, and its momentum.
struct HostParam {
    data: Vec<f32>,
    momentum: Vec<f32>,
}

fn connect() -> Result<Option<toroid::Communicator>> {
    match toroid::Communicator::from_env() {
        Ok(c) => Ok(Some(c)),
        Err(toroid::Error::InvalidUsage(m)) if m.starts_with("no launcher found") => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn log(rank: usize, msg: &str) {
    if rank == 0 {
        eprintln!("{msg}");
    }
}

/// Evaluates top-1 accuracy and mean loss of `model` on this rank's shard of `data`, summed
/// over ranks.
fn evaluate(
    model: &ResNet,
    data: &Arc<dyn Dataset>,
    rep: &Replicas,
    args: &Args,
    augment: &Augment,
    batch: usize,
) -> Result<(f64, f64)> {
    let idx = shard(data.len(), 0, 0, rep.rank(), rep.size(), false, false);
    let cfg = PipelineConfig {
        batch_size: batch,
        workers: args.workers,
        shuffle_buffer: 0,
        train: false,
        keep_partial: true,
        prefetch: args.prefetch,
        seed: args.seed,
        epoch: 0,
        rank: rep.rank(),
        augment: augment.clone(),
        seams: Seams::default(),
    };
    let mut sums = ExampleSums::default();
    for b in pipeline::start(data.clone(), idx, cfg) {
        let b = b?;
        let logits = model.forward(&to_tensor(&b, &Device::Cpu)?, false)?;
        let (loss, correct) = loss_and_correct(&logits, &b.labels, 0.0)?;
        sums.add_batch(loss.to_scalar::<f32>()? as f64, correct, b.len());
    }
    let sums = sums.sum_over_ranks(rep)?;
    if sums.count == 0.0 {
        return Ok((f64::NAN, f64::NAN));
    }
    Ok((sums.mean_loss(), sums.accuracy()))
}

/// Runs `toroid-train` with `args`.
pub fn run(args: Args) -> Result<()> {
    if let Some(dir) = &args.replot {
        let (steps, epochs) = crate::metrics::read_history(dir)?;
        if steps.is_empty() && epochs.is_empty() {
            bail!("{}: no steps.csv or epochs.csv rows to plot", dir.display());
        }
        let path = dir.join("curves.png");
        let title =
            dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
        crate::metrics::plot(&path, &title, &steps, &epochs)?;
        println!("{}", path.display());
        return Ok(());
    }
    if args.print_params {
        let (c, k) = if args.data.is_some() {
            let (train, _) = open_data(&args)?;
            (train.channels(), train.num_classes())
        } else {
            (3, 1000)
        };
        let model = ResNet::new(model_config(&args, c, k), args.seed, &Device::Cpu)?;
        println!("{:?}", model.config);
        println!("{}", model.num_params());
        return Ok(());
    }
    let start = Instant::now();
    let comm = connect()?;
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
    let (train, test) = open_data(&args)?;
    let test = if args.no_eval { None } else { test };
    log(rank, &format!("toroid-train: {world} rank(s); train {}", train.describe()));
    if let Some(t) = &test {
        log(rank, &format!("toroid-train: test {}", t.describe()));
    }
    if train.is_empty() {
        bail!("the training set is empty");
    }
    let first = train.get(0)?;
    let size = args.input_size.unwrap_or(first.image.height.max(first.image.width));
    let channels = train.channels();
    let (mean, std) = if channels == 1 {
        // Fashion-MNIST's training-set statistics.
        (vec![0.2860], vec![0.3530])
    } else {
        (vec![0.485, 0.456, 0.406], vec![0.229, 0.224, 0.225])
    };
    let augment =
        Augment { size, crop_pad: args.crop_pad.unwrap_or(size / 8), flip: !args.no_flip, mean, std };

    let dev = Device::Cpu;
    let model = ResNet::new(model_config(&args, channels, train.num_classes()), args.seed, &dev)?;
    log(
        rank,
        &format!(
            "toroid-train: {:?}, {} parameters, input {channels}x{size}x{size}",
            model.config,
            model.num_params()
        ),
    );
    let bucket_bytes = (args.bucket_mb * 1024.0 * 1024.0) as usize;
    let mut rep = Replicas::new(comm, &model.params, bucket_bytes.max(4), !args.no_overlap);
    log(rank, &format!("toroid-train: {} gradient buckets, overlap {}", rep.buckets.len(), rep.overlap));

    // Same starting point everywhere: rank 0's weights and BN buffers.
    let mut all_vars: Vec<&Var> = model.params.iter().map(|p| &p.var).collect();
    all_vars.extend(Replicas::buffer_vars(&model.buffers));
    rep.broadcast_vars(&all_vars)?;

    let mut host: Vec<HostParam> = model
        .params
        .iter()
        .map(|p| {
            Ok(HostParam {
                data: p.var.as_tensor().flatten_all()?.to_vec1()?,
                momentum: vec![0.0; p.var.elem_count()],
            })
        })
        .collect::<Result<_>>()?;

    let mut start_epoch = 0;
    let mut step: u64 = 0;
    if let Some(path) = &args.resume {
        let mut progress = [0f32; 2];
        if rank == 0 {
            let (meta, tensors) = checkpoint::load(path)?;
            let mut momentum: Vec<Vec<f32>> = host.iter().map(|h| h.momentum.clone()).collect();
            checkpoint::restore(&model, &mut momentum, &meta, &tensors)?;
            for (h, m) in host.iter_mut().zip(momentum) {
                h.momentum = m;
            }
            // Epoch and step numbers travel as f32: exact below 2^24.
            progress = [meta.next_epoch as f32, meta.step as f32];
        }
        rep.broadcast_vars(&all_vars)?;
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
        (start_epoch, step) = (progress[0] as u64, progress[1] as u64);
        log(
            rank,
            &format!("toroid-train: resumed from {} at epoch {start_epoch}, step {step}", path.display()),
        );
    }

    let schedule = match &args.batch_schedule {
        Some(s) => BatchSchedule::parse(s)?,
        None => BatchSchedule::constant(args.batch),
    };
    let lr = LrSchedule {
        base_lr: args.lr,
        ref_batch: args.lr_ref_batch.max(1),
        warmup_epochs: args.warmup_epochs,
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
    let mut metrics = if rank == 0 { Some(Metrics::create(&args.out, args.resume.is_some())?) } else { None };
    let title = format!(
        "{:?} x{} on {} rank(s), {}",
        args.model,
        args.width,
        world,
        train.describe().split(':').next().unwrap_or("data")
    );

    let mut done = false;
    let mut epoch = start_epoch;
    while epoch < args.epochs && !done {
        let global = schedule.at(epoch);
        let plan = plan_batch(global, world, args.max_micro_batch)?;
        let indices = shard(train.len(), epoch, args.seed, rank, world, true, true);
        let steps = indices.len() / (plan.micro * plan.accum);
        if steps == 0 {
            bail!(
                "epoch {epoch}: {} examples per rank cannot fill one step of {} x {}",
                indices.len(),
                plan.accum,
                plan.micro
            );
        }
        let cfg = PipelineConfig {
            batch_size: plan.micro,
            workers: args.workers,
            shuffle_buffer: args.shuffle_buffer,
            train: true,
            keep_partial: false,
            prefetch: args.prefetch,
            seed: args.seed,
            epoch,
            rank,
            augment: augment.clone(),
            seams: Seams::default(),
        };
        let mut batches = pipeline::start(train.clone(), indices, cfg);
        let bar = if rank == 0 { ProgressBar::new(steps as u64) } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({eta})")
                .map_err(|e| Error::msg(e.to_string()))?
                .progress_chars("=> "),
        );
        bar.set_prefix(format!("{}/{}", epoch + 1, args.epochs));
        let epoch_start = Instant::now();
        let mut tot = EpochStats::default();
        let mut win = Window::default();
        let mut win_start = Instant::now();
        let mut rate = lr.at(epoch as f64, global);
        for s in 0..steps {
            let t_step = Instant::now();
            rate = lr.at(epoch as f64 + s as f64 / steps as f64, global);
            rep.begin_step();
            let mut step_loss = 0f64;
            for a in 0..plan.accum {
                let last = a + 1 == plan.accum;
                let b = match batches.next() {
                    Some(b) => b?,
                    None => bail!("input pipeline ended after {s} of {steps} steps in epoch {epoch}"),
                };
                // Forward segment by segment; each segment's input is a fresh leaf so that its
                // backward pass stops there and hands the input gradient to the segment before.
                let mut inputs: Vec<Var> = vec![];
                let mut outputs: Vec<Tensor> = vec![];
                let mut h = to_tensor(&b, &dev)?;
                for seg in 0..SEGMENTS {
                    if seg > 0 {
                        let v = Var::from_tensor(&h.detach())?;
                        h = v.as_tensor().clone();
                        inputs.push(v);
                    }
                    h = model.forward_segment(seg, &h, true)?;
                    outputs.push(h.clone());
                }
                let (loss, correct) = loss_and_correct(&h, &b.labels, args.label_smoothing)?;
                let lv = loss.to_scalar::<f32>()? as f64;
                if !lv.is_finite() {
                    bail!("loss is {lv} at step {step} (epoch {epoch}): lower --lr or add --warmup-epochs");
                }
                step_loss += lv / plan.accum as f64;
                tot.train.add_batch(lv, correct, b.len());
                let mut upstream: Option<Tensor> = None;
                for seg in (0..SEGMENTS).rev() {
                    let grads = match &upstream {
                        None => loss.backward()?,
                        Some(g) => (&outputs[seg] * g)?.sum_all()?.backward()?,
                    };
                    for (pi, p) in model.params.iter().enumerate().filter(|(_, p)| p.segment == seg) {
                        rep.add_grad(pi, grads.get(p.var.as_tensor()), 1.0 / plan.accum as f32)?;
                    }
                    if seg > 0 {
                        let g = grads.get(inputs[seg - 1].as_tensor()).ok_or_else(|| {
                            Error::msg(format!("no gradient reached the input of segment {seg}"))
                        })?;
                        upstream = Some(g.clone());
                    }
                    if last {
                        rep.segment_done(seg)?;
                    }
                }
            }
            let comm = rep.finish(|params, offsets, grads| {
                for (&pi, &off) in params.iter().zip(offsets) {
                    let p = &model.params[pi];
                    let h = &mut host[pi];
                    let n = h.data.len();
                    opt.update(rate, &mut h.data, &grads[off..off + n], &mut h.momentum, p.decay);
                    p.var.set(&Tensor::from_slice(&h.data, p.var.shape(), &dev)?)?;
                }
                Ok(())
            })?;
            step += 1;
            let dt = t_step.elapsed().as_secs_f64();
            let wait = comm.wait.as_secs_f64();
            tot.add_step_time(dt, wait);
            win.add_step(step_loss, plan.micro * plan.accum * world, dt, wait);
            bar.set_message(format!(
                "loss {step_loss:.4} | {:.0} img/s | lr {rate:.4}",
                (plan.micro * plan.accum * world) as f64 / dt
            ));
            bar.inc(1);
            if args.check_every > 0 && step.is_multiple_of(args.check_every) {
                rep.check_identical(
                    &host.iter().map(|h| h.data.as_slice()).collect::<Vec<_>>(),
                    &format!("parameters after step {step}"),
                )?;
            }
            let at_max = args.max_steps.is_some_and(|m| step >= m);
            if step.is_multiple_of(args.log_every.max(1)) || at_max || s + 1 == steps {
                let w = win.sum_over_ranks(&rep)?;
                let elapsed = win_start.elapsed().as_secs_f64();
                if let Some(m) = metrics.as_mut() {
                    m.step(StepRow {
                        step,
                        epoch: epoch as f64 + (s + 1) as f64 / steps as f64,
                        batch: global,
                        lr: rate,
                        loss: w.mean_loss(),
                        images_per_s: w.images_per_s(elapsed),
                        step_s: w.mean_step_s(),
                        comm_s: w.mean_wait_s(),
                    })?;
                }
                win = Window::default();
                win_start = Instant::now();
            }
            if at_max {
                done = true;
                break;
            }
        }
        bar.finish_and_clear();
        drop(batches);
        let epoch_s = epoch_start.elapsed().as_secs_f64();
        // BN running statistics differ per rank (each saw its own examples): average them so
        // evaluation and checkpoints see one model, identical on every rank.
        rep.average_vars(&Replicas::buffer_vars(&model.buffers))?;
        rep.check_identical(
            &host.iter().map(|h| h.data.as_slice()).collect::<Vec<_>>(),
            &format!("parameters at the end of epoch {epoch}"),
        )?;
        let (test_loss, test_acc) = match &test {
            Some(t) => evaluate(&model, t, &rep, &args, &augment, plan.micro.max(64))?,
            None => (f64::NAN, f64::NAN),
        };
        let tot = tot.sum_over_ranks(&rep)?;
        let steps_done = tot.train.count / (plan.micro * plan.accum * world) as f64;
        let row = EpochRow {
            epoch,
            step,
            batch: global,
            lr: rate,
            train_loss: tot.train.mean_loss(),
            train_acc: tot.train.accuracy(),
            test_loss,
            test_acc,
            images_per_s: tot.train.count / epoch_s,
            comm_fraction: tot.comm_fraction(),
            epoch_s,
            wall_s: start.elapsed().as_secs_f64(),
            epochs_done: epoch as f64 + steps_done / steps as f64,
        };
        log(
            rank,
            &format!(
                "epoch {}/{} steps {:.0} batch {} lr {:.4} | loss {:.4} train {:.2}% | test loss {:.4} top-1 {:.2}% | {:.0} img/s, all-reduce wait {:.1}% of step | {:.1}s (total {:.1}s)",
                epoch + 1,
                args.epochs,
                steps_done,
                global,
                rate,
                row.train_loss,
                100.0 * row.train_acc,
                test_loss,
                100.0 * test_acc,
                row.images_per_s,
                100.0 * row.comm_fraction,
                epoch_s,
                row.wall_s
            ),
        );
        if let Some(m) = metrics.as_mut() {
            m.epoch(row)?;
            if !args.no_plot
                && let Err(e) = m.plot(&title)
            {
                eprintln!("toroid-train: warning: {e}");
            }
        }
        epoch += 1;
        let last = epoch >= args.epochs || done;
        if rank == 0 && (last || (args.checkpoint_every > 0 && epoch.is_multiple_of(args.checkpoint_every))) {
            let momentum: Vec<Vec<f32>> = host.iter().map(|h| h.momentum.clone()).collect();
            // A run stopped by --max-steps mid-epoch resumes at the next epoch.
            let meta = Meta {
                next_epoch: epoch,
                step,
                model: format!("{:?}", model.config),
                num_params: model.num_params(),
            };
            let path = checkpoint::save(&args.out, &model, &momentum, &meta)?;
            log(rank, &format!("toroid-train: checkpoint {}", path.display()));
        }
    }
    // Every rank reports its parameter hash (the tests compare them across ranks).
    let h = crate::parallel::hash(&host.iter().map(|h| h.data.as_slice()).collect::<Vec<_>>());
    eprintln!("toroid-train: rank {rank} parameter hash {h:#018x}");
    if let Some(comm) = rep.comm() {
        comm.barrier()?;
    }
    log(rank, &format!("toroid-train: done, {step} steps in {:.1}s", start.elapsed().as_secs_f64()));
    Ok(())
}
