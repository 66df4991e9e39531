//! Collectives on device memory between the ranks of one host through CUDA IPC: each rank
//! allocates a device window of [`WINDOW`] bytes once per communicator and publishes its IPC
//! memory handle; every peer opens each handle once and keeps the mapping for the
//! communicator's life (the IPC handle cache), so the windows of all ranks are plain device
//! pointers to every rank. Ranks that are threads of one process use each other's pointers
//! directly (a process cannot open its own handles).
//!
//! An all-reduce then runs as a reduce-scatter and an all-gather through the windows, chunk by
//! chunk, every byte moved and reduced by the GPU. Each window has two halves that chunks use in
//! turn (double buffering), so two meetings of the ranks per chunk suffice:
//!
//! 1. each rank copies its chunk into its own window's half; meet;
//! 2. rank r reduces segment r of the chunk from every window, in rank order (0, 1, ..., N-1,
//!    with the device kernels of [`super::device`]), into its output, and copies the result
//!    into segment r of its own window; meet;
//! 3. each rank copies every other segment from its owner's window into its output. A half is
//!    written again two chunks later, after a meeting that every rank reaches only once these
//!    copies ran.
//!
//! Each segment is reduced once, by its owner, so every rank ends with the same bits. A
//! broadcast copies the root's chunk into the root's window half, meets, and every other rank
//! copies it out (one meeting per chunk).
//!
//! A meeting is a synchronisation of the stream the collective runs on followed by a collective
//! of the communicator (shared memory or TCP, with its deadlines and failure reports), made by
//! the communicator's worker thread in the collective's queued job ([`super::stream`]). The first meeting of each call is an
//! all-reduce that checks every rank makes the same call (count, type, operation or root), so
//! mismatched calls are an error on every rank, never a read past what a peer wrote.
//!
//! What needs no GPU (the record every rank publishes and how each window is reached, in
//! [`super::window_map`]; the segments) is plain logic with unit tests; the rest runs in
//! `tests/gpu.rs` on a GPU.

use std::sync::Arc;

use super::cuda::{self, CudaContext, CudaStream, DeviceAlloc};
use super::device::DeviceKernels;
use super::host_comm::{DeviceCall, HostComm, Meet};
pub use super::window_map::{Mapping, RECORD, WindowRecord, map_windows};
use super::window_map::{ranks_on_device, separate_processes};
use crate::collective::OpKind;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};

/// Bytes of each rank's device window: two halves of [`HALF`]. The allocation also holds the
/// signal area of the stream-ordered path after it ([`ALLOCATION`]).
pub const WINDOW: usize = 64 << 20;
/// Bytes of each rank's allocation: the window, then the signal area ([`super::signal`]),
/// zeroed when made.
pub const ALLOCATION: usize = WINDOW + super::signal::SIGNAL_BYTES;
/// Bytes of a chunk (a window half).
pub const HALF: usize = WINDOW / 2;

/// Segment `k` of `count` elements split among `n` ranks: (first element, length), balanced
/// (lengths differ by one at most), in rank order, covering `0..count`.
pub fn segment(count: usize, n: usize, k: usize) -> (usize, usize) {
    let at = |k: usize| (count as u128 * k as u128 / n.max(1) as u128) as usize;
    (at(k), at(k + 1) - at(k))
}

/// The kernel that reduces with `op` and the scale after it (avg: a sum, then 1/n). An average
/// of integers is refused (the stream entry points refuse it before any rank meets, so this
/// never splits the ranks).
fn kernel_op(op: ReduceOp, dtype: DataType, n: usize) -> Result<(ReduceOp, Option<f64>)> {
    match op {
        ReduceOp::Avg if dtype.is_float() => Ok((ReduceOp::Sum, Some(1.0 / n as f64))),
        ReduceOp::Avg => Err(Error::Unsupported(format!("avg of {dtype}: averages take float types").into())),
        o => Ok((o, None)),
    }
}

/// Closes a window opened by [`cuda::ipc_open`].
fn close_handle(ctx: &Arc<CudaContext>, ptr: u64) {
    // SAFETY: every caller passes a mapping it opened in `ctx` and no call reads any more.
    unsafe { cuda::ipc_close(ctx, ptr) }
}

/// Every rank's window, mapped in this process, and the kernels that reduce from them.
#[derive(Debug)]
pub struct IpcWindows {
    ctx: Arc<CudaContext>,
    windows: Vec<Mapping>,
    kernels: Arc<DeviceKernels>,
    /// Whether the next chunk uses the second half of every window (flips per chunk, the same
    /// on every rank: each makes the same calls).
    half: bool,
    /// This rank.
    rank: usize,
    /// Whether every rank is a process of its own (the same answer on every rank: from every
    /// rank's record).
    separate: bool,
    /// Ranks on this rank's device, this one included.
    sharing: usize,
    /// This rank's window (declared last: freed after the peers' mappings are closed).
    own: DeviceAlloc,
}

impl Drop for IpcWindows {
    fn drop(&mut self) {
        for m in &self.windows {
            if let Mapping::Opened(p) = m {
                close_handle(&self.ctx, *p);
            }
        }
    }
}

/// This rank's window, its record, and the kernels, or why it cannot take part.
fn make_window(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
    kernels: impl FnOnce() -> Result<Arc<DeviceKernels>>,
) -> Result<(DeviceAlloc, WindowRecord, Arc<DeviceKernels>)> {
    let kernels = kernels()?;
    let own = DeviceAlloc::new(ctx, ALLOCATION, "allocating the device window")?;
    // SAFETY: the whole allocation, just made, used by nothing yet.
    unsafe { cuda::zero(ctx, own.ptr, ALLOCATION) }?;
    let handle = own.ipc_handle()?;
    let record = WindowRecord {
        usable: true,
        device: ordinal as u32,
        pid: std::process::id(),
        bytes: ALLOCATION as u64,
        ptr: own.ptr,
        handle,
    };
    Ok((own, record, kernels))
}

impl IpcWindows {
    /// Sets up the windows of every rank of `comm` on device `ordinal` (a collective: every
    /// rank calls it, with `enabled` false where IPC is off, and all get the same answer).
    /// `kernels` loads the reduction kernels. `Err(Unsupported)` with the reason when any rank
    /// cannot take part; the communicator then stages through host memory.
    pub fn open(
        comm: &impl HostComm,
        ctx: &Arc<CudaContext>,
        ordinal: usize,
        enabled: bool,
        kernels: impl FnOnce() -> Result<Arc<DeviceKernels>>,
    ) -> Result<IpcWindows> {
        let local = if enabled {
            make_window(ctx, ordinal, kernels)
        } else {
            Err(Error::Unsupported("TOROID_CUDA_IPC=0".into()))
        };
        let record = local.as_ref().map_or_else(|_| WindowRecord::unusable(), |(_, r, _)| r.clone());
        let mut all = vec![0u8; RECORD * comm.size()];
        comm.run_bytes(OpKind::AllGather, DataType::U8, Some(&record.encode()), Some(&mut all))?;
        let records = all
            .chunks_exact(RECORD)
            .enumerate()
            .map(|(k, b)| WindowRecord::decode(k, b))
            .collect::<Result<Vec<_>>>();
        let (mut separate, mut sharing) = (false, 1);
        let mapped = match (&local, records) {
            (Err(e), _) => Err(Error::Unsupported(format!("this rank: {e}").into())),
            (Ok(_), Err(e)) => Err(e),
            (Ok(_), Ok(records)) => {
                (separate, sharing) = (separate_processes(&records), ranks_on_device(comm.rank(), &records));
                map_windows(comm.rank(), &records, |_, h| cuda::ipc_open(ctx, h), |p| close_handle(ctx, p))
            }
        };
        // Every rank uses the windows, or none does.
        let mut ok = [u32::from(mapped.is_ok())];
        let as_bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut ok);
        comm.run_bytes(OpKind::AllReduce(ReduceOp::Min), DataType::U32, None, Some(as_bytes))?;
        match (mapped, local) {
            (Ok(windows), Ok((own, _, kernels))) if ok[0] == 1 => Ok(IpcWindows {
                ctx: ctx.clone(),
                windows,
                kernels,
                half: false,
                rank: comm.rank(),
                separate,
                sharing,
                own,
            }),
            (Ok(windows), _) => {
                for m in windows {
                    if let Mapping::Opened(p) = m {
                        close_handle(ctx, p);
                    }
                }
                Err(Error::Unsupported(
                    "another rank could not map every device window (its log says why)".into(),
                ))
            }
            (Err(e), _) => Err(e),
        }
    }

    /// Every rank's window (then its signal area, at [`WINDOW`]), as this process reaches it.
    pub fn ptrs(&self) -> Vec<u64> {
        self.windows.iter().map(|m| m.ptr()).collect()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether every rank is a process of its own (the same on every rank).
    pub fn separate_processes(&self) -> bool {
        self.separate
    }

    /// How many ranks use this rank's device (this one included).
    pub fn ranks_on_device(&self) -> usize {
        self.sharing
    }

    /// Waits for `stream`, then meets every rank. The first meeting of a call also checks that
    /// every rank makes the same call: one all-reduce of maxima over the values and their
    /// complements (so the minimum and maximum of each); later ones are barriers.
    fn meet(meet: &impl Meet, stream: &CudaStream, call: Option<(&str, [u64; 3])>) -> Result<()> {
        cuda::sync(stream)?;
        let Some((what, vals)) = call else { return meet.barrier() };
        let mut v = [vals[0], vals[1], vals[2], !vals[0], !vals[1], !vals[2]];
        meet.all_reduce_u64(&mut v, ReduceOp::Max)?;
        if (0..3).any(|i| v[i] != !v[i + 3]) {
            return Err(Error::InvalidUsage(
                format!(
                    "{what} on device memory: the ranks disagree on (count, type, op/root): this rank ({}, {}, {}), \
                     maxima ({}, {}, {}), minima ({}, {}, {})",
                    vals[0], vals[1], vals[2], v[0], v[1], v[2], !v[3], !v[4], !v[5]
                )
                .into(),
            ));
        }
        Ok(())
    }

    /// `dst <- src`, `bytes` bytes, on `stream`.
    fn copy(stream: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the callers pass ranges inside their buffers or the windows (each at least
        // `bytes` long), not overlapping.
        unsafe { cuda::copy_dtod(stream, dst, src, bytes, "copying on the device") }
    }

    /// The half of every window the next chunk uses (byte offset), flipping for the one after.
    fn next_half(&mut self) -> u64 {
        let at = if self.half { HALF as u64 } else { 0 };
        self.half = !self.half;
        at
    }

    /// Runs `call` (an all-reduce, a broadcast, an all-gather or a reduce-scatter: what the
    /// windows run) ordered on `stream`, meeting the other ranks through `meet`; blocking.
    ///
    /// # Safety
    /// `call`'s buffers are device memory of this context valid for its sizes (as the argument
    /// check accepted them), not used by anything else until the call returns; `stream` is of
    /// this context.
    pub(crate) unsafe fn run(
        &mut self,
        meet: &impl Meet,
        stream: &CudaStream,
        call: &DeviceCall,
    ) -> Result<()> {
        // SAFETY (each): forwarded contract.
        unsafe {
            match call.kind {
                OpKind::AllReduce(op) => self.all_reduce(meet, stream, call, op),
                OpKind::Broadcast(root) => self.broadcast(meet, stream, call, root),
                OpKind::AllGather => self.all_gather(meet, stream, call),
                OpKind::ReduceScatter(op) => self.reduce_scatter(meet, stream, call, op),
                other => Err(Error::Unsupported(format!("{other:?} on device memory").into())),
            }
        }
    }

    /// All-reduces `count` elements of `dtype` from `send` into `recv` (equal: in place) with
    /// `op`, ordered on `stream`; blocking.
    ///
    /// # Safety
    /// `send` and `recv` are device memory of this context valid for `count` elements of
    /// `dtype`, not used by anything else until the call returns; `stream` is of this context.
    unsafe fn all_reduce(
        &mut self,
        meet: &impl Meet,
        stream: &CudaStream,
        call: &DeviceCall,
        op: ReduceOp,
    ) -> Result<()> {
        let DeviceCall { send, recv, count, dtype, .. } = *call;
        let (n, me, es) = (meet.size(), meet.rank(), dtype.size());
        let (kernel_op, scale) = kernel_op(op, dtype, n)?;
        let mut call = Some(("all_reduce", [count as u64, dtype as u64, op as u64]));
        let per = HALF / es;
        let mut at = 0;
        while at < count {
            let len = per.min(count - at);
            let half = self.next_half();
            let own = self.own.ptr + half;
            let (src, dst) = (send + (at * es) as u64, recv + (at * es) as u64);
            // 1. This rank's chunk into its window.
            Self::copy(stream, own, src, len * es)?;
            Self::meet(meet, stream, call.take())?;
            // 2. Segment `me` from every window, in rank order, into the output, then into
            //    this rank's window for the others.
            let (s0, sl) = segment(len, n, me);
            if sl > 0 {
                let off = (s0 * es) as u64;
                let out = dst + off;
                let w = |k: usize| self.windows[k].ptr() + half + off;
                for k in 1..n {
                    let a = if k == 1 { w(0) } else { out };
                    // SAFETY: `out` is inside `recv` (its chunk, segment `me`); `a` and `w(k)`
                    // are that segment in window halves of HALF >= len * es bytes; `out` equals
                    // `a` or overlaps neither input.
                    unsafe { self.kernels.reduce_on(stream, dtype, kernel_op, out, [a, w(k)], sl) }?;
                }
                if let Some(f) = scale {
                    // SAFETY: as above, in place.
                    unsafe { self.kernels.scale_on(stream, dtype, out, out, sl, f) }?;
                }
                Self::copy(stream, own + off, out, sl * es)?;
            }
            Self::meet(meet, stream, None)?;
            // 3. Every other segment from its owner's window. No meeting after: the next chunk
            //    writes the other half, and this half again only after the next chunk's first
            //    meeting, which every rank reaches after these copies ran.
            for k in (0..n).filter(|&k| k != me) {
                let (s0, sl) = segment(len, n, k);
                let off = (s0 * es) as u64;
                Self::copy(stream, dst + off, self.windows[k].ptr() + half + off, sl * es)?;
            }
            at += len;
        }
        Ok(())
    }

    /// Gathers every rank's `count` elements of `dtype` at `send` into every rank's `recv`
    /// (`n x count` elements, rank k's at `k x count`), ordered on `stream`; blocking. In place
    /// when `send` is `recv`'s piece of this rank (NCCL's form).
    ///
    /// # Safety
    /// As [`Self::all_reduce`], `send` valid for `count` and `recv` for `n x count` elements,
    /// overlapping only in NCCL's in-place form.
    unsafe fn all_gather(&mut self, meet: &impl Meet, stream: &CudaStream, call: &DeviceCall) -> Result<()> {
        let DeviceCall { send, recv, count, dtype, .. } = *call;
        let (n, me, es) = (meet.size(), meet.rank(), dtype.size());
        let mut call = Some(("all_gather", [count as u64, dtype as u64, u64::MAX]));
        let per = HALF / es;
        let mut at = 0;
        while at < count {
            let len = per.min(count - at);
            let half = self.next_half();
            // Each rank's chunk into its window; meet; every chunk from its owner's window.
            Self::copy(stream, self.own.ptr + half, send + (at * es) as u64, len * es)?;
            Self::meet(meet, stream, call.take())?;
            for k in 0..n {
                let dst = recv + ((k * count + at) * es) as u64;
                let src = if k == me { send + (at * es) as u64 } else { self.windows[k].ptr() + half };
                if src != dst {
                    Self::copy(stream, dst, src, len * es)?;
                }
            }
            at += len;
        }
        Ok(())
    }

    /// Reduces every rank's `send` (`n x count` elements, piece k at `k x count`) with `op`;
    /// rank k receives piece k of the result in `recv` (`count` elements). Ordered on
    /// `stream`; blocking. In place when `recv` is `send`'s piece of this rank (NCCL's form) or
    /// `send` itself.
    ///
    /// # Safety
    /// As [`Self::all_reduce`], `send` valid for `n x count` and `recv` for `count` elements.
    unsafe fn reduce_scatter(
        &mut self,
        meet: &impl Meet,
        stream: &CudaStream,
        call: &DeviceCall,
        op: ReduceOp,
    ) -> Result<()> {
        let DeviceCall { send, recv, count, dtype, .. } = *call;
        let (n, me, es) = (meet.size(), meet.rank(), dtype.size());
        let (kernel_op, scale) = kernel_op(op, dtype, n)?;
        let mut call = Some(("reduce_scatter", [count as u64, dtype as u64, op as u64]));
        // A chunk takes `len` elements of every piece: n x len in each window half.
        let per = (HALF / es / n).max(1);
        let mut at = 0;
        while at < count {
            let len = per.min(count - at);
            let half = self.next_half();
            let own = self.own.ptr + half;
            for k in 0..n {
                Self::copy(
                    stream,
                    own + (k * len * es) as u64,
                    send + ((k * count + at) * es) as u64,
                    len * es,
                )?;
            }
            Self::meet(meet, stream, call.take())?;
            // Piece `me` of every window, in rank order, into the output. No meeting after:
            // this half is written again only after the next chunk's meeting.
            let out = recv + (at * es) as u64;
            let w = |k: usize| self.windows[k].ptr() + half + (me * len * es) as u64;
            for k in 1..n {
                let a = if k == 1 { w(0) } else { out };
                // SAFETY: `out` is inside `recv` (len elements at `at`); `a` and `w(k)` are
                // piece `me` of window halves holding n x len elements; `out` equals `a` or
                // overlaps neither (the window is not the caller's memory).
                unsafe { self.kernels.reduce_on(stream, dtype, kernel_op, out, [a, w(k)], len) }?;
            }
            if let Some(f) = scale {
                // SAFETY: as above, in place.
                unsafe { self.kernels.scale_on(stream, dtype, out, out, len, f) }?;
            }
            at += len;
        }
        Ok(())
    }

    /// Broadcasts `count` elements of `dtype` from `root`'s `send` into every rank's `recv`
    /// (equal: in place), ordered on `stream`; blocking.
    ///
    /// # Safety
    /// As [`Self::all_reduce`].
    unsafe fn broadcast(
        &mut self,
        meet: &impl Meet,
        stream: &CudaStream,
        call: &DeviceCall,
        root: usize,
    ) -> Result<()> {
        let DeviceCall { send, recv, count, dtype, .. } = *call;
        let (me, es) = (meet.rank(), dtype.size());
        let mut call = Some(("broadcast", [count as u64, dtype as u64, root as u64]));
        let per = HALF / es;
        let mut at = 0;
        while at < count {
            let len = per.min(count - at);
            let half = self.next_half();
            let (src, dst) = (send + (at * es) as u64, recv + (at * es) as u64);
            if me == root {
                Self::copy(stream, self.own.ptr + half, src, len * es)?;
            }
            Self::meet(meet, stream, call.take())?;
            if me != root {
                Self::copy(stream, dst, self.windows[root].ptr() + half, len * es)?;
            } else if src != dst {
                Self::copy(stream, dst, src, len * es)?;
            }
            at += len;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "ipc_tests.rs"]
mod tests;
