//! A small seeded random number generator (SplitMix64).
//!
//! The trainer needs reproducible randomness that every rank can derive independently from a
//! seed and a few integers (epoch, rank, example sequence number): the epoch permutation must be
//! the same on every rank, and the augmentation of an example must not depend on which worker
//! thread happened to pick it up. SplitMix64 is tiny, fast, passes BigCrush, and deriving a
//! stream is one hash, so it needs no dependency.

/// A SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

/// Mixes `x` (the SplitMix64 finaliser): a good 64-bit hash of an integer.
pub fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng { state: mix(seed ^ 0x9e37_79b9_7f4a_7c15) }
    }

    /// A generator for the stream named by `seed` and `parts` (for example epoch and rank):
    /// different parts give independent streams.
    pub fn derive(seed: u64, parts: &[u64]) -> Rng {
        let mut h = mix(seed);
        for p in parts {
            h = mix(h ^ mix(p.wrapping_add(0x632b_e59b_d9b4_e019)));
        }
        Rng::new(h)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.state)
    }

    /// Uniform in `0..n` (`n > 0`), by Lemire's multiply-shift (bias below 2^-32 for n < 2^32).
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal sample (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // in (0, 1]: ln is finite
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Shuffles `v` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_is_a_permutation_and_reproducible() {
        let mut a: Vec<usize> = (0..1000).collect();
        let mut b = a.clone();
        Rng::derive(7, &[1, 2]).shuffle(&mut a);
        Rng::derive(7, &[1, 2]).shuffle(&mut b);
        assert_eq!(a, b);
        assert_ne!(a, (0..1000).collect::<Vec<_>>());
        let mut s = a.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
        let mut c: Vec<usize> = (0..1000).collect();
        Rng::derive(7, &[1, 3]).shuffle(&mut c);
        assert_ne!(a, c);
    }

    #[test]
    fn normal_has_unit_variance() {
        let mut r = Rng::new(3);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }
}
