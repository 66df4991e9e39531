//! Single-producer/single-consumer byte rings in a segment (see the [module
//! documentation](super)).

use std::sync::atomic::{Ordering, fence};

use super::Segment;

/// Bytes before the ring data.
const RING_DATA_OFFSET: usize = 4096;
/// Cache line distance used to keep fields of different writers apart (two 64-byte lines:
/// the adjacent-line prefetcher pulls pairs).
pub(crate) const LINE: usize = 128;
/// The producer publishes at least this often inside one large write.
pub const PUBLISH: usize = 64 * 1024;
/// Smallest ring capacity accepted.
pub const MIN_RING: usize = 4096;

/// Offsets of one ring's control fields inside its control block (each on its own line).
pub(super) const HEAD: usize = 0;
pub(super) const CLOSED: usize = 8;
pub(super) const TAIL: usize = LINE;
pub(super) const GONE: usize = LINE + 8;
pub(super) const READER_WAITING: usize = 2 * LINE;
pub(super) const WRITER_WAITING: usize = 3 * LINE;
/// Size of a control block.
const CTL_LEN: usize = 4 * LINE;

/// Where one ring lives in a segment.
#[derive(Debug, Clone, Copy)]
pub(super) struct RingAt {
    pub(super) ctl: usize,
    pub(super) data: usize,
    pub(super) cap: usize,
}

/// Total bytes of a pair segment with rings of `cap` bytes.
pub fn pair_segment_len(cap: usize) -> usize {
    RING_DATA_OFFSET + 2 * cap
}

/// Rounds a requested ring size to the power of two used (at least [`MIN_RING`]).
pub fn ring_capacity(requested: usize) -> usize {
    requested.max(MIN_RING).checked_next_power_of_two().unwrap_or(1 << 40)
}

pub(super) fn rings(cap: usize) -> [RingAt; 2] {
    [
        RingAt { ctl: 512, data: RING_DATA_OFFSET, cap },
        RingAt { ctl: 512 + CTL_LEN, data: RING_DATA_OFFSET + cap, cap },
    ]
}

/// The writing end of a ring.
#[derive(Debug)]
pub(super) struct Producer {
    pub(super) at: RingAt,
    /// Bytes written (local copy of `head`, ahead of it between publishes).
    pub(super) head: u64,
    pub(super) published: u64,
    pub(super) tail_cache: u64,
}

/// The reading end of a ring.
#[derive(Debug)]
pub(super) struct Consumer {
    pub(super) at: RingAt,
    pub(super) tail: u64,
    pub(super) released: u64,
    pub(super) head_cache: u64,
}

impl Producer {
    pub(super) fn free(&mut self, seg: &Segment) -> usize {
        let cap = self.at.cap as u64;
        if self.head - self.tail_cache == cap {
            self.tail_cache = seg.u64_at(self.at.ctl + TAIL).load(Ordering::Acquire);
        }
        (cap - (self.head - self.tail_cache)) as usize
    }

    /// Copies as much of `bufs` as fits; returns (bytes, reader needs a wake-up).
    pub(super) fn write(&mut self, seg: &Segment, bufs: &[&[u8]]) -> (usize, bool) {
        let mut written = 0;
        let mut wake = false;
        let mask = self.at.cap as u64 - 1;
        'outer: for b in bufs {
            let mut off = 0;
            while off < b.len() {
                let mut free = self.free(seg);
                if free == 0 {
                    // Let the reader drain what we have before giving up.
                    wake |= self.publish(seg);
                    free = self.free(seg);
                    if free == 0 {
                        break 'outer;
                    }
                }
                let pos = (self.head & mask) as usize;
                let unpublished = (self.head - self.published) as usize;
                let n = free
                    .min(b.len() - off)
                    .min(self.at.cap - pos)
                    .min(PUBLISH - unpublished.min(PUBLISH - 1));
                // SAFETY: `pos + n <= cap`, inside this ring's data area of the live mapping;
                // the consumer does not read these bytes before `head` is published past them,
                // and `free` says it has consumed what was there.
                unsafe {
                    crate::reduce::copy_nonoverlapping(
                        b.as_ptr().add(off),
                        seg.as_ptr().add(self.at.data + pos),
                        n,
                    );
                }
                self.head += n as u64;
                off += n;
                written += n;
                if self.head - self.published >= PUBLISH as u64 {
                    wake |= self.publish(seg);
                }
            }
        }
        if self.head != self.published {
            wake |= self.publish(seg);
        }
        (written, wake)
    }

    /// Makes the written bytes visible; true when the reader sleeps and must be woken.
    fn publish(&mut self, seg: &Segment) -> bool {
        if self.head == self.published {
            return false;
        }
        seg.u64_at(self.at.ctl + HEAD).store(self.head, Ordering::Release);
        self.published = self.head;
        fence(Ordering::SeqCst);
        let w = seg.u32_at(self.at.ctl + READER_WAITING);
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0
    }

    pub(super) fn close(&mut self, seg: &Segment) -> bool {
        let wake = self.publish(seg);
        seg.u32_at(self.at.ctl + CLOSED).store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        wake || seg.u32_at(self.at.ctl + READER_WAITING).swap(0, Ordering::AcqRel) != 0
    }

    pub(super) fn reader_gone(&self, seg: &Segment) -> bool {
        seg.u32_at(self.at.ctl + GONE).load(Ordering::Acquire) != 0
    }
}

impl Consumer {
    pub(super) fn available(&mut self, seg: &Segment) -> usize {
        if self.head_cache == self.tail {
            self.head_cache = seg.u64_at(self.at.ctl + HEAD).load(Ordering::Acquire);
        }
        (self.head_cache - self.tail) as usize
    }

    /// True when the writer closed its end (it may have left data to read).
    pub(super) fn writer_done(&self, seg: &Segment) -> bool {
        seg.u32_at(self.at.ctl + CLOSED).load(Ordering::Acquire) != 0
    }

    /// True when the writer closed and everything it wrote has been consumed.
    pub(super) fn at_end(&mut self, seg: &Segment) -> bool {
        if seg.u32_at(self.at.ctl + CLOSED).load(Ordering::Acquire) == 0 {
            return false;
        }
        // `head` was published before `closed`: reload it.
        self.head_cache = seg.u64_at(self.at.ctl + HEAD).load(Ordering::Acquire);
        self.head_cache == self.tail
    }

    /// The readable bytes at the tail that are contiguous in the ring (at most `max`).
    fn contiguous(&mut self, seg: &Segment, max: usize) -> (usize, usize) {
        let avail = self.available(seg).min(max);
        let pos = (self.tail & (self.at.cap as u64 - 1)) as usize;
        (pos, avail.min(self.at.cap - pos))
    }

    /// Copies up to `dst.len()` bytes out; returns the count.
    fn read_into(&mut self, seg: &Segment, dst: &mut [u8]) -> usize {
        let mut got = 0;
        while got < dst.len() {
            let (pos, n) = self.contiguous(seg, dst.len() - got);
            if n == 0 {
                break;
            }
            // SAFETY: `pos + n <= cap` inside the live mapping; the producer published these
            // bytes (acquire load of head) and does not overwrite them before `tail` passes.
            unsafe {
                crate::reduce::copy_nonoverlapping(
                    seg.as_ptr().add(self.at.data + pos),
                    dst[got..].as_mut_ptr(),
                    n,
                )
            };
            got += n;
            self.tail += n as u64;
        }
        got
    }

    pub(super) fn read(&mut self, seg: &Segment, bufs: &mut [&mut [u8]]) -> (usize, bool) {
        let mut total = 0;
        let mut wake = false;
        for b in bufs.iter_mut() {
            let mut off = 0;
            while off < b.len() {
                let chunk = (b.len() - off).min(PUBLISH);
                let n = self.read_into(seg, &mut b[off..off + chunk]);
                off += n;
                total += n;
                if self.tail - self.released >= PUBLISH as u64 {
                    wake |= self.release(seg);
                }
                if n < chunk {
                    wake |= self.release(seg);
                    return (total, wake);
                }
            }
        }
        wake |= self.release(seg);
        (total, wake)
    }

    /// Offers up to `max` bytes in place to `f` (contiguous; across the ring's end a stitched
    /// copy of at most 64 bytes) and consumes what it takes.
    pub(super) fn read_with(
        &mut self,
        seg: &Segment,
        max: usize,
        f: &mut dyn FnMut(&[u8]) -> usize,
    ) -> (usize, bool) {
        let mut total = 0;
        let mut wake = false;
        while total < max {
            let (pos, n) = self.contiguous(seg, max - total);
            if n == 0 {
                break;
            }
            let avail = self.available(seg).min(max - total);
            let took = if n < 64 && avail > n {
                // The contiguous part ends at the ring's end inside the first few elements:
                // stitch it with the start so that at least one whole element is offered.
                let mut bounce = [0u8; 64];
                let k = avail.min(64);
                let mut peekc = Consumer {
                    at: self.at,
                    tail: self.tail,
                    released: self.released,
                    head_cache: self.head_cache,
                };
                let got = peekc.read_into(seg, &mut bounce[..k]);
                f(&bounce[..got]).min(got)
            } else {
                // SAFETY: `pos + n <= cap` inside the live mapping; published bytes that the
                // producer does not touch until `tail` passes them (after `f` returns).
                let s = unsafe { std::slice::from_raw_parts(seg.as_ptr().add(self.at.data + pos), n) };
                f(s).min(n)
            };
            if took == 0 {
                break;
            }
            self.tail += took as u64;
            total += took;
            if self.tail - self.released >= PUBLISH as u64 {
                wake |= self.release(seg);
            }
        }
        wake |= self.release(seg);
        (total, wake)
    }

    /// Copies available bytes without consuming them.
    pub(super) fn peek(&mut self, seg: &Segment, buf: &mut [u8]) -> usize {
        let mut c =
            Consumer { at: self.at, tail: self.tail, released: self.released, head_cache: self.head_cache };
        let n = c.read_into(seg, buf);
        self.head_cache = c.head_cache;
        n
    }

    /// Frees consumed space; true when the writer sleeps and must be woken.
    fn release(&mut self, seg: &Segment) -> bool {
        if self.tail == self.released {
            return false;
        }
        seg.u64_at(self.at.ctl + TAIL).store(self.tail, Ordering::Release);
        self.released = self.tail;
        fence(Ordering::SeqCst);
        let w = seg.u32_at(self.at.ctl + WRITER_WAITING);
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0
    }
}
