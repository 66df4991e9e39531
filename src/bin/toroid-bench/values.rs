//! Element values as bytes of each data type, and what a value becomes when stored in a type
//! (the reference the checks compare against).

use toroid::DataType;

/// `v` as `d`'s bytes in `out` (`d.size()` bytes).
pub(crate) fn encode(d: DataType, v: f64, out: &mut [u8]) {
    match d {
        DataType::F32 => out.copy_from_slice(&(v as f32).to_le_bytes()),
        DataType::F64 => out.copy_from_slice(&v.to_le_bytes()),
        DataType::F16 => out.copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
        DataType::BF16 => out.copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        DataType::I8 => out.copy_from_slice(&(v as i64 as i8).to_le_bytes()),
        DataType::U8 => out.copy_from_slice(&(v as i64 as u8).to_le_bytes()),
        DataType::I32 => out.copy_from_slice(&(v as i64 as i32).to_le_bytes()),
        DataType::U32 => out.copy_from_slice(&(v as i64 as u32).to_le_bytes()),
        DataType::I64 => out.copy_from_slice(&(v as i64).to_le_bytes()),
        DataType::U64 => out.copy_from_slice(&(v as i64 as u64).to_le_bytes()),
    }
}

pub(crate) fn decode(d: DataType, b: &[u8]) -> f64 {
    let mut w = [0u8; 8];
    w[..b.len()].copy_from_slice(b);
    match d {
        DataType::F32 => f32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f64,
        DataType::F64 => f64::from_le_bytes(w),
        DataType::F16 => half::f16::from_le_bytes([w[0], w[1]]).to_f64(),
        DataType::BF16 => half::bf16::from_le_bytes([w[0], w[1]]).to_f64(),
        DataType::I8 => w[0] as i8 as f64,
        DataType::U8 => w[0] as f64,
        DataType::I32 => i32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f64,
        DataType::U32 => u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f64,
        DataType::I64 => i64::from_le_bytes(w) as f64,
        DataType::U64 => u64::from_le_bytes(w) as f64,
    }
}

/// What `v` becomes when stored in `d` (integers wrap as the collective's integers do).
pub(crate) fn roundtrip(d: DataType, v: f64) -> f64 {
    let mut b = [0u8; 8];
    encode(d, v, &mut b[..d.size()]);
    decode(d, &b[..d.size()])
}
