//! Random inputs and independent references.
//!
//! Values are generated per (case, rank) with splitmix64, so every rank can compute every other
//! rank's input and the expected result without communicating. Floats are generated in f64,
//! rounded to the element type, and the reference is computed in f64 from the rounded values;
//! integers use the type's own wrapping (two's complement) arithmetic.

use half::{bf16, f16};
use toroid::{DataType, ReduceOp};

/// splitmix64.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A value as the reference sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Val {
    /// Floating types.
    F(f64),
    /// Integer types.
    I(i128),
}

/// Bits of an integer type and whether it is signed.
fn int_shape(d: DataType) -> (u32, bool) {
    match d {
        DataType::I8 => (8, true),
        DataType::U8 => (8, false),
        DataType::I32 => (32, true),
        DataType::U32 => (32, false),
        DataType::I64 => (64, true),
        DataType::U64 => (64, false),
        _ => unreachable!(),
    }
}

/// Truncates `v` to the integer type `d` (two's complement wrap-around).
pub fn wrap(v: i128, d: DataType) -> i128 {
    let (bits, signed) = int_shape(d);
    let m = (1i128 << bits) - 1;
    let low = v & m;
    if signed && low >> (bits - 1) == 1 { low - (1i128 << bits) } else { low }
}

/// What `rank`'s inputs of `case` are drawn from.
fn seed(case: u64, rank: usize) -> u64 {
    case.wrapping_mul(0x1000_0000_01B3) ^ mix(rank as u64)
}

/// Element `i` of the inputs drawn from `seed`: floats in [-1, 1) (products near +-1), rounded
/// to the element type; integers are the random bits truncated to the type.
fn value(seed: u64, i: usize, d: DataType, op: ReduceOp) -> Val {
    let r = draw(seed, i);
    if d.is_float() { Val::F(float_value(r, d, op)) } else { Val::I(int_value(r, d)) }
}

/// The random bits of element `i` drawn from `seed`.
fn draw(seed: u64, i: usize) -> u64 {
    mix(seed ^ (i as u64).wrapping_mul(0x9E37_79B9))
}

/// A float input before its rounding to the element type: in [-1, 1), or for products +-[0.5,
/// 1.5), so that nine of them neither overflow nor vanish.
fn unrounded(r: u64, op: ReduceOp) -> f64 {
    let u = (r >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    match op {
        ReduceOp::Prod => (0.5 + u) * if r & 1 == 0 { 1.0 } else { -1.0 },
        _ => u * 2.0 - 1.0,
    }
}

fn float_value(r: u64, d: DataType, op: ReduceOp) -> f64 {
    let v = unrounded(r, op);
    match d {
        DataType::F64 => v,
        DataType::F32 => v as f32 as f64,
        DataType::F16 => f16::from_f64(v).to_f64(),
        DataType::BF16 => bf16::from_f64(v).to_f64(),
        _ => unreachable!(),
    }
}

/// `r` as the integer type `d` (two's complement wrap-around, as [`wrap`]).
fn int_value(r: u64, d: DataType) -> i128 {
    match d {
        DataType::I8 => r as i8 as i128,
        DataType::U8 => r as u8 as i128,
        DataType::I32 => r as i32 as i128,
        DataType::U32 => r as u32 as i128,
        DataType::I64 => r as i64 as i128,
        DataType::U64 => r as i128,
        _ => unreachable!(),
    }
}

/// Every rank's inputs of one case, with each rank's seed drawn once: a check of a million
/// elements against nine ranks' inputs costs one splitmix64 per input element.
pub struct Inputs {
    d: DataType,
    op: ReduceOp,
    seeds: Vec<u64>,
}

impl Inputs {
    /// The inputs of ranks `0..ranks` in case `case`.
    pub fn new(case: u64, ranks: usize, d: DataType, op: ReduceOp) -> Inputs {
        Inputs { d, op, seeds: (0..ranks).map(|r| seed(case, r)).collect() }
    }

    /// Element `i` of `rank`'s input (what [`fill`] writes there).
    pub fn of(&self, rank: usize, i: usize) -> Val {
        value(self.seeds[rank], i, self.d, self.op)
    }

    /// Checks `out`, elements `start..` of the reduction over every rank, element by element
    /// against the reference: computed in f64 from the rounded inputs (floats, with a tolerance),
    /// or in the integer type's own wrapping arithmetic (exact). One pass per rank over the
    /// range, with the type and the operation chosen once, not per element: this reference is
    /// most of a large test's time. Pushes one line per mismatch to `bad`, at most 5 in all.
    pub fn check_reduced(&self, start: usize, out: &[u8], bad: &mut Vec<String>) {
        let two = |b: &[u8]| -> [u8; 2] { b.try_into().unwrap() };
        match self.d {
            DataType::F64 => {
                self.check_floats(start, out, bad, |v| v, |b| f64::from_le_bytes(b.try_into().unwrap()))
            }
            DataType::F32 => self.check_floats(
                start,
                out,
                bad,
                |v| v as f32 as f64,
                |b| f32::from_le_bytes(b.try_into().unwrap()) as f64,
            ),
            DataType::F16 => self.check_floats(
                start,
                out,
                bad,
                |v| f16::from_f64(v).to_f64(),
                |b| f16::from_le_bytes(two(b)).to_f64(),
            ),
            DataType::BF16 => self.check_floats(
                start,
                out,
                bad,
                |v| bf16::from_f64(v).to_f64(),
                |b| bf16::from_le_bytes(two(b)).to_f64(),
            ),
            DataType::I8 => self.check_ints::<i8>(start, out, bad),
            DataType::U8 => self.check_ints::<u8>(start, out, bad),
            DataType::I32 => self.check_ints::<i32>(start, out, bad),
            DataType::U32 => self.check_ints::<u32>(start, out, bad),
            DataType::I64 => self.check_ints::<i64>(start, out, bad),
            DataType::U64 => self.check_ints::<u64>(start, out, bad),
        }
    }

    fn check_floats(
        &self,
        start: usize,
        out: &[u8],
        bad: &mut Vec<String>,
        round: impl Fn(f64) -> f64,
        read: impl Fn(&[u8]) -> f64,
    ) {
        let size = self.d.size();
        let want = self.floats(start, out.len() / size, round);
        for (k, (b, &(w, tol))) in out.chunks_exact(size).zip(&want).enumerate() {
            let got = read(b);
            if !matches(Val::F(got), Val::F(w), tol) {
                mismatch(bad, k, Val::F(got), Val::F(w), tol);
            }
        }
    }

    fn check_ints<T: Int>(&self, start: usize, out: &[u8], bad: &mut Vec<String>) {
        let size = std::mem::size_of::<T>();
        let want = self.ints::<T>(start, out.len() / size);
        for (k, (b, &w)) in out.chunks_exact(size).zip(&want).enumerate() {
            let got = T::read(b);
            if got != w {
                mismatch(bad, k, Val::I(got.into()), Val::I(w.into()), 0.0);
            }
        }
    }

    /// The expected (value, tolerance) of elements `start..start + len`.
    fn floats(&self, start: usize, len: usize, round: impl Fn(f64) -> f64) -> Vec<(f64, f64)> {
        match self.op {
            // The sum and the sum of magnitudes (the tolerance's scale).
            ReduceOp::Sum | ReduceOp::Avg => {
                self.float_pass(start, len, &round, (0.0, 0.0), |(s, a), x| (s + x, a + x.abs()))
            }
            ReduceOp::Prod => self.float_pass(start, len, &round, (1.0, 0.0), |(p, _), x| (p * x, 0.0)),
            ReduceOp::Min => {
                self.float_pass(start, len, &round, (f64::INFINITY, 0.0), |(m, _), x| (m.min(x), 0.0))
            }
            ReduceOp::Max => {
                self.float_pass(start, len, &round, (f64::NEG_INFINITY, 0.0), |(m, _), x| (m.max(x), 0.0))
            }
        }
    }

    /// Folds every rank's rounded inputs, in rank order, into (value, scale) per element.
    fn float_pass(
        &self,
        start: usize,
        len: usize,
        round: &impl Fn(f64) -> f64,
        init: (f64, f64),
        fold: impl Fn((f64, f64), f64) -> (f64, f64),
    ) -> Vec<(f64, f64)> {
        let (op, n) = (self.op, self.seeds.len() as f64);
        let mut acc = vec![init; len];
        for &s in &self.seeds {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = fold(*a, round(unrounded(draw(s, start + k), op)));
            }
        }
        // Every partial result is rounded once per rank (plus the pre-scale of avg and the
        // final rounding of the output type).
        let per_scale = 2.0 * (n + 2.0) * eps(self.d);
        for a in &mut acc {
            let (v, abs_sum) = *a;
            let (v, scale) = match op {
                ReduceOp::Sum => (v, abs_sum),
                ReduceOp::Avg => (v / n, abs_sum / n),
                ReduceOp::Prod => (v, v.abs()),
                ReduceOp::Min | ReduceOp::Max => (v, 0.0),
            };
            *a = (v, per_scale * scale + 1e-300);
        }
        acc
    }

    /// The expected values of elements `start..start + len`.
    fn ints<T: Int>(&self, start: usize, len: usize) -> Vec<T> {
        match self.op {
            ReduceOp::Sum => self.int_pass::<T>(start, len, T::wrapping_add),
            ReduceOp::Prod => self.int_pass::<T>(start, len, T::wrapping_mul),
            ReduceOp::Min => self.int_pass::<T>(start, len, Ord::min),
            ReduceOp::Max => self.int_pass::<T>(start, len, Ord::max),
            ReduceOp::Avg => unreachable!("avg is rejected for integers"),
        }
    }

    /// Folds every rank's inputs, in rank order, in the type's own wrapping arithmetic.
    fn int_pass<T: Int>(&self, start: usize, len: usize, fold: impl Fn(T, T) -> T) -> Vec<T> {
        let (&first, rest) = self.seeds.split_first().expect("at least one rank");
        let mut acc: Vec<T> = (0..len).map(|k| T::from_bits(draw(first, start + k))).collect();
        for &s in rest {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = fold(*a, T::from_bits(draw(s, start + k)));
            }
        }
        acc
    }
}

/// Reports a mismatch of element `k`, as the checks of the other collectives do.
fn mismatch(bad: &mut Vec<String>, k: usize, got: Val, want: Val, tol: f64) {
    if bad.len() < 5 {
        bad.push(format!("out[{k}] = {got:?}, expected {want:?} (tol {tol:e})"));
    }
}

/// The integer element types, for the reference's arithmetic.
trait Int: Copy + Ord + Into<i128> {
    /// The low bits of `r` as this type (as [`int_value`]).
    fn from_bits(r: u64) -> Self;
    fn wrapping_add(self, other: Self) -> Self;
    fn wrapping_mul(self, other: Self) -> Self;
    /// The element in `b`, little-endian.
    fn read(b: &[u8]) -> Self;
}

macro_rules! int {
    ($($t:ty),*) => {$(
        impl Int for $t {
            fn from_bits(r: u64) -> Self {
                r as $t
            }
            fn wrapping_add(self, other: Self) -> Self {
                <$t>::wrapping_add(self, other)
            }
            fn wrapping_mul(self, other: Self) -> Self {
                <$t>::wrapping_mul(self, other)
            }
            fn read(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().unwrap())
            }
        }
    )*};
}
int!(i8, u8, i32, u32, i64, u64);

/// Decodes one element.
pub fn decode(d: DataType, b: &[u8]) -> Val {
    match d {
        DataType::F64 => Val::F(f64::from_le_bytes(b.try_into().unwrap())),
        DataType::F32 => Val::F(f32::from_le_bytes(b.try_into().unwrap()) as f64),
        DataType::F16 => Val::F(f16::from_le_bytes(b.try_into().unwrap()).to_f64()),
        DataType::BF16 => Val::F(bf16::from_le_bytes(b.try_into().unwrap()).to_f64()),
        _ => {
            let mut full = [0u8; 16];
            full[..d.size()].copy_from_slice(b);
            Val::I(wrap(i128::from_le_bytes(full), d))
        }
    }
}

/// Fills `buf` with `rank`'s input for elements `start..start + buf.len() / size`: each element
/// [`value`] in the type's bytes (floats rounded to nearest), with the type chosen once.
pub fn fill(buf: &mut [u8], case: u64, rank: usize, start: usize, d: DataType, op: ReduceOp) {
    let seed = seed(case, rank);
    match d {
        DataType::F64 => fill_with(buf, seed, start, |r| unrounded(r, op).to_le_bytes()),
        DataType::F32 => fill_with(buf, seed, start, |r| (unrounded(r, op) as f32).to_le_bytes()),
        DataType::F16 => fill_with(buf, seed, start, |r| f16::from_f64(unrounded(r, op)).to_le_bytes()),
        DataType::BF16 => fill_with(buf, seed, start, |r| bf16::from_f64(unrounded(r, op)).to_le_bytes()),
        DataType::I8 => fill_with(buf, seed, start, |r| (r as i8).to_le_bytes()),
        DataType::U8 => fill_with(buf, seed, start, |r| (r as u8).to_le_bytes()),
        DataType::I32 => fill_with(buf, seed, start, |r| (r as i32).to_le_bytes()),
        DataType::U32 => fill_with(buf, seed, start, |r| (r as u32).to_le_bytes()),
        DataType::I64 => fill_with(buf, seed, start, |r| (r as i64).to_le_bytes()),
        DataType::U64 => fill_with(buf, seed, start, |r| r.to_le_bytes()),
    }
}

fn fill_with<const N: usize>(buf: &mut [u8], seed: u64, start: usize, bytes: impl Fn(u64) -> [u8; N]) {
    for (k, chunk) in buf.chunks_exact_mut(N).enumerate() {
        chunk.copy_from_slice(&bytes(draw(seed, start + k)));
    }
}

/// Machine epsilon of a float type.
pub fn eps(d: DataType) -> f64 {
    match d {
        DataType::F64 => f64::EPSILON,
        DataType::F32 => f32::EPSILON as f64,
        DataType::F16 => 2f64.powi(-10),
        DataType::BF16 => 2f64.powi(-7),
        _ => 0.0,
    }
}

/// Compares an output element with the expectation.
pub fn matches(got: Val, want: Val, tol: f64) -> bool {
    match (got, want) {
        (Val::F(g), Val::F(w)) => (g - w).abs() <= tol,
        (Val::I(g), Val::I(w)) => g == w,
        _ => false,
    }
}
