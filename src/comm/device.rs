//! The communicator as the GPU path sees it: [`Communicator`] implements
//! [`crate::gpu::host_comm::HostComm`] and [`Inline`] implements [`crate::gpu::host_comm::Meet`], so that
//! `gpu` runs its calls on device memory through them without naming `comm`. The device state
//! itself lives in the communicator ([`super::Core`]'s device part).

use std::sync::Mutex;
use std::time::Duration;

use super::enqueue::Inline;
use super::{Communicator, Hooks, RawOp, Work, argcheck};
use crate::collective::{CallOptions, OpKind};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::gpu::host_comm::{DeviceCall, HostComm, Meet};
use crate::gpu::stream::DeviceState;
use crate::memory::RawBufs;

/// The operation a device job queues: a barrier after the job (its hook), so the work
/// completes once every rank has finished the collective.
fn barrier_after(job: Box<dyn FnOnce() + Send>) -> (RawOp, Hooks) {
    let op = RawOp::new(OpKind::Barrier, DataType::U8, RawBufs::None);
    (op, Hooks { before: Some(job), after: None, worker_only: true })
}

impl HostComm for Communicator {
    type Work = Work<()>;
    type Meet = Inline;

    fn rank(&self) -> usize {
        self.core.ident.rank
    }

    fn size(&self) -> usize {
        self.core.ident.size
    }

    fn hosts(&self) -> usize {
        self.core.ident.topology.hosts
    }

    fn timeout(&self) -> Duration {
        Communicator::timeout(self)
    }

    fn is_aborted(&self) -> bool {
        Communicator::is_aborted(self)
    }

    fn cuda_ipc(&self) -> bool {
        self.core.config.cuda_ipc
    }

    fn cuda_ordered(&self) -> bool {
        self.core.config.cuda_ordered
    }

    fn device_state(&self) -> &Mutex<Option<DeviceState>> {
        &self.core.device
    }

    fn check(&self, call: &DeviceCall) -> Result<Option<usize>> {
        argcheck::check_device(call, self.core.ident.rank, self.core.ident.size)
    }

    fn run_bytes(
        &self,
        kind: OpKind,
        dtype: DataType,
        send: Option<&[u8]>,
        recv: Option<&mut [u8]>,
    ) -> Result<()> {
        Communicator::run_bytes(self, kind, dtype, send, recv, CallOptions::default())
    }

    fn meet(&self) -> Inline {
        self.inline()
    }

    unsafe fn run_job(&self, job: Box<dyn FnOnce() + Send>) -> Result<()> {
        let (op, hooks) = barrier_after(job);
        // SAFETY: a barrier has no buffers; what the job touches stays valid until this
        // returns (this function's contract).
        unsafe { self.run_with_hooks(op, hooks) }
    }

    unsafe fn submit_job(&self, job: Box<dyn FnOnce() + Send>) -> Result<Work<()>> {
        let (op, hooks) = barrier_after(job);
        // SAFETY: a barrier has no buffers; what the job touches stays valid until the work
        // completes (this function's contract).
        unsafe { self.submit_raw_with_hooks(op, None, hooks) }
    }
}

impl Meet for Inline {
    fn rank(&self) -> usize {
        Inline::rank(self)
    }

    fn size(&self) -> usize {
        Inline::size(self)
    }

    fn barrier(&self) -> Result<()> {
        Inline::barrier(self)
    }

    fn all_reduce_u64(&self, v: &mut [u64], op: ReduceOp) -> Result<()> {
        Inline::all_reduce_u64(self, v, op)
    }

    fn fail(&self, e: Error) -> Error {
        Inline::fail(self, e)
    }
}
