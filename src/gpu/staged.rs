//! Collectives on device memory staged through pinned host memory: the path between hosts, and
//! wherever CUDA IPC is not available. The buffer moves in chunks of [`CHUNK`] bytes through two
//! page-locked host buffers on one stream: while the host runs the collective on chunk i in one
//! buffer, the stream copies chunk i-1 back to the device and chunk i+1 out of it through the
//! other, so the copies overlap the network (double buffering; one stream keeps each buffer's
//! copy-out after its previous copy-in, and an event tells the host when a chunk has arrived).
//! All-gather, reduce-scatter and all-to-all, whose output is not their input, do the same
//! through halves of the two buffers (one's for the pieces in, the other's for the pieces out),
//! and a receive fills the buffers on the host and only copies them in. All of them run one
//! chunk pipeline (`Pipeline`), parameterised by what each chunk copies out, what the host
//! runs on it and what it copies back in.
//!
//! The host side is the communicator's own collective on host memory, so every algorithm,
//! transport and failure rule applies unchanged, and the result is what the same collective on
//! host memory gives, bit for bit.
//!
//! Calls are blocking for the host and ordered on the stream: work enqueued on it before the
//! call is finished before its data is read, and the result is in device memory when the call
//! returns.

use std::sync::Arc;

use super::cuda::{self, CudaContext, CudaEvent, CudaStream, Pinned};
use super::host_comm::HostComm;
use crate::collective::OpKind;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};

pub use super::cuda::device_of;

/// Bytes per chunk (rounded down to whole elements).
pub const CHUNK: usize = 4 << 20;

/// Whether `ptr` points into device memory ([`device_of`]).
pub fn is_device_pointer(ptr: u64) -> bool {
    device_of(ptr).is_some()
}

/// The staging buffers of one device's context. Calls take the stream they are ordered on.
#[derive(Debug)]
pub struct DeviceCollectives {
    ctx: Arc<CudaContext>,
    bufs: [Pinned; 2],
    /// "Staging buffer j is ready for the host": recorded after each chunk's copy out of the
    /// device (or, with none, after the copy in that last used the buffer), made once.
    ready: [CudaEvent; 2],
}

/// What the stream does around each chunk (the calls enqueue copies; none of them waits).
type Step<'a> = &'a dyn Fn(usize) -> Result<()>;

/// One staged call as a double-buffered pipeline of `chunks` chunks, chunk i in staging buffer
/// i % 2: the stream copies chunk i+1 out of the device (`out`) while the host runs chunk i
/// (`host`), then the stream copies chunk i's result back in (`back`). One stream orders each
/// buffer's copy out after its previous copy in; an event recorded after the copy out (with
/// none: after the copy in two chunks earlier) tells the host its buffer is ready.
struct Pipeline<'a> {
    chunks: usize,
    out: Option<Step<'a>>,
    host: &'a mut dyn FnMut(usize) -> Result<()>,
    back: Option<Step<'a>>,
}

impl Pipeline<'_> {
    /// Runs every chunk, then waits for the stream: also after a failure, no copy may still
    /// read or write the staging buffers (or the caller's memory) once this returns.
    fn run(self, stream: &CudaStream, ready: &[CudaEvent; 2]) -> Result<()> {
        let result = self.chunks_on(stream, ready);
        result.and(cuda::sync(stream))
    }

    fn chunks_on(self, stream: &CudaStream, ready: &[CudaEvent; 2]) -> Result<()> {
        let Pipeline { chunks, out, host, back } = self;
        // Enqueues what makes chunk i's buffer ready; whether the host must wait for it.
        let prepare = |i: usize| -> Result<bool> {
            match out {
                Some(out) => out(i)?,
                // Nothing to copy out: the buffer is free once the copy in of chunk i-2, the
                // last that read it, has run (the first two are free already).
                None if i < 2 => return Ok(false),
                None => {}
            }
            cuda::record(&ready[i % 2], stream).map(|()| true)
        };
        if chunks == 0 {
            return Ok(());
        }
        let mut wait = prepare(0)?;
        for i in 0..chunks {
            if wait {
                cuda::wait_host(&ready[i % 2], "waiting for a copy")?;
            }
            if i + 1 < chunks {
                // Into the other buffer: queued behind chunk i-1's copy in, which read it (or,
                // with none, after chunk i-1's host call returned); its event was last
                // recorded for chunk i-1, already waited for.
                wait = prepare(i + 1)?;
            }
            host(i)?;
            if let Some(back) = back {
                back(i)?;
            }
        }
        Ok(())
    }
}

impl DeviceCollectives {
    /// Staging for device `ordinal` (its primary context, the one the CUDA runtime and torch
    /// use).
    pub fn on_device(ordinal: usize) -> Result<DeviceCollectives> {
        super::driver_available()?;
        DeviceCollectives::new(cuda::open_device(ordinal)?)
    }

    /// Staging for `ctx`.
    pub fn new(ctx: Arc<CudaContext>) -> Result<DeviceCollectives> {
        // Its contents are only read after a copy into it completed (or are overwritten by
        // the collective first).
        let bufs = [Pinned::new(&ctx, CHUNK)?, Pinned::new(&ctx, CHUNK)?];
        let ready = [cuda::new_event(&ctx, true)?, cuda::new_event(&ctx, true)?];
        Ok(DeviceCollectives { ctx, bufs, ready })
    }

    /// The context the staging belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A new stream of the context (for callers without one of their own).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        cuda::new_stream(&self.ctx)
    }

    /// All-reduces `count` elements of `dtype` in place in device memory at `ptr`, on `comm`,
    /// ordered on `stream` (of this context).
    ///
    /// # Safety
    /// `ptr` is device memory of this context, valid for `count` elements of `dtype`, and
    /// nothing else uses it until the call returns.
    pub unsafe fn all_reduce(
        &mut self,
        comm: &impl HostComm,
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
        comm: &impl HostComm,
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
        comm: &impl HostComm,
        stream: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        kind: OpKind,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.through_host(comm, stream, Flat { ptr, count, dtype, kind }, true) }
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
        comm: &impl HostComm,
        stream: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        kind: OpKind,
    ) -> Result<()> {
        // SAFETY: forwarded contract (nothing is written back).
        unsafe { self.through_host(comm, stream, Flat { ptr, count, dtype, kind }, false) }
    }

    /// [`Self::staged`] (`back`: the host's result is copied back) or [`Self::outbound`]: the
    /// stream copies chunk i+1 to the host while the host runs `kind` on chunk i in the other
    /// buffer.
    ///
    /// # Safety
    /// As [`Self::all_reduce`] (`back` false: `ptr` is only read).
    unsafe fn through_host(
        &mut self,
        comm: &impl HostComm,
        stream: &Arc<CudaStream>,
        call: Flat,
        back: bool,
    ) -> Result<()> {
        let Flat { ptr, count, dtype, kind } = call;
        let (per, total, chunks) = Self::chunking(count, dtype)?;
        let raw = self.raw()?;
        let len = |i: usize| per.min(total - i * per);
        // SAFETY (each): `raw[j]` is a live pinned allocation of CHUNK >= len bytes owned by
        // `self`, borrowed exclusively for this call.
        let host = |j: usize, n: usize| unsafe { std::slice::from_raw_parts_mut(raw[j], n) };
        let at = |i: usize| ptr + (i * per) as u64;
        // SAFETY: device range [at(i), + len(i)) is inside the caller's buffer; the host slice
        // is the staging buffer of chunk i, not read until its event.
        let copy_out = |i: usize| unsafe { cuda::copy_dtoh(stream, host(i % 2, len(i)), at(i)) };
        // SAFETY: as for the copy out; the buffer is not written again before this copy has
        // run (chunk i+2's copy out is queued behind it on the same stream).
        let copy_back = |i: usize| unsafe { cuda::copy_htod(stream, at(i), host(i % 2, len(i))) };
        let mut run = |i: usize| {
            if back {
                return comm.run_bytes(kind, dtype, None, Some(host(i % 2, len(i))));
            }
            // A non-root's reduce passes an empty output, as from C.
            let none: &mut [u8] = &mut [];
            let out = matches!(kind, OpKind::Reduce(..)).then_some(none);
            comm.run_bytes(kind, dtype, Some(host(i % 2, len(i))), out)
        };
        let pipeline = Pipeline {
            chunks,
            out: Some(&copy_out),
            host: &mut run,
            back: back.then_some(&copy_back as Step<'_>),
        };
        pipeline.run(stream, &self.ready)
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
    pub(crate) unsafe fn gathered(
        &mut self,
        comm: &impl HostComm,
        stream: &Arc<CudaStream>,
        call: &super::host_comm::DeviceCall,
    ) -> Result<()> {
        let super::host_comm::DeviceCall { kind, dtype, count, send, recv } = *call;
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
        let raw = self.raw()?;
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
                // SAFETY: `src` is `l` elements inside `send`; the host range is a piece of an
                // input half the host does not read before the chunk's event.
                unsafe { cuda::copy_dtoh(stream, &mut into[k * l * es..(k + 1) * l * es], src) }?;
            }
            Ok(())
        };
        let mut run =
            |i: usize| comm.run_bytes(kind, dtype, Some(host_in(i % 2, i)), Some(host_out(i % 2, i)));
        let copy_back = |i: usize| -> Result<()> {
            let (at, l, from) = (i * per, len(i), host_out(i % 2, i));
            for k in 0..outs {
                let dst = recv + ((k * count + at) * es) as u64;
                // SAFETY: `dst` is `l` elements inside `recv`; the host range is a piece of an
                // output half not written again before chunk i+2's arrival, which this copy
                // precedes on the stream.
                unsafe { cuda::copy_htod(stream, dst, &from[k * l * es..(k + 1) * l * es]) }?;
            }
            Ok(())
        };
        Pipeline { chunks, out: Some(&copy_out), host: &mut run, back: Some(&copy_back) }
            .run(stream, &self.ready)
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
        comm: &impl HostComm,
        stream: &Arc<CudaStream>,
        ptr: u64,
        count: usize,
        dtype: DataType,
        kind: OpKind,
    ) -> Result<()> {
        let (per, total, chunks) = Self::chunking(count, dtype)?;
        let raw = self.raw()?;
        let len = |i: usize| per.min(total - i * per);
        // SAFETY (each): `raw[j]` is a live pinned allocation of CHUNK >= len bytes owned by
        // `self`, borrowed exclusively for this call.
        let host = |j: usize, n: usize| unsafe { std::slice::from_raw_parts_mut(raw[j], n) };
        let mut run = |i: usize| comm.run_bytes(kind, dtype, None, Some(host(i % 2, len(i))));
        // SAFETY: device range [ptr + i*per, + len(i)) is inside the caller's buffer; the host
        // slice is not written again before the event recorded behind this copy.
        let copy_back =
            |i: usize| unsafe { cuda::copy_htod(stream, ptr + (i * per) as u64, host(i % 2, len(i))) };
        Pipeline { chunks, out: None, host: &mut run, back: Some(&copy_back) }.run(stream, &self.ready)
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
        Ok([b0.ptr()?, b1.ptr()?])
    }
}

/// An in-place or one-buffer staged call: `kind` of `count` elements of `dtype` at `ptr`.
#[derive(Debug, Clone, Copy)]
struct Flat {
    ptr: u64,
    count: usize,
    dtype: DataType,
    kind: OpKind,
}
