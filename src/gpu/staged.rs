//! Collectives on device memory staged through pinned host memory: the path between hosts, and
//! wherever CUDA IPC is not available. The buffer moves in chunks of [`CHUNK`] bytes through two
//! page-locked host buffers on one stream: while the host runs the collective on chunk i in one
//! buffer, the stream copies chunk i-1 back to the device and chunk i+1 out of it through the
//! other, so the copies overlap the network (double buffering; one stream keeps each buffer's
//! copy-out after its previous copy-in, and an event tells the host when a chunk has arrived).
//!
//! The host side is the communicator's own collective on host memory, so every algorithm,
//! transport and failure rule applies unchanged, and the result is what the same collective on
//! host memory gives, bit for bit.
//!
//! Calls are blocking for the host and ordered on the stream: work enqueued on it before the
//! call is finished before its data is read, and the result is in device memory when the call
//! returns.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, PinnedHostSlice};

use super::guard;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::{CallOptions, Communicator, OpKind};

/// Bytes per chunk (rounded down to whole elements).
pub const CHUNK: usize = 4 << 20;

/// Whether `ptr` points into device memory (`cuPointerGetAttribute`, memory type device).
/// `false` for host memory, and on a machine without CUDA.
pub fn is_device_pointer(ptr: u64) -> bool {
    if super::driver_available().is_err() {
        return false;
    }
    guard("reading a pointer's attributes", || {
        if cudarc::driver::result::init().is_err() {
            return false;
        }
        let mut kind: u32 = 0;
        // SAFETY: `kind` is a live u32, the size the memory-type attribute is written as; any
        // `ptr` value is allowed (an unknown one is an error, not a fault).
        let r = unsafe {
            cudarc::driver::sys::cuPointerGetAttribute(
                (&mut kind as *mut u32).cast(),
                cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr,
            )
        };
        r == cudarc::driver::sys::CUresult::CUDA_SUCCESS
            && kind == cudarc::driver::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
    })
    .unwrap_or(false)
}

/// The staging buffers and the stream of one device.
#[derive(Debug)]
pub struct DeviceCollectives {
    stream: Arc<CudaStream>,
    bufs: [PinnedHostSlice<u8>; 2],
}

fn driver_err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::System(format!("CUDA: {what}: {e:?}").into())
}

impl DeviceCollectives {
    /// Collectives on device `ordinal`'s memory, on a new stream of its primary context.
    pub fn on_device(ordinal: usize) -> Result<DeviceCollectives> {
        super::driver_available()?;
        let stream = guard("creating a stream", || {
            CudaContext::new(ordinal).and_then(|c| c.new_stream()).map_err(driver_err("creating a stream"))
        })??;
        DeviceCollectives::on_stream(stream)
    }

    /// Collectives ordered on `stream`.
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<DeviceCollectives> {
        let ctx = stream.context().clone();
        let alloc = || {
            // SAFETY: page-locked host memory of CHUNK bytes; its contents are only read after
            // a copy into it completed (or are overwritten by the collective first). Flags 0:
            // cached, not write-combined, because the host reads it.
            unsafe { ctx.alloc_pinned_with_flags::<u8>(CHUNK, 0) }
                .map_err(driver_err("allocating pinned memory"))
        };
        let bufs = guard("allocating pinned memory", || -> Result<[PinnedHostSlice<u8>; 2]> {
            Ok([alloc()?, alloc()?])
        })??;
        Ok(DeviceCollectives { stream, bufs })
    }

    /// The stream calls are ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// All-reduces `count` elements of `dtype` in place in device memory at `ptr`, on `comm`.
    ///
    /// # Safety
    /// `ptr` is device memory of the stream's context, valid for `count` elements of `dtype`,
    /// and nothing else uses it until the call returns.
    pub unsafe fn all_reduce(
        &mut self,
        comm: &Communicator,
        ptr: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.staged(comm, ptr, count, dtype, OpKind::AllReduce(op)) }
    }

    /// Broadcasts `count` elements of `dtype` in device memory at `ptr` from `root`, on `comm`.
    ///
    /// # Safety
    /// As [`Self::all_reduce`].
    pub unsafe fn broadcast(
        &mut self,
        comm: &Communicator,
        ptr: u64,
        count: usize,
        dtype: DataType,
        root: usize,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.staged(comm, ptr, count, dtype, OpKind::Broadcast(root)) }
    }

    /// Runs `kind` (an in-place collective whose every element depends only on the same
    /// element of the inputs) chunk by chunk through the staging buffers.
    ///
    /// # Safety
    /// As [`Self::all_reduce`].
    unsafe fn staged(
        &mut self,
        comm: &Communicator,
        ptr: u64,
        count: usize,
        dtype: DataType,
        kind: OpKind,
    ) -> Result<()> {
        let es = dtype.size();
        let per = CHUNK / es * es;
        let total = count
            .checked_mul(es)
            .ok_or_else(|| Error::InvalidArgument(format!("{count} elements of {dtype} overflow").into()))?;
        let chunks = total.div_ceil(per);
        let stream = self.stream.clone();
        let cu = stream.cu_stream();
        let [b0, b1] = &mut self.bufs;
        let raw = guard("mapping pinned memory", || -> Result<[*mut u8; 2]> {
            Ok([
                b0.as_mut_ptr().map_err(driver_err("pinned memory"))?,
                b1.as_mut_ptr().map_err(driver_err("pinned memory"))?,
            ])
        })??;
        let len = |i: usize| per.min(total - i * per);
        // SAFETY (each): `raw[j]` is a live pinned allocation of CHUNK >= len bytes owned by
        // `self`, borrowed exclusively for this call.
        let host = |j: usize, n: usize| unsafe { std::slice::from_raw_parts_mut(raw[j], n) };
        let copy_out = |i: usize| -> Result<cudarc::driver::CudaEvent> {
            guard("copying to the host", || -> Result<_> {
                // SAFETY: device range [ptr + i*per, + len(i)) is inside the caller's buffer;
                // the host slice is the staging buffer of chunk i, not read until the event.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(host(i % 2, len(i)), ptr + (i * per) as u64, cu)
                }
                .map_err(driver_err("copying to the host"))?;
                stream.record_event(None).map_err(driver_err("recording an event"))
            })?
        };
        if chunks == 0 {
            return Ok(());
        }
        let run = || -> Result<()> {
            let mut arrived = copy_out(0)?;
            for i in 0..chunks {
                guard("waiting for a copy", || arrived.synchronize())?
                    .map_err(driver_err("waiting for a copy"))?;
                if i + 1 < chunks {
                    // Queued behind chunk i-1's copy-in, which read the same buffer.
                    arrived = copy_out(i + 1)?;
                }
                comm.run_bytes(kind, dtype, None, Some(host(i % 2, len(i))), CallOptions::default())?;
                guard("copying to the device", || {
                    // SAFETY: as for the copy out; the buffer is not written again before this
                    // copy has run (chunk i+2's copy-out is queued behind it on the same stream).
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(
                            ptr + (i * per) as u64,
                            &*host(i % 2, len(i)),
                            cu,
                        )
                    }
                })?
                .map_err(driver_err("copying to the device"))?;
            }
            Ok(())
        };
        let result = run();
        // Also after a failure: no copy may still be writing into the staging buffers (or the
        // caller's memory) once this returns.
        let synced = guard("synchronising", || stream.synchronize())?.map_err(driver_err("synchronising"));
        result.and(synced)
    }
}
