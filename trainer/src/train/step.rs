//! One optimiser step: segmented forward and backward passes over the micro-batches, the
//! gradient all-reduce (overlapped with the backward pass), and the update of every parameter.

use candle_core::{D, Device, Tensor, Var};
use toroid::internals::trace::timeline;

use super::Trainer;
use super::stats::ExampleSums;
use crate::bail;
use crate::data::pipeline::Batch;
use crate::error::{Error, Result};
use crate::model::SEGMENTS;
use crate::optim::BatchPlan;
use crate::parallel::CommTime;

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

/// The images of `b` as an NCHW tensor.
pub(super) fn to_tensor(b: &Batch, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(&b.images, (b.len(), b.channels, b.size, b.size), dev)?)
}

/// What one optimiser step reports.
pub(super) struct StepOutcome {
    /// Training loss, the mean over the step's micro-batches.
    pub loss: f64,
    /// Seconds spent blocked on the gradient all-reduces.
    pub wait_s: f64,
}

/// A forward pass kept for the backward pass, segment by segment.
struct Segments {
    /// The input of each segment after the first: a fresh leaf, so that the segment's backward
    /// pass stops there and hands the input gradient to the segment before.
    inputs: Vec<Var>,
    /// The output of each segment (the last one's is the logits).
    outputs: Vec<Tensor>,
}

impl Trainer {
    /// One optimiser step at learning rate `rate` over `plan.accum` micro-batches from
    /// `next_batch`; adds each micro-batch's loss and hits to `sums`.
    pub(super) fn train_step(
        &mut self,
        plan: &BatchPlan,
        rate: f64,
        epoch: u64,
        next_batch: &mut impl FnMut() -> Result<Batch>,
        sums: &mut ExampleSums,
    ) -> Result<StepOutcome> {
        self.rep.begin_step();
        let mut loss = 0f64;
        for a in 0..plan.accum {
            let last = a + 1 == plan.accum;
            let t = timeline::now_ns();
            let b = next_batch()?;
            let t = mark("data", t);
            let (logits, seg) = self.forward(&b)?;
            let (l, correct) = loss_and_correct(&logits, &b.labels, self.args.label_smoothing)?;
            let lv = l.to_scalar::<f32>()? as f64;
            if !lv.is_finite() {
                bail!(
                    "loss is {lv} at step {} (epoch {epoch}): lower --lr or add --warmup-epochs",
                    self.step
                );
            }
            loss += lv / plan.accum as f64;
            sums.add_batch(lv, correct, b.len());
            let t = mark("forward", t);
            self.backward(&l, &seg, plan, last)?;
            mark("backward", t);
        }
        let t = timeline::now_ns();
        let comm = self.update(rate)?;
        mark("optimiser (waits for the gradients)", t);
        self.progress.bytes += comm.bytes as f64;
        Ok(StepOutcome { loss, wait_s: comm.wait.as_secs_f64() })
    }

    /// The training-mode forward pass of `b`, segment by segment: the logits, and what the
    /// backward pass needs.
    fn forward(&self, b: &Batch) -> Result<(Tensor, Segments)> {
        let mut seg = Segments { inputs: vec![], outputs: vec![] };
        let mut h = to_tensor(b, &self.dev)?;
        for s in 0..SEGMENTS {
            if s > 0 {
                let v = Var::from_tensor(&h.detach())?;
                h = v.as_tensor().clone();
                seg.inputs.push(v);
            }
            h = self.model.forward_segment(s, &h, true)?;
            seg.outputs.push(h.clone());
        }
        Ok((h, seg))
    }

    /// Backward from `loss` through `seg`, last segment first, adding each parameter's gradient
    /// (scaled by 1 / `plan.accum`) to its bucket; on the `last` micro-batch, buckets whose
    /// segments are done start their all-reduce while earlier segments still run backward.
    fn backward(&mut self, loss: &Tensor, seg: &Segments, plan: &BatchPlan, last: bool) -> Result<()> {
        let mut upstream: Option<Tensor> = None;
        for s in (0..SEGMENTS).rev() {
            let grads = match &upstream {
                None => loss.backward()?,
                Some(g) => (&seg.outputs[s] * g)?.sum_all()?.backward()?,
            };
            for (pi, p) in self.model.params.iter().enumerate().filter(|(_, p)| p.segment == s) {
                self.rep.add_grad(pi, grads.get(p.var.as_tensor()), 1.0 / plan.accum as f32)?;
            }
            if s > 0 {
                let g = grads
                    .get(seg.inputs[s - 1].as_tensor())
                    .ok_or_else(|| Error::msg(format!("no gradient reached the input of segment {s}")))?;
                upstream = Some(g.clone());
            }
            if last {
                self.rep.segment_done(s)?;
            }
        }
        Ok(())
    }

    /// Waits for the averaged gradients bucket by bucket (under BMUF: this rank's own) and
    /// applies the optimiser at `rate` to the host copies, then to the model.
    fn update(&mut self, rate: f64) -> Result<CommTime> {
        let (model, host, opt, dev) = (&self.model, &mut self.host, &self.opt, &self.dev);
        self.adam_t += 1.0; // Adam's step counters, counted from 1
        self.adam_t1 += 1.0;
        let (adam, t, t1) = (self.adam, self.adam_t, self.adam_t1);
        self.rep.finish(|params, offsets, grads| {
            for (&pi, &off) in params.iter().zip(offsets) {
                let p = &model.params[pi];
                let h = &mut host[pi];
                let n = h.data.len();
                let g = &grads[off..off + n];
                match &adam {
                    Some(a) => a.update(rate, t1, t, &mut h.data, g, &mut h.momentum, &mut h.second, p.decay),
                    None => opt.update(rate, &mut h.data, g, &mut h.momentum, p.decay),
                }
                p.var.set(&Tensor::from_slice(&h.data, p.var.shape(), dev)?)?;
            }
            Ok(())
        })
    }
}

/// Ends the trainer's span `name` begun at `start` on the timeline (nothing without
/// `--timeline`); returns now, the start of the next span.
fn mark(name: &str, start: u64) -> u64 {
    let now = timeline::now_ns();
    timeline::span("trainer", name, start, now);
    now
}
