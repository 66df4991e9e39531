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
mod tests {
    use super::*;
    use crate::transport::testutil::{Rng, bytes};
    use std::collections::VecDeque;
    use std::sync::atomic::AtomicU64;

    /// Guard bytes around the data area, checked untouched at the end of a test.
    const GUARD: usize = 64;
    const GUARD_WORD: u64 = 0xA5A5_5A5A_A5A5_5A5A;

    /// Heap memory for one ring of `cap` bytes: control block, guard, data, guard.
    struct Heap {
        words: Vec<AtomicU64>,
        at: RingAt,
    }

    impl Heap {
        fn new(cap: usize) -> Heap {
            assert!(cap.is_power_of_two());
            let at = RingAt { ctl: 0, data: CTL_LEN + GUARD, cap };
            let words: Vec<AtomicU64> = (0..(at.data + cap + GUARD) / 8).map(|_| AtomicU64::new(0)).collect();
            let h = Heap { words, at };
            for i in h.guard_words() {
                h.words[i].store(GUARD_WORD, Ordering::Relaxed);
            }
            h
        }

        fn guard_words(&self) -> impl Iterator<Item = usize> {
            let before = (CTL_LEN / 8)..(self.at.data / 8);
            let after = (self.at.data + self.at.cap) / 8..self.words.len();
            before.chain(after)
        }

        fn mem(&self) -> SharedMem<'_> {
            SharedMem::from_words(&self.words)
        }

        fn ends(&self) -> (Producer, Consumer) {
            (Producer::new(self.at), Consumer::new(self.at))
        }

        /// The control words as the other side sees them: (head, tail).
        fn counters(&self) -> (u64, u64) {
            let m = self.mem();
            (
                m.u64_at(self.at.ctl + HEAD).load(Ordering::Relaxed),
                m.u64_at(self.at.ctl + TAIL).load(Ordering::Relaxed),
            )
        }

        fn flag(&self, which: usize) -> u32 {
            self.mem().u32_at(self.at.ctl + which).load(Ordering::Relaxed)
        }

        fn set_flag(&self, which: usize) {
            self.mem().u32_at(self.at.ctl + which).store(1, Ordering::Relaxed);
        }
    }

    impl Drop for Heap {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                for i in self.guard_words() {
                    assert_eq!(
                        self.words[i].load(Ordering::Relaxed),
                        GUARD_WORD,
                        "ring wrote outside its data"
                    );
                }
            }
        }
    }

    #[test]
    fn the_stream_keeps_its_order_across_many_wrap_arounds() {
        let h = Heap::new(64);
        let (mut p, mut c) = h.ends();
        let (mut sent, mut got) = (0u64, 0u64);
        while got < 64 * 100 {
            let chunk = bytes(sent, 23);
            sent += p.write(h.mem(), &[&chunk]).0 as u64;
            let mut buf = [0u8; 17];
            let n = c.read(h.mem(), &mut [&mut buf]).0;
            assert_eq!(buf[..n], bytes(got, n)[..], "at byte {got}");
            got += n as u64;
        }
        assert_eq!(h.counters(), (sent, got));
    }

    #[test]
    fn writes_and_reads_stop_part_way_through_their_buffers() {
        let h = Heap::new(64);
        let (mut p, mut c) = h.ends();
        let data = bytes(0, 80);
        // Two buffers, the ring fills in the second: 40 + 24.
        assert_eq!(p.write(h.mem(), &[&data[..40], &data[40..]]).0, 64);
        assert_eq!(p.write(h.mem(), &[b"x"]).0, 0, "full");
        let (mut a, mut b) = ([0u8; 10], [0u8; 100]);
        assert_eq!(c.read(h.mem(), &mut [&mut a, &mut b]).0, 64);
        assert_eq!((&a[..], &b[..54]), (&data[..10], &data[10..64]));
        // The rest of the second buffer, after the ring's end.
        assert_eq!(p.write(h.mem(), &[&data[64..]]).0, 16);
        assert_eq!(c.read(h.mem(), &mut [&mut [], &mut b[..5]]).0, 5);
        assert_eq!(c.read(h.mem(), &mut [&mut b]).0, 11);
        assert_eq!(&b[..11], &data[69..80]);
        assert_eq!(c.read(h.mem(), &mut [&mut b]).0, 0, "empty");
    }

    #[test]
    fn a_partial_element_is_taken_once_the_writer_publishes_the_rest() {
        let h = Heap::new(256);
        let (mut p, mut c) = h.ends();
        let whole = |s: &[u8]| s.len() - s.len() % 4;
        p.write(h.mem(), &[&[7u8; 3]]);
        // 3 bytes of a 4-byte element: nothing can be taken yet.
        assert_eq!(c.read_with(h.mem(), usize::MAX, &mut |s| whole(s)).0, 0);
        p.write(h.mem(), &[&[9u8; 5]]);
        // The rest was published after the reader cached the head: it is seen at once.
        let mut got = Vec::new();
        let n = c.read_with(h.mem(), usize::MAX, &mut |s| {
            got.extend_from_slice(&s[..whole(s)]);
            whole(s)
        });
        assert_eq!((n.0, got), (8, [[7u8; 3].as_slice(), &[9u8; 5]].concat()));
    }

    #[test]
    fn lending_offers_whole_elements_across_the_ring_end() {
        let h = Heap::new(256);
        let (mut p, mut c) = h.ends();
        // Move the stream to 6 bytes before the ring's end.
        p.write(h.mem(), &[&[0u8; 250]]);
        c.read(h.mem(), &mut [&mut [0u8; 250]]);
        let data = bytes(250, 200);
        assert_eq!(p.write(h.mem(), &[&data]).0, 200);
        // Taking nothing consumes nothing.
        assert_eq!(c.read_with(h.mem(), usize::MAX, &mut |_| 0).0, 0);
        assert_eq!(c.available(h.mem()), 200);
        // Whole 8-byte elements: 6 bytes before the end are stitched with the start (64 bytes
        // offered from a bounce buffer), then the rest is lent in place.
        let mut offers = Vec::new();
        let mut seen = Vec::new();
        let data_area =
            h.mem().ptr_at(h.at.data, 256) as usize..h.mem().ptr_at(h.at.data, 256) as usize + 256;
        let (n, _) = c.read_with(h.mem(), usize::MAX, &mut |s: &[u8]| {
            offers.push((s.len(), data_area.contains(&(s.as_ptr() as usize))));
            let take = s.len() - s.len() % 8;
            seen.extend_from_slice(&s[..take]);
            take
        });
        assert_eq!((n, seen), (200, data));
        assert_eq!(offers, vec![(64, false), (136, true)]);
        // At most `max` bytes, stitched or in place.
        p.write(h.mem(), &[&bytes(0, 100)]);
        c.read(h.mem(), &mut [&mut [0u8; 56]]); // 6 bytes before the end again
        offers.clear();
        let (n, _) = c.read_with(h.mem(), 20, &mut |s: &[u8]| {
            offers.push((s.len(), data_area.contains(&(s.as_ptr() as usize))));
            s.len() - s.len() % 8
        });
        assert_eq!(n, 16);
        assert_eq!(offers, vec![(20, false), (4, true)]);
    }

    #[test]
    fn publish_and_release_move_the_shared_counters_and_ask_for_wake_ups_once() {
        let h = Heap::new(4 * PUBLISH);
        let (mut p, mut c) = h.ends();
        // A write larger than PUBLISH ends published; nobody sleeps, so no wake-up.
        let big = bytes(0, 3 * PUBLISH + 5);
        assert_eq!(p.write(h.mem(), &[&big]), (big.len(), false));
        assert_eq!(h.counters(), (big.len() as u64, 0));
        // Peeking consumes and releases nothing.
        let mut buf = vec![0u8; 2 * PUBLISH];
        assert_eq!(c.peek(h.mem(), &mut buf[..10]), 10);
        assert_eq!(h.counters().1, 0);
        // A reader that went to sleep is woken by the next publish, once.
        assert!(!c.arm(h.mem()), "data is there: no sleep");
        assert_eq!(h.flag(READER_WAITING), 0);
        h.set_flag(READER_WAITING);
        assert_eq!(p.write(h.mem(), &[b"abc"]), (3, true));
        assert_eq!(h.flag(READER_WAITING), 0);
        assert_eq!(p.write(h.mem(), &[b"d"]), (1, false));
        // Reads release what they consumed; a sleeping writer is woken, once.
        h.set_flag(WRITER_WAITING);
        assert_eq!(c.read(h.mem(), &mut [&mut buf]), (2 * PUBLISH, true));
        assert_eq!(h.counters().1, 2 * PUBLISH as u64);
        assert_eq!(c.read(h.mem(), &mut [&mut buf[..7]]), (7, false));
        // Lending releases what `f` took.
        let (n, _) = c.read_with(h.mem(), 100, &mut |s: &[u8]| s.len().min(30));
        assert_eq!(n, 100);
        assert_eq!(h.counters().1, 2 * PUBLISH as u64 + 107);
        // The writer reloads the reader's tail only when its cached one says full.
        let written = big.len() + 4;
        assert_eq!(p.free(h.mem()), 4 * PUBLISH - written, "cached: nothing consumed yet");
        assert_eq!(p.write(h.mem(), &[&bytes(0, 4 * PUBLISH - written)]).0, 4 * PUBLISH - written);
        assert_eq!(p.free(h.mem()), 2 * PUBLISH + 107, "full by its cache: reloaded");
    }

    #[test]
    fn a_full_ring_pushes_back_until_the_reader_frees_space() {
        let h = Heap::new(64);
        let (mut p, mut c) = h.ends();
        assert!(c.arm(h.mem()), "an empty ring: the reader may sleep");
        assert_eq!(h.flag(READER_WAITING), 1);
        assert_eq!(p.write(h.mem(), &[&bytes(0, 100)]), (64, true), "fills the ring, wakes the reader");
        assert_eq!(p.write(h.mem(), &[b"more"]), (0, false));
        assert_eq!(p.free(h.mem()), 0);
        assert!(p.arm(h.mem()), "full: the writer may sleep");
        assert_eq!(h.flag(WRITER_WAITING), 1);
        let mut one = [0u8; 1];
        assert_eq!(c.read(h.mem(), &mut [&mut one]), (1, true), "freeing space wakes the writer");
        assert_eq!(h.flag(WRITER_WAITING), 0);
        assert!(!p.arm(h.mem()), "room for one byte");
        assert_eq!(h.flag(WRITER_WAITING), 0, "lowered again");
        assert_eq!(p.write(h.mem(), &[b"more"]).0, 1);
        let mut rest = [0u8; 64];
        assert_eq!(c.read(h.mem(), &mut [&mut rest]).0, 64);
        assert_eq!(&rest[..63], &bytes(1, 63)[..]);
        assert_eq!(rest[63], b'm');
    }

    #[test]
    fn close_ends_the_stream_after_the_data_and_leave_breaks_it() {
        let h = Heap::new(64);
        let (mut p, mut c) = h.ends();
        p.write(h.mem(), &[b"last"]);
        assert!(!c.writer_done(h.mem()) && !c.at_end(h.mem()));
        assert!(!p.close(h.mem()), "nobody sleeps");
        assert!(c.writer_done(h.mem()));
        assert!(!c.at_end(h.mem()), "data left");
        assert!(!c.arm(h.mem()), "data left: no sleep");
        let mut buf = [0u8; 8];
        assert_eq!(c.read(h.mem(), &mut [&mut buf]).0, 4);
        assert!(c.at_end(h.mem()));
        assert!(!c.arm(h.mem()), "the end: no sleep");
        assert_eq!(c.read(h.mem(), &mut [&mut buf]).0, 0);
        // A sleeping reader is woken by the close even without data.
        let h = Heap::new(64);
        let (mut p, mut c) = h.ends();
        assert!(c.arm(h.mem()));
        assert!(p.close(h.mem()));
        assert!(c.at_end(h.mem()));
        // A reader that leaves stops the writer.
        let h = Heap::new(64);
        let (mut p, c) = h.ends();
        assert!(!p.reader_gone(h.mem()));
        p.write(h.mem(), &[&[0u8; 64]]);
        c.leave(h.mem());
        assert!(p.reader_gone(h.mem()));
        assert!(!p.arm(h.mem()), "full but the reader left: no sleep");
    }

    /// Random operations against a `VecDeque<u8>` model of the stream.
    fn model_run(seed: u64, cap: usize, steps: usize) {
        let h = Heap::new(cap);
        let (mut p, mut c) = h.ends();
        let mut rng = Rng(seed);
        let mut model: VecDeque<u8> = VecDeque::new();
        let mut next = 0u64;
        let mut bufs = vec![vec![0u8; 2 * cap]; 3];
        for step in 0..steps {
            let ctx = format!("seed {seed}, cap {cap}, step {step}, {} buffered", model.len());
            match rng.upto(9) {
                0..=3 => {
                    let lens: Vec<usize> = (0..rng.upto(2) + 1).map(|_| rng.upto(cap + cap / 2)).collect();
                    let total: usize = lens.iter().sum();
                    let data = bytes(next, total);
                    let mut parts = Vec::new();
                    let mut at = 0;
                    for l in &lens {
                        parts.push(&data[at..at + l]);
                        at += l;
                    }
                    let (n, _) = p.write(h.mem(), &parts);
                    assert_eq!(n, total.min(cap - model.len()), "write: {ctx}");
                    model.extend(&data[..n]);
                    next += n as u64;
                }
                4..=6 => {
                    let lens: Vec<usize> = (0..rng.upto(2) + 1).map(|_| rng.upto(cap)).collect();
                    let mut outs: Vec<&mut [u8]> =
                        bufs.iter_mut().zip(&lens).map(|(b, &l)| &mut b[..l]).collect();
                    let (n, _) = c.read(h.mem(), &mut outs);
                    assert_eq!(n, lens.iter().sum::<usize>().min(model.len()), "read: {ctx}");
                    let got: Vec<u8> = outs.iter().flat_map(|b| b.iter().copied()).take(n).collect();
                    let want: Vec<u8> = model.drain(..n).collect();
                    assert_eq!(got, want, "read: {ctx}");
                }
                7 | 8 => {
                    let max = rng.upto(2 * cap);
                    let unit = [0usize, 1, 2, 4, 8][rng.upto(4)];
                    let mut at = 0usize;
                    let (n, _) = c.read_with(h.mem(), max, &mut |s: &[u8]| {
                        let avail = max.min(model.len()) - at;
                        assert!(!s.is_empty() && s.len() <= avail, "offer of {}: {ctx}", s.len());
                        assert!(s.iter().zip(model.range(at..)).all(|(a, b)| a == b), "lent bytes: {ctx}");
                        let take = if unit == 0 { 0 } else { s.len() - s.len() % unit };
                        at += take;
                        take
                    });
                    assert_eq!(n, at, "read_with: {ctx}");
                    if unit == 1 {
                        assert_eq!(n, max.min(model.len()), "read_with takes all: {ctx}");
                    }
                    model.drain(..n);
                }
                _ => {
                    let l = rng.upto(cap);
                    let n = c.peek(h.mem(), &mut bufs[0][..l]);
                    assert_eq!(n, l.min(model.len()), "peek: {ctx}");
                    assert!(bufs[0][..n].iter().zip(&model).all(|(a, b)| a == b), "peek: {ctx}");
                }
            }
            let (head, tail) = h.counters();
            assert_eq!((head - tail) as usize, model.len(), "shared counters: {ctx}");
            assert_eq!(c.available(h.mem()) == 0, model.is_empty(), "available: {ctx}");
            assert_eq!(p.free(h.mem()) == 0, model.len() == cap, "free: {ctx}");
        }
        assert!(next > 20 * cap as u64, "the stream wrapped around many times ({next} bytes)");
    }

    #[test]
    fn random_operations_match_a_queue_model() {
        model_run(1, 64, 20_000);
        model_run(2, 128, 20_000);
        model_run(3, 4096, 5_000);
    }

    #[test]
    fn a_producer_and_a_consumer_thread_share_a_heap_ring() {
        const TOTAL: u64 = 8 << 20;
        let h = Heap::new(2 * PUBLISH);
        let (mut p, mut c) = h.ends();
        std::thread::scope(|s| {
            s.spawn(|| {
                let (mut sent, mut len) = (0u64, 1usize);
                while sent < TOTAL {
                    len = (len * 7 + 13) % (3 * PUBLISH) + 1;
                    let chunk = bytes(sent, len.min((TOTAL - sent) as usize));
                    let mut off = 0;
                    let mut since = std::time::Instant::now();
                    while off < chunk.len() {
                        match p.write(h.mem(), &[&chunk[off..]]).0 {
                            0 => {
                                // A consumer that failed leaves the ring full for good.
                                assert!(since.elapsed().as_secs() < 60, "no space for a minute");
                                std::thread::yield_now();
                            }
                            n => {
                                off += n;
                                since = std::time::Instant::now();
                            }
                        }
                    }
                    sent += chunk.len() as u64;
                }
                p.close(h.mem());
            });
            let mut got = 0u64;
            let mut buf = vec![0u8; 50_000];
            let mut turn = 0usize;
            while !c.at_end(h.mem()) {
                turn += 1;
                let n = if turn.is_multiple_of(2) {
                    let n = c.read(h.mem(), &mut [&mut buf[..turn % 50_000 + 1]]).0;
                    assert!(buf[..n] == bytes(got, n)[..], "at byte {got}");
                    n
                } else {
                    let mut at = got;
                    c.read_with(h.mem(), usize::MAX, &mut |s: &[u8]| {
                        assert!(s == &bytes(at, s.len())[..], "lent at byte {at}");
                        at += s.len() as u64;
                        s.len()
                    })
                    .0
                };
                got += n as u64;
                if n == 0 {
                    std::thread::yield_now();
                }
            }
            assert_eq!(got, TOTAL);
        });
    }
}
