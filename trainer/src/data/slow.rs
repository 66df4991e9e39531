//! A data set made slow on purpose: `--decode-cost-us N` adds N microseconds to every read, so
//! experiments can put the input pipeline behind the optimiser (R = t_up / t_down > 1), the
//! situation data echoing is for (Choi et al. motivate it with data read over a network and
//! CPU-heavy decoding).
//!
//! `spin` burns CPU like a real decoder; `sleep` waits like a slow network or disk, which on a
//! machine with fewer cores than threads measures the pipeline without taking CPU from the step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Dataset, Example};
use crate::error::Result;

/// How the extra cost is spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CostKind {
    /// Busy-wait (CPU-bound decoding).
    Spin,
    /// Sleep (I/O-bound reading).
    Sleep,
}

/// `inner` with `cost` added to every [`Dataset::get`].
pub struct SlowDataset {
    inner: Arc<dyn Dataset>,
    cost: Duration,
    kind: CostKind,
}

impl SlowDataset {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Dataset>, cost: Duration, kind: CostKind) -> SlowDataset {
        SlowDataset { inner, cost, kind }
    }
}

impl Dataset for SlowDataset {
    fn len(&self) -> usize {
        self.inner.len()
    }

    fn num_classes(&self) -> usize {
        self.inner.num_classes()
    }

    fn channels(&self) -> usize {
        self.inner.channels()
    }

    fn get(&self, i: usize) -> Result<Example> {
        let t = Instant::now();
        let ex = self.inner.get(i)?;
        match self.kind {
            CostKind::Sleep => std::thread::sleep(self.cost.saturating_sub(t.elapsed())),
            CostKind::Spin => {
                let mut x = i as u64;
                while t.elapsed() < self.cost {
                    x = std::hint::black_box(crate::rng::mix(x));
                }
            }
        }
        Ok(ex)
    }

    fn describe(&self) -> String {
        format!("{} (+{} us per read, {:?})", self.inner.describe(), self.cost.as_micros(), self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Image;

    struct One;
    impl Dataset for One {
        fn len(&self) -> usize {
            3
        }
        fn num_classes(&self) -> usize {
            2
        }
        fn channels(&self) -> usize {
            1
        }
        fn get(&self, i: usize) -> Result<Example> {
            Ok(Example { image: Image { height: 1, width: 1, channels: 1, pixels: vec![i as u8] }, label: 1 })
        }
        fn describe(&self) -> String {
            "one".into()
        }
    }

    #[test]
    fn every_read_takes_at_least_the_cost_and_returns_the_same_example() {
        for kind in [CostKind::Spin, CostKind::Sleep] {
            let d = SlowDataset::new(Arc::new(One), Duration::from_millis(5), kind);
            let t = Instant::now();
            let ex = d.get(2).unwrap();
            assert!(t.elapsed() >= Duration::from_millis(5));
            assert_eq!(ex, One.get(2).unwrap());
            assert_eq!((d.len(), d.num_classes(), d.channels()), (3, 2, 1));
        }
    }
}
