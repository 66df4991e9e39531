//! The cost model of a new communicator: measured by the probe at creation, or inherited from
//! the communicator it was made from, since the links are the same.
//!
//! The probe (`tuning::probe`: ping-pongs, bulk transfers and a timed reduction, agreed by an
//! all-reduce of maxima) costs tens of milliseconds on a small host and allocates its 8 MiB
//! scratch: most of what a shrink or a grow would otherwise spend after connecting. A shrink
//! and a split keep a subset of the parent's ranks on the parent's hosts, so every member holds
//! the same agreed measurements already and needs no collective at all. A grow may bring a new
//! host: its ranks agree by one small all-reduce of maxima of the old ranks' measurements (the
//! new ranks contribute zeros) and of the parent's host count; when the grown communicator has
//! more hosts than that, the links between hosts were never measured and every rank runs the
//! probe, as at creation. The processes' share of the cores is taken afresh in the grow (more
//! ranks may now share a machine); a shrink or split keeps the parent's, an upper bound.

use crate::collective::{CallOptions, OpKind};
use crate::comm::Communicator;
use crate::dtype::{DataType, ReduceOp};
use crate::error::Result;
use crate::tuning::{CostModel, PROBE_LEN, ProbeResult, Shape};

/// Where the cost model of a new communicator comes from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Calibration {
    /// The probe, as at creation.
    Probe,
    /// The parent's agreed measurements (shrink, split: the same ranks' links).
    Inherit(Option<ProbeResult>),
    /// A grow: an old rank's parent measurements and the parent's host count (`None` on a new
    /// rank).
    Grow(Option<(ProbeResult, usize)>),
}

/// The slot of the cores share in a [`ProbeResult`].
const CPU_SHARE: usize = 5;

impl Communicator {
    /// Sets the cost model: `explicit` (`TOROID_COST_MODEL`) when given, else as `how` says.
    /// Every rank passes the same kind of `how` (a grow's old and new ranks both `Grow`), so the
    /// collectives it runs match.
    pub(super) fn calibrate(&self, explicit: Option<CostModel>, how: Calibration) -> Result<()> {
        let shape = self.core.tuning.untuned.1.clone();
        let measured = match (explicit, how) {
            (Some(m), _) => {
                self.set_model(m, shape, None);
                return Ok(());
            }
            (None, _) if self.size() == 1 => {
                self.set_model(CostModel::default(), shape, None);
                return Ok(());
            }
            (None, Calibration::Inherit(Some(r))) => r,
            (None, Calibration::Grow(parent)) => match self.agree_on_parent(parent)? {
                Some(r) => r,
                None => self.probe()?,
            },
            (None, Calibration::Probe | Calibration::Inherit(None)) => self.probe()?,
        };
        let model = CostModel::from_probe(&measured);
        let shape = Shape { cpu_share: measured[CPU_SHARE].max(1.0), ..shape };
        self.set_model(model, shape, Some(measured));
        Ok(())
    }

    /// The probe's measurements, agreed by an all-reduce of maxima (a collective).
    fn probe(&self) -> Result<ProbeResult> {
        let mut r = [0f64; PROBE_LEN];
        self.go(OpKind::Probe, DataType::F64, None, Some(bytemuck::cast_slice_mut(&mut r)))?;
        self.all_reduce_exact(&mut r)?;
        Ok(r)
    }

    /// A grow's agreement: the old ranks' measurements if the grown communicator spans no more
    /// hosts than the parent did, else `None` (every rank decides the same from the same sums).
    fn agree_on_parent(&self, parent: Option<(ProbeResult, usize)>) -> Result<Option<ProbeResult>> {
        let mut v = [0f64; PROBE_LEN + 1];
        if let Some((r, hosts)) = parent {
            v[..PROBE_LEN].copy_from_slice(&r);
            v[PROBE_LEN] = hosts as f64;
        }
        let t = &self.core.ident.topology;
        let cores = crate::sys::cpu::online_cpus();
        v[CPU_SHARE] = (t.machine_ranks(self.rank()) as f64 / cores as f64).max(1.0);
        self.all_reduce_exact(&mut v)?;
        let parent_hosts = v[PROBE_LEN] as usize;
        let mut r = [0f64; PROBE_LEN];
        r.copy_from_slice(&v[..PROBE_LEN]);
        Ok((parent_hosts > 0 && t.hosts <= parent_hosts).then_some(r))
    }

    /// An all-reduce of maxima in f64 whatever `TOROID_WIRE_DTYPE` says: f16 would flush the
    /// link costs (microseconds, nanoseconds per byte) to zero.
    fn all_reduce_exact(&self, v: &mut [f64]) -> Result<()> {
        let exact = CallOptions { wire: Some(DataType::F64), ..CallOptions::default() };
        self.all_reduce_with(v, ReduceOp::Max, exact)
    }

    fn set_model(&self, model: CostModel, shape: Shape, measured: Option<ProbeResult>) {
        if self.rank() == 0 {
            tracing::info!(target: "toroid::tuning", "cost model: {model} (cpu share {:.1})", shape.cpu_share);
        }
        if let Some(m) = measured {
            let _ = self.core.tuning.measured.set(m);
        }
        let _ = self.core.tuning.model.set((model, shape));
    }

    /// The measurements this communicator's model came from (`None`: explicit or one rank),
    /// for the communicators made from it.
    pub(crate) fn measured(&self) -> Option<ProbeResult> {
        self.core.tuning.measured.get().copied()
    }
}
