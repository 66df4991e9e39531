//! Grouped collectives: calls issued together and run as one pass, as NCCL's
//! `ncclGroupStart`/`ncclGroupEnd` and Horovod's tensor fusion do.
//!
//! A data-parallel step issues hundreds of small all-reduces, and each alone pays its
//! algorithm's whole latency (2(N-1) message latencies for a ring of N). In a group,
//! consecutive all-reduces of one element type, op and options, each at most [`FUSE_EACH`]
//! bytes, are packed into one buffer (up to [`FUSE_MAX`] bytes), reduced by one all-reduce
//! and unpacked: one latency for the lot, and the large-message algorithm's bandwidth for a
//! pack that is large in total. The other calls run one after the other in issue order, so a
//! group computes what the same calls made one by one compute (packed all-reduces are
//! element-wise, and a pack never holds two calls whose buffers overlap).
//!
//! A group's sends and receives run side by side as one operation after its collectives
//! ([`OpKind::SendRecv`], `transport::exchange::batch`), as NCCL runs a group's `ncclSend` and
//! `ncclRecv` together: a group in which every rank sends to one neighbour and receives from the
//! other completes, where the same blocking calls one by one wait for each other. (NCCL orders
//! none of a group's operations either: a receive and a collective on its buffer belong in two
//! groups.) Each travels as it would alone, so a group's send pairs with a lone receive on its
//! peer, and sends to one peer arrive in their order.
//!
//! Every rank must issue the same collectives in a group, in the same order, as for the calls
//! one by one (sends and receives pair with their peers' as single calls do). Packing depends
//! only on the calls, so every rank packs the same way; a rank whose calls differ sends a pack
//! of another count or type, which the fingerprint check turns into an error on every rank (a
//! mismatch, not a hang).

use std::marker::PhantomData;

use super::QueuedJob;
use super::{Hook, Hooks, Work};
use crate::collective::{CallOptions, OpKind};
use crate::comm::{Communicator, RawOp, lock};
use crate::dtype::{Element, ReduceOp};
use crate::error::Result;
use crate::memory::{RawBuf, RawBufMut, RawBufs};

/// All-reduces of at most this many bytes are packed with their neighbours.
pub const FUSE_EACH: usize = 256 << 10;
/// A pack holds at most this many bytes (the communicator keeps a buffer this large once a
/// group has used it).
pub const FUSE_MAX: usize = 8 << 20;

/// Collectives to run as one pass; see [`Communicator::group`].
///
/// ```no_run
/// # let comm = toroid::Communicator::from_env()?;
/// let mut grads: Vec<Vec<f32>> = (0..200).map(|_| vec![1.0; 1024]).collect();
/// let mut group = comm.group();
/// for g in grads.iter_mut() {
///     group.all_reduce(g, toroid::ReduceOp::Avg);
/// }
/// group.run()?; // one all-reduce of 200 x 4 KiB packed together
/// # Ok::<(), toroid::Error>(())
/// ```
#[must_use = "a group does nothing until run"]
#[derive(Debug)]
pub struct Group<'a> {
    comm: &'a Communicator,
    ops: Vec<(RawOp, Hooks)>,
    /// The buffers are borrowed until the group is run or dropped.
    _bufs: PhantomData<&'a mut [u8]>,
}

impl Communicator {
    /// Starts a group of collectives on buffers borrowed until [`Group::run`]: calls added to
    /// it run together, small all-reduces packed into one (see the module docs of `group.rs`).
    pub fn group(&self) -> Group<'_> {
        Group { comm: self, ops: Vec::new(), _bufs: PhantomData }
    }

    /// Runs `ops` as a group, blocking until all have run; nothing runs unless all are valid.
    /// Stops at the first failure (which, as for single calls, aborts the communicator).
    ///
    /// # Safety
    /// The buffers of every operation must be valid as [`RawBufs::bufs`] requires until this
    /// returns; the hooks may touch only their operation's buffers.
    pub(crate) unsafe fn run_group(&self, ops: Vec<(RawOp, Hooks)>) -> Result<()> {
        let mut ops = self.checked_group(ops)?;
        let mut start = 0;
        for end in pack_ends(&ops) {
            if end - start >= 2 {
                // SAFETY: forwarded from the caller.
                unsafe { self.run_packed(&ops[start..end])? };
            } else {
                let hooks = std::mem::take(&mut ops[start].1);
                // SAFETY: forwarded from the caller.
                unsafe { self.run_with_hooks(ops[start].0.clone(), hooks)? };
            }
            start = end;
        }
        Ok(())
    }

    /// A group's operations as they run: its collectives in issue order, then its sends and
    /// receives as one batch ([`OpKind::SendRecv`]; one alone stays as it is), every one
    /// checked before anything runs.
    fn checked_group(&self, ops: Vec<(RawOp, Hooks)>) -> Result<Vec<(RawOp, Hooks)>> {
        let c = &self.core;
        c.forked()?;
        let (p2ps, mut ops): (Vec<_>, Vec<_>) = ops.into_iter().partition(p2p);
        match p2ps.len() {
            0 => {}
            1 => ops.extend(p2ps),
            _ => ops.push((batch_op(&p2ps), Hooks::default())),
        }
        for (op, _) in &ops {
            crate::comm::argcheck::validate(op, c.ident.rank, c.ident.size, c.links.has_window)?;
        }
        Ok(ops)
    }

    /// One all-reduce of the packed inputs of `run` (all-reduces of one type, op and options),
    /// unpacked into their outputs.
    ///
    /// # Safety
    /// As [`Communicator::run_group`].
    unsafe fn run_packed(&self, run: &[(RawOp, Hooks)]) -> Result<()> {
        let total: usize = run.iter().map(|(op, _)| op.bufs.output_len()).sum();
        let mut pack = lock(&self.core.buffers.pack);
        if pack.len() * 8 < total {
            pack.resize(total.div_ceil(8), 0);
        }
        let bytes = RawBufMut::new(&mut bytemuck::cast_slice_mut(&mut pack[..])[..total]);
        // SAFETY: `bytes` is borrowed from the lock held across these calls; the inputs and
        // outputs are valid (the caller's promise) and no output overlaps another (pack_ends).
        unsafe {
            pack_in(pack_sides(run).map(|(input, _)| input), bytes);
            self.run(packed_op(&run[0].0, bytes))?;
            unpack(bytes, pack_sides(run).map(|(_, output)| output));
        }
        Ok(())
    }

    /// Queues `ops` as a group behind the work already queued, and returns at once: what
    /// [`Communicator::run_group`] runs, one queued operation per pack or lone call, the same
    /// packs (each in a buffer of its own, filled and emptied on the worker thread right before
    /// and after its all-reduce). The works complete in order, so the last one completing
    /// means that every one has. Nothing is queued unless every call is valid.
    ///
    /// # Safety
    /// The buffers of every operation must stay valid, and untouched by anything else, until
    /// the last work completes; the hooks may touch only their operation's buffers.
    pub(crate) unsafe fn submit_group(&self, ops: Vec<(RawOp, Hooks)>) -> Result<Vec<Work<()>>> {
        let mut ops = self.checked_group(ops)?;
        let mut jobs = Vec::new();
        let mut start = 0;
        for end in pack_ends(&ops) {
            if end - start >= 2 {
                jobs.push(packed_job(&ops[start..end]));
            } else {
                let hooks = std::mem::take(&mut ops[start].1);
                jobs.push((ops[start].0.clone(), None, hooks));
            }
            start = end;
        }
        // SAFETY: forwarded from the caller; each pack's buffer is kept by its own job.
        unsafe { self.submit_validated_jobs(jobs) }
    }
}

impl<'a> Group<'a> {
    /// All-reduces of at most this many bytes are packed with their neighbours.
    pub const FUSE_EACH: usize = FUSE_EACH;
    /// A pack holds at most this many bytes.
    pub const FUSE_MAX: usize = FUSE_MAX;

    fn add(&mut self, kind: OpKind, dtype: crate::dtype::DataType, bufs: RawBufs) -> &mut Self {
        let op = RawOp::new(kind, dtype, bufs);
        self.ops.push((op, Hooks::default()));
        self
    }

    /// Adds an in-place all-reduce (see [`Communicator::all_reduce`]).
    pub fn all_reduce<T: Element>(&mut self, buf: &'a mut [T], op: ReduceOp) -> &mut Self {
        let b = RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(buf)));
        self.add(OpKind::AllReduce(op), T::DTYPE, b)
    }

    /// Adds an out-of-place all-reduce (see [`Communicator::all_reduce_into`]).
    pub fn all_reduce_into<T: Element>(
        &mut self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> &mut Self {
        let b = RawBufs::OutOfPlace(
            RawBuf::new(bytemuck::cast_slice(send)),
            RawBufMut::new(bytemuck::cast_slice_mut(recv)),
        );
        self.add(OpKind::AllReduce(op), T::DTYPE, b)
    }

    /// Adds a broadcast from `root` (see [`Communicator::broadcast`]).
    pub fn broadcast<T: Element>(&mut self, buf: &'a mut [T], root: usize) -> &mut Self {
        let b = RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(buf)));
        self.add(OpKind::Broadcast(root), T::DTYPE, b)
    }

    /// Adds a reduce to `root` (see [`Communicator::reduce`]).
    pub fn reduce<T: Element>(&mut self, buf: &'a mut [T], op: ReduceOp, root: usize) -> &mut Self {
        let b = RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(buf)));
        self.add(OpKind::Reduce(op, root), T::DTYPE, b)
    }

    /// Adds an all-gather (see [`Communicator::all_gather`]).
    pub fn all_gather<T: Element>(&mut self, send: &'a [T], recv: &'a mut [T]) -> &mut Self {
        let b = RawBufs::OutOfPlace(
            RawBuf::new(bytemuck::cast_slice(send)),
            RawBufMut::new(bytemuck::cast_slice_mut(recv)),
        );
        self.add(OpKind::AllGather, T::DTYPE, b)
    }

    /// Adds a reduce-scatter (see [`Communicator::reduce_scatter`]).
    pub fn reduce_scatter<T: Element>(
        &mut self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> &mut Self {
        let b = RawBufs::OutOfPlace(
            RawBuf::new(bytemuck::cast_slice(send)),
            RawBufMut::new(bytemuck::cast_slice_mut(recv)),
        );
        self.add(OpKind::ReduceScatter(op), T::DTYPE, b)
    }

    /// Adds a send to `peer` (see [`Communicator::send`]); the group's sends and receives run
    /// side by side, after its collectives.
    pub fn send<T: Element>(&mut self, buf: &'a [T], peer: usize) -> &mut Self {
        let b = RawBufs::Read(RawBuf::new(bytemuck::cast_slice(buf)));
        self.add(OpKind::Send(peer), T::DTYPE, b)
    }

    /// Adds a receive from `peer` (see [`Communicator::recv`]); the group's sends and receives
    /// run side by side, after its collectives.
    pub fn recv<T: Element>(&mut self, buf: &'a mut [T], peer: usize) -> &mut Self {
        let b = RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(buf)));
        self.add(OpKind::Recv(peer), T::DTYPE, b)
    }

    /// Calls added so far.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// True when nothing was added.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Runs the group, blocking until every call has run. Nothing runs unless every call is
    /// valid; a failure stops the group there (and, as for single calls, aborts the
    /// communicator).
    pub fn run(self) -> Result<()> {
        // SAFETY: every buffer is borrowed for 'a, which outlives this call; `&mut` borrows
        // cannot alias, and `&` ones are only read.
        unsafe { self.comm.run_group(self.ops) }
    }
}

/// The input and the output buffer of each of a pack's calls, in order (no allocation: the
/// blocking group end runs on the hot path).
fn pack_sides(run: &[(RawOp, Hooks)]) -> impl Iterator<Item = (RawBuf, RawBufMut)> + '_ {
    run.iter().filter_map(|(op, _)| match op.bufs {
        RawBufs::InPlace(b) => Some((b.as_read(), b)),
        RawBufs::OutOfPlace(s, r) => Some((s, r)),
        RawBufs::None | RawBufs::Read(_) => None, // not packed (see pack_ends)
    })
}

/// The all-reduce of a pack: `first`'s kind, type and options, in place on `pack`.
fn packed_op(first: &RawOp, pack: RawBufMut) -> RawOp {
    RawOp {
        kind: first.kind,
        dtype: first.dtype,
        bufs: RawBufs::InPlace(pack),
        opts: first.opts,
        source: None,
        splits: None,
        batch: None,
    }
}

/// Copies `inputs` one after the other into `pack`.
///
/// # Safety
/// Every buffer must be valid (inputs for reads, `pack` for writes, as long as their total),
/// and `pack` must not overlap an input.
unsafe fn pack_in(inputs: impl IntoIterator<Item = RawBuf>, pack: RawBufMut) {
    // SAFETY: the caller's promise.
    let bytes = unsafe { pack.as_mut_slice() };
    let mut at = 0;
    for input in inputs {
        // SAFETY: the caller's promise.
        let src = unsafe { input.as_slice() };
        bytes[at..at + src.len()].copy_from_slice(src);
        at += src.len();
    }
}

/// Copies `pack` piece by piece into `outputs` (the reverse of [`pack_in`]).
///
/// # Safety
/// Every buffer must be valid (outputs for writes, `pack` for reads) and none may overlap
/// another.
unsafe fn unpack(pack: RawBufMut, outputs: impl IntoIterator<Item = RawBufMut>) {
    // SAFETY: the caller's promise.
    let bytes = unsafe { pack.as_read().as_slice() };
    let mut at = 0;
    for out in outputs {
        // SAFETY: the caller's promise.
        let dst = unsafe { out.as_mut_slice() };
        dst.copy_from_slice(&bytes[at..at + dst.len()]);
        at += dst.len();
    }
}

/// A pack as one queued operation: its own buffer (kept by the job), filled by the job's
/// `before` hook and emptied by its `after` hook, both on the worker thread, so the inputs are
/// read and the outputs written in issue order with the rest of the queue.
fn packed_job(run: &[(RawOp, Hooks)]) -> QueuedJob {
    let total: usize = run.iter().map(|(op, _)| op.bufs.output_len()).sum();
    let mut pack = vec![0u64; total.div_ceil(8)].into_boxed_slice();
    // The box's heap data does not move when the box moves into the job.
    let bytes = RawBufMut::new(&mut bytemuck::cast_slice_mut(&mut pack[..])[..total]);
    // (Owned by the hooks, which run later on the worker thread.)
    let (inputs, outputs): (Vec<RawBuf>, Vec<RawBufMut>) = pack_sides(run).unzip();
    // The pack's buffer lives in the job until it completes; the calls' buffers stay valid and
    // untouched until then (submit_group's contract), and no output overlaps another buffer of
    // the pack (pack_ends).
    // SAFETY: as just said.
    let before: Hook = Box::new(move || unsafe { pack_in(inputs, bytes) });
    // SAFETY: as just said.
    let after: Hook = Box::new(move || unsafe { unpack(bytes, outputs) });
    let hooks = Hooks { before: Some(before), after: Some(after), worker_only: false };
    (packed_op(&run[0].0, bytes), Some(Box::new(pack)), hooks)
}

/// Whether `op` is a send or receive that joins its group's batch (see the module
/// documentation).
fn p2p((op, hooks): &(RawOp, Hooks)) -> bool {
    matches!(op.kind, OpKind::Send(_) | OpKind::Recv(_)) && hooks.before.is_none() && hooks.after.is_none()
}

/// The one operation of a group's sends and receives: each as it is, side by side, under the
/// shortest of their deadlines.
fn batch_op(run: &[(RawOp, Hooks)]) -> RawOp {
    let timeout = run.iter().filter_map(|(op, _)| op.opts.timeout).min();
    RawOp {
        opts: CallOptions { timeout, ..CallOptions::default() },
        batch: Some(run.iter().map(|(op, _)| op.clone()).collect()),
        ..RawOp::new(OpKind::SendRecv, crate::dtype::DataType::U8, RawBufs::None)
    }
}

/// Whether `op` can join a pack.
fn packable(op: &RawOp) -> bool {
    matches!(op.kind, OpKind::AllReduce(_))
        && matches!(op.bufs, RawBufs::InPlace(_) | RawBufs::OutOfPlace(..))
        && op.bufs.output_len() <= FUSE_EACH
        && op.source.is_none()
}

/// The byte ranges an operation reads and writes.
fn ranges(op: &RawOp) -> [(usize, usize); 2] {
    match op.bufs {
        RawBufs::InPlace(b) => [(b.addr(), b.len()), (b.addr(), b.len())],
        RawBufs::OutOfPlace(s, r) => [(s.addr(), s.len()), (r.addr(), r.len())],
        RawBufs::None => [(0, 0), (0, 0)],
        RawBufs::Read(s) => [(s.addr(), s.len()), (0, 0)],
    }
}

fn overlap(a: (usize, usize), b: (usize, usize)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Where each run of `ops` ends (exclusive indices, ascending, the last = `ops.len()`): a run
/// of two or more is a pack; a run of one runs alone. A pack is consecutive packable
/// all-reduces of one kind, type and options, without hooks, at most [`FUSE_MAX`] bytes in
/// all, none of whose output overlaps another's input or output.
fn pack_ends(ops: &[(RawOp, Hooks)]) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut i = 0;
    while i < ops.len() {
        let (first, hooks) = &ops[i];
        let mut j = i + 1;
        if packable(first) && hooks.before.is_none() && hooks.after.is_none() {
            let mut bytes = first.bufs.output_len();
            while j < ops.len() {
                let (op, h) = &ops[j];
                let fits = packable(op)
                    && h.before.is_none()
                    && h.after.is_none()
                    && op.kind == first.kind
                    && op.dtype == first.dtype
                    && op.opts == first.opts
                    && bytes + op.bufs.output_len() <= FUSE_MAX;
                let [inp, out] = ranges(op);
                let clash = ops[i..j].iter().any(|(o, _)| {
                    let [i2, o2] = ranges(o);
                    overlap(out, i2) || overlap(out, o2) || overlap(inp, o2)
                });
                if !fits || clash {
                    break;
                }
                bytes += op.bufs.output_len();
                j += 1;
            }
        }
        ends.push(j);
        i = j;
    }
    ends
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;

    fn ar(buf: &mut [u8], dtype: DataType, op: ReduceOp) -> (RawOp, Hooks) {
        let bufs = RawBufs::InPlace(RawBufMut::new(buf));
        (RawOp::new(OpKind::AllReduce(op), dtype, bufs), Hooks::default())
    }

    #[test]
    fn packs_break_at_other_kinds_types_ops_sizes_and_overlaps() {
        let mut m = vec![0u8; 4 * FUSE_EACH];
        let (a, rest) = m.split_at_mut(64);
        let (b, rest) = rest.split_at_mut(64);
        let (c, rest) = rest.split_at_mut(64);
        let (d, rest) = rest.split_at_mut(64);
        let (e, rest) = rest.split_at_mut(FUSE_EACH + 8);
        let (f, _) = rest.split_at_mut(64);
        let bcast = {
            let bufs = RawBufs::InPlace(RawBufMut::new(&mut *d));
            let op = RawOp::new(OpKind::Broadcast(0), DataType::F32, bufs);
            (op, Hooks::default())
        };
        let ops = vec![
            ar(a, DataType::F32, ReduceOp::Sum),
            ar(b, DataType::F32, ReduceOp::Sum),
            ar(c, DataType::F32, ReduceOp::Max), // another op: a new run
            bcast,                               // not an all-reduce: alone
            ar(e, DataType::F32, ReduceOp::Max), // too large: alone
            ar(f, DataType::F32, ReduceOp::Max),
        ];
        assert_eq!(pack_ends(&ops), vec![2, 3, 4, 5, 6]);
        // The same buffer twice: the second starts a new pack.
        let mut one = vec![0u8; 64];
        let p = one.as_mut_ptr();
        // SAFETY: only the descriptors' addresses are compared; nothing is read or written.
        let same = unsafe { RawBufMut::from_raw(p, 64).unwrap() };
        let mk = || {
            let op = RawOp::new(OpKind::AllReduce(ReduceOp::Sum), DataType::F32, RawBufs::InPlace(same));
            (op, Hooks::default())
        };
        assert_eq!(pack_ends(&[mk(), mk(), mk()]), vec![1, 2, 3]);
    }

    #[test]
    fn a_pack_stops_at_its_size_limit() {
        let mut m = vec![0u8; FUSE_MAX + FUSE_EACH];
        let ops: Vec<_> = m.chunks_mut(FUSE_EACH).map(|c| ar(c, DataType::U8, ReduceOp::Sum)).collect();
        let per = FUSE_MAX / FUSE_EACH;
        assert_eq!(pack_ends(&ops), vec![per, per + 1]);
    }
}
