//! Evaluation on the test set.

use std::sync::Arc;

use candle_core::Device;

use super::stats::ExampleSums;
use super::step::{loss_and_correct, to_tensor};
use crate::cli::Args;
use crate::data::pipeline::{self, Augment, PipelineConfig, Seams};
use crate::data::{Dataset, shard};
use crate::error::Result;
use crate::model::ResNet;
use crate::parallel::Replicas;

/// Evaluates top-1 accuracy and mean loss of `model` on this rank's shard of `data`, summed
/// over ranks.
pub(super) fn evaluate(
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
        augment_shuffle: 0,
        batch_shuffle: 0,
        clock: None,
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
