//! Adam (Kingma and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015), on host
//! memory like the SGD rules in `optim.rs`:
//!
//! ```text
//!   m_t = b1 m_{t-1} + (1 - b1) g        v_t = b2 v_{t-1} + (1 - b2) g^2
//!   w  -= lr * (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps)
//! ```
//!
//! Weight decay is L2 added to the gradient (PyTorch's `torch.optim.Adam(weight_decay=...)`),
//! on conv and linear weights only, as for SGD.
//!
//! The step counter `t` is a float: BMUF-Adam (Chen, Ding and Huo, ICASSP 2020) advances it by
//! eta * rho_n after every block, a count of "virtual" steps that need not be whole (see
//! `bmuf.rs`). The caller owns the counter and increments it once per optimiser step, before
//! calling [`AdamConfig::update`] on every tensor.

/// Adam's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Added to the denominator (1e-8).
    pub eps: f64,
    /// L2 weight decay on decayed tensors.
    pub weight_decay: f64,
}

impl AdamConfig {
    /// Updates `w` in place with gradient `g` and moments `m`, `v` at rate `lr`, as step `t`
    /// (counted from 1) of `m` and step `t2` of `v`: the two are one counter except under
    /// BMUF-Adam's `first=reset`, which restarts m every block. `decay` says whether the tensor
    /// takes weight decay.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &self,
        lr: f64,
        t: f64,
        t2: f64,
        w: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        decay: bool,
    ) {
        let wd = if decay { self.weight_decay as f32 } else { 0.0 };
        let (b1, b2) = (self.beta1 as f32, self.beta2 as f32);
        // 1 - beta in f64 first: in f32, 1 - 0.999 is off by 5e-5 relative.
        let (g1, g2) = ((1.0 - self.beta1) as f32, (1.0 - self.beta2) as f32);
        // Bias corrections folded into the step size, as PyTorch does.
        let c1 = 1.0 - self.beta1.powf(t);
        let c2 = 1.0 - self.beta2.powf(t2);
        let step = (lr / c1) as f32;
        let (inv_c2, eps) = ((1.0 / c2) as f32, self.eps as f32);
        for i in 0..w.len() {
            let gi = g[i] + wd * w[i];
            m[i] = b1 * m[i] + g1 * gi;
            v[i] = b2 * v[i] + g2 * gi * gi;
            w[i] -= step * m[i] / ((v[i] * inv_c2).sqrt() + eps);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_hand_computed_steps() {
        let a = AdamConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        let (mut w, mut m, mut v) = (vec![1.0f32], vec![0.0f32], vec![0.0f32]);
        // Step 1, g = 2: m = 0.2, v = 0.004; m^ = 2, v^ = 4; w = 1 - 0.1 * 2 / (2 + 1e-8).
        a.update(0.1, 1.0, 1.0, &mut w, &[2.0], &mut m, &mut v, true);
        assert!((m[0] - 0.2).abs() < 1e-6 && (v[0] - 0.004).abs() < 1e-8, "{m:?} {v:?}");
        assert!((w[0] - 0.9).abs() < 1e-6, "{w:?}");
        // Step 2, g = -1: m = 0.08, v = 0.004996; m^ = 0.08 / 0.19, v^ = 0.004996 / 0.001999.
        a.update(0.1, 2.0, 2.0, &mut w, &[-1.0], &mut m, &mut v, true);
        let want = 0.9 - 0.1 * (0.08 / 0.19) / ((0.004996f64 / 0.001999).sqrt() + 1e-8);
        assert!((w[0] as f64 - want).abs() < 1e-6, "{} vs {want}", w[0]);
        // A fractional step count only changes the bias corrections.
        let (mut w2, mut m2, mut v2) = (vec![1.0f32], vec![0.2f32], vec![0.004f32]);
        a.update(0.1, 2.5, 2.5, &mut w2, &[-1.0], &mut m2, &mut v2, true);
        let c1 = 1.0 - 0.9f64.powf(2.5);
        let c2 = 1.0 - 0.999f64.powf(2.5);
        let want = 1.0 - 0.1 * (0.08 / c1) / ((0.004996 / c2).sqrt() + 1e-8);
        assert!((w2[0] as f64 - want).abs() < 1e-6, "{} vs {want}", w2[0]);
        // The two counters apart (BMUF-Adam's first=reset): m's correction uses t, v's uses t2.
        let (mut w5, mut m5, mut v5) = (vec![1.0f32], vec![0.0f32], vec![0.004f32]);
        a.update(0.1, 1.0, 3.0, &mut w5, &[2.0], &mut m5, &mut v5, true);
        let v_hat = (0.999 * 0.004 + 0.001 * 4.0) / (1.0 - 0.999f64.powi(3));
        let want = 1.0 - 0.1 * (0.2 / 0.1) / (v_hat.sqrt() + 1e-8);
        assert!((w5[0] as f64 - want).abs() < 1e-5, "{} vs {want}", w5[0]);
        // L2 decay joins the gradient on decayed tensors only.
        let d = AdamConfig { weight_decay: 0.5, ..a };
        let (mut w3, mut m3, mut v3) = (vec![2.0f32], vec![0.0f32], vec![0.0f32]);
        d.update(0.1, 1.0, 1.0, &mut w3, &[0.0], &mut m3, &mut v3, true);
        assert!((m3[0] - 0.1).abs() < 1e-7 && (w3[0] - 1.9).abs() < 1e-6);
        let (mut w4, mut m4, mut v4) = (vec![2.0f32], vec![0.0f32], vec![0.0f32]);
        d.update(0.1, 1.0, 1.0, &mut w4, &[0.0], &mut m4, &mut v4, false);
        assert_eq!(w4, vec![2.0]);
    }
}
