//! Single-producer/single-consumer byte rings (see the [module documentation](super)).
//!
//! A ring is a control block and a data area of `cap` bytes (a power of two) in some shared
//! memory ([`SharedMem`]): a pair segment in production, a heap buffer in the tests below.
//!
//! The counters' arithmetic (free space, spans, what to publish, which values of the peer's
//! counter to accept) is the ring protocol's one state machine, [`crate::transport::ledger`],
//! which the RDMA ring shares; this file moves the counters through shared memory and copies
//! the bytes.

use std::sync::atomic::{Ordering, fence};

use super::segment::SharedMem;
use crate::transport::ledger::{RecvLedger, SendLedger};

/// Bytes before the ring data in a pair segment.
const RING_DATA_OFFSET: usize = 4096;
/// Cache line distance used to keep fields of different writers apart (two 64-byte lines:
/// the adjacent-line prefetcher pulls pairs).
pub(crate) const LINE: usize = 128;
/// The producer publishes at least this often inside one large write.
pub const PUBLISH: usize = 64 * 1024;
/// Smallest ring capacity accepted.
pub const MIN_RING: usize = 4096;

/// Offsets of one ring's control fields inside its control block (each on its own line).
const HEAD: usize = 0;
const CLOSED: usize = 8;
const TAIL: usize = LINE;
const GONE: usize = LINE + 8;
const READER_WAITING: usize = 2 * LINE;
const WRITER_WAITING: usize = 3 * LINE;
/// Size of a control block.
const CTL_LEN: usize = 4 * LINE;

/// Where one ring lives in its memory: control block and data area offsets, capacity.
#[derive(Debug, Clone, Copy)]
pub(super) struct RingAt {
    ctl: usize,
    data: usize,
    cap: usize,
}

/// Total bytes of a pair segment with rings of `cap` bytes.
pub fn pair_segment_len(cap: usize) -> usize {
    RING_DATA_OFFSET + 2 * cap
}

/// Rounds a requested ring size to the power of two used (at least [`MIN_RING`]).
pub fn ring_capacity(requested: usize) -> usize {
    requested.max(MIN_RING).checked_next_power_of_two().unwrap_or(1 << 40)
}

/// The two rings of a pair segment with rings of `cap` bytes: lower rank to higher, and back.
pub(super) fn rings(cap: usize) -> [RingAt; 2] {
    [
        RingAt { ctl: 512, data: RING_DATA_OFFSET, cap },
        RingAt { ctl: 512 + CTL_LEN, data: RING_DATA_OFFSET + cap, cap },
    ]
}

/// The writing end of a ring.
#[derive(Debug)]
pub(super) struct Producer {
    at: RingAt,
    /// `head`, what of it was published, and the consumer's `tail` as last loaded.
    book: SendLedger,
}

/// The reading end of a ring.
#[derive(Debug)]
pub(super) struct Consumer {
    at: RingAt,
    /// `tail`, what of it was released, and the producer's `head` as last loaded.
    book: RecvLedger,
}

impl Producer {
    /// The writing end of the ring at `at`, at the start of its stream.
    pub(super) fn new(at: RingAt) -> Producer {
        Producer { at, book: SendLedger::new(at.cap) }
    }

    /// Bytes that fit now (reloads the consumer's `tail` only when the cached one says full).
    pub(super) fn free(&mut self, mem: SharedMem<'_>) -> usize {
        if self.book.free() == 0 {
            // A `tail` the protocol does not allow (a corrupted segment) is ignored: the ring
            // stays full and the writer's wait ends at its deadline.
            let _ = self.book.credit(mem.u64_at(self.at.ctl + TAIL).load(Ordering::Acquire));
        }
        self.book.free()
    }

    /// Copies as much of `bufs` as fits; returns (bytes, reader needs a wake-up).
    pub(super) fn write(&mut self, mem: SharedMem<'_>, bufs: &[&[u8]]) -> (usize, bool) {
        let mut written = 0;
        let mut wake = false;
        'outer: for b in bufs {
            let mut off = 0;
            while off < b.len() {
                if self.free(mem) == 0 {
                    // Let the reader drain what we have before giving up.
                    wake |= self.publish(mem);
                    if self.free(mem) == 0 {
                        break 'outer;
                    }
                }
                let unpublished = self.book.unpublished();
                let span = self.book.span((b.len() - off).min(PUBLISH - unpublished.min(PUBLISH - 1)));
                let (pos, n) = (span.pos, span.len);
                let dst = mem.ptr_at(self.at.data + pos, n);
                // SAFETY: `dst` is `n` bytes of this ring's data area (`pos + n <= cap`, checked
                // against the memory by `ptr_at`), and `off + n <= b.len()`; the consumer does
                // not read these bytes before `head` is published past them, and `free` says it
                // has consumed what was there.
                unsafe { crate::reduce::copy_nonoverlapping(b.as_ptr().add(off), dst, n) };
                self.book.advance(n);
                off += n;
                written += n;
                if self.book.unpublished() >= PUBLISH {
                    wake |= self.publish(mem);
                }
            }
        }
        if self.book.unpublished() > 0 {
            wake |= self.publish(mem);
        }
        (written, wake)
    }

    /// Makes the written bytes visible; true when the reader sleeps and must be woken.
    fn publish(&mut self, mem: SharedMem<'_>) -> bool {
        let Some(head) = self.book.publish() else {
            return false;
        };
        mem.u64_at(self.at.ctl + HEAD).store(head, Ordering::Release);
        fence(Ordering::SeqCst);
        let w = mem.u32_at(self.at.ctl + READER_WAITING);
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0
    }

    /// Publishes what was written and marks the end of the stream; true when the reader
    /// sleeps and must be woken.
    pub(super) fn close(&mut self, mem: SharedMem<'_>) -> bool {
        let wake = self.publish(mem);
        mem.u32_at(self.at.ctl + CLOSED).store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        wake || mem.u32_at(self.at.ctl + READER_WAITING).swap(0, Ordering::AcqRel) != 0
    }

    /// True when the reader has left ([`Consumer::leave`]).
    pub(super) fn reader_gone(&self, mem: SharedMem<'_>) -> bool {
        mem.u32_at(self.at.ctl + GONE).load(Ordering::Acquire) != 0
    }

    /// Before the writer sleeps for space: raises `writer_waiting` and looks again (a
    /// sequentially consistent fence on both sides: either this sees the reader's release or
    /// the reader sees the flag). True when it may sleep, and the reader's next release asks
    /// for a wake-up; false, with the flag lowered, when there is space or the reader has left.
    pub(super) fn arm(&mut self, mem: SharedMem<'_>) -> bool {
        let flag = mem.u32_at(self.at.ctl + WRITER_WAITING);
        flag.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.free(mem) > 0 || self.reader_gone(mem) {
            flag.store(0, Ordering::Relaxed);
            return false;
        }
        true
    }
}

impl Consumer {
    /// The reading end of the ring at `at`, at the start of its stream.
    pub(super) fn new(at: RingAt) -> Consumer {
        Consumer { at, book: RecvLedger::new(at.cap) }
    }

    /// Bytes readable now (reloads the producer's `head` only when the cached one says empty).
    pub(super) fn available(&mut self, mem: SharedMem<'_>) -> usize {
        if self.book.available() == 0 {
            // A `head` the protocol does not allow is ignored: the ring stays empty.
            let _ = self.book.arrived(mem.u64_at(self.at.ctl + HEAD).load(Ordering::Acquire));
        }
        self.book.available()
    }

    /// True when the writer closed its end (it may have left data to read).
    pub(super) fn writer_done(&self, mem: SharedMem<'_>) -> bool {
        mem.u32_at(self.at.ctl + CLOSED).load(Ordering::Acquire) != 0
    }

    /// True when the writer closed and everything it wrote has been consumed.
    pub(super) fn at_end(&mut self, mem: SharedMem<'_>) -> bool {
        if mem.u32_at(self.at.ctl + CLOSED).load(Ordering::Acquire) == 0 {
            return false;
        }
        // `head` was published before `closed`: reload it.
        let _ = self.book.arrived(mem.u64_at(self.at.ctl + HEAD).load(Ordering::Acquire));
        self.book.available() == 0
    }

    /// Before the reader sleeps for data: raises `reader_waiting` and looks again (see
    /// [`Producer::arm`]). True when it may sleep, and the writer's next publish asks for a
    /// wake-up; false, with the flag lowered, when there is data or the stream has ended.
    pub(super) fn arm(&mut self, mem: SharedMem<'_>) -> bool {
        let flag = mem.u32_at(self.at.ctl + READER_WAITING);
        flag.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.available(mem) > 0 || self.at_end(mem) {
            flag.store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Leaves the ring: the writer's writes fail from now on ([`Producer::reader_gone`]).
    pub(super) fn leave(&self, mem: SharedMem<'_>) {
        mem.u32_at(self.at.ctl + GONE).store(1, Ordering::Release);
    }

    /// The readable bytes at the tail that are contiguous in the ring (at most `max`).
    fn contiguous(&mut self, mem: SharedMem<'_>, max: usize) -> (usize, usize) {
        self.available(mem);
        let span = self.book.span(max);
        (span.pos, span.len)
    }

    /// Copies up to `dst.len()` bytes out; returns the count.
    fn read_into(&mut self, mem: SharedMem<'_>, dst: &mut [u8]) -> usize {
        let mut got = 0;
        while got < dst.len() {
            let (pos, n) = self.contiguous(mem, dst.len() - got);
            if n == 0 {
                break;
            }
            let src = mem.ptr_at(self.at.data + pos, n);
            // SAFETY: `src` is `n` bytes of this ring's data area (`pos + n <= cap`, checked by
            // `ptr_at`) and `got + n <= dst.len()`; the producer published these bytes (acquire
            // load of head) and does not overwrite them before `tail` passes them.
            unsafe { crate::reduce::copy_nonoverlapping(src, dst[got..].as_mut_ptr(), n) };
            got += n;
            self.book.consume(n);
        }
        got
    }

    /// Copies into `bufs` in order what is there; returns (bytes, writer needs a wake-up).
    pub(super) fn read(&mut self, mem: SharedMem<'_>, bufs: &mut [&mut [u8]]) -> (usize, bool) {
        let mut total = 0;
        let mut wake = false;
        for b in bufs.iter_mut() {
            let mut off = 0;
            while off < b.len() {
                let chunk = (b.len() - off).min(PUBLISH);
                let n = self.read_into(mem, &mut b[off..off + chunk]);
                off += n;
                total += n;
                if self.book.unreleased() >= PUBLISH {
                    wake |= self.release(mem);
                }
                if n < chunk {
                    wake |= self.release(mem);
                    return (total, wake);
                }
            }
        }
        wake |= self.release(mem);
        (total, wake)
    }

    /// Offers up to `max` bytes in place to `f` (contiguous; across the ring's end a stitched
    /// copy of at most 64 bytes) and consumes what it takes.
    pub(super) fn read_with(
        &mut self,
        mem: SharedMem<'_>,
        max: usize,
        f: &mut dyn FnMut(&[u8]) -> usize,
    ) -> (usize, bool) {
        let mut total = 0;
        let mut wake = false;
        while total < max {
            let (pos, n) = self.contiguous(mem, max - total);
            if n == 0 {
                break;
            }
            let avail = self.available(mem).min(max - total);
            let took = if n < 64 && avail > n {
                // The contiguous part ends at the ring's end inside the first few elements:
                // stitch it with the start so that at least one whole element is offered.
                let mut bounce = [0u8; 64];
                let k = avail.min(64);
                let mut peekc = Consumer { at: self.at, book: self.book };
                let got = peekc.read_into(mem, &mut bounce[..k]);
                f(&bounce[..got]).min(got)
            } else {
                let at = mem.ptr_at(self.at.data + pos, n);
                // SAFETY: `n` bytes of this ring's data area (`pos + n <= cap`, checked by
                // `ptr_at`), published, which the producer does not touch until `tail` passes
                // them (after `f` returns).
                let s = unsafe { std::slice::from_raw_parts(at, n) };
                f(s).min(n)
            };
            if took == 0 {
                // Only part of an element is here as far as `head_cache` knows: the writer may
                // have published the rest since it was read (without this re-read the same
                // partial element would be offered until the deadline).
                let head = mem.u64_at(self.at.ctl + HEAD).load(Ordering::Acquire);
                if head == self.book.head() || self.book.arrived(head).is_err() {
                    break;
                }
                continue;
            }
            self.book.consume(took);
            total += took;
            if self.book.unreleased() >= PUBLISH {
                wake |= self.release(mem);
            }
        }
        wake |= self.release(mem);
        (total, wake)
    }

    /// Copies available bytes without consuming them.
    pub(super) fn peek(&mut self, mem: SharedMem<'_>, buf: &mut [u8]) -> usize {
        let mut c = Consumer { at: self.at, book: self.book };
        let n = c.read_into(mem, buf);
        // Keep what the copy learnt of the producer's head (allowed: it accepted it).
        let _ = self.book.arrived(c.book.head());
        n
    }

    /// Frees consumed space; true when the writer sleeps and must be woken.
    fn release(&mut self, mem: SharedMem<'_>) -> bool {
        let Some(tail) = self.book.release() else {
            return false;
        };
        mem.u64_at(self.at.ctl + TAIL).store(tail, Ordering::Release);
        fence(Ordering::SeqCst);
        let w = mem.u32_at(self.at.ctl + WRITER_WAITING);
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0
    }
}

#[cfg(test)]
mod tests;
