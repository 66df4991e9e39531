//! The flag protocol on the CPU: ranks as threads, blocks as threads, windows and signal areas
//! in host memory (atomics, so a protocol bug shows as wrong data, never as undefined
//! behaviour), random pauses at every point of the protocol to force interleavings.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use super::*;

/// Every rank's signal area and window (two halves of `slice` words per block).
struct Host {
    sig: Vec<Vec<AtomicU64>>,
    win: Vec<Vec<AtomicU64>>,
    stop: AtomicBool,
}

impl Host {
    fn new(n: usize, blocks: usize, slice: usize) -> Arc<Host> {
        let area = |len: usize| (0..len).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        Arc::new(Host {
            sig: (0..n).map(|_| area(SIGNAL_WORDS)).collect(),
            win: (0..n).map(|_| area(2 * blocks * slice)).collect(),
            stop: AtomicBool::new(false),
        })
    }
}

impl Signals for Host {
    fn load(&self, rank: usize, slot: usize) -> u64 {
        self.sig[rank][slot].load(Ordering::Acquire)
    }
    fn store(&self, rank: usize, slot: usize, value: u64) {
        self.sig[rank][slot].store(value, Ordering::Release)
    }
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// A small deterministic generator (xorshift) for the pauses.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Now and then a yield or a short sleep: the interleavings a GPU's scheduler could make.
    fn pause(&mut self) {
        match self.next() % 16 {
            0 => std::thread::sleep(Duration::from_micros(self.next() % 200)),
            1..=3 => std::thread::yield_now(),
            _ => {}
        }
    }
}

/// The value rank `r` contributes at element `i` of step `s` (block `b`).
fn value(r: usize, s: u64, b: usize, i: usize) -> u64 {
    (r as u64 + 1) * 1_000_003 + s * 7919 + (b * 31 + i) as u64
}

/// One block of one rank running `steps` all-reduce steps: write its slice, post, wait, read
/// every rank's slice and check the sum, done. Returns the fault, if any.
/// One block's part: rank `me` of `n`, block `b`, `slice` words per step, the call `fp`.
#[derive(Clone, Copy)]
struct Part {
    me: usize,
    n: usize,
    b: usize,
    slice: usize,
    steps: u64,
    fp: u64,
    seed: u64,
}

fn run_block(host: &Host, part: Part) -> Result<(), Fault> {
    let Part { me, n, b, slice, steps, fp, seed } = part;
    let mut rng = Rng(seed | 1);
    let t = Duration::from_secs(10);
    for _ in 0..steps {
        let s = host.sig[me][step_slot(b)].load(Ordering::Relaxed) + 1;
        host.sig[me][step_slot(b)].store(s, Ordering::Relaxed);
        let at = (half(s) * host.win[me].len() / 2) + b * slice;
        rng.pause();
        for i in 0..slice {
            host.win[me][at + i].store(value(me, s, b, i), Ordering::Relaxed);
            if i == slice / 2 {
                rng.pause();
            }
        }
        rng.pause();
        publish(host, me, b, s, fp);
        rng.pause();
        before_read(host, me, n, b, s, fp, t)?;
        for i in 0..slice {
            let sum: u64 = (0..n).map(|r| host.win[r][at + i].load(Ordering::Relaxed)).sum();
            let want: u64 = (0..n).map(|r| value(r, s, b, i)).sum();
            assert_eq!(
                sum, want,
                "rank {me} block {b} step {s} element {i}: a window was overwritten too early"
            );
            if i == 0 {
                rng.pause();
            }
        }
    }
    Ok(())
}

/// Runs every block of every rank; with `stop_on_fault`, a fault stops the others' waits (as
/// the kernels' status word does).
fn run_all(
    n: usize,
    blocks: usize,
    slice: usize,
    steps: u64,
    seed: u64,
    fps: &[u64],
    stop_on_fault: bool,
) -> Vec<Result<(), Fault>> {
    let host = Host::new(n, blocks, slice);
    let mut handles = Vec::new();
    for (me, &fp) in fps.iter().enumerate().take(n) {
        for b in 0..blocks {
            let host = host.clone();
            let seed = seed.wrapping_mul(1_000_003).wrapping_add((me * MAX_BLOCKS + b) as u64 + 1);
            handles.push(std::thread::spawn(move || {
                let r = run_block(&host, Part { me, n, b, slice, steps, fp, seed });
                if r.is_err() && stop_on_fault {
                    host.stop.store(true, Ordering::Release);
                }
                r
            }));
        }
    }
    handles.into_iter().map(|h| h.join().expect("a block panicked")).collect()
}

#[test]
fn every_step_reads_what_every_rank_wrote_for_it() {
    // World sizes including non-powers of two; each seed forces other interleavings.
    for (n, blocks) in [(2, 1), (2, 3), (3, 2), (5, 1), (4, 2)] {
        for seed in 1..4 {
            let fps = vec![fingerprint([1, 2, 3, 4]); n];
            for r in run_all(n, blocks, 17, 40, seed, &fps, true) {
                assert_eq!(r, Ok(()), "n {n} blocks {blocks} seed {seed}");
            }
        }
    }
}

#[test]
fn a_rank_making_another_call_is_a_mismatch_on_every_rank() {
    let n = 3;
    let mut fps = vec![fingerprint([1, 0, 7, 100]); n];
    fps[2] = fingerprint([1, 0, 7, 101]);
    let results = run_all(n, 1, 8, 5, 9, &fps, false);
    // Ranks 0 and 1 see rank 2's fingerprint; rank 2 sees rank 0's (the first it compares).
    assert_eq!(results[0], Err(Fault::Mismatch { peer: 2 }));
    assert_eq!(results[1], Err(Fault::Mismatch { peer: 2 }));
    assert_eq!(results[2], Err(Fault::Mismatch { peer: 0 }));
}

#[test]
fn a_missing_rank_is_a_timeout_naming_it() {
    let host = Host::new(2, 1, 4);
    let r = before_read(&*host, 0, 2, 0, 1, 5, Duration::from_millis(50));
    assert_eq!(r, Err(Fault::Timeout { peer: 1 }));
    host.stop.store(true, Ordering::Release);
    assert_eq!(before_read(&*host, 0, 2, 0, 1, 5, Duration::from_secs(10)), Err(Fault::Stopped));
}

#[test]
fn status_words_round_trip_and_fingerprints_differ() {
    for f in [Fault::Timeout { peer: 3 }, Fault::Mismatch { peer: 15 }] {
        assert_eq!(Fault::from_word(f.word()), Some(f));
    }
    assert_eq!(Fault::Stopped.word(), 0);
    assert_ne!(fingerprint([1, 2, 3, 4]), fingerprint([1, 2, 3, 5]));
    assert_ne!(fingerprint([0; 4]), 0);
    // Every slot of every (half, block) and every step counter is inside the area, distinct.
    let mut seen = std::collections::HashSet::new();
    for h in 0..2 {
        for b in 0..MAX_BLOCKS {
            for s in [post_slot(h, b), fp_slot(h, b)] {
                assert!(s < SIGNAL_WORDS && seen.insert(s));
            }
        }
    }
    for b in 0..MAX_BLOCKS {
        assert!(step_slot(b) < SIGNAL_WORDS && seen.insert(step_slot(b)));
    }
    const { assert!(SIGNAL_WORDS * 8 <= SIGNAL_BYTES) };
}
