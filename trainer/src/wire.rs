//! Compressed gradient all-reduce (`--wire bf16|f16`) with error feedback (`--error-feedback`).
//!
//! Each gradient bucket's all-reduce travels in a 16-bit float type through toroid's
//! compressed all-reduce (`CallOptions::wire`): half the bytes, the sum accumulated in f32, the
//! same averaged gradient on every rank, so replicas stay bit-identical. What rounding costs is
//! the low bits of each rank's gradient: a component smaller than half a unit in the last place
//! of the bucket value it is added to is lost every step. Error feedback (Seide et al., "1-bit
//! stochastic gradient descent", Interspeech 2014; Karimireddy et al., "Error feedback fixes
//! SignSGD", ICML 2019) keeps it: each rank adds last step's residual to this step's gradient,
//! rounds the sum to the wire type itself (so the all-reduce's own rounding of the input is
//! exact) and keeps the new residual,
//!
//! ```text
//!   x = g_t + e_{t-1};   q = round(x);   e_t = x - q;   all-reduce q
//! ```
//!
//! so that over any number of steps sum(q) = sum(g) - e_t: nothing is lost, only delayed. The
//! second rounding, of the averaged result (one rounding of a value that is identical on every
//! rank), is not fed back. Residuals are per rank and live in memory only: a checkpoint does not
//! hold them (a resumed run starts from zero residuals) and an elastic shrink resets them.

use half::{bf16, f16};
use toroid::{CallOptions, DataType};

use crate::bail;
use crate::cli::WireKind;
use crate::error::Result;

/// How gradients travel: the wire type (None: f32, uncompressed) and whether residuals are fed
/// back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GradWire {
    /// BF16 or F16; None: the gradients' own f32.
    pub dtype: Option<DataType>,
    /// Keep the rounding residual per bucket and add it to the next step's gradients.
    pub error_feedback: bool,
}

impl GradWire {
    /// From `--wire` and `--error-feedback` (which needs a 16-bit wire type).
    pub fn new(kind: WireKind, error_feedback: bool) -> Result<GradWire> {
        let dtype = match kind {
            WireKind::F32 => None,
            WireKind::Bf16 => Some(DataType::BF16),
            WireKind::F16 => Some(DataType::F16),
        };
        if error_feedback && dtype.is_none() {
            bail!("--error-feedback needs --wire bf16 or --wire f16 (f32 gradients are not rounded)");
        }
        Ok(GradWire { dtype, error_feedback })
    }

    /// The options of a gradient all-reduce.
    pub fn options(&self) -> CallOptions {
        CallOptions { wire: self.dtype, ..CallOptions::default() }
    }

    /// Bytes one gradient element occupies on the wire.
    pub fn bytes_per_element(&self) -> usize {
        self.dtype.map_or(4, |d| d.size())
    }

    /// With error feedback, replaces `buf` (this step's gradients) by `round(buf + residual)`
    /// and `residual` by what that rounding dropped; otherwise leaves both alone. `residual`
    /// grows to `buf`'s length (zeros) the first time.
    pub fn compensate(&self, buf: &mut [f32], residual: &mut Vec<f32>) {
        let Some(dtype) = self.dtype.filter(|_| self.error_feedback) else { return };
        residual.resize(buf.len(), 0.0);
        for (g, e) in buf.iter_mut().zip(residual.iter_mut()) {
            let x = *g + *e;
            let q = round_to(dtype, x);
            *e = x - q;
            *g = q;
        }
    }
}

/// `x` rounded to the nearest value of `dtype` (BF16 or F16; ties to even), as f32.
pub fn round_to(dtype: DataType, x: f32) -> f32 {
    match dtype {
        DataType::BF16 => bf16::from_f32(x).to_f32(),
        DataType::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ef(kind: WireKind) -> GradWire {
        GradWire::new(kind, true).unwrap()
    }

    #[test]
    fn feedback_carries_what_bf16_drops_into_later_steps() {
        // bf16 keeps 8 significant bits: around 1.0 its spacing is 2^-7. A gradient of
        // 1 + 2^-9, three steps in a row:
        let w = ef(WireKind::Bf16);
        let g = 1.0 + 2f32.powi(-9);
        let mut e = vec![];
        let mut sent = vec![];
        for _ in 0..3 {
            let mut buf = [g];
            w.compensate(&mut buf, &mut e);
            sent.push(buf[0]);
        }
        // step 1: x = 1 + 2^-9 -> 1, residual 2^-9; step 2: x = 1 + 2^-8, a tie -> 1 (even),
        // residual 2^-8; step 3: x = 1 + 3 * 2^-9 -> 1 + 2^-7, residual -2^-9.
        assert_eq!(sent, vec![1.0, 1.0, 1.0 + 2f32.powi(-7)]);
        assert_eq!(e, vec![-(2f32.powi(-9))]);
        // Without feedback every step sends 1.0: 3 * 2^-9 lost for good.
        let plain = GradWire::new(WireKind::Bf16, false).unwrap();
        let mut buf = [g];
        plain.compensate(&mut buf, &mut vec![]);
        assert_eq!(buf, [g], "without feedback the trainer leaves rounding to the all-reduce");
        assert_eq!(round_to(DataType::BF16, g), 1.0);
    }

    #[test]
    fn nothing_is_lost_over_many_steps_only_delayed() {
        // sum(sent) + residual == sum(gradients), up to the f32 rounding of g + e (2^-24 of
        // |g + e| per step), for both
        // wire types on random gradients of mixed magnitudes; each residual is within half a
        // unit of the wire type of the value it was rounded from.
        for (kind, u) in [(WireKind::Bf16, 2f32.powi(-8)), (WireKind::F16, 2f32.powi(-11))] {
            let w = ef(kind);
            let mut rng = crate::rng::Rng::new(7);
            let n = 257;
            let (mut e, mut sent, mut total, mut size) =
                (vec![], vec![0f64; n], vec![0f64; n], vec![0f64; n]);
            for _ in 0..50 {
                let mut buf: Vec<f32> =
                    (0..n).map(|i| (rng.normal() * 10f64.powi(i as i32 % 5 - 3)) as f32).collect();
                for ((t, a), g) in total.iter_mut().zip(size.iter_mut()).zip(&buf) {
                    *t += f64::from(*g);
                    *a += f64::from(g.abs());
                }
                w.compensate(&mut buf, &mut e);
                for ((s, q), r) in sent.iter_mut().zip(&buf).zip(&e) {
                    assert_eq!(
                        round_to(w.dtype.unwrap(), *q),
                        *q,
                        "{kind:?}: a sent value is not in the wire type"
                    );
                    // (f16's subnormals below 2^-14 are spaced 2^-24 apart.)
                    assert!(r.abs() <= u * (q + r).abs() + 2f32.powi(-25), "{kind:?}: residual {r} of {q}");
                    *s += f64::from(*q);
                }
            }
            for i in 0..n {
                let lost = total[i] - sent[i] - f64::from(e[i]);
                assert!(lost.abs() <= 1e-6 * size[i], "{kind:?} element {i}: {lost} lost of {}", total[i]);
            }
        }
    }

    #[test]
    fn error_feedback_needs_a_narrow_wire() {
        assert!(GradWire::new(WireKind::F32, true).is_err());
        assert_eq!(GradWire::new(WireKind::F32, false).unwrap().bytes_per_element(), 4);
        assert_eq!(ef(WireKind::F16).bytes_per_element(), 2);
        assert_eq!(ef(WireKind::Bf16).options().wire, Some(DataType::BF16));
    }
}
