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

/// The seeded generator of the kernel tests (splitmix64): the same steps on every run.
pub(crate) use crate::reduce::testutil::Rng;
