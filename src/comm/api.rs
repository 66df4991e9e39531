//! The typed API: collectives on slices of [`Element`]s, blocking and async.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Communicator, RawOp, Work};
use crate::collective::{CallOptions, OpKind};
use crate::dtype::{DataType, Element, ReduceOp};
use crate::error::Result;
use crate::memory::{RawBuf, RawBufMut, RawBufs};

/// Host memory an async operation can own: its heap data does not move when the value does.
pub trait OwnedBuffer<T>: Send + 'static {
    /// The elements.
    fn as_mut_elems(&mut self) -> &mut [T];
}

impl<T: Element> OwnedBuffer<T> for Vec<T> {
    fn as_mut_elems(&mut self) -> &mut [T] {
        self
    }
}

impl<T: Element> OwnedBuffer<T> for Box<[T]> {
    fn as_mut_elems(&mut self) -> &mut [T] {
        self
    }
}

fn bytes_of<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_of_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

/// The typed collectives. Each blocks until done (see [`Communicator::run`]); `*_into` forms
/// are out of place, the others in place.
impl Communicator {
    pub(super) fn go(
        &self,
        kind: OpKind,
        dtype: DataType,
        send: Option<&[u8]>,
        recv: Option<&mut [u8]>,
    ) -> Result<()> {
        self.run_bytes(kind, dtype, send, recv, CallOptions::default())
    }

    /// Reduces `buf` across all ranks in place: afterwards every rank holds the result.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.go(OpKind::AllReduce(op), T::DTYPE, None, Some(bytes_of_mut(buf)))
    }

    /// [`Communicator::all_reduce`] with per-call options: a deadline, a forced algorithm, or
    /// the type the data travels in ([`CallOptions::wire`], a compressed all-reduce).
    ///
    /// ```no_run
    /// # let comm = toroid::Communicator::from_env()?;
    /// let mut grads = vec![0.5f32; 1 << 20];
    /// let bf16 = toroid::CallOptions { wire: Some(toroid::DataType::BF16), ..Default::default() };
    /// comm.all_reduce_with(&mut grads, toroid::ReduceOp::Avg, bf16)?;
    /// # Ok::<(), toroid::Error>(())
    /// ```
    pub fn all_reduce_with<T: Element>(&self, buf: &mut [T], op: ReduceOp, opts: CallOptions) -> Result<()> {
        self.run_bytes(OpKind::AllReduce(op), T::DTYPE, None, Some(bytes_of_mut(buf)), opts)
    }

    /// Reduces `send` across all ranks into `recv` (same length).
    pub fn all_reduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.go(OpKind::AllReduce(op), T::DTYPE, Some(bytes_of(send)), Some(bytes_of_mut(recv)))
    }

    /// Reduces `send` (`size` equal pieces) across ranks; rank `r` receives piece `r` in `recv`.
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.go(OpKind::ReduceScatter(op), T::DTYPE, Some(bytes_of(send)), Some(bytes_of_mut(recv)))
    }

    /// In-place reduce-scatter: `buf` holds `size` equal pieces; afterwards piece `rank` holds
    /// the reduction of everyone's piece `rank` (other pieces hold intermediate values).
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.go(OpKind::ReduceScatter(op), T::DTYPE, None, Some(bytes_of_mut(buf)))
    }

    /// Gathers every rank's `send` into `recv` (`size` pieces in rank order).
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.go(OpKind::AllGather, T::DTYPE, Some(bytes_of(send)), Some(bytes_of_mut(recv)))
    }

    /// In-place all-gather: this rank's piece is already at position `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.go(OpKind::AllGather, T::DTYPE, None, Some(bytes_of_mut(buf)))
    }

    /// Broadcasts `root`'s `buf` to every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.go(OpKind::Broadcast(root), T::DTYPE, None, Some(bytes_of_mut(buf)))
    }

    /// Broadcasts `root`'s `send` into every rank's `recv` (`send` is read on the root only).
    pub fn broadcast_into<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.go(OpKind::Broadcast(root), T::DTYPE, Some(bytes_of(send)), Some(bytes_of_mut(recv)))
    }

    /// Reduces every rank's `buf` into `root`'s `buf`; other ranks' buffers are left untouched.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.go(OpKind::Reduce(op, root), T::DTYPE, None, Some(bytes_of_mut(buf)))
    }

    /// Reduces every rank's `send` into `root`'s `recv` (`recv` is written on the root only).
    pub fn reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.go(OpKind::Reduce(op, root), T::DTYPE, Some(bytes_of(send)), Some(bytes_of_mut(recv)))
    }

    /// All-to-all: block `j` of `send` goes to rank `j`, arriving as its block `rank`.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.go(OpKind::AllToAll, T::DTYPE, Some(bytes_of(send)), Some(bytes_of_mut(recv)))
    }

    /// All-to-all with blocks of any size (MPI's `MPI_Alltoallv`, packed; torch's
    /// `all_to_all_single` with splits): `send_counts[j]` elements of `send`, after the blocks
    /// for the ranks below `j`, go to rank `j`; `recv_counts[j]` elements from rank `j` land in
    /// `recv` after the blocks from the ranks below `j`. Both lists have one count per rank and
    /// add up to their buffer's length; `send_counts[j]` here must equal `recv_counts[rank]` at
    /// rank `j` (where a pair disagrees, the receiver fails with its block untouched and the
    /// communicator aborts, so the next call fails on every rank).
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_to_all_v_bytes(T::DTYPE, bytes_of(send), send_counts, bytes_of_mut(recv), recv_counts)
    }

    /// [`Communicator::all_to_all_v`] on untyped bytes holding elements of `dtype` (the counts
    /// are elements).
    pub fn all_to_all_v_bytes(
        &self,
        dtype: DataType,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let splits = super::split_offsets(send_counts, recv_counts, self.size(), dtype.size())?;
        let op = RawOp {
            kind: OpKind::AllToAllV,
            dtype,
            bufs: RawBufs::OutOfPlace(RawBuf::new(send), RawBufMut::new(recv)),
            opts: CallOptions::default(),
            source: None,
            splits: Some(splits),
            batch: None,
        };
        // SAFETY: the buffers are borrowed for this blocking call, which returns only once the
        // operation has stopped touching them; `&` and `&mut` borrows cannot overlap.
        unsafe { self.run(op) }
    }

    /// In-place all-to-all.
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.go(OpKind::AllToAll, T::DTYPE, None, Some(bytes_of_mut(buf)))
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.go(OpKind::Barrier, DataType::U8, None, None)
    }

    /// Sends `buf` to `peer` (which must post a matching `recv`).
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.go(OpKind::Send(peer), T::DTYPE, Some(bytes_of(buf)), None)
    }

    /// Receives `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.go(OpKind::Recv(peer), T::DTYPE, None, Some(bytes_of_mut(buf)))
    }

    /// Receives `buf.len()` elements from whichever rank sends first (MPI's `MPI_ANY_SOURCE`)
    /// and returns that rank. The sender's length must match. Among ranks whose messages have
    /// arrived, the lowest-numbered is taken first; messages from one rank arrive in order.
    pub fn recv_any<T: Element>(&self, buf: &mut [T]) -> Result<usize> {
        let slot = Arc::new(AtomicUsize::new(usize::MAX));
        let op = RawOp {
            kind: OpKind::RecvAny,
            dtype: T::DTYPE,
            bufs: RawBufs::InPlace(RawBufMut::new(bytes_of_mut(buf))),
            opts: CallOptions::default(),
            source: Some(slot.clone()),
            splits: None,
            batch: None,
        };
        // SAFETY: `buf` is borrowed for this blocking call, which returns only once the
        // operation has stopped touching it.
        unsafe { self.run(op)? };
        Ok(slot.load(Ordering::Acquire))
    }

    /// Any collective on untyped bytes with options (the form the benchmark and the C ABI use).
    pub fn run_bytes(
        &self,
        kind: OpKind,
        dtype: DataType,
        send: Option<&[u8]>,
        recv: Option<&mut [u8]>,
        opts: CallOptions,
    ) -> Result<()> {
        let bufs = match (send, recv) {
            (None, None) => RawBufs::None,
            (Some(s), None) => RawBufs::Read(RawBuf::new(s)),
            (None, Some(r)) => RawBufs::InPlace(RawBufMut::new(r)),
            (Some(s), Some(r)) => RawBufs::OutOfPlace(RawBuf::new(s), RawBufMut::new(r)),
        };
        // SAFETY: the buffers are borrowed for this blocking call, which returns only once the
        // operation has stopped touching them; `&` and `&mut` borrows cannot overlap.
        unsafe { self.run(RawOp { kind, dtype, bufs, opts, source: None, splits: None, batch: None }) }
    }

    /// Async in-place all-reduce of an owned buffer; `wait` gives it back.
    ///
    /// ```no_run
    /// # let comm = toroid::Communicator::from_env()?;
    /// let work = comm.all_reduce_async(vec![1.0f32; 1024], toroid::ReduceOp::Sum)?;
    /// // ... compute meanwhile ...
    /// let summed: Vec<f32> = work.wait()?;
    /// # Ok::<(), toroid::Error>(())
    /// ```
    pub fn all_reduce_async<T: Element, B: OwnedBuffer<T>>(&self, buf: B, op: ReduceOp) -> Result<Work<B>> {
        self.all_reduce_async_with(buf, op, CallOptions::default())
    }

    /// [`Communicator::all_reduce_async`] with per-call options (see
    /// [`Communicator::all_reduce_with`]).
    pub fn all_reduce_async_with<T: Element, B: OwnedBuffer<T>>(
        &self,
        buf: B,
        op: ReduceOp,
        opts: CallOptions,
    ) -> Result<Work<B>> {
        self.submit_owned(buf, opts, |b| (OpKind::AllReduce(op), RawBufs::InPlace(RawBufMut::new(b))))
    }

    /// Async broadcast of an owned buffer.
    pub fn broadcast_async<T: Element, B: OwnedBuffer<T>>(&self, buf: B, root: usize) -> Result<Work<B>> {
        self.submit_owned(buf, CallOptions::default(), |b| {
            (OpKind::Broadcast(root), RawBufs::InPlace(RawBufMut::new(b)))
        })
    }

    /// Async in-place reduce-scatter of an owned buffer (see [`Communicator::reduce_scatter_in_place`]).
    pub fn reduce_scatter_async<T: Element, B: OwnedBuffer<T>>(
        &self,
        buf: B,
        op: ReduceOp,
    ) -> Result<Work<B>> {
        self.submit_owned(buf, CallOptions::default(), |b| {
            (OpKind::ReduceScatter(op), RawBufs::InPlace(RawBufMut::new(b)))
        })
    }

    /// Async in-place all-gather of an owned buffer (see [`Communicator::all_gather_in_place`]).
    pub fn all_gather_async<T: Element, B: OwnedBuffer<T>>(&self, buf: B) -> Result<Work<B>> {
        self.submit_owned(buf, CallOptions::default(), |b| {
            (OpKind::AllGather, RawBufs::InPlace(RawBufMut::new(b)))
        })
    }

    /// Async barrier.
    pub fn barrier_async(&self) -> Result<Work<()>> {
        // SAFETY: a barrier has no buffers.
        unsafe { self.submit_raw(RawOp::new(OpKind::Barrier, DataType::U8, RawBufs::None), None) }
    }

    fn submit_owned<T: Element, B: OwnedBuffer<T>>(
        &self,
        mut buf: B,
        opts: CallOptions,
        make: impl FnOnce(&mut [u8]) -> (OpKind, RawBufs),
    ) -> Result<Work<B>> {
        let (kind, bufs) = make(bytes_of_mut(buf.as_mut_elems()));
        let op = RawOp { kind, dtype: T::DTYPE, bufs, opts, source: None, splits: None, batch: None };
        // SAFETY: the work keeps `buf` alive until the operation completes, and its heap data
        // does not move when `buf` is moved into the box (OwnedBuffer's promise).
        let w = unsafe { self.submit_raw(op, Some(Box::new(buf)))? };
        Ok(w.keeping())
    }
}
