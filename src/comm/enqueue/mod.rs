//! The ordered work queue: blocking calls run on the caller's thread when nothing is queued,
//! async calls run on the communicator's one worker thread in issue order, and each returns a
//! [`Work`] that completes when its operation has run; a wait that finds its operation not yet
//! started runs it (and the queued work before it) on the waiting thread instead, and the worker
//! leaves a just-queued job a moment for such a wait ([`HANDOFF_GRACE`]). Beside it:
//! groups of operations run as one job (`group.rs`), persistent requests (`persistent.rs`), and
//! the direct runner queued jobs' hooks meet the other ranks with ([`Inline`]).

pub(super) mod group;
pub(super) mod persistent;
mod work;

pub(crate) use work::Completion;
pub use work::Work;

use std::any::Any;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::collective::OpKind;
use crate::comm::{Communicator, Core, RawOp, lock};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::memory::{RawBufMut, RawBufs};

/// The queue of operations not yet run.
#[derive(Default)]
pub(super) struct Queue {
    pub(super) jobs: VecDeque<Job>,
    pub(super) running: bool,
    pub(super) shutdown: bool,
    /// Queued operations that failed after shutdown began, and the first of their errors
    /// (what [`Communicator::destroy`] reports).
    failed_in_shutdown: usize,
    first_shutdown_error: Option<Error>,
}

/// One queued operation and its completion.
/// How long the worker leaves a job it finds just queued to the thread that queued it: a caller
/// that waits on its call at once (torch's `dist.send`, a blocking call made async and waited)
/// runs it itself (`Core::run_queued_through`) within a few microseconds, without the two
/// cross-core hand-overs (tens of microseconds each) of the worker taking it.
const HANDOFF_GRACE: Duration = Duration::from_micros(20);

pub(super) struct Job {
    op: RawOp,
    /// When it was issued (ns since the Unix epoch; the flight recorder's issue time).
    issued_ns: u64,
    /// When it was queued (see [`HANDOFF_GRACE`]).
    queued: Instant,
    done: Arc<Completion>,
    hooks: Hooks,
}

/// An operation to queue, what it keeps alive until it has run, and its hooks (see
/// [`Communicator::submit_validated_jobs`]).
pub(crate) type QueuedJob = (RawOp, Option<Box<dyn Any + Send>>, Hooks);

/// A step run on the worker thread next to an operation, in issue order (see
/// [`Communicator::submit_raw_with_hooks`]).
pub type Hook = Box<dyn FnOnce() + Send>;

/// Steps around one queued operation.
#[derive(Default)]
pub struct Hooks {
    /// Runs right before the operation starts.
    pub before: Option<Hook>,
    /// Runs right after the operation succeeded, before its work handle reports completion.
    pub after: Option<Hook>,
    /// The hooks run on the communicator's worker thread only (a device job's, which expects
    /// it): a waiter does not run the job itself (see `Core::run_queued_through`). Other hooks
    /// (a pack's copies, an in-place layout's move) run on whichever thread runs the job.
    pub worker_only: bool,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("before", &self.before.is_some())
            .field("after", &self.after.is_some())
            .field("worker_only", &self.worker_only)
            .finish()
    }
}

impl Communicator {
    /// Validates `op` and runs it, blocking until it completes (the typed API and the C ABI
    /// end here).
    ///
    /// # Safety
    /// The buffers of `op` must be valid as [`RawBufs::bufs`] requires until this returns.
    pub(crate) unsafe fn run(&self, op: RawOp) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.run_checked(op, true) }
    }

    /// [`Communicator::run`] of an operation validated before (a persistent collective's).
    ///
    /// # Safety
    /// As [`Communicator::run`]; `op` must have passed [`super::validate`] on this communicator.
    pub(crate) unsafe fn run_validated(&self, op: RawOp) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.run_checked(op, false) }
    }

    /// # Safety
    /// As [`Communicator::run`].
    unsafe fn run_checked(&self, op: RawOp, validate: bool) -> Result<()> {
        let r = self.run_inner(op, validate);
        if let Err(e) = &r {
            *lock(&self.core.watch.last_error) = Some(e.to_string());
        }
        r
    }

    fn run_inner(&self, op: RawOp, validate: bool) -> Result<()> {
        self.run_inner_hooked(op, validate, Hooks::default())
    }

    /// [`Communicator::run`] with hooks around the operation, run where the operation runs: on
    /// the caller's thread when nothing is queued, else on the worker after the queued work
    /// (the caller waits either way).
    ///
    /// # Safety
    /// As [`Communicator::run`]; the hooks may touch only what the caller keeps valid until
    /// this returns.
    pub(crate) unsafe fn run_with_hooks(&self, op: RawOp, hooks: Hooks) -> Result<()> {
        let r = self.run_inner_hooked(op, true, hooks);
        if let Err(e) = &r {
            *lock(&self.core.watch.last_error) = Some(e.to_string());
        }
        r
    }

    fn run_inner_hooked(&self, op: RawOp, validate: bool, mut hooks: Hooks) -> Result<()> {
        self.core.forked()?;
        if validate {
            crate::comm::argcheck::validate(
                &op,
                self.core.ident.rank,
                self.core.ident.size,
                self.core.links.has_window,
            )?;
        }
        self.core.abort.check()?;
        {
            let mut q = lock(&self.core.queue.jobs);
            if q.jobs.is_empty() && !q.running {
                q.running = true;
                drop(q);
                let r = self.core.execute_guarded(&op, &mut hooks, 0);
                self.core.queue_idle();
                return r;
            }
        }
        // Queued behind async work: wait for it (running it and the work ahead of it here when
        // the worker has not started them). The caller's borrows outlive this wait.
        let done = self.enqueue(op, None, hooks)?;
        self.core.run_queued_through(&done);
        done.wait_done(&self.core.abort, self.core.timeout)
    }

    /// Validates `op` and queues it; the returned handle completes when it has run.
    ///
    /// # Safety
    /// The buffers of `op` must stay valid (and, for outputs, untouched by anything else) until
    /// the work completes, and `keep` (if any) must own them or otherwise keep them alive.
    pub unsafe fn submit_raw(&self, op: RawOp, keep: Option<Box<dyn Any + Send>>) -> Result<Work<()>> {
        // SAFETY: forwarded from the caller.
        unsafe { self.submit_raw_with_hooks(op, keep, Hooks::default()) }
    }

    /// As [`Communicator::submit_raw`], with steps run on the worker thread right before the
    /// operation and right after it succeeded, in issue order. The C ABI uses them to move a
    /// piece within the caller's buffer for NCCL's in-place layouts of reduce_scatter and
    /// all_gather, which must happen after earlier queued operations and before later ones.
    ///
    /// # Safety
    /// As [`Communicator::submit_raw`]; the hooks may touch only the operation's buffers.
    pub unsafe fn submit_raw_with_hooks(
        &self,
        op: RawOp,
        keep: Option<Box<dyn Any + Send>>,
        hooks: Hooks,
    ) -> Result<Work<()>> {
        let r = self
            .core
            .forked()
            .and_then(|_| {
                crate::comm::argcheck::validate(
                    &op,
                    self.core.ident.rank,
                    self.core.ident.size,
                    self.core.links.has_window,
                )
            })
            .and_then(|_| self.core.abort.check())
            .and_then(|_| self.enqueue(op, keep, hooks));
        match r {
            Ok(done) => Ok(self.work_of(done)),
            Err(e) => {
                *lock(&self.core.watch.last_error) = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// Queues `jobs` (operations validated before, with what each keeps alive and its hooks)
    /// together: all of them, next to each other, or none (a group's runs must not be split by
    /// a shutdown). Their works complete in this order.
    ///
    /// # Safety
    /// As [`Communicator::submit_raw_with_hooks`], for every job.
    pub(crate) unsafe fn submit_validated_jobs(&self, jobs: Vec<QueuedJob>) -> Result<Vec<Work<()>>> {
        let r = self.core.forked().and_then(|_| self.core.abort.check()).and_then(|_| {
            self.ensure_worker()?;
            let mut q = lock(&self.core.queue.jobs);
            if q.shutdown {
                return Err(Error::Aborted("communicator is shutting down".into()));
            }
            let mut done = Vec::with_capacity(jobs.len());
            for (op, keep, hooks) in jobs {
                let issued_ns =
                    if self.core.watch.recorder.is_on() { self.core.watch.recorder.now_ns() } else { 0 };
                let d = Arc::new(Completion::new(keep));
                q.jobs.push_back(Job { op, issued_ns, queued: Instant::now(), done: d.clone(), hooks });
                done.push(d);
            }
            Ok(done)
        });
        self.core.queue.cv.notify_all();
        match r {
            Ok(done) => Ok(done.into_iter().map(|d| self.work_of(d)).collect()),
            Err(e) => {
                *lock(&self.core.watch.last_error) = Some(e.to_string());
                Err(e)
            }
        }
    }

    fn work_of(&self, done: Arc<Completion>) -> Work<()> {
        Work {
            done,
            core: Arc::downgrade(&self.core),
            abort: self.core.abort.clone(),
            timeout: self.core.timeout,
            fork_generation: self.core.ident.fork_generation,
            _buf: PhantomData,
        }
    }

    fn enqueue(&self, op: RawOp, keep: Option<Box<dyn Any + Send>>, hooks: Hooks) -> Result<Arc<Completion>> {
        self.ensure_worker()?;
        let done = Arc::new(Completion::new(keep));
        let mut q = lock(&self.core.queue.jobs);
        if q.shutdown {
            return Err(Error::Aborted("communicator is shutting down".into()));
        }
        let issued_ns = if self.core.watch.recorder.is_on() { self.core.watch.recorder.now_ns() } else { 0 };
        q.jobs.push_back(Job { op, issued_ns, queued: Instant::now(), done: done.clone(), hooks });
        drop(q);
        self.core.queue.cv.notify_all();
        Ok(done)
    }

    fn ensure_worker(&self) -> Result<()> {
        let mut w = lock(&self.worker);
        if w.is_none() {
            let core = self.core.clone();
            let h = std::thread::Builder::new()
                .name(format!("toroid-r{}", self.core.ident.rank))
                .spawn(move || core.worker_loop())
                .map_err(|e| Error::system("spawning the worker thread", e))?;
            *w = Some(h);
        }
        Ok(())
    }
}

/// Runs collectives on the engine directly, bypassing the queue: for a queued job's hook that
/// must meet the other ranks several times (a collective on device memory, `gpu::stream`).
/// While a hook runs, its job holds the queue, so nothing else runs on the communicator and the
/// operations keep their place in issue order on every rank. Anywhere else it would overtake
/// queued work: only hooks use it.
#[derive(Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct Inline(Arc<Core>);

impl std::fmt::Debug for Inline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inline").field("rank", &self.0.ident.rank).finish()
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Communicator {
    /// The direct runner of this communicator, for the hooks of its queued jobs.
    pub(crate) fn inline(&self) -> Inline {
        Inline(self.core.clone())
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Inline {
    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.0.ident.rank
    }

    /// Number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.0.ident.size
    }

    fn run(&self, kind: OpKind, dtype: DataType, buf: Option<&mut [u8]>) -> Result<()> {
        let bufs = match buf {
            Some(b) => RawBufs::InPlace(RawBufMut::new(b)),
            None => RawBufs::None,
        };
        let op = RawOp::new(kind, dtype, bufs);
        crate::comm::argcheck::validate(&op, self.0.ident.rank, self.0.ident.size, self.0.links.has_window)?;
        self.0.abort.check()?;
        let r = self.0.execute(&op, 0);
        self.0.watch.recorder.end(r.is_ok());
        r
    }

    /// A barrier.
    pub(crate) fn barrier(&self) -> Result<()> {
        self.run(OpKind::Barrier, DataType::U8, None)
    }

    /// An in-place all-reduce of `v` with `op`.
    pub(crate) fn all_reduce_u64(&self, v: &mut [u64], op: ReduceOp) -> Result<()> {
        self.run(OpKind::AllReduce(op), DataType::U64, Some(bytemuck::cast_slice_mut(v)))
    }

    /// Fails the communicator with `e` as a failed operation does: its links close (so every
    /// peer's next step fails too) and later calls fail with `e`.
    pub(crate) fn fail(&self, e: Error) -> Error {
        self.0.failed(&mut lock(&self.0.engine), e)
    }
}

impl Communicator {
    /// Waits for every queued operation to finish, then releases the communicator. Unlike
    /// dropping it, this reports the operations that failed while it waited, which nobody may
    /// be left to see otherwise: the error says how many, and gives the first.
    ///
    /// # Errors
    /// The first failure among the operations that were queued or running when it was called,
    /// with their number.
    pub fn destroy(self) -> Result<()> {
        self.drain()
    }

    /// [`Communicator::destroy`] by reference (the C ABI's handles are shared): later
    /// submissions are refused, and this returns once the queue is empty.
    pub(crate) fn drain(&self) -> Result<()> {
        self.core.forked()?;
        lock(&self.core.queue.jobs).shutdown = true;
        self.core.queue.cv.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            let _ = h.join();
        }
        let mut q = lock(&self.core.queue.jobs);
        match (q.failed_in_shutdown, q.first_shutdown_error.take()) {
            (0, _) | (_, None) => Ok(()),
            (1, Some(e)) => {
                Err(e.context("an operation still queued when the communicator was destroyed failed"))
            }
            (n, Some(e)) => Err(e.context(&format!(
                "{n} operations still queued when the communicator was destroyed failed; the first"
            ))),
        }
    }
}

impl Core {
    fn worker_loop(self: Arc<Core>) {
        loop {
            let mut job = {
                let mut q = lock(&self.queue.jobs);
                loop {
                    if !q.running {
                        if let Some(front) = q.jobs.front() {
                            // (one its waiter can take, see run_queued_through)
                            if !front.hooks.worker_only
                                && front.queued.elapsed() < HANDOFF_GRACE
                                && !q.shutdown
                            {
                                drop(q);
                                std::thread::yield_now();
                                q = lock(&self.queue.jobs);
                                continue;
                            }
                        }
                        if let Some(j) = q.jobs.pop_front() {
                            q.running = true;
                            break j;
                        }
                        if q.shutdown {
                            return;
                        }
                    }
                    q = self.queue.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            self.run_job(&mut job);
        }
    }

    /// Runs a job taken from the queue (whose `running` the taker set), then completes it and
    /// frees the queue for the next in one step.
    fn run_job(&self, job: &mut Job) {
        let r = self.execute_guarded(&job.op, &mut job.hooks, job.issued_ns);
        if let Err(e) = &r {
            *lock(&self.watch.last_error) = Some(e.to_string());
        }
        let mut q = lock(&self.queue.jobs);
        if let Err(e) = &r
            && q.shutdown
        {
            q.failed_in_shutdown += 1;
            q.first_shutdown_error.get_or_insert_with(|| e.clone());
        }
        // Under the queue's lock: the next job cannot start before this one is complete (works
        // complete in issue order), and the waiter this wakes, which may issue its next call at
        // once, finds the queue free. Freed after the wake-up, a call issued in that gap went
        // to the worker, and so did every later one: each a hand-over to the worker and back
        // (tens of microseconds) instead of a call on the caller's thread.
        job.done.complete(r);
        self.free_queue(q);
    }

    /// Frees the queue after a job ran, waking the worker only when it has something to do:
    /// queued jobs, or the shutdown (a needless wake-up takes a core from the ranks).
    fn queue_idle(&self) {
        self.free_queue(lock(&self.queue.jobs));
    }

    fn free_queue(&self, mut q: std::sync::MutexGuard<'_, Queue>) {
        q.running = false;
        let wake = !q.jobs.is_empty() || q.shutdown;
        drop(q);
        if wake {
            self.queue.cv.notify_all();
        }
    }

    /// A waiter's fast path: while the worker has not started the queued jobs up to and
    /// including the one `done` completes, runs them here, one at a time in issue order, as the
    /// worker would have (the `running` flag keeps it to one runner). A call waited on at once
    /// thus runs on the caller's thread, without the two cross-core wake-ups of a hand-over to
    /// the worker and back (tens of microseconds each). Stops, leaving the rest to the worker,
    /// at a job whose hooks are the worker's only (`Hooks::worker_only`: a device collective's)
    /// and as soon as anything else is running. A job's other hooks (a group's pack, an in-place
    /// layout's move) run here with it.
    fn run_queued_through(&self, done: &Arc<Completion>) {
        while !done.is_done() {
            let mut job = {
                let mut q = lock(&self.queue.jobs);
                let steal = !q.running
                    && q.jobs.front().is_some_and(|j| !j.hooks.worker_only)
                    && q.jobs.iter().any(|j| Arc::ptr_eq(&j.done, done));
                if !steal {
                    return;
                }
                let Some(job) = q.jobs.pop_front() else {
                    return;
                };
                q.running = true;
                job
            };
            self.run_job(&mut job);
        }
    }

    /// Runs `op` between its hooks inside a panic boundary: a panic (a bug in toroid or in a
    /// hook) becomes [`Error::Internal`] and aborts the communicator, which stays destroyable,
    /// instead of leaving it "running" forever with its queue stuck.
    fn execute_guarded(&self, op: &RawOp, hooks: &mut Hooks, issued_ns: u64) -> Result<()> {
        let run = || {
            if let Some(before) = hooks.before.take() {
                before();
            }
            let r = match self.wire_of(op) {
                Some(wire) => self.execute_compressed(op, wire, issued_ns),
                None => self.execute(op, issued_ns),
            };
            // (After a failure's stall report, which shows the operation still running.)
            self.watch.recorder.end(r.is_ok());
            if r.is_ok()
                && let Some(after) = hooks.after.take()
            {
                after();
            }
            r
        };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
            Ok(r) => r,
            Err(payload) => {
                let what = crate::error::panic_message(&*payload).unwrap_or("a panic without a message");
                let e = Error::Internal(
                    format!(
                        "rank {}: panic during {:?}: {what} (the communicator is aborted)",
                        self.ident.rank, op.kind
                    )
                    .into(),
                );
                self.watch.recorder.end(false);
                // The engine's lock may be poisoned by the panic; `lock` takes it anyway, and
                // closing every link is the one thing left to do with it.
                Err(self.failed(&mut lock(&self.engine), e))
            }
        }
    }
}
