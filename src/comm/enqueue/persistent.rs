//! Persistent collectives: an all-reduce set up once on one buffer and started many times, as
//! MPI 4's `MPI_Allreduce_init` / `MPI_Start`. Set-up does once what every call does again:
//! validating the buffer, type and op, and choosing the algorithm (for a size the cost model
//! weighs several candidates, with a lookup of the shared-window rules before). Each start
//! then goes straight to the run: a new sequence number and fingerprint, the deadline, the
//! algorithm. The choice is made on every rank from the same model and size, so every rank
//! pins the same algorithm.

use super::{Hooks, Work};
use crate::collective::{Algorithm, CallOptions, OpKind};
use crate::comm::{Communicator, OwnedBuffer, RawOp};
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::memory::{RawBufMut, RawBufs};

/// An all-reduce of one buffer, started as often as needed; see
/// [`Communicator::all_reduce_init`].
///
/// ```no_run
/// # let comm = toroid::Communicator::from_env()?;
/// let mut grads = vec![0f32; 1024];
/// let mut req = comm.all_reduce_init(&mut grads, toroid::ReduceOp::Sum)?;
/// for step in 0..100 {
///     req.buffer().fill(step as f32); // the next step's gradients
///     req.start()?;                   // every rank now holds the sum
/// }
/// # Ok::<(), toroid::Error>(())
/// ```
#[derive(Debug)]
pub struct Persistent<'a, T: Element> {
    comm: &'a Communicator,
    buf: &'a mut [T],
    kind: OpKind,
    opts: CallOptions,
}

impl Communicator {
    /// Sets up an in-place all-reduce of `buf` with `op` to be started many times
    /// ([`Persistent::start`]): validated and its algorithm chosen once, here. Every rank must
    /// set up the same all-reduce (the same length, type and op) and start it as often.
    pub fn all_reduce_init<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Persistent<'a, T>> {
        let opts = self.plan_all_reduce(buf, op)?;
        Ok(Persistent { comm: self, buf, kind: OpKind::AllReduce(op), opts })
    }

    /// What a persistent all-reduce does once: checks an in-place all-reduce of `buf` with `op`
    /// and returns its options with the algorithm every rank chooses for it.
    fn plan_all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<CallOptions> {
        let probe = RawOp::new(
            OpKind::AllReduce(op),
            T::DTYPE,
            RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(buf))),
        );
        let c = &self.core;
        c.forked()?;
        crate::comm::argcheck::validate(&probe, c.ident.rank, c.ident.size, c.links.has_window)?;
        Ok(self.pin_algorithm(probe).opts)
    }

    /// `op` (validated) with the algorithm its runs will use set in its options, as every rank
    /// chooses it for this kind and size.
    pub(crate) fn pin_algorithm(&self, mut op: RawOp) -> RawOp {
        let bytes = op.bufs.output_len().max(op.bufs.input_len());
        op.opts.algorithm = Some(self.core.choose(op.kind, bytes, &op.opts));
        op
    }
}

impl<T: Element> Persistent<'_, T> {
    /// The buffer, to fill before a start and read after it.
    pub fn buffer(&mut self) -> &mut [T] {
        self.buf
    }

    /// The algorithm every start runs.
    pub fn algorithm(&self) -> Option<Algorithm> {
        self.opts.algorithm
    }

    /// Runs the all-reduce on the buffer as it is now, blocking until every rank holds the
    /// result.
    pub fn start(&mut self) -> Result<()> {
        let op = RawOp {
            kind: self.kind,
            dtype: T::DTYPE,
            bufs: RawBufs::InPlace(RawBufMut::new(bytemuck::cast_slice_mut(self.buf))),
            opts: self.opts,
            source: None,
            splits: None,
            batch: None,
        };
        // SAFETY: the buffer is borrowed mutably by `self` for this blocking call; the
        // operation is the one validated at set-up (same buffer, type, op), with the algorithm
        // chosen then.
        unsafe { self.comm.run_validated(op) }
    }
}

/// A persistent all-reduce whose starts are asynchronous and take an owned buffer: checked and
/// its algorithm chosen once, at [`AllReducePlan::new`], each
/// [`start_async`](AllReducePlan::start_async) queues the run (as
/// [`Communicator::all_reduce_async`] does) with neither. It borrows nothing, so a buffer can
/// move through the works as the async calls' do (a data-parallel trainer's gradient buckets,
/// filled while earlier buckets reduce).
///
/// Not part of the stable API: reachable through `toroid::internals::comm` for the project's
/// own trainer, as [`Persistent`] (which borrows its buffer and starts blocking) is for users.
#[derive(Debug, Clone)]
pub struct AllReducePlan {
    /// The communicator it was made on: its id, rank and size.
    comm: (u64, usize, usize),
    kind: OpKind,
    dtype: crate::dtype::DataType,
    bytes: usize,
    opts: CallOptions,
}

impl AllReducePlan {
    /// Checks an in-place all-reduce of buffers like `buf` (its length and type) with `op` on
    /// `comm` and chooses its algorithm, as [`Communicator::all_reduce_init`] does.
    pub fn new<T: Element>(comm: &Communicator, buf: &mut [T], op: ReduceOp) -> Result<AllReducePlan> {
        let opts = comm.plan_all_reduce(buf, op)?;
        let c = &comm.core;
        Ok(AllReducePlan {
            comm: (c.ident.id, c.ident.rank, c.ident.size),
            kind: OpKind::AllReduce(op),
            dtype: T::DTYPE,
            bytes: std::mem::size_of_val(buf),
            opts,
        })
    }

    /// The algorithm every start runs.
    pub fn algorithm(&self) -> Option<Algorithm> {
        self.opts.algorithm
    }

    /// Queues the all-reduce of `buf` (which must have the planned length and type, on the
    /// communicator of the plan) behind the work already issued on `comm`; the work gives the
    /// buffer back, reduced, as [`Communicator::all_reduce_async`]'s does.
    pub fn start_async<T: Element, B: OwnedBuffer<T>>(
        &self,
        comm: &Communicator,
        mut buf: B,
    ) -> Result<Work<B>> {
        let c = &comm.core;
        if (c.ident.id, c.ident.rank, c.ident.size) != self.comm {
            return Err(Error::InvalidUsage("an all-reduce plan started on another communicator".into()));
        }
        let bytes = bytemuck::cast_slice_mut::<T, u8>(buf.as_mut_elems());
        if T::DTYPE != self.dtype || bytes.len() != self.bytes {
            return Err(Error::InvalidArgument(
                format!(
                    "an all-reduce plan of {} bytes of {:?} started on {} bytes of {:?}",
                    self.bytes,
                    self.dtype,
                    bytes.len(),
                    T::DTYPE
                )
                .into(),
            ));
        }
        let op = RawOp {
            kind: self.kind,
            dtype: self.dtype,
            bufs: RawBufs::InPlace(RawBufMut::new(bytes)),
            opts: self.opts,
            source: None,
            splits: None,
            batch: None,
        };
        // SAFETY: the job keeps `buf` until the operation completes, and its heap data does not
        // move when `buf` moves into the box (OwnedBuffer's promise); the operation is the one
        // validated at `new` (same type, length and op; only the address differs, and an owned
        // buffer of T is aligned for T).
        let mut works =
            unsafe { comm.submit_validated_jobs(vec![(op, Some(Box::new(buf)), Hooks::default())])? };
        let w = works.pop().ok_or_else(|| Error::Internal("a queued all-reduce returned no work".into()))?;
        Ok(w.keeping())
    }
}
