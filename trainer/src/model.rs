//! ResNet-18/34/50 (He et al.; torchvision's v1.5 layout: stride on the 3x3 of the bottleneck)
//! built on candle tensors, with explicit parameter bookkeeping for data parallelism.
//!
//! Every trainable tensor is a [`Param`] registered in forward order, with the facts the optimiser
//! and the gradient buckets need: whether it takes weight decay (conv and linear weights do, BN
//! and biases do not) and which backward *segment* it belongs to. The network is cut into four
//! segments (stem + layer1, layer2, layer3, layer4 + head) so that the trainer can run backward
//! one segment at a time, last first, and start all-reducing a segment's gradients while the
//! earlier segments are still being differentiated: candle computes a whole backward pass in one
//! call with no per-parameter hooks, so this is how DDP's overlap is obtained here.

use candle_core::{DType, Device, Tensor, Var};

use crate::bail;
use crate::error::{Error, Result};
use crate::pool::MaxPool;
use crate::rng::Rng;

/// Number of backward segments of every [`ResNet`].
pub const SEGMENTS: usize = 4;

/// A trainable tensor.
#[derive(Debug, Clone)]
pub struct Param {
    /// Dotted name, as in torchvision's state dict (`layer1.0.conv1.weight`).
    pub name: String,
    /// The tensor.
    pub var: Var,
    /// Takes weight decay (and LARS trust ratio): conv and linear weights only.
    pub decay: bool,
    /// The backward segment that produces its gradient.
    pub segment: usize,
}

/// A non-trainable state tensor (BN running mean and variance).
#[derive(Debug, Clone)]
pub struct Buffer {
    /// Dotted name.
    pub name: String,
    /// The tensor.
    pub var: Var,
}

/// How batch norm normalises during training.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BnMode {
    /// Batch statistics of the local (per-rank) batch, running statistics updated: the usual.
    Batch,
    /// Running statistics only, never updated; gamma and beta still learn. With it a rank's
    /// gradient does not depend on how the global batch is split across ranks.
    Frozen,
}

/// The architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Basic blocks [2, 2, 2, 2].
    ResNet18,
    /// Basic blocks [3, 4, 6, 3].
    ResNet34,
    /// Bottleneck blocks [3, 4, 6, 3].
    ResNet50,
}

impl std::str::FromStr for Arch {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Arch, String> {
        match s.to_ascii_lowercase().as_str() {
            "resnet18" => Ok(Arch::ResNet18),
            "resnet34" => Ok(Arch::ResNet34),
            "resnet50" => Ok(Arch::ResNet50),
            _ => Err(format!("unknown model '{s}' (resnet18, resnet34, resnet50)")),
        }
    }
}

/// The first layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stem {
    /// 7x7/2 convolution, BN, ReLU, 3x3/2 max pool: 4x down-sampling (ImageNet).
    ImageNet,
    /// 3x3/1 convolution, BN, ReLU: no down-sampling (small images such as 28x28 or 32x32).
    Small,
}

impl std::str::FromStr for Stem {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Stem, String> {
        match s.to_ascii_lowercase().as_str() {
            "imagenet" => Ok(Stem::ImageNet),
            "small" | "cifar" => Ok(Stem::Small),
            _ => Err(format!("unknown stem '{s}' (imagenet, small)")),
        }
    }
}

/// Everything that defines a network's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Channel multiplier: every layer's width is round(width * standard), at least 1.
    pub width: f64,
    /// Input channels (3 for RGB, 1 for grey).
    pub in_channels: usize,
    /// Output classes.
    pub num_classes: usize,
    /// The stem.
    pub stem: Stem,
    /// Batch-norm training mode.
    pub bn: BnMode,
    /// Zero-initialise the last BN gamma of each residual block (Goyal et al.).
    pub zero_init_residual: bool,
}

/// Running sums of parameter counts, for the `--print-params` report.
impl ModelConfig {
    fn channels(&self, standard: usize) -> usize {
        ((standard as f64 * self.width).round() as usize).max(1)
    }
}

struct Builder<'a> {
    params: Vec<Param>,
    buffers: Vec<Buffer>,
    rng: Rng,
    device: &'a Device,
    segment: usize,
}

impl Builder<'_> {
    fn param(&mut self, name: String, t: Tensor, decay: bool) -> Result<Var> {
        let var = Var::from_tensor(&t)?;
        self.params.push(Param { name, var: var.clone(), decay, segment: self.segment });
        Ok(var)
    }

    /// Kaiming normal, fan_out, ReLU gain (torchvision's ResNet init).
    fn conv(
        &mut self,
        name: &str,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        pad: usize,
    ) -> Result<Conv> {
        let std = (2.0 / (cout * k * k) as f64).sqrt();
        let v: Vec<f32> = (0..cout * cin * k * k).map(|_| (self.rng.normal() * std) as f32).collect();
        let w =
            self.param(format!("{name}.weight"), Tensor::from_vec(v, (cout, cin, k, k), self.device)?, true)?;
        Ok(Conv { w, stride, pad })
    }

    fn bn(&mut self, name: &str, c: usize, gamma: f32) -> Result<BatchNorm> {
        let g = self.param(format!("{name}.weight"), Tensor::full(gamma, c, self.device)?, false)?;
        let b = self.param(format!("{name}.bias"), Tensor::zeros(c, DType::F32, self.device)?, false)?;
        let rm = Var::from_tensor(&Tensor::zeros(c, DType::F32, self.device)?)?;
        let rv = Var::from_tensor(&Tensor::ones(c, DType::F32, self.device)?)?;
        self.buffers.push(Buffer { name: format!("{name}.running_mean"), var: rm.clone() });
        self.buffers.push(Buffer { name: format!("{name}.running_var"), var: rv.clone() });
        Ok(BatchNorm { gamma: g, beta: b, running_mean: rm, running_var: rv })
    }

    /// torchvision's nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
    fn linear(&mut self, name: &str, cin: usize, cout: usize) -> Result<Linear> {
        let bound = 1.0 / (cin as f64).sqrt();
        let w: Vec<f32> =
            (0..cout * cin).map(|_| ((self.rng.uniform() * 2.0 - 1.0) * bound) as f32).collect();
        let b: Vec<f32> = (0..cout).map(|_| ((self.rng.uniform() * 2.0 - 1.0) * bound) as f32).collect();
        let w = self.param(format!("{name}.weight"), Tensor::from_vec(w, (cout, cin), self.device)?, true)?;
        let b = self.param(format!("{name}.bias"), Tensor::from_vec(b, cout, self.device)?, false)?;
        Ok(Linear { w, b })
    }
}

struct Conv {
    w: Var,
    stride: usize,
    pad: usize,
}

impl Conv {
    /// `x` and the result are CNHW (see `conv.rs`).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(crate::conv::conv_cnhw(x, self.w.as_tensor(), self.stride, self.pad)?)
    }
}

struct BatchNorm {
    gamma: Var,
    beta: Var,
    running_mean: Var,
    running_var: Var,
}

const BN_EPS: f64 = 1e-5;
const BN_MOMENTUM: f64 = 0.1;

impl BatchNorm {
    fn forward(&self, x: &Tensor, train: bool, mode: BnMode) -> Result<Tensor> {
        // Activations are CNHW: a channel's values are contiguous, statistics reduce dims 1..3.
        let c = self.gamma.dims()[0];
        if train && mode == BnMode::Batch {
            let n = (x.dims()[1] * x.dims()[2] * x.dims()[3]) as f64;
            let mean = x.mean_keepdim((1, 2, 3))?;
            let centred = x.broadcast_sub(&mean)?;
            let var = centred.sqr()?.mean_keepdim((1, 2, 3))?;
            let inv = (var.clone() + BN_EPS)?.sqrt()?.recip()?;
            let scale = inv.broadcast_mul(&self.gamma.as_tensor().reshape((c, 1, 1, 1))?)?;
            let y = centred
                .broadcast_mul(&scale)?
                .broadcast_add(&self.beta.as_tensor().reshape((c, 1, 1, 1))?)?;
            // Running statistics as PyTorch keeps them: the variance is the unbiased one.
            let unbiased = if n > 1.0 { n / (n - 1.0) } else { 1.0 };
            let m = mean.detach().flatten_all()?;
            let v = var.detach().flatten_all()?;
            let rm = ((self.running_mean.as_tensor() * (1.0 - BN_MOMENTUM))? + (m * BN_MOMENTUM)?)?;
            let rv =
                ((self.running_var.as_tensor() * (1.0 - BN_MOMENTUM))? + (v * (BN_MOMENTUM * unbiased))?)?;
            self.running_mean.set(&rm)?;
            self.running_var.set(&rv)?;
            Ok(y)
        } else {
            // y = x * gamma / sqrt(rv + eps) + (beta - rm * gamma / sqrt(rv + eps)): an affine
            // map per channel, differentiable in gamma and beta.
            let inv = (self.running_var.as_tensor().detach() + BN_EPS)?.sqrt()?.recip()?;
            let scale = (self.gamma.as_tensor() * inv)?;
            let shift = (self.beta.as_tensor() - (self.running_mean.as_tensor().detach() * &scale)?)?;
            Ok(x.broadcast_mul(&scale.reshape((c, 1, 1, 1))?)?
                .broadcast_add(&shift.reshape((c, 1, 1, 1))?)?)
        }
    }
}

struct Linear {
    w: Var,
    b: Var,
}

impl Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.matmul(&self.w.as_tensor().t()?)?.broadcast_add(self.b.as_tensor())?)
    }
}

/// A residual block: basic (two 3x3) or bottleneck (1x1, 3x3, 1x1).
struct Block {
    convs: Vec<(Conv, BatchNorm)>,
    downsample: Option<(Conv, BatchNorm)>,
}

impl Block {
    fn forward(&self, x: &Tensor, train: bool, mode: BnMode) -> Result<Tensor> {
        let mut y = x.clone();
        let last = self.convs.len() - 1;
        for (i, (conv, bn)) in self.convs.iter().enumerate() {
            y = bn.forward(&conv.forward(&y)?, train, mode)?;
            if i != last {
                y = y.relu()?;
            }
        }
        let shortcut = match &self.downsample {
            Some((conv, bn)) => bn.forward(&conv.forward(x)?, train, mode)?,
            None => x.clone(),
        };
        Ok((y + shortcut)?.relu()?)
    }
}

/// A ResNet: parameters, buffers and the layers that use them.
pub struct ResNet {
    /// Shape of the network.
    pub config: ModelConfig,
    /// Trainable tensors in forward order.
    pub params: Vec<Param>,
    /// BN running statistics in forward order.
    pub buffers: Vec<Buffer>,
    stem: (Conv, BatchNorm),
    pool: Option<MaxPool>,
    layers: Vec<Vec<Block>>,
    fc: Linear,
}

impl ResNet {
    /// Builds a network with weights drawn from `seed` (every rank may use the same seed, but the
    /// trainer broadcasts rank 0's weights anyway, as DDP does).
    pub fn new(config: ModelConfig, seed: u64, device: &Device) -> Result<ResNet> {
        if !(config.width > 0.0 && config.width.is_finite()) {
            bail!("width multiplier must be positive, got {}", config.width);
        }
        if config.num_classes == 0 || config.in_channels == 0 {
            bail!("a model needs at least one input channel and one class");
        }
        let mut b = Builder { params: vec![], buffers: vec![], rng: Rng::new(seed), device, segment: 0 };
        let c0 = config.channels(64);
        let stem = match config.stem {
            Stem::ImageNet => (b.conv("conv1", config.in_channels, c0, 7, 2, 3)?, b.bn("bn1", c0, 1.0)?),
            Stem::Small => (b.conv("conv1", config.in_channels, c0, 3, 1, 1)?, b.bn("bn1", c0, 1.0)?),
        };
        let pool = (config.stem == Stem::ImageNet).then_some(MaxPool { kernel: 3, stride: 2, padding: 1 });
        let (bottleneck, counts) = match config.arch {
            Arch::ResNet18 => (false, [2, 2, 2, 2]),
            Arch::ResNet34 => (false, [3, 4, 6, 3]),
            Arch::ResNet50 => (true, [3, 4, 6, 3]),
        };
        let expansion = if bottleneck { 4 } else { 1 };
        let last_gamma = if config.zero_init_residual { 0.0 } else { 1.0 };
        let mut inplanes = c0;
        let mut layers = vec![];
        for (li, (&count, standard)) in counts.iter().zip([64, 128, 256, 512]).enumerate() {
            b.segment = li;
            let planes = config.channels(standard);
            let mut blocks = vec![];
            for bi in 0..count {
                let stride = if bi == 0 && li > 0 { 2 } else { 1 };
                let name = format!("layer{}.{bi}", li + 1);
                let out = planes * expansion;
                let convs = if bottleneck {
                    vec![
                        (
                            b.conv(&format!("{name}.conv1"), inplanes, planes, 1, 1, 0)?,
                            b.bn(&format!("{name}.bn1"), planes, 1.0)?,
                        ),
                        (
                            b.conv(&format!("{name}.conv2"), planes, planes, 3, stride, 1)?,
                            b.bn(&format!("{name}.bn2"), planes, 1.0)?,
                        ),
                        (
                            b.conv(&format!("{name}.conv3"), planes, out, 1, 1, 0)?,
                            b.bn(&format!("{name}.bn3"), out, last_gamma)?,
                        ),
                    ]
                } else {
                    vec![
                        (
                            b.conv(&format!("{name}.conv1"), inplanes, planes, 3, stride, 1)?,
                            b.bn(&format!("{name}.bn1"), planes, 1.0)?,
                        ),
                        (
                            b.conv(&format!("{name}.conv2"), planes, planes, 3, 1, 1)?,
                            b.bn(&format!("{name}.bn2"), planes, last_gamma)?,
                        ),
                    ]
                };
                let downsample = if stride != 1 || inplanes != out {
                    Some((
                        b.conv(&format!("{name}.downsample.0"), inplanes, out, 1, stride, 0)?,
                        b.bn(&format!("{name}.downsample.1"), out, 1.0)?,
                    ))
                } else {
                    None
                };
                blocks.push(Block { convs, downsample });
                inplanes = out;
            }
            layers.push(blocks);
        }
        b.segment = SEGMENTS - 1;
        let fc = b.linear("fc", inplanes, config.num_classes)?;
        Ok(ResNet { config, params: b.params, buffers: b.buffers, stem, pool, layers, fc })
    }

    /// Number of trainable scalars.
    pub fn num_params(&self) -> usize {
        self.params.iter().map(|p| p.var.elem_count()).sum()
    }

    /// Runs segment `s` (0..SEGMENTS) on `x`: the stem and layer1 (taking NCHW images), layer2,
    /// layer3, or layer4 with the pooling and the classifier (giving logits). Between segments
    /// activations are CNHW.
    pub fn forward_segment(&self, s: usize, x: &Tensor, train: bool) -> Result<Tensor> {
        let mode = self.config.bn;
        let mut x = x.clone();
        if s == 0 {
            // Images arrive NCHW; the network runs CNHW (see conv.rs).
            x = x.transpose(0, 1)?.contiguous()?;
            x = self.stem.1.forward(&self.stem.0.forward(&x)?, train, mode)?.relu()?;
            if let Some(p) = &self.pool {
                x = p.forward(&x)?;
            }
        }
        let layer = self.layers.get(s).ok_or_else(|| Error::msg(format!("no segment {s}")))?;
        for block in layer {
            x = block.forward(&x, train, mode)?;
        }
        if s == SEGMENTS - 1 {
            x = x.mean((2, 3))?.t()?; // (C, N) -> (N, C)
            x = self.fc.forward(&x)?;
        }
        Ok(x)
    }

    /// The whole network: logits (N, classes) for images (N, C, H, W).
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut x = x.clone();
        for s in 0..SEGMENTS {
            x = self.forward_segment(s, &x, train)?;
        }
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(arch: Arch) -> ModelConfig {
        ModelConfig {
            arch,
            width: 1.0,
            in_channels: 3,
            num_classes: 1000,
            stem: Stem::ImageNet,
            bn: BnMode::Batch,
            zero_init_residual: true,
        }
    }

    /// torchvision's counts: resnet50 25,557,032; resnet18 11,689,512; resnet34 21,797,672.
    #[test]
    fn parameter_counts_match_torchvision() {
        let d = Device::Cpu;
        assert_eq!(ResNet::new(cfg(Arch::ResNet50), 0, &d).unwrap().num_params(), 25_557_032);
        assert_eq!(ResNet::new(cfg(Arch::ResNet18), 0, &d).unwrap().num_params(), 11_689_512);
        assert_eq!(ResNet::new(cfg(Arch::ResNet34), 0, &d).unwrap().num_params(), 21_797_672);
    }

    #[test]
    fn names_are_unique_and_zero_init_hits_last_bn_only() {
        let m = ResNet::new(cfg(Arch::ResNet50), 0, &Device::Cpu).unwrap();
        let mut names: Vec<&str> = m.params.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), m.params.len());
        for p in &m.params {
            let zero = p.var.as_tensor().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() == 0.0;
            let last_bn = p.name.ends_with("bn3.weight");
            if p.name.ends_with(".weight") {
                assert_eq!(zero, last_bn, "{}", p.name);
            }
            assert_eq!(
                p.decay,
                p.name.contains("conv") || p.name == "fc.weight" || p.name.ends_with("downsample.0.weight"),
                "{}",
                p.name
            );
        }
        assert_eq!(m.params.last().unwrap().segment, SEGMENTS - 1);
        assert_eq!(m.params[0].segment, 0);
    }

    #[test]
    fn small_model_shapes() {
        let c = ModelConfig {
            arch: Arch::ResNet18,
            width: 0.125,
            in_channels: 1,
            num_classes: 10,
            stem: Stem::ImageNet,
            bn: BnMode::Batch,
            zero_init_residual: true,
        };
        let m = ResNet::new(c, 1, &Device::Cpu).unwrap();
        let x = Tensor::randn(0f32, 1.0, (2, 1, 28, 28), &Device::Cpu).unwrap();
        assert_eq!(m.forward(&x, true).unwrap().dims(), &[2, 10]);
        assert_eq!(m.forward(&x, false).unwrap().dims(), &[2, 10]);
    }
}
