//! Optimisers (SGD with momentum, Nesterov, LARS) on host memory, and the learning-rate and
//! batch-size schedules.
//!
//! The update runs on flat f32 slices after the gradient all-reduce, one bucket at a time, so a
//! bucket's update overlaps the all-reduce of the buckets behind it. Every rank runs the same
//! update on the same averaged gradient, so parameters stay bit-identical across ranks.

use crate::bail;
use crate::error::Result;

/// Which update rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// SGD with momentum (PyTorch's form: v = m v + g, w -= lr v).
    Sgd,
    /// LARS (You, Gitman, Ginsburg): a per-layer trust ratio `trust * |w| / (|g| + wd |w|)`
    /// scales the step of every decayed tensor (conv and linear weights); BN parameters and
    /// biases take plain momentum SGD.
    Lars {
        /// Trust coefficient (eta in the paper, about 0.001).
        trust: f64,
    },
}

/// Optimiser settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptConfig {
    /// Update rule.
    pub rule: Rule,
    /// Momentum coefficient.
    pub momentum: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 weight decay, applied to decayed tensors only (never BN parameters or biases).
    pub weight_decay: f64,
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt()
}

impl OptConfig {
    /// Updates one tensor `w` in place with gradient `g` and momentum buffer `v` at rate `lr`.
    /// `decay` says whether the tensor takes weight decay (and the LARS trust ratio).
    pub fn update(&self, lr: f64, w: &mut [f32], g: &[f32], v: &mut [f32], decay: bool) {
        let wd = if decay { self.weight_decay } else { 0.0 };
        let mu = self.momentum as f32;
        // The LARS trust ratio multiplies the gradient; plain SGD uses 1.
        let local = match self.rule {
            Rule::Lars { trust } if decay => {
                let (wn, gn) = (norm(w), norm(g));
                if wn > 0.0 && gn > 0.0 { trust * wn / (gn + wd * wn) } else { 1.0 }
            }
            _ => 1.0,
        };
        let (lr, wd, scale) = (lr as f32, wd as f32, local as f32);
        for i in 0..w.len() {
            let d = scale * (g[i] + wd * w[i]);
            v[i] = mu * v[i] + d;
            let step = if self.nesterov { d + mu * v[i] } else { v[i] };
            w[i] -= lr * step;
        }
    }
}

/// Global batch size by epoch: `0:256,5:512,20:1024` means 256 from epoch 0, 512 from epoch 5,
/// 1024 from epoch 20 (Smith et al.'s "increase the batch size", as Sony's runs used).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSchedule {
    entries: Vec<(u64, usize)>,
}

impl BatchSchedule {
    /// A constant batch size.
    pub fn constant(batch: usize) -> BatchSchedule {
        BatchSchedule { entries: vec![(0, batch)] }
    }

    /// Parses `EPOCH:BATCH,...`; the first entry must be epoch 0, epochs strictly increasing.
    pub fn parse(s: &str) -> Result<BatchSchedule> {
        let mut entries = vec![];
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((e, b)) = part.split_once(':') else {
                bail!("batch schedule entry '{part}' is not EPOCH:BATCH")
            };
            let (Ok(e), Ok(b)) = (e.trim().parse::<u64>(), b.trim().parse::<usize>()) else {
                bail!("batch schedule entry '{part}' is not EPOCH:BATCH with whole numbers")
            };
            if b == 0 {
                bail!("batch schedule entry '{part}': batch size must be positive");
            }
            if let Some(&(last, _)) = entries.last()
                && e <= last
            {
                bail!("batch schedule epochs must increase: {e} after {last}");
            }
            entries.push((e, b));
        }
        match entries.first() {
            None => bail!("empty batch schedule"),
            Some(&(e, _)) if e != 0 => bail!("batch schedule must start at epoch 0, not {e}"),
            _ => Ok(BatchSchedule { entries }),
        }
    }

    /// Global batch in `epoch`.
    pub fn at(&self, epoch: u64) -> usize {
        self.entries.iter().rev().find(|(e, _)| *e <= epoch).map_or(self.entries[0].1, |&(_, b)| b)
    }

    /// Every (epoch, batch) entry.
    pub fn entries(&self) -> &[(u64, usize)] {
        &self.entries
    }
}

/// How one global batch is realised: `world` ranks, each running `accum` passes of `micro`
/// examples before the all-reduce (`micro * accum * world == global`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    /// Examples per forward/backward pass on one rank.
    pub micro: usize,
    /// Passes accumulated per step.
    pub accum: usize,
}

/// Splits `global` over `world` ranks with at most `max_micro` examples per pass: the smallest
/// accumulation count that divides evenly.
pub fn plan_batch(global: usize, world: usize, max_micro: usize) -> Result<BatchPlan> {
    if !global.is_multiple_of(world) {
        bail!("global batch {global} is not a multiple of the {world} ranks");
    }
    let per_rank = global / world;
    let max_micro = max_micro.max(1);
    for accum in 1..=per_rank {
        if per_rank.is_multiple_of(accum) && per_rank / accum <= max_micro {
            return Ok(BatchPlan { micro: per_rank / accum, accum });
        }
    }
    bail!("cannot split a per-rank batch of {per_rank} into passes of at most {max_micro}")
}

/// LR decay after the warm-up.
#[derive(Debug, Clone, PartialEq)]
pub enum Decay {
    /// Constant.
    None,
    /// Multiply by `gamma` at each listed epoch.
    Step {
        /// Epochs at which the rate drops.
        milestones: Vec<f64>,
        /// Factor per drop.
        gamma: f64,
    },
    /// Half-cosine from the peak (end of warm-up) to 0 at `total_epochs`.
    Cosine,
}

/// The learning-rate schedule: linear scaling with the global batch, gradual warm-up, decay
/// (Goyal et al.).
#[derive(Debug, Clone, PartialEq)]
pub struct LrSchedule {
    /// Rate for a global batch of `ref_batch`.
    pub base_lr: f64,
    /// The batch `base_lr` is quoted for (256 for ImageNet).
    pub ref_batch: usize,
    /// Warm-up length in epochs (may be fractional; 0: none).
    pub warmup_epochs: f64,
    /// Where the warm-up starts, as a fraction of the peak rate; None: Goyal et al.'s start,
    /// min(base_lr, peak) (so a run whose batch is `ref_batch` has no ramp).
    pub warmup_from: Option<f64>,
    /// Decay after the warm-up.
    pub decay: Decay,
    /// Length of the run in epochs (for cosine).
    pub total_epochs: f64,
}

impl LrSchedule {
    /// The rate at fractional epoch `t` for global batch `batch`: base_lr * batch / ref_batch,
    /// reached by a linear ramp from min(base_lr, that) over the warm-up, then decayed. When the
    /// batch grows (batch schedule), the rate follows it: that is the linear scaling rule
    /// applied to the batch in force.
    pub fn at(&self, t: f64, batch: usize) -> f64 {
        let peak = self.base_lr * batch as f64 / self.ref_batch as f64;
        if t < self.warmup_epochs {
            let start = match self.warmup_from {
                Some(f) => f * peak,
                None => self.base_lr.min(peak),
            };
            return start + (peak - start) * t / self.warmup_epochs;
        }
        match &self.decay {
            Decay::None => peak,
            Decay::Step { milestones, gamma } => {
                peak * gamma.powi(milestones.iter().filter(|&&m| t >= m).count() as i32)
            }
            Decay::Cosine => {
                let span = (self.total_epochs - self.warmup_epochs).max(1e-9);
                let p = ((t - self.warmup_epochs) / span).clamp(0.0, 1.0);
                peak * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_matches_pytorch_reference() {
        // torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=...) for two
        // steps with g = [1, -2]: computed by hand from PyTorch's documented update.
        for nesterov in [false, true] {
            let o = OptConfig { rule: Rule::Sgd, momentum: 0.9, nesterov, weight_decay: 0.01 };
            let mut w = vec![1.0f32, 2.0];
            let mut v = vec![0.0f32; 2];
            let mut ww = [1.0f64, 2.0];
            let mut vv = [0.0f64; 2];
            for _ in 0..2 {
                o.update(0.1, &mut w, &[1.0, -2.0], &mut v, true);
                for i in 0..2 {
                    let d = [1.0, -2.0][i] + 0.01 * ww[i];
                    vv[i] = 0.9 * vv[i] + d;
                    ww[i] -= 0.1 * if nesterov { d + 0.9 * vv[i] } else { vv[i] };
                }
            }
            for i in 0..2 {
                assert!((w[i] as f64 - ww[i]).abs() < 1e-6, "{w:?} vs {ww:?}");
            }
        }
        // No decay on BN and biases.
        let o = OptConfig { rule: Rule::Sgd, momentum: 0.0, nesterov: false, weight_decay: 0.5 };
        let mut w = vec![1.0f32];
        o.update(1.0, &mut w, &[0.0], &mut [0.0], false);
        assert_eq!(w, vec![1.0]);
    }

    #[test]
    fn lars_scales_by_the_trust_ratio() {
        let o = OptConfig {
            rule: Rule::Lars { trust: 0.001 },
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let mut w = vec![3.0f32, 4.0]; // |w| = 5
        o.update(1.0, &mut w, &[0.0, 10.0], &mut [0.0, 0.0], true); // |g| = 10
        // local lr = 0.001 * 5 / 10 = 5e-4; step = 5e-4 * g
        assert!((w[1] - (4.0 - 5e-3)).abs() < 1e-6 && w[0] == 3.0, "{w:?}");
    }

    #[test]
    fn batch_schedule_and_plan() {
        let s = BatchSchedule::parse("0:256,5:512,20:1024").unwrap();
        assert_eq!((s.at(0), s.at(4), s.at(5), s.at(19), s.at(100)), (256, 256, 512, 512, 1024));
        for bad in ["", "1:256", "0:256,0:512", "0:0", "0-256", "0:x"] {
            assert!(BatchSchedule::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(plan_batch(256, 2, 128).unwrap(), BatchPlan { micro: 128, accum: 1 });
        assert_eq!(plan_batch(1024, 2, 128).unwrap(), BatchPlan { micro: 128, accum: 4 });
        assert_eq!(plan_batch(96, 3, 10).unwrap(), BatchPlan { micro: 8, accum: 4 });
        assert!(plan_batch(100, 3, 10).is_err());
    }

    #[test]
    fn lr_warms_up_scales_and_decays() {
        let s = LrSchedule {
            base_lr: 0.1,
            ref_batch: 256,
            warmup_epochs: 5.0,
            warmup_from: None,
            decay: Decay::Step { milestones: vec![30.0, 60.0], gamma: 0.1 },
            total_epochs: 90.0,
        };
        assert!((s.at(0.0, 8192) - 0.1).abs() < 1e-12); // Goyal: from eta ...
        assert!((s.at(5.0, 8192) - 3.2).abs() < 1e-12); // ... to k * eta after 5 epochs
        assert!((s.at(2.5, 8192) - 1.65).abs() < 1e-12);
        assert!((s.at(30.0, 8192) - 0.32).abs() < 1e-12);
        assert!((s.at(61.0, 256) - 0.001).abs() < 1e-12);
        let c = LrSchedule { decay: Decay::Cosine, warmup_epochs: 0.0, ..s };
        assert!((c.at(45.0, 256) - 0.05).abs() < 1e-12);
        assert!(c.at(90.0, 256).abs() < 1e-12);
        // From a fraction of the peak: a run at its reference batch ramps too.
        let z = LrSchedule { warmup_from: Some(0.0), warmup_epochs: 1.0, ..c };
        assert!(z.at(0.0, 256).abs() < 1e-12 && (z.at(0.5, 256) - 0.05).abs() < 1e-12);
        assert!((z.at(1.0, 256) - 0.1).abs() < 1e-12);
    }
}
