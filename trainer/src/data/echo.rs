//! Data echoing (Choi, Passos, Shallue, Dahl, "Faster Neural Network Training with Data
//! Echoing", arXiv 1907.05550).
//!
//! When the stages before some point of the input pipeline ("upstream": reading, decoding, maybe
//! augmenting) cannot keep up with the optimiser ("downstream"), the accelerator idles. Echoing
//! inserts a stage that repeats each item `e` times (the paper's
//! `flat_map(lambda t: from_tensors(t).repeat(e))`), so downstream gets `e` items for every
//! fresh one. Where the stage sits decides what a repeat is:
//!
//! - **example echoing before augmentation** (seam `after_decode`): each repeat is augmented
//!   afresh, so repeats differ;
//! - **example echoing after augmentation** (seam `after_augment`): repeats are identical tensors;
//! - **batch echoing** (seam `after_batch`): the same batch is used `e` times.
//!
//! A shuffle buffer after the echo stage keeps repeats out of the same batch; the paper found
//! larger buffers help example echoing (batch echoing cannot use an example buffer; here its
//! buffer shuffles whole batches).
//!
//! Timing model (the paper's §3, with R = t_up / t_down, t_up the upstream time per fresh batch
//! and t_down the time of one optimiser step): with perfect pipelining a fresh batch costs
//! max(t_up, e t_down), so as long as e <= R the echoes are free and the wall-clock time to a
//! target is proportional to the fresh examples read. `--echo auto` therefore picks
//! e = floor(R), at least 1 and at most [`AUTO_MAX`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use super::pipeline::Stage;
use crate::bail;
use crate::error::Result;
use crate::rng::Rng;

/// The largest factor `--echo auto` chooses (the paper's gains flatten out by e = 4-8).
pub const AUTO_MAX: usize = 8;

/// Where the echo stage sits in the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EchoPoint {
    /// After decoding, before augmentation (each repeat is augmented afresh).
    BeforeAugment,
    /// After augmentation, before batching (repeats are identical).
    AfterAugment,
    /// After batching (whole batches are repeated).
    Batch,
}

/// The echo factor: fixed, or chosen from the measured R at each epoch start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EchoFactor {
    /// Every item is emitted this many times (1: no echoing).
    Fixed(usize),
    /// floor(R) from the previous epoch's measurements, clamped to 1..=[`AUTO_MAX`]; the first
    /// epoch runs with 1.
    Auto,
}

/// A parsed `--echo` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EchoSpec {
    /// Insertion point.
    pub point: EchoPoint,
    /// Echo factor.
    pub factor: EchoFactor,
}

impl EchoSpec {
    /// No echoing (the upstream for the R report is everything before augmentation).
    pub const OFF: EchoSpec = EchoSpec { point: EchoPoint::BeforeAugment, factor: EchoFactor::Fixed(1) };

    /// Parses `example-before-aug:E`, `example-after-aug:E`, `batch:E` (E a whole number or
    /// `auto`), or `auto` (example echoing before augmentation, E from R).
    pub fn parse(s: &str) -> Result<EchoSpec> {
        let s = s.trim();
        if s == "auto" {
            return Ok(EchoSpec { point: EchoPoint::BeforeAugment, factor: EchoFactor::Auto });
        }
        let Some((point, e)) = s.split_once(':') else {
            bail!("--echo '{s}': expected POINT:E (example-before-aug, example-after-aug, batch) or auto")
        };
        let point = match point.trim() {
            "example-before-aug" => EchoPoint::BeforeAugment,
            "example-after-aug" => EchoPoint::AfterAugment,
            "batch" => EchoPoint::Batch,
            p => {
                bail!("--echo: unknown insertion point '{p}' (example-before-aug, example-after-aug, batch)")
            }
        };
        let factor = match e.trim() {
            "auto" => EchoFactor::Auto,
            e => match e.parse::<usize>() {
                Ok(n) if n >= 1 => EchoFactor::Fixed(n),
                _ => bail!("--echo: echo factor '{e}' must be a whole number >= 1 or auto"),
            },
        };
        Ok(EchoSpec { point, factor })
    }
}

/// The echo factor `--echo auto` uses for a measured `r`: floor(R), so that e <= R and the
/// repeats cost no wall-clock time, clamped to 1..=`max` (1 when R is unknown or below 2).
pub fn auto_factor(r: f64, max: usize) -> usize {
    if !r.is_finite() || r < 1.0 { 1 } else { (r.floor() as usize).clamp(1, max.max(1)) }
}

/// Optimiser steps in an epoch of `examples` fresh examples per rank, echoed `e` times at
/// `point`, with `micro`-example batches and `accum` batches per step. Example echoing multiplies
/// the examples (a last partial batch is dropped); batch echoing multiplies the full batches.
pub fn steps_per_epoch(point: EchoPoint, e: usize, examples: usize, micro: usize, accum: usize) -> usize {
    let (micro, accum, e) = (micro.max(1), accum.max(1), e.max(1));
    let batches = match point {
        EchoPoint::BeforeAugment | EchoPoint::AfterAugment => examples * e / micro,
        EchoPoint::Batch => examples / micro * e,
    };
    batches / accum
}

/// The echo stage: emits every item `factor` times.
#[derive(Debug, Clone, Copy)]
pub struct Echo {
    /// Copies of each item (at least 1).
    pub factor: usize,
}

impl<T: Clone> Stage<T> for Echo {
    fn process(&self, item: T, emit: &mut dyn FnMut(T)) {
        for _ in 1..self.factor {
            emit(item.clone());
        }
        emit(item);
    }
}

/// A shuffle buffer (tf.data's `shuffle`): holds up to `capacity` items; once full, each new
/// item replaces a uniformly chosen resident, which is emitted. Capacity 0 or 1 passes items
/// through in order. Deterministic given its generator.
#[derive(Debug)]
pub struct ShuffleBuffer<T> {
    capacity: usize,
    items: Vec<T>,
    rng: Rng,
}

impl<T> ShuffleBuffer<T> {
    /// An empty buffer of `capacity` items drawing from `rng`.
    pub fn new(capacity: usize, rng: Rng) -> ShuffleBuffer<T> {
        ShuffleBuffer { capacity, items: Vec::with_capacity(capacity.min(1 << 16)), rng }
    }

    /// Adds `item`; emits one item once the buffer is full. Returns false as soon as `emit`
    /// does (the consumer went away).
    pub fn push(&mut self, item: T, emit: &mut impl FnMut(T) -> bool) -> bool {
        if self.capacity <= 1 {
            return emit(item);
        }
        if self.items.len() < self.capacity {
            self.items.push(item);
            return true;
        }
        let j = self.rng.below(self.items.len());
        emit(std::mem::replace(&mut self.items[j], item))
    }

    /// Emits the remaining items in random order (end of the epoch).
    pub fn drain(&mut self, emit: &mut impl FnMut(T) -> bool) -> bool {
        while !self.items.is_empty() {
            let j = self.rng.below(self.items.len());
            if !emit(self.items.swap_remove(j)) {
                return false;
            }
        }
        true
    }
}

/// Busy time of the pipeline's worker pools, shared by their threads: what t_up is measured
/// from. Decode counts one item per example read (fresh by definition); augment counts every
/// example it augments (with echoing before augmentation, the repeats too).
///
/// Stopping the clock also holds the pools before their next item: the trainer does so while it
/// evaluates, otherwise a slow pipeline would fill its queues during the evaluation and the
/// time left out of the training time would hide upstream work.
#[derive(Debug, Default)]
pub struct StageClock {
    decode_ns: AtomicU64,
    decoded: AtomicU64,
    augment_ns: AtomicU64,
    augmented: AtomicU64,
    stopped: AtomicBool,
}

/// A reading of a [`StageClock`].
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ClockReading {
    /// Seconds the decode threads spent reading and decoding.
    pub decode_s: f64,
    /// Examples decoded.
    pub decoded: f64,
    /// Seconds the augment threads spent augmenting.
    pub augment_s: f64,
    /// Examples augmented.
    pub augmented: f64,
}

impl StageClock {
    /// Records one decoded example that took `d`.
    pub fn add_decode(&self, d: Duration) {
        self.decode_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.decoded.fetch_add(1, Ordering::Relaxed);
    }

    /// Records one augmented example that took `d`.
    pub fn add_augment(&self, d: Duration) {
        self.augment_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.augmented.fetch_add(1, Ordering::Relaxed);
    }

    /// Stops (`true`) or restarts the clock and the pools that use it.
    pub fn stop(&self, stopped: bool) {
        self.stopped.store(stopped, Ordering::Release);
    }

    /// Waits while the clock is stopped (called by a pool thread before each item).
    pub fn wait_while_stopped(&self) {
        while self.stopped.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The totals so far.
    pub fn read(&self) -> ClockReading {
        ClockReading {
            decode_s: self.decode_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            decoded: self.decoded.load(Ordering::Relaxed) as f64,
            augment_s: self.augment_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            augmented: self.augmented.load(Ordering::Relaxed) as f64,
        }
    }
}

impl ClockReading {
    /// The totals since `earlier`.
    pub fn since(&self, earlier: &ClockReading) -> ClockReading {
        ClockReading {
            decode_s: self.decode_s - earlier.decode_s,
            decoded: self.decoded - earlier.decoded,
            augment_s: self.augment_s - earlier.augment_s,
            augmented: self.augmented - earlier.augmented,
        }
    }

    /// Upstream seconds per fresh example with `workers` threads per pool, the upstream being
    /// the stages before `point`. The pools run concurrently, so (perfect pipelining) the slower
    /// one sets the rate. Augmentation is upstream unless echoing happens before it. NaN before
    /// anything was measured.
    pub fn upstream_per_example(&self, point: EchoPoint, workers: usize) -> f64 {
        let w = workers.max(1) as f64;
        let decode = self.decode_s / self.decoded / w;
        match point {
            EchoPoint::BeforeAugment => decode,
            EchoPoint::AfterAugment | EchoPoint::Batch => decode.max(self.augment_s / self.augmented / w),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_the_three_points_and_auto() {
        let p = |s| EchoSpec::parse(s).unwrap();
        assert_eq!(
            p("example-before-aug:2"),
            EchoSpec { point: EchoPoint::BeforeAugment, factor: EchoFactor::Fixed(2) }
        );
        assert_eq!(p("example-after-aug:4").point, EchoPoint::AfterAugment);
        assert_eq!(p("batch:3"), EchoSpec { point: EchoPoint::Batch, factor: EchoFactor::Fixed(3) });
        assert_eq!(p("auto"), EchoSpec { point: EchoPoint::BeforeAugment, factor: EchoFactor::Auto });
        assert_eq!(p("batch:auto").factor, EchoFactor::Auto);
        for bad in ["", "2", "batch:0", "batch:x", "examples:2", "auto:2"] {
            assert!(EchoSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn echo_stage_repeats_exactly_factor_times() {
        for factor in 1..=4 {
            let mut out = vec![];
            for i in 0..5 {
                Echo { factor }.process(i, &mut |x| out.push(x));
            }
            assert_eq!(out.len(), 5 * factor);
            for i in 0..5 {
                assert_eq!(out.iter().filter(|&&x| x == i).count(), factor);
            }
            // Without a shuffle buffer the repeats are adjacent.
            assert_eq!(&out[..factor], &vec![0; factor][..]);
        }
    }

    #[test]
    fn shuffle_buffer_permutes_reproducibly_and_spreads_repeats() {
        let run = |cap: usize, seed: u64| {
            let mut b = ShuffleBuffer::new(cap, Rng::new(seed));
            let mut out = vec![];
            for i in 0..100 {
                Echo { factor: 2 }.process(i, &mut |x| {
                    b.push(x, &mut |y| {
                        out.push(y);
                        true
                    });
                });
            }
            b.drain(&mut |y| {
                out.push(y);
                true
            });
            out
        };
        let none = run(0, 1);
        assert_eq!(none, (0..100).flat_map(|i| [i, i]).collect::<Vec<_>>());
        let a = run(32, 1);
        assert_eq!(a, run(32, 1));
        assert_ne!(a, run(32, 2));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, none);
        // Adjacent repeats: all 100 pairs without a buffer, few with one.
        let adjacent = |v: &[i32]| v.windows(2).filter(|w| w[0] == w[1]).count();
        assert_eq!(adjacent(&none), 100);
        assert!(adjacent(&a) < 15, "{} adjacent repeats", adjacent(&a));
        // A consumer that goes away stops the buffer.
        let mut b = ShuffleBuffer::new(2, Rng::new(0));
        assert!(b.push(1, &mut |_| false) && b.push(2, &mut |_| false));
        assert!(!b.push(3, &mut |_| false));
    }

    #[test]
    fn steps_and_auto_factor() {
        // 100 examples, batches of 8: 12 steps; echoed twice: 25 (example) or 24 (batch).
        assert_eq!(steps_per_epoch(EchoPoint::BeforeAugment, 1, 100, 8, 1), 12);
        assert_eq!(steps_per_epoch(EchoPoint::AfterAugment, 2, 100, 8, 1), 25);
        assert_eq!(steps_per_epoch(EchoPoint::Batch, 2, 100, 8, 1), 24);
        assert_eq!(steps_per_epoch(EchoPoint::Batch, 3, 100, 8, 2), 18);
        assert_eq!(auto_factor(0.5, 8), 1);
        assert_eq!(auto_factor(2.9, 8), 2);
        assert_eq!(auto_factor(30.0, 8), 8);
        assert_eq!(auto_factor(f64::NAN, 8), 1);
    }

    #[test]
    fn upstream_time_is_the_slower_pool_before_the_echo_point() {
        let c = StageClock::default();
        for _ in 0..4 {
            c.add_decode(Duration::from_millis(10));
            c.add_augment(Duration::from_millis(30));
        }
        let r = c.read();
        assert_eq!((r.decoded, r.augmented), (4.0, 4.0));
        assert!((r.upstream_per_example(EchoPoint::BeforeAugment, 1) - 0.010).abs() < 1e-9);
        assert!((r.upstream_per_example(EchoPoint::AfterAugment, 1) - 0.030).abs() < 1e-9);
        assert!((r.upstream_per_example(EchoPoint::Batch, 2) - 0.015).abs() < 1e-9);
        let later = {
            c.add_decode(Duration::from_millis(50));
            c.read()
        };
        let d = later.since(&r);
        assert!((d.decode_s - 0.05).abs() < 1e-9 && d.decoded == 1.0 && d.augmented == 0.0);
        // A stopped clock holds a pool thread until it restarts.
        let c = std::sync::Arc::new(StageClock::default());
        c.stop(true);
        let t = std::time::Instant::now();
        let worker = {
            let c = c.clone();
            std::thread::spawn(move || c.wait_while_stopped())
        };
        std::thread::sleep(Duration::from_millis(30));
        c.stop(false);
        worker.join().unwrap();
        assert!(t.elapsed() >= Duration::from_millis(30));
    }
}
