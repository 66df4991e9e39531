//! Test inputs shared by the kernel tests: a seeded generator, random elements that hit every
//! float class, and byte buffers at a chosen misalignment.

use half::{bf16, f16};

use crate::dtype::DataType;

/// Element counts every sweep runs: empty, a single element, tails shorter than one vector,
/// and lengths long enough for the main loops with a remainder.
pub(super) const LENS: [usize; 6] = [0, 1, 7, 31, 1000, 4099];

/// splitmix64: tiny, fast and good enough to fill test buffers (the transports' tests use it
/// too, through `transport::testutil`).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=max`.
    pub(crate) fn upto(&mut self, max: usize) -> usize {
        (self.next() % (max as u64 + 1)) as usize
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Mostly moderate values of mixed sign and magnitude (so sums really round), one in
    /// sixteen a special one (signed zero, infinity, NaN, an f32 subnormal).
    fn float(&mut self, max_exp: i32) -> f64 {
        const SPECIAL: [f64; 8] = [0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 1.0, -1.0, 1e-40];
        match self.next() % 16 {
            0 => SPECIAL[(self.next() % SPECIAL.len() as u64) as usize],
            _ => {
                let exp = (self.next() % (2 * max_exp as u64 + 1)) as i32 - max_exp;
                let sign = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
                sign * (1.0 + self.unit()) * 2f64.powi(exp)
            }
        }
    }
}

/// `n` random elements of `dtype` as native-endian bytes; for f32/f64 one in eight is raw
/// bits (signalling NaNs, subnormals, extremes).
pub(super) fn random_elems(rng: &mut Rng, dtype: DataType, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dtype.size());
    for _ in 0..n {
        let bits = rng.next();
        match dtype {
            // Raw bits for halves cover every class (NaN, inf, subnormal) at useful rates.
            DataType::F16 | DataType::BF16 => out.extend_from_slice(&(bits as u16).to_ne_bytes()),
            DataType::F32 if !bits.is_multiple_of(8) => {
                out.extend_from_slice(&(rng.float(20) as f32).to_ne_bytes())
            }
            DataType::F64 if !bits.is_multiple_of(8) => out.extend_from_slice(&rng.float(60).to_ne_bytes()),
            _ => out.extend_from_slice(&bits.to_ne_bytes()[..dtype.size()]),
        }
    }
    out
}

/// A byte buffer starting `offset` bytes past an 8-byte-aligned address.
pub(super) struct Buf {
    store: Vec<u64>,
    offset: usize,
    len: usize,
}

impl Buf {
    pub(super) fn new(bytes: &[u8], offset: usize) -> Buf {
        let mut b = Buf { store: vec![0; (bytes.len() + offset).div_ceil(8)], offset, len: bytes.len() };
        b.bytes_mut().copy_from_slice(bytes);
        b
    }
    pub(super) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.store)[self.offset..self.offset + self.len]
    }
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.store)[self.offset..self.offset + self.len]
    }
}

/// Whether the element `b` is a NaN (never, for an integer type).
pub(super) fn is_nan(dtype: DataType, b: &[u8]) -> bool {
    match dtype {
        DataType::F32 => f32::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DataType::F64 => f64::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DataType::F16 => f16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DataType::BF16 => bf16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        _ => false,
    }
}
