//! The stall report of a communicator: when an operation passes its deadline or loses a peer,
//! this rank asks every other rank for its flight-recorder snapshot over the control plane,
//! logs the whole report once, and puts its one-line conclusion at the front of the error.
//!
//! It runs before the communicator aborts (`Core::failed`), so the abort frames that tell every
//! peer why carry the conclusion too: every rank's error names the culprit, including the rank
//! that skipped a collective, which sees the abort (and the line) at its next call. An error
//! that came in as a peer's abort frame already carries that peer's line and is left alone.
//! [`Communicator::dump`] builds the same report on demand without failing anything, and
//! `SIGUSR1` prints it for every live communicator of the process (a watcher thread, started
//! with the first communicator unless `TOROID_DUMP_ON_SIGNAL=0`).

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use super::{Communicator, Core, lock};
use crate::error::{Error, Result};
use crate::trace::{PeerAnswer, Report};

/// How long a peer has to answer. A live rank answers from its control thread in well under a
/// millisecond whatever its other threads do, so silence this long means stopped or hung; a
/// loaded host can delay a thread by a few hundred milliseconds, not seconds. It also bounds
/// how much the report adds to the failure: an error arrives within the timeout plus this.
pub(crate) const GRACE: Duration = Duration::from_secs(2);

/// How long a peer has to answer when this rank's failure is a peer's (a closed connection, an
/// abort, bad bytes: `Error::Remote`). The report already names that rank; the others' state is
/// detail, and a survivor that saw the death first may already be rebuilding (a shrink stops
/// serving the control plane while it connects), so it would not answer at all. The full grace
/// there made the next survivor's error, and with it every survivor's shrink, 2 s late
/// (`examples/grow_cycle.rs`, 8 ranks); a live rank that is not shrinking answers in well under
/// this.
const REMOTE_GRACE: Duration = Duration::from_millis(250);

/// How long one check that a peer whose connection closed is gone may take (a refused
/// connection comes back in one round trip; a live peer's kernel accepts).
const DEATH_PROBE: Duration = Duration::from_millis(100);
/// How long a peer whose connection closed may still accept connections and yet be dying.
const DEATH_WINDOW: Duration = Duration::from_millis(50);

/// True for the failures the report explains: a deadline that passed, a peer that went away or
/// a mismatch found on this rank's own links (not an abort frame relayed from a peer, which
/// already carries that peer's report, nor this rank's own `abort`).
fn explains(e: &Error) -> bool {
    match e {
        Error::Timeout(_) => true,
        Error::Remote(d) => !is_relayed_abort(d),
        Error::InvalidUsage(d) => d.starts_with("collective mismatch"),
        _ => false,
    }
}

/// `rank 3 aborted: ...` (an abort frame's reason) or `another rank aborted ...` (the shared
/// window's abort flag).
fn is_relayed_abort(message: &str) -> bool {
    if message.starts_with("another rank aborted") {
        return true;
    }
    let Some(rest) = message.strip_prefix("rank ") else { return false };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && rest[digits..].starts_with(" aborted")
}

impl Core {
    /// The report of every rank's state now (asks the peers, each within `grace`); `closed`:
    /// the peer whose closed connection this rank's failure began with.
    pub(crate) fn stall_report(&self, closed: Option<usize>, grace: Duration) -> Report {
        let own = self.own_snapshot();
        let others: Vec<(usize, PeerAnswer)> = self.ask_peers(grace);
        Report::build_after_close(&own, &others, closed)
    }

    /// Whether `peer`, whose connection closed, is gone, with why. A process being killed
    /// closes its descriptors one by one: its listener may still take a connection a moment
    /// after its links closed, so a live answer is asked again, briefly.
    fn died(&self, peer: usize) -> Option<String> {
        let until = std::time::Instant::now() + DEATH_WINDOW;
        loop {
            if let Some(why) = self.peer_gone(peer, DEATH_PROBE) {
                return Some(why);
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The report when peer `dead` is known gone (`why`): this rank's own state and the dead
    /// rank, the others not asked.
    fn death_report(&self, dead: usize, why: String) -> Report {
        let own = self.own_snapshot();
        let others: Vec<(usize, PeerAnswer)> = (0..self.ident.size)
            .filter(|&r| r != self.ident.rank)
            .map(|r| {
                let a = if r == dead {
                    PeerAnswer::Dead(why.clone())
                } else {
                    PeerAnswer::Failed(format!("not asked: rank {dead} is gone"))
                };
                (r, a)
            })
            .collect();
        Report::build_after_close(&own, &others, Some(dead))
    }

    /// `e` with the stall report's conclusion in front of its message, when `e` is a failure
    /// the report explains (the whole report goes to the log, target `toroid::stall`).
    pub(crate) fn with_stall_report(&self, e: Error) -> Error {
        if self.ident.size < 2 || !explains(&e) {
            return e;
        }
        // A lost connection names the peer that closed it: that one died; others found gone
        // by now most likely exited after failing because of it.
        let closed = if matches!(e, Error::Remote(_)) { e.peer() } else { None };
        let grace = if matches!(e, Error::Remote(_)) { REMOTE_GRACE } else { GRACE };
        let report = match closed.and_then(|c| self.died(c).map(|why| (c, why))) {
            // The peer whose connection closed is gone: that is the whole story. Asking the
            // others would wait for survivors already rebuilding (shrinking ranks do not serve
            // the control plane), for nothing the conclusion needs.
            Some((c, why)) => self.death_report(c, why),
            None => self.stall_report(closed, grace),
        };
        tracing::error!(target: "toroid::stall", "rank {}: {e}\n{report}", self.ident.rank);
        if !report.is_informative() {
            return e;
        }
        e.context(report.conclusion())
    }
}

impl Communicator {
    /// The stall report now, without failing anything: every rank's last completed operation,
    /// the one it is in (phase, step, whom it waits on and for how long) or why it did not
    /// answer, and the one-line conclusion first. Asks every other rank over the control plane
    /// (each within two seconds); callable from any thread, also while an operation runs.
    pub fn dump(&self) -> Result<String> {
        self.core.forked()?;
        Ok(self.core.stall_report(None, GRACE).to_string())
    }
}

/// The communicators the `SIGUSR1` watcher reports on (weak: a dropped one just disappears).
static LIVE: Mutex<Vec<Weak<Core>>> = Mutex::new(Vec::new());
static WATCHER: OnceLock<()> = OnceLock::new();

/// Lists `core` for the `SIGUSR1` report, starting the watcher with the first communicator of
/// the process (when `TOROID_DUMP_ON_SIGNAL` is on and the program has no `SIGUSR1` handler).
pub(crate) fn watch(core: &Arc<Core>) {
    if !core.config.dump_on_signal {
        return;
    }
    {
        let mut live = lock(&LIVE);
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(core));
    }
    WATCHER.get_or_init(start_watcher);
}

fn start_watcher() {
    let ev = match crate::sys::signal::SignalEvent::install(crate::sys::signal::SIGUSR1) {
        Ok(Some(ev)) => ev,
        Ok(None) => {
            tracing::info!(target: "toroid::stall", "SIGUSR1 is handled by the program: no report on it");
            return;
        }
        Err(e) => {
            tracing::warn!(target: "toroid::stall", "cannot handle SIGUSR1 (no report on it): {e}");
            return;
        }
    };
    let spawned = std::thread::Builder::new().name("toroid-dump".into()).spawn(move || {
        while ev.wait().is_ok() {
            let live: Vec<Arc<Core>> = lock(&LIVE).iter().filter_map(Weak::upgrade).collect();
            for core in live {
                if core.forked().is_ok() {
                    let text = format!(
                        "toroid: rank {} of communicator {:#018x} (SIGUSR1): {}",
                        core.ident.rank,
                        core.ident.id,
                        core.stall_report(None, GRACE)
                    );
                    eprintln!("{text}");
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(target: "toroid::stall", "cannot start the SIGUSR1 watcher: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_failures_seen_on_this_rank_are_explained() {
        assert!(explains(&Error::Timeout("all_reduce #3 timed out".into())));
        assert!(explains(&Error::Remote("rank 2 closed its connection".into())));
        assert!(explains(&Error::InvalidUsage("collective mismatch: rank 0 called ...".into())));
        assert!(!explains(&Error::Remote("rank 12 aborted: rank 12: timeout: ...".into())));
        assert!(!explains(&Error::Remote("rank 1 aborted (its reason did not arrive)".into())));
        assert!(!explains(&Error::Remote("another rank aborted all_reduce #3 (...)".into())));
        assert!(!explains(&Error::Aborted("rank 0 aborted the communicator".into())));
        assert!(!explains(&Error::InvalidArgument("count".into())));
        assert!(explains(&Error::Remote("rank x aborted".into())));
    }
}
