//! Checkpoints: parameters, BN buffers and momentum in one safetensors file, progress in a JSON
//! file beside it. Written by rank 0 only (all replicas are identical), atomically (temporary
//! file, then rename), so a crash mid-write leaves the previous checkpoint intact.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::bail;
use crate::error::{Context, Result};
use crate::model::ResNet;

/// What a checkpoint records besides tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// The next epoch to run.
    pub next_epoch: u64,
    /// Optimiser steps taken.
    pub step: u64,
    /// The model description (`{:?}` of its config); must match on resume.
    pub model: String,
    /// Parameter count; must match on resume.
    pub num_params: usize,
}

/// The tensors file of a checkpoint at `path` (`.safetensors` beside the `.json`).
fn tensor_path(json: &Path) -> PathBuf {
    json.with_extension("safetensors")
}

/// Writes `dir/checkpoint.json` and `dir/checkpoint.safetensors`.
pub fn save(dir: &Path, model: &ResNet, momentum: &[Vec<f32>], meta: &Meta) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).context(|| format!("cannot create {}", dir.display()))?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (p, m) in model.params.iter().zip(momentum) {
        tensors.insert(p.name.clone(), p.var.as_tensor().clone());
        tensors.insert(format!("momentum.{}", p.name), Tensor::from_slice(m, p.var.shape(), &Device::Cpu)?);
    }
    for b in &model.buffers {
        tensors.insert(b.name.clone(), b.var.as_tensor().clone());
    }
    let json = dir.join("checkpoint.json");
    let st = tensor_path(&json);
    let tmp_st = st.with_extension("safetensors.tmp");
    candle_core::safetensors::save(&tensors, &tmp_st)?;
    std::fs::rename(&tmp_st, &st)?;
    let tmp_json = json.with_extension("json.tmp");
    std::fs::write(
        &tmp_json,
        serde_json::to_string_pretty(meta).context(|| "cannot encode checkpoint metadata")?,
    )?;
    std::fs::rename(&tmp_json, &json)?;
    Ok(json)
}

/// Reads a checkpoint (`path` is the `.json` file or the directory holding it).
pub fn load(path: &Path) -> Result<(Meta, HashMap<String, Tensor>)> {
    let json = if path.is_dir() { path.join("checkpoint.json") } else { path.to_path_buf() };
    let text =
        std::fs::read_to_string(&json).context(|| format!("cannot read checkpoint {}", json.display()))?;
    let meta: Meta = serde_json::from_str(&text)
        .context(|| format!("malformed checkpoint metadata {}", json.display()))?;
    let st = tensor_path(&json);
    let tensors = candle_core::safetensors::load(&st, &Device::Cpu)
        .context(|| format!("cannot read {}", st.display()))?;
    Ok((meta, tensors))
}

/// Loads checkpoint tensors into `model` and `momentum`, checking every name and shape.
pub fn restore(
    model: &ResNet,
    momentum: &mut [Vec<f32>],
    meta: &Meta,
    tensors: &HashMap<String, Tensor>,
) -> Result<()> {
    if meta.num_params != model.num_params() || meta.model != format!("{:?}", model.config) {
        bail!(
            "checkpoint is for another model ({}, {} parameters); this run is {:?} with {} parameters",
            meta.model,
            meta.num_params,
            model.config,
            model.num_params()
        );
    }
    let get = |name: &str, shape: &candle_core::Shape| -> Result<&Tensor> {
        match tensors.get(name) {
            Some(t) if t.shape() == shape => Ok(t),
            Some(t) => bail!("checkpoint tensor {name} has shape {:?}, model expects {shape:?}", t.shape()),
            None => bail!("checkpoint has no tensor {name}"),
        }
    };
    for (p, m) in model.params.iter().zip(momentum.iter_mut()) {
        p.var.set(get(&p.name, p.var.shape())?)?;
        *m = get(&format!("momentum.{}", p.name), p.var.shape())?.flatten_all()?.to_vec1()?;
    }
    for b in &model.buffers {
        b.var.set(get(&b.name, b.var.shape())?)?;
    }
    Ok(())
}
