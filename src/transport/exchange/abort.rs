//! The abort state shared by a communicator's threads.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};

/// What a revoke's reason says after `rank <r> ` (`Communicator::revoke`): it travels in the
/// abort frames, and a peer that reads it reports the revoke as such.
pub const REVOKED: &str = "revoked the communicator";

/// The abort state shared by a communicator's threads: a flag, the first reason, and an event
/// descriptor that wakes a rank sleeping in `poll(2)`.
#[derive(Debug)]
pub struct AbortSignal {
    flag: AtomicBool,
    reason: Mutex<Option<Error>>,
    pub(super) event: crate::sys::eventfd::EventFd,
}

impl AbortSignal {
    /// A signal that has not fired.
    pub fn new() -> Result<AbortSignal> {
        let event = crate::sys::eventfd::EventFd::new().map_err(|e| Error::system("eventfd", e))?;
        Ok(AbortSignal { flag: AtomicBool::new(false), reason: Mutex::new(None), event })
    }

    /// Fires the signal (the first reason is kept) and wakes every sleeping waiter. Never blocks.
    pub fn fire(&self, reason: Error) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                *r = Some(reason);
            }
        }
        self.flag.store(true, Ordering::Release);
        self.event.signal();
    }

    /// The event descriptor (readable once fired), for waits outside the engine.
    pub fn event_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.event.as_raw_fd()
    }

    /// True once fired.
    pub fn is_fired(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// `Err(Aborted)` with the reason once fired.
    pub fn check(&self) -> Result<()> {
        if !self.is_fired() {
            return Ok(());
        }
        Err(self.error())
    }

    /// The error later calls report once fired.
    pub fn error(&self) -> Error {
        let r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        match &*r {
            Some(Error::Aborted(s)) => Error::Aborted(s.clone()),
            Some(e) => e.facts_into(Error::Aborted(
                format!("communicator aborted after an earlier error: {e}").into(),
            )),
            None => Error::Aborted("communicator aborted".into()),
        }
    }
}
