//! Training and evaluation statistics: named accumulators instead of index arithmetic.
//!
//! Each rank accumulates its own [`ExampleSums`], [`EpochStats`] and [`Window`]; before they are
//! reported they are summed over ranks with one all-reduce of a small `[f64; N]`. The order of
//! the fields in that array is private to this module: only the `to_array`/`from_array` pairs
//! below know it, and the tests check that summing arrays is the same as [`merge`]-ing structs.
//!
//! [`merge`]: ExampleSums::merge

use crate::error::Result;
use crate::parallel::Replicas;

/// Sums `values` element by element over ranks (unchanged when running alone).
fn sum_over_ranks<const N: usize>(rep: &Replicas, mut values: [f64; N]) -> Result<[f64; N]> {
    rep.sum_f64(&mut values)?;
    Ok(values)
}

/// Loss and top-1 hits summed over examples: what training and evaluation both count.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ExampleSums {
    /// Sum over batches of (mean loss of the batch) x (examples in the batch).
    pub loss_sum: f64,
    /// Correct top-1 predictions.
    pub correct: f64,
    /// Examples seen.
    pub count: f64,
}

impl ExampleSums {
    /// Adds one batch of `n` examples with mean loss `mean_loss` and `correct` hits.
    pub fn add_batch(&mut self, mean_loss: f64, correct: usize, n: usize) {
        self.loss_sum += mean_loss * n as f64;
        self.correct += correct as f64;
        self.count += n as f64;
    }

    /// Adds another accumulator's counts to this one.
    pub fn merge(&mut self, other: &ExampleSums) {
        self.loss_sum += other.loss_sum;
        self.correct += other.correct;
        self.count += other.count;
    }

    /// Mean loss per example (NaN when no example was seen).
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.count
    }

    /// Fraction of examples predicted correctly (NaN when no example was seen).
    pub fn accuracy(&self) -> f64 {
        self.correct / self.count
    }

    /// The sums over all ranks.
    pub fn sum_over_ranks(&self, rep: &Replicas) -> Result<ExampleSums> {
        Ok(Self::from_array(sum_over_ranks(rep, self.to_array())?))
    }

    /// The wire form: `[loss_sum, correct, count]`.
    fn to_array(self) -> [f64; 3] {
        [self.loss_sum, self.correct, self.count]
    }

    fn from_array([loss_sum, correct, count]: [f64; 3]) -> ExampleSums {
        ExampleSums { loss_sum, correct, count }
    }
}

/// One epoch's training totals.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct EpochStats {
    /// Loss and hits over the training examples of the epoch.
    pub train: ExampleSums,
    /// Seconds spent in optimiser steps.
    pub step_s: f64,
    /// Seconds of those spent blocked on gradient all-reduces.
    pub wait_s: f64,
}

impl EpochStats {
    /// Adds the time of one optimiser step, `wait_s` of its `step_s` waiting for all-reduces.
    pub fn add_step_time(&mut self, step_s: f64, wait_s: f64) {
        self.step_s += step_s;
        self.wait_s += wait_s;
    }

    /// Adds another accumulator's totals to this one.
    pub fn merge(&mut self, other: &EpochStats) {
        self.train.merge(&other.train);
        self.step_s += other.step_s;
        self.wait_s += other.wait_s;
    }

    /// Fraction of step time spent waiting for all-reduces (0 when no time was counted).
    pub fn comm_fraction(&self) -> f64 {
        if self.step_s > 0.0 { self.wait_s / self.step_s } else { 0.0 }
    }

    /// The totals over all ranks.
    pub fn sum_over_ranks(&self, rep: &Replicas) -> Result<EpochStats> {
        Ok(Self::from_array(sum_over_ranks(rep, self.to_array())?))
    }

    /// The wire form: `[loss_sum, correct, count, step_s, wait_s]`.
    fn to_array(self) -> [f64; 5] {
        let [loss_sum, correct, count] = self.train.to_array();
        [loss_sum, correct, count, self.step_s, self.wait_s]
    }

    fn from_array([loss_sum, correct, count, step_s, wait_s]: [f64; 5]) -> EpochStats {
        EpochStats { train: ExampleSums::from_array([loss_sum, correct, count]), step_s, wait_s }
    }
}

/// The optimiser steps since the last logged `steps.csv` row.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Window {
    /// Sum of the steps' mean losses.
    pub loss_sum: f64,
    /// Steps.
    pub steps: f64,
    /// Images of all ranks processed by those steps (each step counts the global batch).
    pub images: f64,
    /// Seconds spent in the steps.
    pub step_s: f64,
    /// Seconds of those spent blocked on gradient all-reduces.
    pub wait_s: f64,
    /// Seconds of those not spent waiting for the input pipeline: the downstream time.
    pub compute_s: f64,
}

impl Window {
    /// Adds one step of mean loss `loss` over `images` images (all ranks) taking `step_s`
    /// seconds, `wait_s` of them waiting for all-reduces.
    pub fn add_step(&mut self, loss: f64, images: usize, step_s: f64, wait_s: f64) {
        self.loss_sum += loss;
        self.steps += 1.0;
        self.images += images as f64;
        self.step_s += step_s;
        self.wait_s += wait_s;
    }

    /// Adds `secs` of downstream time (a step's time less its wait for input).
    pub fn add_compute(&mut self, secs: f64) {
        self.compute_s += secs;
    }

    /// Adds another window's steps to this one.
    pub fn merge(&mut self, other: &Window) {
        self.loss_sum += other.loss_sum;
        self.steps += other.steps;
        self.images += other.images;
        self.step_s += other.step_s;
        self.wait_s += other.wait_s;
        self.compute_s += other.compute_s;
    }

    /// Mean downstream seconds per step (t_down of the echoing timing model).
    pub fn mean_compute_s(&self) -> f64 {
        self.compute_s / self.steps
    }

    /// Mean loss per step.
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.steps
    }

    /// Mean seconds per step.
    pub fn mean_step_s(&self) -> f64 {
        self.step_s / self.steps
    }

    /// Mean seconds per step spent waiting for all-reduces.
    pub fn mean_wait_s(&self) -> f64 {
        self.wait_s / self.steps
    }

    /// Images per second over `elapsed` seconds.
    pub fn images_per_s(&self, elapsed: f64) -> f64 {
        self.images / elapsed
    }

    /// Loss, steps and times summed over all ranks; `images` is kept as it is, since every rank
    /// already counts the images of all ranks.
    pub fn sum_over_ranks(&self, rep: &Replicas) -> Result<Window> {
        Ok(self.with_array(sum_over_ranks(rep, self.to_array())?))
    }

    /// The wire form: `[loss_sum, steps, step_s, wait_s, compute_s]` (not `images`).
    fn to_array(self) -> [f64; 5] {
        [self.loss_sum, self.steps, self.step_s, self.wait_s, self.compute_s]
    }

    fn with_array(self, [loss_sum, steps, step_s, wait_s, compute_s]: [f64; 5]) -> Window {
        Window { loss_sum, steps, step_s, wait_s, compute_s, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add<const N: usize>(a: [f64; N], b: [f64; N]) -> [f64; N] {
        std::array::from_fn(|i| a[i] + b[i])
    }

    #[test]
    fn example_sums_weight_losses_by_batch_size() {
        let mut s = ExampleSums::default();
        s.add_batch(0.5, 3, 4); // loss 2.0
        s.add_batch(2.0, 1, 2); // loss 4.0
        assert_eq!(s, ExampleSums { loss_sum: 6.0, correct: 4.0, count: 6.0 });
        assert_eq!(s.mean_loss(), 1.0);
        assert_eq!(s.accuracy(), 4.0 / 6.0);
        assert!(ExampleSums::default().mean_loss().is_nan());
        assert!(ExampleSums::default().accuracy().is_nan());
    }

    #[test]
    fn example_sums_merge_like_the_all_reduce() {
        let a = ExampleSums { loss_sum: 1.5, correct: 2.0, count: 4.0 };
        let b = ExampleSums { loss_sum: 2.5, correct: 6.0, count: 12.0 };
        let mut m = a;
        m.merge(&b);
        assert_eq!(m, ExampleSums { loss_sum: 4.0, correct: 8.0, count: 16.0 });
        assert_eq!(m.mean_loss(), 0.25);
        assert_eq!(m.accuracy(), 0.5);
        assert_eq!(ExampleSums::from_array(add(a.to_array(), b.to_array())), m);
    }

    #[test]
    fn epoch_stats_add_merge_and_comm_fraction() {
        let mut a = EpochStats::default();
        assert_eq!(a.comm_fraction(), 0.0);
        a.train.add_batch(1.0, 5, 10);
        a.add_step_time(0.5, 0.125);
        a.add_step_time(1.5, 0.375);
        assert_eq!(a.step_s, 2.0);
        assert_eq!(a.wait_s, 0.5);
        assert_eq!(a.comm_fraction(), 0.25);
        let b = EpochStats {
            train: ExampleSums { loss_sum: 2.0, correct: 3.0, count: 6.0 },
            step_s: 2.0,
            wait_s: 1.5,
        };
        let mut m = a;
        m.merge(&b);
        let want = EpochStats {
            train: ExampleSums { loss_sum: 12.0, correct: 8.0, count: 16.0 },
            step_s: 4.0,
            wait_s: 2.0,
        };
        assert_eq!(m, want);
        assert_eq!(m.comm_fraction(), 0.5);
        assert_eq!(m.train.mean_loss(), 0.75);
        assert_eq!(EpochStats::from_array(add(a.to_array(), b.to_array())), m);
    }

    #[test]
    fn window_means_and_reduction_keep_images() {
        let mut w = Window::default();
        w.add_step(2.0, 64, 0.25, 0.0625);
        w.add_step(1.0, 64, 0.75, 0.1875);
        w.add_compute(0.5);
        let want =
            Window { loss_sum: 3.0, steps: 2.0, images: 128.0, step_s: 1.0, wait_s: 0.25, compute_s: 0.5 };
        assert_eq!(w, want);
        assert_eq!(w.mean_compute_s(), 0.25);
        assert_eq!(w.mean_loss(), 1.5);
        assert_eq!(w.mean_step_s(), 0.5);
        assert_eq!(w.mean_wait_s(), 0.125);
        assert_eq!(w.images_per_s(0.5), 256.0);
        // A second rank's window over the same steps: the images are the same global count.
        let other =
            Window { loss_sum: 1.0, steps: 2.0, images: 128.0, step_s: 1.0, wait_s: 0.75, compute_s: 1.0 };
        let reduced = w.with_array(add(w.to_array(), other.to_array()));
        let want =
            Window { loss_sum: 4.0, steps: 4.0, images: 128.0, step_s: 2.0, wait_s: 1.0, compute_s: 1.5 };
        assert_eq!(reduced, want);
        assert_eq!(reduced.mean_loss(), 1.0);
        assert_eq!(reduced.mean_wait_s(), 0.25);
        let mut m = w;
        m.merge(&other);
        assert_eq!(m, Window { images: 256.0, ..reduced });
    }

    #[test]
    fn alone_the_sums_over_ranks_are_the_local_ones() {
        let rep = Replicas::new(None, &[], 4, true);
        let s = ExampleSums { loss_sum: 1.0, correct: 2.0, count: 3.0 };
        assert_eq!(s.sum_over_ranks(&rep).unwrap(), s);
        let e = EpochStats { train: s, step_s: 4.0, wait_s: 5.0 };
        assert_eq!(e.sum_over_ranks(&rep).unwrap(), e);
        let w = Window { loss_sum: 1.0, steps: 2.0, images: 3.0, step_s: 4.0, wait_s: 5.0, compute_s: 6.0 };
        assert_eq!(w.sum_over_ranks(&rep).unwrap(), w);
    }
}
