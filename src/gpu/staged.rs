//! Collectives on device memory staged through pinned host memory: the path between hosts, and
//! wherever CUDA IPC is not available. The buffer moves in chunks of [`CHUNK`] bytes through two
//! page-locked host buffers on one stream: while the host runs the collective on chunk i in one
//! buffer, the stream copies chunk i-1 back to the device and chunk i+1 out of it through the
//! other, so the copies overlap the network (double buffering; one stream keeps each buffer's
//! copy-out after its previous copy-in, and an event tells the host when a chunk has arrived).
//! All-gather, reduce-scatter and all-to-all, whose output is not their input, do the same
//! through halves of the two buffers (one's for the pieces in, the other's for the pieces out).
//!
//! The host side is the communicator's own collective on host memory, so every algorithm,
//! transport and failure rule applies unchanged, and the result is what the same collective on
//! host memory gives, bit for bit.
//!
//! Calls are blocking for the host and ordered on the stream: work enqueued on it before the
//! call is finished before its data is read, and the result is in device memory when the call
//! returns.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};

use super::{driver_err, guard};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::{CallOptions, Communicator, OpKind};

/// Bytes per chunk (rounded down to whole elements).
pub const CHUNK: usize = 4 << 20;

/// The device ordinal of the memory `ptr` points into (`cuPointerGetAttribute`: memory type
/// device); `None` for host memory, and on a machine without CUDA.
pub fn device_of(ptr: u64) -> Option<usize> {
    use cudarc::driver::sys::{CUmemorytype, CUpointer_attribute, CUresult, cuPointerGetAttribute};
    super::driver_available().ok()?;
    guard("reading a pointer's attributes", || {
        cudarc::driver::result::init().ok()?;
        let (mut kind, mut ordinal): (u32, i32) = (0, -1);
        // SAFETY: each destination is a live value of the size its attribute is written as (an
        // unsigned int, an int); any `ptr` value is allowed (an unknown one is an error).
        let ok = unsafe {
            cuPointerGetAttribute(
                (&mut kind as *mut u32).cast(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr,
            ) == CUresult::CUDA_SUCCESS
                && kind == CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
                && cuPointerGetAttribute(
                    (&mut ordinal as *mut i32).cast(),
                    CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr,
                ) == CUresult::CUDA_SUCCESS
        };
        (ok && ordinal >= 0).then_some(ordinal as usize)
    })
    .ok()
    .flatten()
}

/// Whether `ptr` points into device memory ([`device_of`]).
pub fn is_device_pointer(ptr: u64) -> bool {
    device_of(ptr).is_some()
}

/// Waits until everything queued on `stream` has run.
fn sync(stream: &CudaStream) -> Result<()> {
    guard("synchronising", || stream.synchronize())?.map_err(driver_err("synchronising"))
}

/// The staging buffers of one device's context. Calls take the stream they are ordered on.
#[derive(Debug)]
pub struct DeviceCollectives {
    ctx: Arc<CudaContext>,
    bufs: [PinnedHostSlice<u8>; 2],
    /// "Chunk arrived in buffer j": recorded after each copy out, made once.
    arrived: [CudaEvent; 2],
}

impl DeviceCollectives {
    /// Staging for device `ordinal` (its primary context, the one the CUDA runtime and torch
    /// use).
    pub fn on_device(ordinal: usize) -> Result<DeviceCollectives> {
        super::driver_available()?;
        let ctx = guard("opening the device", || {
            CudaContext::new(ordinal).map_err(driver_err("opening the device"))
        })??;
        DeviceCollectives::new(ctx)
    }

    /// Staging for `ctx`.
    pub fn new(ctx: Arc<CudaContext>) -> Result<DeviceCollectives> {
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
        let event = || ctx.new_event(None).map_err(driver_err("creating an event"));
        let arrived = guard("creating events", || -> Result<[CudaEvent; 2]> { Ok([event()?, event()?]) })??;
        Ok(DeviceCollectives { ctx, bufs, arrived })
    }

    /// The context the staging belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A new stream of the context (for callers without one of their own).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        guard("creating a stream", || self.ctx.new_stream().map_err(driver_err("creating a stream")))?
    }

    /// All-reduces `count` elements of `dtype` in place in device memory at `ptr`, on `comm`,
    /// ordered on `stream` (of this context).
    ///
    /// # Safety
    /// `ptr` is device memory of this context, valid for `count` elements of `dtype`, and
    /// nothing else uses it until the call returns.
    pub unsafe fn all_reduce(
        &mut self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.staged(comm, stream, ptr, count, dtype, OpKind::AllReduce(op)) }
    }

    /// Broadcasts `count` elements of `dtype` in device memory at `ptr` from `root`, on `comm`.
    ///
    /// # Safety
    /// As [`Self::all_reduce`].
    pub unsafe fn broadcast(
        &mut self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        root: usize,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.staged(comm, stream, ptr, count, dtype, OpKind::Broadcast(root)) }
    }

    /// Runs `kind` (an in-place collective whose every element depends only on the same
    /// element of the inputs: all-reduce, broadcast, a reduce at its root) chunk by chunk
    /// through the staging buffers.
    ///
    /// # Safety
    /// As [`Self::all_reduce`].
    pub(crate) unsafe fn staged(
        &mut self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        kind: OpKind,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.through_host(comm, stream, ptr, count, dtype, kind, true) }
    }

    /// Sends (`kind`: a send, or a reduce at a rank other than its root, whose output is on
    /// the root only) `count` elements of `dtype` from device memory at `ptr`, chunk by chunk
    /// as [`Self::staged`] cuts them (every rank derives the same chunks from the count).
    ///
    /// # Safety
    /// `ptr` is device memory of this context, valid for `count` elements of `dtype`, and
    /// nothing writes it until the call returns.
    pub(crate) unsafe fn outbound(
        &mut self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        kind: OpKind,
    ) -> Result<()> {
        // SAFETY: forwarded contract (nothing is written back).
        unsafe { self.through_host(comm, stream, ptr, count, dtype, kind, false) }
    }

    /// [`Self::staged`] (`back`: the host's result is copied back) or [`Self::outbound`]: the
    /// stream copies chunk i+1 to the host while the host runs `kind` on chunk i in the other
    /// buffer.
    ///
    /// # Safety
    /// As [`Self::all_reduce`] (`back` false: `ptr` is only read).
    #[allow(clippy::too_many_arguments)]
    unsafe fn through_host(
        &mut self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        kind: OpKind,
        back: bool,
    ) -> Result<()> {
        let (per, total, chunks) = Self::chunking(count, dtype)?;
        let cu = stream.cu_stream();
        let raw = self.raw()?;
        let DeviceCollectives { arrived, .. } = self;
        let len = |i: usize| per.min(total - i * per);
        // SAFETY (each): `raw[j]` is a live pinned allocation of CHUNK >= len bytes owned by
        // `self`, borrowed exclusively for this call.
        let host = |j: usize, n: usize| unsafe { std::slice::from_raw_parts_mut(raw[j], n) };
        let copy_out = |i: usize| -> Result<()> {
            guard("copying to the host", || -> Result<_> {
                // SAFETY: device range [ptr + i*per, + len(i)) is inside the caller's buffer;
                // the host slice is the staging buffer of chunk i, not read until the event.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(host(i % 2, len(i)), ptr + (i * per) as u64, cu)
                }
                .map_err(driver_err("copying to the host"))?;
                arrived[i % 2].record(stream).map_err(driver_err("recording an event"))
            })?
        };
        if chunks == 0 {
            return Ok(());
        }
        let run = || -> Result<()> {
            copy_out(0)?;
            for i in 0..chunks {
                guard("waiting for a copy", || arrived[i % 2].synchronize())?
                    .map_err(driver_err("waiting for a copy"))?;
                if i + 1 < chunks {
                    // Queued behind chunk i-1's copy-in, which read the same buffer (or, not
                    // writing back, after chunk i-1's host call returned); its event was last
                    // recorded for chunk i-1, already waited for.
                    copy_out(i + 1)?;
                }
                if !back {
                    // A non-root's reduce passes an empty output, as from C.
                    let none: &mut [u8] = &mut [];
                    let out = matches!(kind, OpKind::Reduce(..)).then_some(none);
                    comm.run_bytes(kind, dtype, Some(host(i % 2, len(i))), out, CallOptions::default())?;
                    continue;
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
        result.and(sync(stream))
    }

    /// All-gather (`count` elements from every rank into `n x count`), reduce-scatter
    /// (`n x count` into `count`) or all-to-all (`n x count` into `n x count`, `count` per
    /// rank) of device memory through the staging buffers, chunk by chunk (`len` elements of
    /// every piece per chunk). Each buffer is split in two halves, the first buffer's for the
    /// pieces in and the second's for the pieces out, so the copies overlap the host: while the
    /// host runs chunk i from input half i % 2 into output half i % 2, the stream copies chunk
    /// i+1's pieces out into the other input half and, behind them, chunk i-1's results in from
    /// the other output half. Waiting for chunk i's arrival (an event recorded after its copy
    /// out) also waits for everything queued before it, chunk i-2's copy in from output half
    /// i % 2 included, so that half is free for chunk i. In place (all-to-all: `send == recv`;
    /// NCCL's forms of the other two), a chunk's copies in write only elements of its own
    /// range, which every later copy out leaves alone and every earlier one has read.
    ///
    /// # Safety
    /// `send` and `recv` are device memory of this context valid for the sizes above, not used
    /// by anything else until the call returns, overlapping only in the in-place forms the
    /// stream entry points allow; `stream` is of this context.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gathered(
        &mut self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        kind: OpKind,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
    ) -> Result<()> {
        let (n, es, half) = (comm.size(), dtype.size(), CHUNK / 2);
        if n.saturating_mul(es) > half {
            return Err(Error::Unsupported(
                format!(
                    "{kind:?} on device memory among {n} ranks: one element per rank exceeds the staging"
                )
                .into(),
            ));
        }
        let per = half / es / n;
        let chunks = count.div_ceil(per);
        let len = |i: usize| per.min(count - i * per);
        let cu = stream.cu_stream();
        let raw = self.raw()?;
        let DeviceCollectives { arrived, .. } = self;
        // Pieces in and out per rank; piece k of a side is at `k x count` elements.
        let (ins, outs) = match kind {
            OpKind::AllGather => (1, n),
            OpKind::AllToAll => (n, n),
            _ => (n, 1),
        };
        // SAFETY (both): half j of a pinned buffer of CHUNK = 2 x half bytes owned by `self`
        // and borrowed exclusively for this call; n x len x es <= half. The host touches a half
        // only after the copies into or out of it were waited for (see above).
        let host_in = |j: usize, i: usize| unsafe {
            std::slice::from_raw_parts_mut(raw[0].add(j * half), ins * len(i) * es)
        };
        let host_out = |j: usize, i: usize| unsafe {
            std::slice::from_raw_parts_mut(raw[1].add(j * half), outs * len(i) * es)
        };
        let copy_out = |i: usize| -> Result<()> {
            let (at, l, into) = (i * per, len(i), host_in(i % 2, i));
            for k in 0..ins {
                let src = send + ((k * count + at) * es) as u64;
                guard("copying to the host", || {
                    // SAFETY: `src` is `l` elements inside `send`; the host range is a piece of
                    // an input half the host does not read before the event below.
                    unsafe {
                        cudarc::driver::result::memcpy_dtoh_async(
                            &mut into[k * l * es..(k + 1) * l * es],
                            src,
                            cu,
                        )
                    }
                })?
                .map_err(driver_err("copying to the host"))?;
            }
            guard("recording an event", || arrived[i % 2].record(stream))?
                .map_err(driver_err("recording an event"))
        };
        let run = || -> Result<()> {
            if chunks == 0 {
                return Ok(());
            }
            copy_out(0)?;
            for i in 0..chunks {
                guard("waiting for a copy", || arrived[i % 2].synchronize())?
                    .map_err(driver_err("waiting for a copy"))?;
                if i + 1 < chunks {
                    // Into the input half the host read for chunk i-1 (its call has returned).
                    copy_out(i + 1)?;
                }
                let (at, l, from) = (i * per, len(i), host_out(i % 2, i));
                comm.run_bytes(
                    kind,
                    dtype,
                    Some(host_in(i % 2, i)),
                    Some(&mut *from),
                    CallOptions::default(),
                )?;
                for k in 0..outs {
                    let dst = recv + ((k * count + at) * es) as u64;
                    guard("copying to the device", || {
                        // SAFETY: `dst` is `l` elements inside `recv`; the host range is a piece
                        // of an output half not written again before chunk i+2's arrival,
                        // which this copy precedes on the stream.
                        unsafe {
                            cudarc::driver::result::memcpy_htod_async(
                                dst,
                                &from[k * l * es..(k + 1) * l * es],
                                cu,
                            )
                        }
                    })?
                    .map_err(driver_err("copying to the device"))?;
                }
            }
            Ok(())
        };
        let result = run();
        // Also after a failure: no copy may still be in flight once this returns.
        result.and(sync(stream))
    }

    /// Receives (`kind`: a receive) `count` elements of `dtype` into device memory at `ptr`,
    /// chunk by chunk as [`Self::outbound`] sends them: the host receives chunk i into one
    /// buffer while the stream copies chunk i-1 to the device from the other.
    ///
    /// # Safety
    /// `ptr` is device memory of this context, valid for `count` elements of `dtype`, and
    /// nothing else uses it until the call returns.
    pub(crate) unsafe fn inbound(
        &mut self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        kind: OpKind,
    ) -> Result<()> {
        let (per, total, chunks) = Self::chunking(count, dtype)?;
        let cu = stream.cu_stream();
        let raw = self.raw()?;
        // Here an event says "the copy to the device out of buffer j has run" (buffer j free).
        let DeviceCollectives { arrived: copied, .. } = self;
        let len = |i: usize| per.min(total - i * per);
        // SAFETY (each): `raw[j]` is a live pinned allocation of CHUNK >= len bytes owned by
        // `self`, borrowed exclusively for this call.
        let host = |j: usize, n: usize| unsafe { std::slice::from_raw_parts_mut(raw[j], n) };
        let run = || -> Result<()> {
            for i in 0..chunks {
                let j = i % 2;
                if i >= 2 {
                    // Chunk i-2's copy out of this buffer must have run before it is overwritten.
                    guard("waiting for a copy", || copied[j].synchronize())?
                        .map_err(driver_err("waiting for a copy"))?;
                }
                comm.run_bytes(kind, dtype, None, Some(host(j, len(i))), CallOptions::default())?;
                guard("copying to the device", || -> Result<_> {
                    // SAFETY: device range [ptr + i*per, + len(i)) is inside the caller's
                    // buffer; the host slice is not written again before the event below.
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(
                            ptr + (i * per) as u64,
                            &*host(j, len(i)),
                            cu,
                        )
                    }
                    .map_err(driver_err("copying to the device"))?;
                    copied[j].record(stream).map_err(driver_err("recording an event"))
                })??;
            }
            Ok(())
        };
        let result = run();
        // Also after a failure: no copy may still be reading the staging buffers (or writing the
        // caller's memory) once this returns.
        result.and(sync(stream))
    }

    /// Bytes per chunk (whole elements), total bytes and chunks of `count` elements of `dtype`.
    fn chunking(count: usize, dtype: DataType) -> Result<(usize, usize, usize)> {
        let es = dtype.size();
        let per = CHUNK / es * es;
        let total = count
            .checked_mul(es)
            .ok_or_else(|| Error::InvalidArgument(format!("{count} elements of {dtype} overflow").into()))?;
        Ok((per, total, total.div_ceil(per)))
    }

    /// The staging buffers' host addresses.
    fn raw(&mut self) -> Result<[*mut u8; 2]> {
        let [b0, b1] = &mut self.bufs;
        guard("mapping pinned memory", || -> Result<[*mut u8; 2]> {
            Ok([
                b0.as_mut_ptr().map_err(driver_err("pinned memory"))?,
                b1.as_mut_ptr().map_err(driver_err("pinned memory"))?,
            ])
        })?
    }
}
