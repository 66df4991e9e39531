//! The completion of one queued operation ([`Completion`]) and the caller's handle on it
//! ([`Work`]): test, wait with a deadline, and the buffer an owned call gives back. A wait that
//! finds its operation not yet started runs it on the waiting thread
//! (`Core::run_queued_through`).

use std::any::Any;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::comm::{Core, lock};
use crate::error::{Error, Result};
use crate::transport::exchange::AbortSignal;

/// Completion state of one queued operation.
pub(crate) struct Completion {
    result: Mutex<Option<Result<()>>>,
    cv: Condvar,
    done: AtomicBool,
    keep: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Completion {
    pub(in crate::comm) fn new(keep: Option<Box<dyn Any + Send>>) -> Completion {
        Completion {
            result: Mutex::new(None),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
            keep: Mutex::new(keep),
        }
    }

    pub(in crate::comm) fn complete(&self, r: Result<()>) {
        // `done` is set before the result's lock is released: a waiter that finds the result
        // (under that lock) then also finds the work done (`Work::wait_timeout` checks both;
        // set after the unlock, a waiter could see the result, not yet `done`, and report a
        // timeout for a work that had completed).
        let mut result = lock(&self.result);
        *result = Some(r);
        self.done.store(true, Ordering::Release);
        drop(result);
        self.cv.notify_all();
    }

    pub(in crate::comm) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Waits for completion. Past `timeout` the communicator is aborted (so the operation
    /// fails fast) and the wait continues until it has actually stopped: a caller's buffers are
    /// never released while the operation may still touch them.
    pub(in crate::comm) fn wait_done(&self, abort: &AbortSignal, timeout: Duration) -> Result<()> {
        let deadline = crate::config::deadline_in(timeout);
        // Poll briefly first: waking a sleeping thread costs tens of microseconds.
        let spin_until = Instant::now() + Duration::from_micros(20);
        while !self.is_done() && Instant::now() < spin_until {
            std::hint::spin_loop();
        }
        let mut r = lock(&self.result);
        let mut timed_out = false;
        while r.is_none() {
            let now = Instant::now();
            if !timed_out && now >= deadline {
                timed_out = true;
                abort.fire(Error::Timeout(format!("work not completed within {timeout:?}").into()));
            }
            let wait = if timed_out { Duration::from_millis(50) } else { deadline - now };
            r = self.cv.wait_timeout(r, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
        let res = r.clone().unwrap_or(Ok(()));
        match res {
            // The operation stopped because this wait's deadline aborted the communicator.
            Err(Error::Aborted(_)) if timed_out => Err(Error::Timeout(
                format!("work not completed within {timeout:?} (communicator aborted)").into(),
            )),
            other => other,
        }
    }
}

/// A handle to an operation issued asynchronously.
///
/// The operation runs on the communicator's worker thread in issue order. Dropping the handle
/// does not cancel it; owned buffers stay alive until it has run.
pub struct Work<B = ()> {
    pub(in crate::comm) done: Arc<Completion>,
    /// The communicator, for running the operation on the waiting thread (see
    /// `Core::run_queued_through`); weak, so that a work outliving its communicator does not
    /// keep its links and shared memory.
    pub(in crate::comm) core: Weak<Core>,
    pub(in crate::comm) abort: Arc<AbortSignal>,
    pub(in crate::comm) timeout: Duration,
    /// The fork generation of its communicator: a forked child has no worker to wait for.
    pub(in crate::comm) fork_generation: u64,
    pub(in crate::comm) _buf: PhantomData<fn() -> B>,
}

impl<B> std::fmt::Debug for Work<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("done", &self.done.is_done()).finish()
    }
}

impl Work<()> {
    /// The same work, typed as giving back the `B` its completion keeps (the caller put a `B`
    /// there when it queued the operation).
    pub(in crate::comm) fn keeping<B>(self) -> Work<B> {
        Work {
            done: self.done,
            core: self.core,
            abort: self.abort,
            timeout: self.timeout,
            fork_generation: self.fork_generation,
            _buf: PhantomData,
        }
    }
}

impl<B: 'static> Work<B> {
    fn not_forked(&self) -> Result<()> {
        if crate::sys::fork::generation() == self.fork_generation {
            return Ok(());
        }
        Err(Error::InvalidUsage(
            "this work belongs to a communicator created before fork(); a forked child cannot wait on it"
                .into(),
        ))
    }

    /// Runs the operation (and the queued ones before it) on this thread if the worker has not
    /// started it, when this wait allows as long as the operation's own deadline: a shorter
    /// wait must be able to give up on time, so it leaves the operation to the worker.
    fn run_here(&self, timeout: Duration) {
        if timeout < self.timeout {
            return;
        }
        if let Some(core) = self.core.upgrade() {
            core.run_queued_through(&self.done);
        }
    }

    /// True once the operation has finished (successfully or not). Never blocks.
    pub fn test(&self) -> bool {
        self.done.is_done()
    }

    /// The error, once finished with one.
    pub fn error(&self) -> Option<Error> {
        if !self.test() {
            return None;
        }
        lock(&self.done.result).clone().and_then(Result::err)
    }

    /// Waits up to `timeout`. Past it the communicator is aborted (this and every pending
    /// operation fail) and `Err(Timeout)` is returned once the operation has stopped.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        self.not_forked()?;
        self.run_here(timeout);
        let r = self.done.wait_done(&self.abort, timeout);
        if r.is_ok() && !self.test() {
            return Err(Error::Timeout(format!("work not completed within {timeout:?}").into()));
        }
        r
    }

    /// Waits (with the communicator's timeout) and returns the buffer the operation owned.
    pub fn wait(self) -> Result<B> {
        self.not_forked()?;
        self.run_here(self.timeout);
        self.done.wait_done(&self.abort, self.timeout)?;
        let keep = lock(&self.done.keep).take();
        match keep.map(|b| b.downcast::<B>()) {
            Some(Ok(b)) => Ok(*b),
            _ => {
                // `B = ()` for raw submissions.
                let unit: Box<dyn Any> = Box::new(());
                unit.downcast::<B>()
                    .map(|b| *b)
                    .map_err(|_| Error::Internal("work buffer already taken".into()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A waiter that finds the result also finds the work done: `Work::wait_timeout` reports a
    /// timeout for a result without `done`. Observed by a thread that takes the result's lock
    /// as often as it can while another completes the work, many times over.
    #[test]
    fn a_completed_result_is_never_seen_without_done() {
        let mut seen_early = 0;
        let deadline = Instant::now() + Duration::from_secs(30);
        for _ in 0..2_000 {
            let c = Arc::new(Completion::new(None));
            let go = Arc::new(AtomicBool::new(false));
            let (c2, go2) = (c.clone(), go.clone());
            let completer = std::thread::spawn(move || {
                while !go2.load(Ordering::Acquire) {
                    assert!(Instant::now() < deadline, "the completer was never started");
                    std::hint::spin_loop();
                }
                c2.complete(Ok(()));
            });
            go.store(true, Ordering::Release);
            loop {
                let found = lock(&c.result).is_some();
                if found {
                    seen_early += usize::from(!c.is_done());
                    break;
                }
                assert!(Instant::now() < deadline, "the work was never completed");
            }
            completer.join().expect("completer");
        }
        assert_eq!(seen_early, 0, "a waiter saw the result before the work was done");
    }
}
