//! Cancelling a set-up that runs on a thread of its own: the non-blocking forms of creation and
//! shrink (`comm/setup/pending.rs`, NCCL's non-blocking `ncclCommInitRankConfig` and
//! `ncclCommShrink` with `ncclCommAbort`).
//!
//! Set-up is a sequence of bounded waits in several layers (the store, the TCP mesh, the
//! shared-memory links, the calibration collectives). Rather than thread a token through every
//! one of their signatures, the set-up thread installs a [`Token`] for itself ([`Scope`]), and
//! each wait that can last calls [`check`] at least every [`SLICE`]: it fails with
//! [`Error::Aborted`] once the token is cancelled. Waits that sleep in the engine (calibration,
//! after every link is up) are woken instead by the hook the communicator registers
//! ([`on_cancel`]), which fires its abort signal. On any other thread (every blocking set-up)
//! there is no token: [`check`] is one thread-local read, and nothing else changes.
//!
//! This module is a leaf (it imports only `error`), so the store, the transports and the
//! communicator can all call it.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};

/// The longest a cancellable set-up wait sleeps between two checks.
pub const SLICE: Duration = Duration::from_millis(100);

/// What the caller of a non-blocking set-up holds to cancel it.
#[derive(Default)]
pub struct Token {
    cancelled: AtomicBool,
    /// Wakes a wait that sleeps where no [`check`] runs (the communicator's abort signal).
    hook: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token").field("cancelled", &self.is_cancelled()).finish()
    }
}

impl Token {
    /// Cancels the set-up: its next [`check`] fails, and the registered hook (if any) runs.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        if let Some(hook) = self.hook.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            hook();
        }
    }

    /// True once [`Token::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<Token>>> = const { RefCell::new(None) };
}

/// Installs `token` for the calling thread until dropped.
#[derive(Debug)]
pub struct Scope(());

impl Scope {
    /// Makes `token` the calling thread's token (the set-up thread calls this first).
    pub fn enter(token: Arc<Token>) -> Scope {
        CURRENT.with(|c| *c.borrow_mut() = Some(token));
        Scope(())
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let _ = CURRENT.try_with(|c| c.borrow_mut().take());
    }
}

/// True when the calling thread's set-up can be cancelled (its waits should sleep in slices).
pub fn active() -> bool {
    CURRENT.try_with(|c| c.borrow().is_some()).unwrap_or(false)
}

/// Fails with [`Error::Aborted`] when the calling thread's set-up was cancelled; `what` says
/// where it was.
pub fn check(what: &str) -> Result<()> {
    let cancelled = CURRENT.try_with(|c| c.borrow().as_ref().is_some_and(|t| t.is_cancelled()));
    if cancelled.unwrap_or(false) {
        return Err(Error::Aborted(format!("set-up aborted by its caller while {what}").into()));
    }
    Ok(())
}

/// Registers `hook` to run when the calling thread's set-up is cancelled (at once if it already
/// was). No-op on a thread without a token.
pub fn on_cancel(hook: Box<dyn Fn() + Send + Sync>) {
    let token = CURRENT.try_with(|c| c.borrow().clone()).ok().flatten();
    let Some(token) = token else { return };
    *token.hook.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    if token.is_cancelled() {
        token.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn check_fails_only_on_the_thread_whose_token_is_cancelled() {
        check("idle").unwrap();
        assert!(!active());
        let token = Arc::new(Token::default());
        let t = token.clone();
        let (entered, started) = std::sync::mpsc::channel();
        let other = std::thread::spawn(move || {
            let _scope = Scope::enter(t);
            assert!(active());
            check("before").unwrap();
            entered.send(()).unwrap();
            while check("waiting").is_ok() {
                std::thread::sleep(Duration::from_millis(1));
            }
            check("after").unwrap_err().to_string()
        });
        // This thread has no token: cancelling another's leaves it alone.
        started.recv().unwrap();
        token.cancel();
        check("here").unwrap();
        let msg = other.join().unwrap();
        assert!(msg.contains("aborted by its caller while after"), "{msg}");
    }

    #[test]
    fn the_hook_runs_on_cancel_and_at_once_when_registered_late() {
        let runs = Arc::new(AtomicUsize::new(0));
        let token = Arc::new(Token::default());
        let _scope = Scope::enter(token.clone());
        let r = runs.clone();
        on_cancel(Box::new(move || {
            r.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(runs.load(Ordering::Relaxed), 0);
        token.cancel();
        assert_eq!(runs.load(Ordering::Relaxed), 1);
        let r = runs.clone();
        on_cancel(Box::new(move || {
            r.fetch_add(10, Ordering::Relaxed);
        }));
        assert_eq!(runs.load(Ordering::Relaxed), 11);
        drop(_scope);
        assert!(!active());
    }
}
