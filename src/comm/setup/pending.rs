//! Non-blocking creation and shrink: the set-up runs on a thread of its own and the caller holds
//! a [`PendingComm`] to poll, wait for or abort, as NCCL's non-blocking communicators
//! (`blocking = 0`, `ncclCommGetAsyncError`, `ncclCommAbort`) and MPI's `MPI_Comm_ishrink`
//! allow. A framework creates the communicators of several groups at once, or keeps serving
//! its own event loop (a health check, a signal) while the ranks gather.
//!
//! The set-up is the blocking one, unchanged; what makes it abortable is its thread's
//! [`cancel::Token`]: every wait of the set-up checks it at least every [`cancel::SLICE`], and
//! the calibration collectives are woken through the communicator's abort signal. So
//! [`PendingComm::abort`] returns within about that slice, with the thread joined, its
//! listener closed and every link it had made dropped; the ranks still setting up see this one
//! go, and fail at their own deadline or on the closed connections.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::cancel;
use crate::comm::{Communicator, lock};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::rendezvous::{self, Store};

/// Where the set-up stands.
enum State {
    /// The thread is still setting up.
    Running,
    /// Finished: the communicator, or why not; not yet taken.
    Done(Result<Communicator>),
    /// [`PendingComm::wait`] took the outcome, or [`PendingComm::abort`] dropped it.
    Taken(&'static str),
}

/// The outcome slot the set-up thread fills.
struct Slot {
    state: Mutex<State>,
    done: Condvar,
}

/// A communicator being created or shrunk on a thread of its own. Poll it with
/// [`is_done`](PendingComm::is_done), take the communicator with [`wait`](PendingComm::wait), or
/// give up with [`abort`](PendingComm::abort). Dropping it aborts it (and drops a communicator
/// that was made but never taken).
pub struct PendingComm {
    what: String,
    token: Arc<cancel::Token>,
    slot: Arc<Slot>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for PendingComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingComm").field("what", &self.what).field("done", &self.is_done()).finish()
    }
}

impl PendingComm {
    /// Runs `setup` on a new thread, cancellable through the returned handle.
    pub(crate) fn spawn(
        what: String,
        setup: impl FnOnce() -> Result<Communicator> + Send + 'static,
    ) -> Result<PendingComm> {
        let token = Arc::new(cancel::Token::default());
        let slot = Arc::new(Slot { state: Mutex::new(State::Running), done: Condvar::new() });
        let (t, s) = (token.clone(), slot.clone());
        let thread = std::thread::Builder::new()
            .name("toroid-setup".into())
            .spawn(move || {
                let scope = cancel::Scope::enter(t);
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(setup))
                    .unwrap_or_else(|_| Err(Error::Internal("the set-up thread panicked".into())));
                drop(scope);
                *lock(&s.state) = State::Done(r);
                s.done.notify_all();
            })
            .map_err(|e| Error::system("spawning the set-up thread", e))?;
        Ok(PendingComm { what, token, slot, thread: Mutex::new(Some(thread)) })
    }

    /// True once the set-up has finished, successfully or not ([`wait`](PendingComm::wait)
    /// then returns at once). Never blocks.
    pub fn is_done(&self) -> bool {
        !matches!(*lock(&self.slot.state), State::Running)
    }

    /// Waits for the set-up (bounded by the timeout it was started with) and returns the new
    /// communicator, or the set-up's error ([`Error::Aborted`] after
    /// [`abort`](PendingComm::abort)). The communicator is handed out once: a second call is an
    /// [`Error::InvalidUsage`].
    pub fn wait(&self) -> Result<Communicator> {
        let mut state = lock(&self.slot.state);
        while matches!(*state, State::Running) {
            state = self.slot.done.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        let outcome = match std::mem::replace(&mut *state, State::Taken("taken by an earlier wait")) {
            State::Done(r) => r,
            State::Taken(why) => {
                *state = State::Taken(why);
                Err(Error::InvalidUsage(format!("{}: the communicator was {why}", self.what).into()))
            }
            State::Running => Err(Error::Internal("set-up state".into())),
        };
        drop(state);
        self.join();
        outcome
    }

    /// Gives up the set-up: its waits fail at their next check, and this returns once its
    /// thread has stopped and dropped what it had made (a communicator already made but not
    /// taken is dropped too). Later [`wait`](PendingComm::wait)s fail with [`Error::Aborted`].
    /// No-op once the communicator was taken.
    pub fn abort(&self) {
        let mut state = lock(&self.slot.state);
        if matches!(*state, State::Taken(_)) {
            return;
        }
        // Under the lock, so that a communicator a concurrent `wait` has taken is never aborted.
        self.token.cancel();
        while matches!(*state, State::Running) {
            state = self.slot.done.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        let made = std::mem::replace(&mut *state, State::Done(Err(self.aborted())));
        if let State::Taken(why) = made {
            *state = State::Taken(why); // a wait on another thread won the race
            return;
        }
        drop(state);
        drop(made); // outside the lock: dropping a communicator closes its links
        self.join();
    }

    fn aborted(&self) -> Error {
        Error::Aborted(format!("{} was aborted by its caller", self.what).into())
    }

    fn join(&self) {
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

impl Drop for PendingComm {
    fn drop(&mut self) {
        self.abort();
    }
}

impl Communicator {
    /// [`Communicator::from_env`] on a thread of its own: returns at once with a
    /// [`PendingComm`] to poll, wait for or abort.
    pub fn from_env_async() -> Result<PendingComm> {
        crate::config::init_logging();
        let cfg = Config::global()?;
        let launch = rendezvous::env::detect(cfg)?;
        Communicator::from_launch_async(launch, cfg.clone())
    }

    /// [`Communicator::from_launch`] on a thread of its own (see [`PendingComm`]).
    pub fn from_launch_async(launch: rendezvous::env::Launch, cfg: Config) -> Result<PendingComm> {
        let what = format!("creation of rank {} of {}", launch.rank, launch.size);
        PendingComm::spawn(what, move || Communicator::from_launch(&launch, &cfg))
    }

    /// [`Communicator::with_store`] on a thread of its own (see [`PendingComm`]).
    pub fn with_store_async(
        rank: usize,
        size: usize,
        store: Arc<dyn Store>,
        config: &Config,
    ) -> Result<PendingComm> {
        let cfg = config.clone();
        let what = format!("creation of rank {rank} of {size}");
        PendingComm::spawn(what, move || Communicator::with_store(rank, size, store, &cfg))
    }
}
