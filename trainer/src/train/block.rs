//! BMUF's block synchronisation inside the training loop (the algorithm is in `bmuf.rs`): the
//! host copies of the parameters (and Adam's moments) are flattened into one vector, synchronised
//! with one all-reduce, and copied back to the host and to the model.

use candle_core::Tensor;

use super::Trainer;
use crate::bmuf::{AdamState, LocalMomentum};
use crate::error::Result;

impl Trainer {
    /// After a local step: ends the block when it is complete.
    pub(super) fn after_local_step(&mut self) -> Result<()> {
        if self.bmuf.as_mut().is_some_and(|b| b.local_step()) {
            self.block_sync()?;
        }
        Ok(())
    }

    /// Ends the current block now if local steps were taken since the last one (before an
    /// evaluation, a checkpoint or the end of an epoch, which need one model on every rank).
    pub(super) fn finish_block(&mut self) -> Result<()> {
        if self.bmuf.as_ref().is_some_and(|b| b.pending()) {
            self.block_sync()?;
        }
        Ok(())
    }

    /// Synchronises the block: every rank ends with the same parameters (checked with a hash
    /// when `--check-every` is not 0).
    fn block_sync(&mut self) -> Result<()> {
        let Some(bmuf) = self.bmuf.as_mut() else { return Ok(()) };
        let flat = |f: fn(&super::HostParam) -> &Vec<f32>| -> Vec<f32> {
            self.host.iter().flat_map(|h| f(h).iter().copied()).collect()
        };
        let mut params = flat(|h| &h.data);
        let bytes = match &self.adam {
            Some(a) => {
                let (mut m, mut v) = (flat(|h| &h.momentum), flat(|h| &h.second));
                let state = AdamState {
                    m: &mut m,
                    v: &mut v,
                    t: &mut self.adam_t,
                    t1: &mut self.adam_t1,
                    beta1: a.beta1,
                    beta2: a.beta2,
                };
                let bytes = bmuf.sync(self.rep.comm(), &mut params, Some(state))?;
                let mut off = 0;
                for h in &mut self.host {
                    let n = h.data.len();
                    h.momentum.copy_from_slice(&m[off..off + n]);
                    h.second.copy_from_slice(&v[off..off + n]);
                    off += n;
                }
                bytes
            }
            None => {
                let bytes = bmuf.sync(self.rep.comm(), &mut params, None)?;
                if bmuf.cfg.local == LocalMomentum::Reset {
                    for h in &mut self.host {
                        h.momentum.fill(0.0);
                    }
                }
                bytes
            }
        };
        self.progress.bytes += bytes as f64;
        let mut off = 0;
        for (h, p) in self.host.iter_mut().zip(&self.model.params) {
            let n = h.data.len();
            h.data.copy_from_slice(&params[off..off + n]);
            p.var.set(&Tensor::from_slice(&h.data, p.var.shape(), &self.dev)?)?;
            off += n;
        }
        if self.args.check_every > 0 {
            let what = format!("parameters after BMUF block ending at step {}", self.step);
            self.rep.check_identical(&self.host_values(), &what)?;
        }
        Ok(())
    }
}
