//! What the ring transports' tests share (shared memory, RDMA): a byte pattern that says where
//! in a stream each byte belongs, and a seeded generator for random schedules.

/// The byte at position `i` of a test stream.
pub(crate) fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// Bytes `from .. from + n` of a test stream.
pub(crate) fn bytes(from: u64, n: usize) -> Vec<u8> {
    (from..from + n as u64).map(pattern).collect()
}

/// A seeded generator (splitmix64): the same steps on every run.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=max`.
    pub(crate) fn upto(&mut self, max: usize) -> usize {
        (self.next() % (max as u64 + 1)) as usize
    }
}
