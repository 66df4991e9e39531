//! Convolution as one matrix product, with activations in CNHW layout.
//!
//! candle's CPU convolution back-propagates through a direct-loop transposed convolution that is
//! an order of magnitude slower than its GEMM; that made a training step several times slower
//! than the forward pass deserved. Here a convolution is `W (Cout, C*k*k) x cols (C*k*k, N*Ho*Wo)`
//! where `cols` is the im2col unfolding of the input. Keeping activations channel-major (C, N,
//! H, W) makes the product's output already the next layer's input, with no transpose; a 1x1
//! stride-1 convolution needs no unfolding at all. The matrix product and its backward are
//! candle's (GEMM); only the unfolding and its adjoint (col2im) are written here.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// im2col for square kernels: (C, N, H, W) -> (C*k*k, N*Ho*Wo), zero padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unfold {
    /// Kernel side.
    pub k: usize,
    /// Stride.
    pub stride: usize,
    /// Zero padding on each side.
    pub pad: usize,
}

impl Unfold {
    /// Output side for input side `n`.
    pub fn out_size(&self, n: usize) -> usize {
        (n + 2 * self.pad - self.k) / self.stride + 1
    }

    /// Calls `f(col_index_within_row_block, input_index)` for every in-bounds tap of one
    /// (channel, ky, kx) row: the shared index arithmetic of unfold and fold.
    #[inline]
    fn row(&self, n: usize, h: usize, w: usize, ky: usize, kx: usize, mut f: impl FnMut(usize, usize)) {
        let (ho, wo) = (self.out_size(h), self.out_size(w));
        for b in 0..n {
            for oy in 0..ho {
                let iy = (oy * self.stride + ky) as isize - self.pad as isize;
                if iy < 0 || iy >= h as isize {
                    continue;
                }
                let col0 = (b * ho + oy) * wo;
                let in0 = (b * h + iy as usize) * w;
                for ox in 0..wo {
                    let ix = (ox * self.stride + kx) as isize - self.pad as isize;
                    if ix >= 0 && ix < w as isize {
                        f(col0 + ox, in0 + ix as usize);
                    }
                }
            }
        }
    }
}

fn contiguous<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("unfold: needs a contiguous input"),
    }
}

impl CustomOp1 for Unfold {
    fn name(&self) -> &'static str {
        "unfold-cnhw"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (c, n, h, w) = l.shape().dims4()?;
        let x = contiguous(s, l)?;
        let (ho, wo) = (self.out_size(h), self.out_size(w));
        let cols = n * ho * wo;
        let k = self.k;
        let mut out = vec![0f32; c * k * k * cols];
        for ch in 0..c {
            let plane = &x[ch * n * h * w..(ch + 1) * n * h * w];
            for ky in 0..k {
                for kx in 0..k {
                    let r = (ch * k + ky) * k + kx;
                    let dst = &mut out[r * cols..(r + 1) * cols];
                    self.row(n, h, w, ky, kx, |o, i| dst[o] = plane[i]);
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((c * k * k, cols))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (c, n, h, w) = arg.dims4()?;
        let g = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let (ho, wo) = (self.out_size(h), self.out_size(w));
        let cols = n * ho * wo;
        let k = self.k;
        let mut dx = vec![0f32; c * n * h * w];
        for ch in 0..c {
            let plane = &mut dx[ch * n * h * w..(ch + 1) * n * h * w];
            for ky in 0..k {
                for kx in 0..k {
                    let r = (ch * k + ky) * k + kx;
                    let src = &g[r * cols..(r + 1) * cols];
                    self.row(n, h, w, ky, kx, |o, i| plane[i] += src[o]);
                }
            }
        }
        Ok(Some(Tensor::from_vec(dx, (c, n, h, w), arg.device())?))
    }
}

/// Convolves `x` (C, N, H, W) with `weight` (Cout, C, k, k): output (Cout, N, Ho, Wo).
pub fn conv_cnhw(x: &Tensor, weight: &Tensor, stride: usize, pad: usize) -> candle_core::Result<Tensor> {
    let (c, n, h, w) = x.dims4()?;
    let (cout, cin, k, k2) = weight.dims4()?;
    if cin != c || k != k2 {
        candle_core::bail!("conv: input has {c} channels, weight is {:?}", weight.dims());
    }
    let u = Unfold { k, stride, pad };
    let (ho, wo) = (u.out_size(h), u.out_size(w));
    let cols = if k == 1 && stride == 1 && pad == 0 {
        x.reshape((c, n * h * w))?
    } else {
        x.contiguous()?.apply_op1(u)?
    };
    weight.reshape((cout, c * k * k))?.matmul(&cols)?.reshape((cout, n, ho, wo))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Against candle's own conv2d (NCHW), forward and both gradients.
    #[test]
    fn matches_candle_conv2d_forward_and_backward() {
        let d = Device::Cpu;
        for &(c, n, h, w, cout, k, stride, pad) in &[
            (3, 2, 7, 7, 4, 3, 1, 1),
            (2, 3, 8, 6, 5, 3, 2, 1),
            (4, 2, 9, 9, 3, 7, 2, 3),
            (3, 2, 5, 5, 6, 1, 1, 0),
            (3, 2, 6, 6, 2, 1, 2, 0),
        ] {
            let x0 = Tensor::randn(0f32, 1.0, (n, c, h, w), &d).unwrap();
            let w0 = Tensor::randn(0f32, 1.0, (cout, c, k, k), &d).unwrap();
            let (xa, wa) = (Var::from_tensor(&x0).unwrap(), Var::from_tensor(&w0).unwrap());
            let ya = xa.as_tensor().conv2d(wa.as_tensor(), pad, stride, 1, 1).unwrap();
            let r = Tensor::randn(0f32, 1.0, ya.dims(), &d).unwrap();
            let ga = (&ya * &r).unwrap().sum_all().unwrap().backward().unwrap();

            let (xb, wb) = (Var::from_tensor(&x0).unwrap(), Var::from_tensor(&w0).unwrap());
            let xc = xb.as_tensor().transpose(0, 1).unwrap().contiguous().unwrap();
            let yb = conv_cnhw(&xc, wb.as_tensor(), stride, pad).unwrap().transpose(0, 1).unwrap();
            let gb = (&yb * &r).unwrap().sum_all().unwrap().backward().unwrap();

            let diff = |a: &Tensor, b: &Tensor| {
                (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
            };
            let case = format!("c{c} n{n} {h}x{w} cout{cout} k{k} s{stride} p{pad}");
            assert_eq!(ya.dims(), yb.dims(), "{case}");
            assert!(diff(&ya, &yb) < 1e-4, "forward {case}");
            assert!(
                diff(ga.get(xa.as_tensor()).unwrap(), gb.get(xb.as_tensor()).unwrap()) < 1e-3,
                "dx {case}"
            );
            assert!(
                diff(ga.get(wa.as_tensor()).unwrap(), gb.get(wb.as_tensor()).unwrap()) < 1e-3,
                "dw {case}"
            );
        }
    }
}
