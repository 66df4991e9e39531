//! Blocking use of an RDMA ring with a deadline (the set-up's messages and the tests): write or
//! read everything, yielding and then sleeping between tries.

use std::time::{Duration, Instant};

use super::super::verbs::Verbs;
use super::RdmaRing;
use crate::error::{Error, Result};

impl<V: Verbs> RdmaRing<V> {
    /// Writes all of `data`, waiting for credits until `deadline`.
    pub fn write_all(&mut self, mut data: &[u8], deadline: Instant) -> Result<()> {
        let mut idle = 0u32;
        while !data.is_empty() {
            let n = self.write(&[data])?;
            data = &data[n..];
            if n == 0 && !data.is_empty() {
                self.pause(&mut idle, deadline, || "no credits (every slot is unread)")?;
            } else {
                idle = 0;
            }
        }
        Ok(())
    }

    /// Fills `buf`, waiting for data until `deadline`.
    pub fn read_exact(&mut self, buf: &mut [u8], deadline: Instant) -> Result<()> {
        let (mut got, mut idle) = (0usize, 0u32);
        while got < buf.len() {
            let n = self.read(&mut [&mut buf[got..]])?;
            got += n;
            if n > 0 {
                idle = 0;
            } else if self.at_end() {
                return Err(Error::Remote(
                    format!("rank {} closed its RDMA ring after {got} of {} bytes", self.peer, buf.len())
                        .into(),
                )
                .with_peer(self.peer));
            } else {
                self.pause(&mut idle, deadline, || "nothing arrived")?;
            }
        }
        Ok(())
    }

    /// One step of a wait: yields the CPU, then sleeps for growing intervals up to 1 ms;
    /// at the deadline an error naming the peer and what was awaited.
    pub(super) fn pause(
        &mut self,
        idle: &mut u32,
        deadline: Instant,
        what: impl Fn() -> &'static str,
    ) -> Result<()> {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout(
                format!(
                    "RDMA ring with rank {}: {} until the deadline ({} of {} slots in flight to it, {} unread from it)",
                    self.peer,
                    what(),
                    self.tx.in_flight(),
                    self.geo.slots,
                    self.rx.available()
                )
                .into(),
            )
            .with_peer(self.peer));
        }
        *idle += 1;
        if *idle < 64 {
            std::thread::yield_now();
        } else {
            let nap = Duration::from_micros(1 << (*idle - 64).min(10));
            std::thread::sleep(nap.min(deadline - now));
        }
        Ok(())
    }
}
