//! Random inputs and independent references.
//!
//! Values are generated per (case, rank) with splitmix64, so every rank can compute every other
//! rank's input and the expected result without communicating. Floats are generated in f64,
//! rounded to the element type, and the reference is computed in f64 from the rounded values;
//! integers use wrapping i128 arithmetic truncated to the type's width.

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

fn float_value(r: u64, d: DataType, op: ReduceOp) -> f64 {
    let u = (r >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    let v = match op {
        // Products stay near 1 so nine of them neither overflow nor vanish.
        ReduceOp::Prod => (0.5 + u) * if r & 1 == 0 { 1.0 } else { -1.0 },
        _ => u * 2.0 - 1.0,
    };
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

    /// The expected reduction of element `i` over every rank, computed in f64 from the rounded
    /// inputs (floats, with the tolerance) or in wrapping i128 (integers, tolerance 0).
    pub fn expected(&self, i: usize) -> (Val, f64) {
        let (d, op) = (self.d, self.op);
        let n = self.seeds.len();
        if d.is_float() {
            let (mut sum, mut abs_sum, mut prod) = (0.0f64, 0.0f64, 1.0f64);
            let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
            for &s in &self.seeds {
                let x = float_value(draw(s, i), d, op);
                sum += x;
                abs_sum += x.abs();
                prod *= x;
                min = min.min(x);
                max = max.max(x);
            }
            let (v, scale) = match op {
                ReduceOp::Sum => (sum, abs_sum),
                ReduceOp::Avg => (sum / n as f64, abs_sum / n as f64),
                ReduceOp::Prod => (prod, prod.abs()),
                ReduceOp::Min => (min, 0.0),
                ReduceOp::Max => (max, 0.0),
            };
            // Every partial result is rounded once per rank (plus the pre-scale of avg and the
            // final rounding of the output type).
            let tol = 2.0 * (n as f64 + 2.0) * eps(d) * scale + 1e-300;
            (Val::F(v), tol)
        } else {
            let mut acc: Option<i128> = None;
            for &s in &self.seeds {
                let x = int_value(draw(s, i), d);
                acc = Some(match acc {
                    None => x,
                    Some(a) => match op {
                        ReduceOp::Sum => wrap(a.wrapping_add(x), d),
                        ReduceOp::Prod => wrap(a.wrapping_mul(x), d),
                        ReduceOp::Min => a.min(x),
                        ReduceOp::Max => a.max(x),
                        ReduceOp::Avg => unreachable!("avg is rejected for integers"),
                    },
                });
            }
            (Val::I(acc.unwrap_or(0)), 0.0)
        }
    }
}

/// Encodes one value into the type's bytes (floats rounded to nearest).
pub fn encode(d: DataType, v: Val, out: &mut [u8]) {
    match (d, v) {
        (DataType::F64, Val::F(f)) => out.copy_from_slice(&f.to_le_bytes()),
        (DataType::F32, Val::F(f)) => out.copy_from_slice(&(f as f32).to_le_bytes()),
        (DataType::F16, Val::F(f)) => out.copy_from_slice(&f16::from_f64(f).to_le_bytes()),
        (DataType::BF16, Val::F(f)) => out.copy_from_slice(&bf16::from_f64(f).to_le_bytes()),
        (_, Val::I(i)) => out.copy_from_slice(&i.to_le_bytes()[..d.size()]),
        _ => unreachable!(),
    }
}

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

/// Fills `buf` with `rank`'s input for elements `start..start + buf.len() / size`.
pub fn fill(buf: &mut [u8], case: u64, rank: usize, start: usize, d: DataType, op: ReduceOp) {
    let seed = seed(case, rank);
    for (k, chunk) in buf.chunks_exact_mut(d.size()).enumerate() {
        encode(d, value(seed, start + k, d, op), chunk);
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
