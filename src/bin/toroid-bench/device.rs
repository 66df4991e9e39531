//! `toroid-bench --device N`: the benchmark's buffers in memory of CUDA device N, every call
//! through the stream entry points' path (`gpu::stream::on_stream`: CUDA IPC between the ranks
//! of a host for the collectives the device windows run, staged through pinned host memory
//! otherwise) on a stream of the benchmark's own. The timed loop ends with a synchronisation of
//! that stream (on the stream-ordered path a call returns once enqueued), so the host clock
//! times the calls' work.
//! The inputs are filled and the outputs checked on the host, copied in and out around the
//! timed calls.

use std::sync::Arc;

use toroid::internals::gpu::cuda::{self, CudaStream, DeviceAlloc};
use toroid::internals::gpu::driver_available;
use toroid::internals::gpu::stream::{self, DevicePath};
use toroid::{Communicator, DataType, OpKind, Result};

/// A send buffer and an output buffer on the device, and the stream the calls are ordered on.
pub struct DeviceBufs {
    stream: Arc<CudaStream>,
    send: DeviceAlloc,
    out: DeviceAlloc,
}

impl DeviceBufs {
    /// Buffers of `send` and `out` bytes on device `ordinal` (at least one byte each).
    pub fn new(ordinal: usize, send: usize, out: usize) -> Result<DeviceBufs> {
        driver_available()?;
        let ctx = cuda::open_device(ordinal)?;
        let stream = cuda::new_stream(&ctx)?;
        let send = DeviceAlloc::new(&ctx, send.max(1), "allocating device memory")?;
        let out = DeviceAlloc::new(&ctx, out.max(1), "allocating device memory")?;
        Ok(DeviceBufs { stream, send, out })
    }

    /// Copies `send` and `out` (host) to the front of the device buffers.
    pub fn upload(&mut self, send: &[u8], out: &[u8]) -> Result<()> {
        self.send.upload(&self.stream, 0, send)?;
        self.out.upload(&self.stream, 0, out)
    }

    /// Waits until the stream has run every call made so far (the stream-ordered path returns
    /// once a call is enqueued).
    pub fn sync(&self) -> Result<()> {
        cuda::sync(&self.stream)
    }

    /// Copies the front of the output buffer into `out` (host).
    pub fn download(&mut self, out: &mut [u8]) -> Result<()> {
        self.out.download(&self.stream, 0, out)
    }

    /// One call of `kind` on `count` elements (the entry points' count: per rank for an
    /// all-gather's input, a reduce-scatter's output and an all-to-all's blocks). In place, the
    /// output buffer is both: an all-gather reads this rank's piece of it, a reduce-scatter
    /// leaves its result at this rank's piece (NCCL's in-place forms).
    pub fn run(
        &self,
        comm: &Communicator,
        kind: OpKind,
        count: usize,
        dtype: DataType,
        in_place: bool,
    ) -> Result<()> {
        let (send, out) = (self.send.ptr, self.out.ptr);
        let piece = (comm.rank() * count * dtype.size()) as u64;
        let (send, recv) = match (in_place, kind) {
            (false, _) => (send, out),
            (true, OpKind::AllGather) => (out + piece, out),
            (true, OpKind::ReduceScatter(_)) => (out, out + piece),
            (true, _) => (out, out),
        };
        let raw = cuda::raw_stream(&self.stream);
        // SAFETY: both allocations hold what the collective reads and writes (measure sizes
        // them from the same counts), live until this returns, and nothing else uses them;
        // the stream is this buffer's own, of the device's primary context.
        unsafe { stream::on_stream(comm, kind, send, recv, count, dtype, raw) }
    }
}

/// The `algorithm` column of a device row: where `kind` ran ("ipc" or "staged").
pub fn route(comm: &Communicator, kind: OpKind) -> &'static str {
    match stream::route_of(comm, kind) {
        Some(DevicePath::Ordered) => "ordered",
        Some(DevicePath::Ipc) => "ipc",
        Some(DevicePath::Staged) => "staged",
        None => "none",
    }
}
