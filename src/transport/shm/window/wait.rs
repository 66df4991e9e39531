//! Waiting for another member's stage: spin, then yield, then sleep on its futex word in
//! slices, checking the deadline, the abort signal, the window's abort flag and the member's
//! connection between slices (see the [module documentation](super), "Stages").

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{HDR_ABORTED, PURE_SPIN, Probe, SLICE, WAITERS, Waiter, Window, reached};
use crate::collective::Fingerprint;
use crate::error::{Error, Result};

impl Window {
    /// Waits until member `m` reached stage `target`, checking its fingerprint for this
    /// collective on the way.
    pub fn wait(&mut self, m: usize, target: u32, w: &mut Waiter<'_>) -> Result<()> {
        self.wait_at(m, target, w, Instant::now(), true)
    }

    /// Waits until every other member reached `target` (one spin budget for all).
    pub fn wait_all(&mut self, target: u32, w: &mut Waiter<'_>) -> Result<()> {
        let start = Instant::now();
        // Check everyone once before waiting on anyone: members that are already there cost a
        // load each instead of a spin budget.
        for m in 0..self.members {
            if m != self.me && !reached(self.seen[m], target) {
                let v = self.stage_word(m).load(Ordering::Acquire);
                if reached(v, target) {
                    self.seen[m] = v;
                }
            }
        }
        for m in 0..self.members {
            if m != self.me {
                self.wait_at(m, target, w, start, true)?;
            }
        }
        Ok(())
    }

    pub(super) fn wait_at(
        &mut self,
        m: usize,
        target: u32,
        w: &mut Waiter<'_>,
        start: Instant,
        check_fp: bool,
    ) -> Result<()> {
        if !reached(self.seen[m], target) {
            self.spin_then_sleep(m, target, w, start)?;
        }
        if check_fp {
            self.check_fp(m, w.fp)?;
        }
        Ok(())
    }

    fn spin_then_sleep(&mut self, m: usize, target: u32, w: &mut Waiter<'_>, start: Instant) -> Result<()> {
        let Waiter { fp, policy, deadline, abort, probe } = w;
        let (fp, policy, deadline, abort, probe) = (*fp, *policy, *deadline, *abort, &mut **probe);
        let aborted = self.seg.u32_at(HDR_ABORTED);
        let pure = if policy.oversubscribed { Duration::ZERO } else { PURE_SPIN.min(policy.spin) };
        let mut i = 0u32;
        self.stats.waits += 1;
        let spun = Instant::now();
        // 1. Spin, then yield, until the spin budget is spent.
        loop {
            let v = self.stage_word(m).load(Ordering::Acquire);
            if reached(v, target) {
                self.seen[m] = v;
                self.stats.spin_time += spun.elapsed();
                return Ok(());
            }
            i = i.wrapping_add(1);
            if i.is_multiple_of(64) || policy.oversubscribed {
                abort.check()?;
                if aborted.load(Ordering::Relaxed) != 0 {
                    return Err(self.aborted_error(m, fp, probe));
                }
                let spent = start.elapsed();
                if spent >= policy.spin {
                    break;
                }
                if spent >= pure {
                    self.stats.yields += 1;
                    std::thread::yield_now();
                    continue;
                }
            }
            std::hint::spin_loop();
        }
        self.stats.spin_time += spun.elapsed();
        // 2. Sleep on the member's stage word in slices, checking liveness between them.
        let word = self.stage_word(m);
        let waiters = self.seg.u32_at(self.ctl(m) + WAITERS);
        waiters.fetch_add(1, Ordering::SeqCst);
        let slept = Instant::now();
        let mut last_probe = slept;
        let mut naps = 0u64;
        let r = (|| loop {
            let v = word.load(Ordering::SeqCst);
            if reached(v, target) {
                return Ok(v);
            }
            abort.check()?;
            if aborted.load(Ordering::Relaxed) != 0 {
                return Err(self.aborted_error(m, fp, &mut *probe));
            }
            let now = Instant::now();
            if now.duration_since(last_probe) < SLICE && now < deadline {
                naps += 1;
                crate::sys::futex::wait(word, v, SLICE.min(deadline - now));
                continue;
            }
            // A slice passed without the stage moving: is the member still there?
            last_probe = now;
            if probe(m)? {
                // Its connection closed: fine only if it got there before leaving.
                let v = word.load(Ordering::SeqCst);
                if reached(v, target) {
                    return Ok(v);
                }
                return Err(Error::Remote(
                    format!(
                        "local rank {m} closed its connection during {fp} (it exited, crashed or aborted)"
                    )
                    .into(),
                )
                // Every rank is a member of the window (it exists only when all are on one
                // host), so member `m` is rank `m`.
                .with_peer(m));
            }
            if now >= deadline {
                return Err(Error::Timeout(
                    format!(
                        "local rank {} in {fp}: deadline passed waiting for local rank {m} \
                     (shared-memory stage {v}, waiting for {target})",
                        self.me
                    )
                    .into(),
                ));
            }
            naps += 1;
            crate::sys::futex::wait(word, v, SLICE.min(deadline - now));
        })();
        waiters.fetch_sub(1, Ordering::SeqCst);
        self.stats.sleeps += 1;
        self.stats.naps += naps;
        self.stats.sleep_time += slept.elapsed();
        let v = r?;
        self.seen[m] = v;
        Ok(())
    }

    /// Another member flagged the window aborted: find its reason on the links if it is there.
    fn aborted_error(&self, m: usize, fp: &Fingerprint, probe: Probe<'_>) -> Error {
        let deadline = Instant::now() + Duration::from_millis(200);
        while Instant::now() < deadline {
            match probe(m) {
                Err(e) => return e,
                Ok(true) => break,
                Ok(false) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        Error::Remote(format!("another rank aborted {fp} (its reason did not arrive)").into())
    }
}
