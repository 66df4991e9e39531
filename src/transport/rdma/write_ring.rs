//! The RDMA ring: one direction's byte stream as RDMA WRITEs with immediate into the peer's
//! registered staging ring, under the ring protocol's credits ([`crate::transport::ledger`]).
//!
//! Each side registers two buffers of `slots x slot_bytes` once: a receive ring the peer
//! writes into, and a send stage it writes from. Sending copies up to `slot_bytes` bytes into
//! stage slot `head mod slots` and posts one WRITE_WITH_IMM of them into the peer's ring slot
//! of the same number, the immediate saying "data, n bytes"; RC delivers writes in order, so
//! the receiver knows the slot without it being named. A slot is one unit of the ledger: the
//! writer holds a credit per free slot and writes nothing without one, so it never overwrites
//! unread bytes, and never has more writes on their way than the receiver has receives posted.
//! The receiver reads slots in order (a slot may be read in several pieces), and at the end of
//! every read that emptied slots returns them with one zero-length WRITE_WITH_IMM, "credit,
//! n slots". Shutting down sends "close" after the last data. Larger writes are split into
//! slots; a slot is never shared by two writes (a small write wastes the rest of its slot,
//! as NCCL's network steps do).
//!
//! Everything the peer sends is checked before use: the immediate's kind, a data length of
//! 1..=slot_bytes (and equal to the bytes the completion reports), no slot beyond the credits
//! given, credits only for slots sent. A failed completion (or a flushed receive, after the
//! peer's failure moved the queue pair to the error state) fails the ring for good, with an
//! error naming the peer. Every wait ends at its deadline with an error naming the peer.

use std::time::Instant;

use super::verbs::{Completion, Region, RemoteRegion, Verbs, WcOp, WriteImm};
use crate::error::{Error, Result};
use crate::transport::ledger::{RecvLedger, SendLedger};

#[cfg_attr(not(test), allow(dead_code))] // the unit tests' tools
mod blocking;
mod geometry;
mod staging;

pub use geometry::{Geometry, RingInfo};
use staging::Buf;

/// Receive work requests carry this bit in their id (sends do not).
pub const RECV_TAG: u64 = 1 << 63;
/// Credit writes carry this bit in their id.
const CREDIT_TAG: u64 = 1 << 62;

/// The immediate: kind in bits 30-31, value in bits 0-29.
const KIND_SHIFT: u32 = 30;
const VALUE_MASK: u32 = (1 << KIND_SHIFT) - 1;
const KIND_DATA: u32 = 0;
const KIND_CREDIT: u32 = 1;
const KIND_CLOSE: u32 = 2;

/// The immediate of a write: `kind` and its value.
fn imm(kind: u32, value: usize) -> u32 {
    debug_assert!(value <= VALUE_MASK as usize);
    (kind << KIND_SHIFT) | value as u32
}

/// One peer's RDMA ring pair (this side's send direction and receive direction) over one
/// queue pair.
#[derive(Debug)]
pub struct RdmaRing<V: Verbs> {
    verbs: V,
    peer: usize,
    geo: Geometry,
    stage: Buf,
    stage_mr: Region,
    ring: Buf,
    ring_mr: Region,
    remote: Option<RemoteRegion>,
    tx: SendLedger,
    rx: RecvLedger,
    /// Bytes in each arrived slot.
    lens: Vec<usize>,
    /// Bytes already read of the slot at the receive tail.
    rx_off: usize,
    /// Send-queue entries posted and not completed.
    sq: usize,
    closed: bool,
    peer_closed: bool,
    failed: Option<Error>,
    /// The failure was the connection's (a failed completion), not the peer breaking the
    /// protocol: bytes that arrived before it are still read.
    lost: bool,
    wcs: Vec<Completion>,
}

impl<V: Verbs> RdmaRing<V> {
    /// Registers the two buffers on `verbs` and posts the receives; connect with the peer's
    /// [`RingInfo`] next. `peer` is the peer's rank (for errors).
    pub fn new(mut verbs: V, peer: usize, geo: Geometry) -> Result<RdmaRing<V>> {
        geo.check()?;
        let (mut stage, mut ring) = (Buf::new(geo.bytes())?, Buf::new(geo.bytes())?);
        let reg = |v: &mut V, b: &mut Buf| {
            // SAFETY: the buffer lives in the returned ring, whose Drop deregisters it before
            // the buffer is freed (fields drop after `drop` returns).
            unsafe { v.register(b.as_ptr(), geo.bytes()) }
                .map_err(|e| Error::system("registering an RDMA ring buffer", e))
        };
        let stage_mr = reg(&mut verbs, &mut stage)?;
        let ring_mr = match reg(&mut verbs, &mut ring) {
            Ok(r) => r,
            Err(e) => {
                verbs.deregister(&stage_mr);
                return Err(e);
            }
        };
        let mut r = RdmaRing {
            verbs,
            peer,
            geo,
            stage,
            stage_mr,
            ring,
            ring_mr,
            remote: None,
            tx: SendLedger::new(geo.slots),
            rx: RecvLedger::new(geo.slots),
            lens: vec![0; geo.slots],
            rx_off: 0,
            sq: 0,
            closed: false,
            peer_closed: false,
            failed: None,
            lost: false,
            wcs: Vec::new(),
        };
        for i in 0..geo.recv_depth() {
            r.verbs.post_recv(RECV_TAG | i as u64).map_err(|e| Error::system("posting RDMA receives", e))?;
        }
        Ok(r)
    }

    /// What the peer needs to connect to this ring.
    pub fn info(&self) -> RingInfo {
        RingInfo {
            qp: self.verbs.local_qp(),
            ring: RemoteRegion { addr: self.ring_mr.addr, len: self.ring_mr.len, rkey: self.ring_mr.rkey },
            geometry: self.geo,
        }
    }

    /// Connects to the peer's ring (decoded and checked by [`RingInfo::decode`]).
    pub fn connect(&mut self, peer: &RingInfo) -> Result<()> {
        if peer.geometry != self.geo {
            return Err(Error::InvalidUsage(
                format!(
                    "rank {} has an RDMA ring of {} slots of {} bytes, this rank {} of {}",
                    self.peer,
                    peer.geometry.slots,
                    peer.geometry.slot_bytes,
                    self.geo.slots,
                    self.geo.slot_bytes
                )
                .into(),
            )
            .with_peer(self.peer));
        }
        self.verbs
            .connect(&peer.qp)
            .map_err(|e| Error::system(format!("connecting the RDMA queue pair to rank {}", self.peer), e))?;
        self.remote = Some(peer.ring);
        Ok(())
    }

    /// The peer's rank.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The send side's ledger (slots written, published, credited).
    #[cfg_attr(not(test), allow(dead_code))] // the unit tests' tools
    pub fn send_ledger(&self) -> &SendLedger {
        &self.tx
    }

    #[cfg_attr(not(test), allow(dead_code))] // the unit tests' tools
    /// The receive side's ledger (slots arrived, consumed, released).
    pub fn recv_ledger(&self) -> &RecvLedger {
        &self.rx
    }

    #[cfg_attr(not(test), allow(dead_code))] // the unit tests' tools
    /// Send-queue entries in use.
    pub fn send_queue_used(&self) -> usize {
        self.sq
    }

    /// Fails the ring for good with `e` (kept for later calls) and returns it.
    fn fail(&mut self, e: Error) -> Error {
        let e = e.with_peer(self.peer);
        self.failed.get_or_insert(e).clone()
    }

    fn protocol(&mut self, what: String) -> Error {
        self.fail(Error::Remote(format!("RDMA ring from rank {}: {what}", self.peer).into()))
    }

    /// Polls the completion queue and applies what arrived: data, credits, close, failures.
    pub fn progress(&mut self) -> Result<()> {
        self.poll_completions()?;
        self.return_credits()
    }

    fn poll_completions(&mut self) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut wcs = std::mem::take(&mut self.wcs);
        wcs.clear();
        let polled = self.verbs.poll(&mut wcs);
        let r = polled
            .map_err(|e| self.fail(Error::system("polling the RDMA completion queue", e)))
            .and_then(|_| wcs.iter().try_for_each(|c| self.apply(c)));
        self.wcs = wcs;
        r
    }

    /// A post failed: the cause is usually a failed completion already queued (the queue
    /// pair went to the error state), which names what happened better than the post's error.
    fn post_failed(&mut self, what: String, e: std::io::Error) -> Error {
        match self.poll_completions() {
            Err(cause) => cause,
            Ok(()) => self.fail(Error::system(what, e)),
        }
    }

    fn apply(&mut self, c: &Completion) -> Result<()> {
        if let Err(status) = &c.status {
            let what = if c.wr_id & RECV_TAG != 0 { "a receive" } else { "a write" };
            self.lost = self.failed.is_none();
            return Err(self.fail(Error::Remote(
                format!("RDMA with rank {}: {what} failed: {status}", self.peer).into(),
            )));
        }
        match c.op {
            WcOp::Write => {
                self.sq = self.sq.saturating_sub(1);
                Ok(())
            }
            WcOp::RecvImm { imm, len } => {
                if let Err(e) = self.verbs.post_recv(c.wr_id) {
                    return Err(self.fail(Error::system("reposting an RDMA receive", e)));
                }
                let value = (imm & VALUE_MASK) as usize;
                match imm >> KIND_SHIFT {
                    KIND_DATA => {
                        if self.peer_closed {
                            return Err(self.protocol("data after it closed its ring".into()));
                        }
                        if value == 0 || value > self.geo.slot_bytes || len as usize != value {
                            return Err(self.protocol(format!(
                                "a write of {len} bytes announced as {value} (slots hold {})",
                                self.geo.slot_bytes
                            )));
                        }
                        // RC keeps the writes in order: this one filled the slot at the head.
                        let slot = (self.rx.head() % self.geo.slots as u64) as usize;
                        if let Err(v) = self.rx.arrived(self.rx.head() + 1) {
                            return Err(
                                self.protocol(format!("a write beyond the credits it was given ({v})"))
                            );
                        }
                        self.lens[slot] = value;
                        Ok(())
                    }
                    KIND_CREDIT if len == 0 && value > 0 => {
                        match self.tx.credit(self.tx.tail() + value as u64) {
                            Ok(_) => Ok(()),
                            Err(v) => Err(self.protocol(format!("credits for slots never sent ({v})"))),
                        }
                    }
                    KIND_CLOSE if len == 0 => {
                        self.peer_closed = true;
                        Ok(())
                    }
                    _ => Err(self.protocol(format!("an immediate 0x{imm:08x} with {len} bytes"))),
                }
            }
        }
    }

    /// Returns the slots consumed since the last credit, when the send queue has room.
    fn return_credits(&mut self) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let (Some(remote), n) = (self.remote, self.rx.unreleased()) else {
            return Ok(());
        };
        if n == 0 || self.sq >= self.geo.send_depth() {
            return Ok(());
        }
        let posted = self.verbs.post_write_imm(
            CREDIT_TAG | self.rx.tail(),
            WriteImm {
                local: &self.stage_mr,
                offset: 0,
                len: 0,
                remote: &remote,
                remote_offset: 0,
                imm: imm(KIND_CREDIT, n),
            },
        );
        if let Err(e) = posted {
            return Err(self.post_failed(format!("returning credits to rank {}", self.peer), e));
        }
        self.sq += 1;
        self.rx.release();
        Ok(())
    }

    /// Writes as much of `bufs` as the credits allow, one slot per write; returns the bytes
    /// taken (0: no credit now). Never waits.
    pub fn write(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        self.progress()?;
        let Some(remote) = self.remote else {
            return Err(Error::InvalidUsage("RDMA ring written before it was connected".into()));
        };
        if self.closed {
            return Err(Error::InvalidUsage(
                format!("RDMA ring to rank {} written after shutdown", self.peer).into(),
            ));
        }
        let b = self.geo.slot_bytes;
        let (mut written, mut i, mut off) = (0usize, 0usize, 0usize);
        loop {
            while i < bufs.len() && off == bufs[i].len() {
                (i, off) = (i + 1, 0);
            }
            // One entry stays for the credits the receive side owes.
            if i == bufs.len() || self.tx.free() == 0 || self.sq + 1 >= self.geo.send_depth() {
                return Ok(written);
            }
            let slot = self.tx.span(1).pos;
            let mut n = 0;
            while i < bufs.len() && n < b {
                let k = (bufs[i].len() - off).min(b - n);
                self.stage.write(slot * b + n, &bufs[i][off..off + k]);
                (n, off) = (n + k, off + k);
                if off == bufs[i].len() {
                    (i, off) = (i + 1, 0);
                }
            }
            let at = slot * b;
            let posted = self.verbs.post_write_imm(
                self.tx.head(),
                WriteImm {
                    local: &self.stage_mr,
                    offset: at,
                    len: n,
                    remote: &remote,
                    remote_offset: at,
                    imm: imm(KIND_DATA, n),
                },
            );
            if let Err(e) = posted {
                return Err(self.post_failed(format!("RDMA write to rank {}", self.peer), e));
            }
            self.sq += 1;
            self.tx.advance(1);
            self.tx.publish();
            written += n;
        }
    }

    /// Reads what has arrived into `bufs` in order; returns the bytes read (0: nothing now,
    /// or the end of the stream: see [`RdmaRing::at_end`]). Never waits. Bytes that arrived
    /// before the connection failed are still read (a peer that wrote its last bytes and
    /// exited fails only the credits returned to it); the failure is reported once none are
    /// left. A peer that broke the protocol is an error at once.
    pub fn read(&mut self, bufs: &mut [&mut [u8]]) -> Result<usize> {
        let progressed = self.progress();
        if self.rx.available() == 0 || !self.lost {
            progressed?;
        }
        let b = self.geo.slot_bytes;
        let mut total = 0;
        for dst in bufs.iter_mut() {
            let mut off = 0;
            while off < dst.len() && self.rx.available() > 0 {
                let slot = self.rx.span(1).pos;
                let len = self.lens[slot];
                let n = (len - self.rx_off).min(dst.len() - off);
                self.ring.read(slot * b + self.rx_off, &mut dst[off..off + n]);
                (off, self.rx_off) = (off + n, self.rx_off + n);
                if self.rx_off == len {
                    self.rx.consume(1);
                    self.rx_off = 0;
                }
            }
            total += off;
        }
        let credited = self.return_credits();
        if total == 0 {
            credited?;
        }
        Ok(total)
    }

    /// Copies up to `buf.len()` arrived bytes without consuming them (across slots); applies
    /// what completed first. Never waits.
    pub fn peek(&mut self, buf: &mut [u8]) -> Result<usize> {
        let progressed = self.progress();
        if self.rx.available() == 0 || !self.lost {
            progressed?;
        }
        Ok(self.peek_arrived(buf))
    }

    /// True when a read would return bytes or the end of the stream, or the ring has failed
    /// (the next call reports it): applies what completed first.
    pub fn readable(&mut self) -> bool {
        let _ = self.progress();
        self.failed.is_some() || self.rx.available() > 0 || self.peer_closed
    }

    /// True when a write would take bytes now, or the ring has failed: applies what completed
    /// first.
    pub fn writable(&mut self) -> bool {
        let _ = self.progress();
        self.failed.is_some() || (self.tx.free() > 0 && self.sq + 1 < self.geo.send_depth())
    }

    /// Waits (polling, until `deadline`) for every write posted so far to complete: the peer
    /// then has the bytes, and the queue pair can go without losing them.
    pub fn flush(&mut self, deadline: Instant) -> Result<()> {
        let mut idle = 0u32;
        loop {
            self.progress()?;
            if self.sq == 0 {
                return Ok(());
            }
            self.pause(&mut idle, deadline, || "writes not yet completed")?;
        }
    }

    /// True when the ring failed because the connection did (a failed completion: the peer
    /// is gone or unreachable), not because the peer broke the protocol.
    pub fn lost(&self) -> bool {
        self.lost && self.failed.is_some()
    }

    /// The verbs endpoint (for its notifications).
    pub fn verbs_mut(&mut self) -> &mut V {
        &mut self.verbs
    }

    /// The verbs endpoint.
    pub fn verbs(&self) -> &V {
        &self.verbs
    }

    /// Zero-copy read: offers up to `max` arrived bytes to `f` where they lie in the ring, one
    /// slot's run at a time; `f` returns how many it took (it may take fewer, e.g. whole
    /// elements only) and those are consumed. Where a slot ends within the first 64 bytes
    /// offered and more has arrived, the bytes are stitched across the slots into a small
    /// buffer, so that a whole element is always offered. Returns the bytes taken (0: nothing,
    /// or nothing `f` took). Failures as for [`RdmaRing::read`].
    pub fn read_with(&mut self, max: usize, f: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize> {
        let progressed = self.progress();
        if self.rx.available() == 0 || !self.lost {
            progressed?;
        }
        let b = self.geo.slot_bytes;
        let mut total = 0;
        while total < max && self.rx.available() > 0 {
            let slot = (self.rx.tail() % self.geo.slots as u64) as usize;
            let run = (self.lens[slot] - self.rx_off).min(max - total);
            let took = if run < 64 && self.rx.available() > 1 {
                let mut bounce = [0u8; 64];
                let k = (max - total).min(64);
                let got = self.peek_arrived(&mut bounce[..k]);
                f(&bounce[..got]).min(got)
            } else {
                f(self.ring.slice(slot * b + self.rx_off, run)).min(run)
            };
            if took == 0 {
                break;
            }
            self.consume_bytes(took);
            total += took;
        }
        let credited = self.return_credits();
        if total == 0 {
            credited?;
        }
        Ok(total)
    }

    /// Copies arrived bytes from the read position on, across slots, without consuming them.
    fn peek_arrived(&self, buf: &mut [u8]) -> usize {
        let (b, slots) = (self.geo.slot_bytes, self.geo.slots);
        let first = (self.rx.tail() % slots as u64) as usize;
        let (mut got, mut off) = (0usize, self.rx_off);
        for k in 0..self.rx.available() {
            if got == buf.len() {
                break;
            }
            let slot = (first + k) % slots;
            let n = (self.lens[slot] - off).min(buf.len() - got);
            self.ring.read(slot * b + off, &mut buf[got..got + n]);
            (got, off) = (got + n, 0);
        }
        got
    }

    /// Consumes `n` arrived bytes from the read position on, across slots.
    fn consume_bytes(&mut self, mut n: usize) {
        while n > 0 && self.rx.available() > 0 {
            let slot = (self.rx.tail() % self.geo.slots as u64) as usize;
            let k = (self.lens[slot] - self.rx_off).min(n);
            (self.rx_off, n) = (self.rx_off + k, n - k);
            if self.rx_off == self.lens[slot] {
                self.rx.consume(1);
                self.rx_off = 0;
            }
        }
    }

    /// True when the peer shut its side down and everything it wrote has been read.
    pub fn at_end(&self) -> bool {
        self.peer_closed && self.rx.available() == 0
    }

    /// Sends "close" after the data written so far: the peer reads end of stream after it.
    pub fn shutdown(&mut self) -> Result<()> {
        self.progress()?;
        let Some(remote) = self.remote else {
            return Ok(());
        };
        if !self.closed {
            let posted = self.verbs.post_write_imm(
                u64::MAX >> 2,
                WriteImm {
                    local: &self.stage_mr,
                    offset: 0,
                    len: 0,
                    remote: &remote,
                    remote_offset: 0,
                    imm: imm(KIND_CLOSE, 0),
                },
            );
            if let Err(e) = posted {
                return Err(self.post_failed(format!("closing the RDMA ring to rank {}", self.peer), e));
            }
            self.sq += 1;
            self.closed = true;
        }
        Ok(())
    }
}

impl<V: Verbs> Drop for RdmaRing<V> {
    fn drop(&mut self) {
        // Before the buffers are freed (they drop after this).
        self.verbs.deregister(&self.ring_mr);
        self.verbs.deregister(&self.stage_mr);
    }
}
