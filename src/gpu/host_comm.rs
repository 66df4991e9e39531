//! What the GPU path needs from a communicator, as two narrow traits, so that `gpu` never names
//! the communicator (`comm` depends on `gpu`, never the reverse): [`HostComm`], what a call on
//! device memory asks of the communicator it runs on (its rank and size, its settings, its
//! argument check, a host collective on host buffers, its queue), and [`Meet`], the direct
//! runner a queued job's hook meets the other ranks with. `comm` implements both for its
//! communicator and owns the [`DeviceState`] they hand out.
//!
//! [`DeviceCall`] describes one call on device memory as the C entry points take it; the
//! communicator's argument check reads it.

use std::sync::Mutex;
use std::time::Duration;

use super::stream::DeviceState;
use crate::collective::OpKind;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};

/// One collective on device memory as a caller describes it: `kind` of `count` elements of
/// `dtype` (per rank: an all-gather's sendcount, a reduce-scatter's recvcount, an all-to-all's
/// count per rank) from device memory at `send` into device memory at `recv` (in place: the
/// same pointer, or NCCL's forms for all-gather and reduce-scatter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCall {
    /// What to do.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DataType,
    /// Elements (per rank, as above).
    pub count: usize,
    /// The input's device address (unused by a receive).
    pub send: u64,
    /// The output's device address (unused by a send, and by a reduce's non-root).
    pub recv: u64,
}

impl DeviceCall {
    /// Bytes of `count` elements (the call passed the argument check: no overflow).
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// The same call on other buffers (one chunk of it).
    pub fn with(&self, send: u64, recv: u64, count: usize) -> DeviceCall {
        DeviceCall { send, recv, count, ..*self }
    }
}

/// What the GPU path needs from the communicator a call on device memory runs on.
pub trait HostComm {
    /// What an asynchronous call returns: the communicator's work, completed once the job is.
    type Work;
    /// The direct runner handed to a queued job's hook.
    type Meet: Meet;

    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Number of hosts the ranks are on.
    fn hosts(&self) -> usize;
    /// The default deadline of every call.
    fn timeout(&self) -> Duration;
    /// True once aborted.
    fn is_aborted(&self) -> bool;
    /// Whether CUDA IPC may be used (`TOROID_CUDA_IPC`).
    fn cuda_ipc(&self) -> bool;
    /// Whether the IPC path between processes may enqueue on the caller's stream
    /// (`TOROID_CUDA_ORDERED`).
    fn cuda_ordered(&self) -> bool;
    /// The device state of this communicator's calls on device memory (made by the first).
    fn device_state(&self) -> &Mutex<Option<DeviceState>>;
    /// Checks `call`'s arguments, as every other call on this communicator is checked: the
    /// device ordinal its buffers are on, or `None` when it has nothing to do.
    fn check(&self, call: &DeviceCall) -> Result<Option<usize>>;
    /// Runs `kind` on host buffers, blocking (the communicator's own host collective).
    fn run_bytes(
        &self,
        kind: OpKind,
        dtype: DataType,
        send: Option<&[u8]>,
        recv: Option<&mut [u8]>,
    ) -> Result<()>;
    /// The direct runner for a hook of a queued job.
    fn meet(&self) -> Self::Meet;
    /// Runs `job` as a blocking call of the communicator, in issue order (on this thread when
    /// nothing is queued), followed by a barrier.
    ///
    /// # Safety
    /// Whatever `job` touches stays valid until this returns.
    unsafe fn run_job(&self, job: Box<dyn FnOnce() + Send>) -> Result<()>;
    /// Queues `job`, followed by a barrier, on the communicator's queue; the work completes
    /// once it has run.
    ///
    /// # Safety
    /// Whatever `job` touches stays valid until the work completes.
    unsafe fn submit_job(&self, job: Box<dyn FnOnce() + Send>) -> Result<Self::Work>;
}

/// Meetings of the ranks from inside a queued job (which holds the queue, so they keep their
/// place in issue order on every rank).
pub trait Meet: Send + 'static {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// A barrier.
    fn barrier(&self) -> Result<()>;
    /// An in-place all-reduce of `v` with `op`.
    fn all_reduce_u64(&self, v: &mut [u64], op: ReduceOp) -> Result<()>;
    /// Fails the communicator with `e`, as a failed operation does (every rank learns of it).
    fn fail(&self, e: Error) -> Error;
}
