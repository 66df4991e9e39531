//! Unit tests of the shared-memory byte rings ([`super`]), over heap memory.

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
                assert_eq!(self.words[i].load(Ordering::Relaxed), GUARD_WORD, "ring wrote outside its data");
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
    let data_area = h.mem().ptr_at(h.at.data, 256) as usize..h.mem().ptr_at(h.at.data, 256) as usize + 256;
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
