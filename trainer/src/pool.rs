//! Max pooling with a correct backward pass for overlapping windows (the ResNet stem's 3x3/2).
//!
//! candle's `max_pool2d` back-propagates only when kernel == stride, and has no padding; the
//! ResNet stem pools 3x3 with stride 2 and padding 1, so neighbouring windows overlap. This op
//! computes the forward pass directly and routes each output's gradient to the first maximum of
//! its window in row-major order (what cuDNN and PyTorch do), so a value that is the maximum of
//! two windows receives both gradients. Padding counts as -inf: it never wins.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

/// Geometry of a square max pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool {
    /// Window side.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
    /// Implicit -inf border on each side.
    pub padding: usize,
}

impl MaxPool {
    /// Output side for an input side `n`.
    pub fn out_size(&self, n: usize) -> usize {
        (n + 2 * self.padding).saturating_sub(self.kernel) / self.stride + 1
    }

    /// Pools `x` (N, C, H, W), f32, differentiably.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.kernel == 0 || self.stride == 0 || self.padding >= self.kernel {
            candle_core::bail!("max-pool: bad geometry {self:?}")
        }
        x.contiguous()?.apply_op1(*self)
    }

    /// For every output element, the flat index (within its H*W plane) of the input element that
    /// wins its window. Shared by forward and backward so both agree on ties.
    fn argmax_plane(&self, plane: &[f32], h: usize, w: usize, mut visit: impl FnMut(usize, usize, f32)) {
        let (ho, wo) = (self.out_size(h), self.out_size(w));
        for oy in 0..ho {
            let y0 = (oy * self.stride) as isize - self.padding as isize;
            for ox in 0..wo {
                let x0 = (ox * self.stride) as isize - self.padding as isize;
                let mut best = f32::NEG_INFINITY;
                let mut best_i = usize::MAX;
                for ky in 0..self.kernel as isize {
                    let y = y0 + ky;
                    if y < 0 || y >= h as isize {
                        continue;
                    }
                    for kx in 0..self.kernel as isize {
                        let xx = x0 + kx;
                        if xx < 0 || xx >= w as isize {
                            continue;
                        }
                        let i = y as usize * w + xx as usize;
                        // Strictly greater: the first maximum in row-major order wins ties;
                        // NaN propagates (it is never "less than" the best so far).
                        let v = plane[i];
                        if best_i == usize::MAX || v > best || v.is_nan() {
                            best = v;
                            best_i = i;
                            if v.is_nan() {
                                break;
                            }
                        }
                    }
                }
                visit(oy * wo + ox, best_i, best);
            }
        }
    }
}

fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what}: needs a contiguous input"),
    }
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "max-pool-2d-overlapping"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = l.shape().dims4()?;
        let src = contiguous_f32(s, l, "max-pool")?;
        let (ho, wo) = (self.out_size(h), self.out_size(w));
        let mut out = vec![0f32; n * c * ho * wo];
        for (p, dst) in out.chunks_mut((ho * wo).max(1)).enumerate().take(n * c) {
            let plane = &src[p * h * w..(p + 1) * h * w];
            self.argmax_plane(plane, h, w, |o, _, v| dst[o] = v);
        }
        Ok((CpuStorage::F32(out), Shape::from((n, c, ho, wo))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad_res = grad_res.contiguous()?;
        Ok(Some(arg.apply_op2_no_bwd(&grad_res, &MaxPoolBackward(*self))?))
    }
}

/// The backward pass: (input, output gradient) -> input gradient.
struct MaxPoolBackward(MaxPool);

impl CustomOp2 for MaxPoolBackward {
    fn name(&self) -> &'static str {
        "max-pool-2d-overlapping-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = l1.shape().dims4()?;
        let x = contiguous_f32(s1, l1, "max-pool backward")?;
        let g = contiguous_f32(s2, l2, "max-pool backward")?;
        let (ho, wo) = (self.0.out_size(h), self.0.out_size(w));
        if l2.shape().dims4()? != (n, c, ho, wo) {
            candle_core::bail!(
                "max-pool backward: gradient shape {:?} for input {:?}",
                l2.shape(),
                l1.shape()
            )
        }
        let mut dx = vec![0f32; n * c * h * w];
        for p in 0..n * c {
            let plane = &x[p * h * w..(p + 1) * h * w];
            let gp = &g[p * ho * wo..(p + 1) * ho * wo];
            let dp = &mut dx[p * h * w..(p + 1) * h * w];
            self.0.argmax_plane(plane, h, w, |o, i, _| {
                if i != usize::MAX {
                    dp[i] += gp[o];
                }
            });
        }
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use candle_core::{Device, Var};

    /// The independent reference: max over the k*k shifted, strided views of the -inf-padded
    /// input, built from candle's own ops (narrow, reshape, maximum).
    fn pool_by_views(x: &Tensor, p: MaxPool) -> candle_core::Result<Tensor> {
        let (n, c, h, w) = x.dims4()?;
        let (ho, wo) = (p.out_size(h), p.out_size(w));
        // Pad to (stride * out + kernel) on each axis so every strided view fits.
        let hp = p.stride * ho + p.kernel;
        let wp = p.stride * wo + p.kernel;
        let padded = Tensor::full(f32::NEG_INFINITY, (n, c, hp, wp), x.device())?;
        let padded =
            padded.slice_assign(&[0..n, 0..c, p.padding..p.padding + h, p.padding..p.padding + w], x)?;
        let mut out: Option<Tensor> = None;
        for dy in 0..p.kernel {
            for dx in 0..p.kernel {
                let v = padded
                    .narrow(2, dy, p.stride * ho)?
                    .narrow(3, dx, p.stride * wo)?
                    .reshape((n, c, ho, p.stride, wo, p.stride))?
                    .narrow(3, 0, 1)?
                    .narrow(5, 0, 1)?
                    .reshape((n, c, ho, wo))?;
                out = Some(match out {
                    None => v,
                    Some(o) => o.maximum(&v)?,
                });
            }
        }
        out.ok_or_else(|| candle_core::Error::Msg("empty kernel".into()))
    }

    fn random(shape: (usize, usize, usize, usize), seed: u64) -> Tensor {
        let mut r = Rng::new(seed);
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        // Distinct values: no ties, so the gradient is unique and finite differences are exact.
        let mut v: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
        r.shuffle(&mut v);
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn forward_matches_shifted_views() {
        let p = MaxPool { kernel: 3, stride: 2, padding: 1 };
        for &(h, w) in &[(7, 7), (8, 8), (5, 6), (112, 112), (1, 1), (2, 3)] {
            let x = random((2, 3, h, w), (h * 100 + w) as u64);
            let a = p.forward(&x).unwrap();
            let b = pool_by_views(&x, p).unwrap();
            assert_eq!(a.dims4().unwrap(), (2, 3, p.out_size(h), p.out_size(w)));
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(d, 0.0, "{h}x{w}");
        }
    }

    /// Gradient of sum(pool(x) * r) against central finite differences, element by element, and
    /// against candle's autograd through the shifted-views reference.
    #[test]
    fn backward_matches_numeric_gradient_and_views() {
        let p = MaxPool { kernel: 3, stride: 2, padding: 1 };
        let (n, c, h, w) = (2, 2, 9, 8);
        let x0 = random((n, c, h, w), 11);
        let r = random((n, c, p.out_size(h), p.out_size(w)), 12).affine(0.1, -0.3).unwrap();
        let x = Var::from_tensor(&x0).unwrap();
        let loss = (p.forward(x.as_tensor()).unwrap() * &r).unwrap().sum_all().unwrap();
        let g = loss
            .backward()
            .unwrap()
            .get(x.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();

        let xv = Var::from_tensor(&x0).unwrap();
        let loss_v = (pool_by_views(xv.as_tensor(), p).unwrap() * &r).unwrap().sum_all().unwrap();
        let gv = loss_v
            .backward()
            .unwrap()
            .get(xv.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();

        let base: Vec<f32> = x0.flatten_all().unwrap().to_vec1().unwrap();
        let f = |v: &[f32]| -> f64 {
            let t = Tensor::from_slice(v, (n, c, h, w), &Device::Cpu).unwrap();
            let o: Vec<f32> = p.forward(&t).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let rr: Vec<f32> = r.flatten_all().unwrap().to_vec1().unwrap();
            o.iter().zip(&rr).map(|(a, b)| *a as f64 * *b as f64).sum()
        };
        let eps = 1e-3f32; // values are 0.01 apart: a 1e-3 nudge never changes a window's winner
        let mut nonzero = 0;
        for i in 0..base.len() {
            let mut up = base.clone();
            up[i] += eps;
            let mut dn = base.clone();
            dn[i] -= eps;
            let num = (f(&up) - f(&dn)) / (2.0 * eps as f64);
            assert!((num - g[i] as f64).abs() < 1e-3, "element {i}: numeric {num} vs {}", g[i]);
            assert!((gv[i] - g[i]).abs() < 1e-5, "element {i}: views {} vs {}", gv[i], g[i]);
            if g[i] != 0.0 {
                nonzero += 1;
            }
        }
        // Overlapping windows: some inputs win two or more windows, many win none.
        assert!(nonzero > 10 && nonzero < base.len());
    }

    #[test]
    fn ties_go_to_the_first_maximum() {
        let p = MaxPool { kernel: 3, stride: 2, padding: 1 };
        let x =
            Var::from_tensor(&Tensor::zeros((1, 1, 4, 4), candle_core::DType::F32, &Device::Cpu).unwrap())
                .unwrap();
        let y = p.forward(x.as_tensor()).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        let g: Vec<f32> = g.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        // Windows start at (-1,-1), (-1,1), (1,-1), (1,1): first in-bounds elements (0,0), (0,1),
        // (1,0), (1,1).
        let mut want = vec![0f32; 16];
        for i in [0, 1, 4, 5] {
            want[i] = 1.0;
        }
        assert_eq!(g, want);
    }
}
