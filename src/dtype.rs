//! Element types and reduction operations.
//!
//! The discriminants are the C ABI's `toroid_datatype` and `toroid_redop` values.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The element type of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    /// `i8`
    I8 = 0,
    /// `u8`
    U8 = 1,
    /// `i32`
    I32 = 2,
    /// `u32`
    U32 = 3,
    /// `i64`
    I64 = 4,
    /// `u64`
    U64 = 5,
    /// IEEE 754 half precision ([`half::f16`]).
    F16 = 6,
    /// bfloat16 ([`half::bf16`]).
    BF16 = 7,
    /// `f32`
    F32 = 8,
    /// `f64`
    F64 = 9,
}

impl DataType {
    /// Every data type, in discriminant order.
    pub const ALL: [DataType; 10] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::BF16,
        DataType::F32,
        DataType::F64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::BF16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// True for the floating-point types (the ones `avg` is defined on).
    pub const fn is_float(self) -> bool {
        matches!(self, DataType::F16 | DataType::BF16 | DataType::F32 | DataType::F64)
    }

    /// The nccl-tests name (`float`, `half`, `bfloat16`, ...), used by toroid-bench.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::I8 => "int8",
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
            DataType::F16 => "half",
            DataType::BF16 => "bfloat16",
            DataType::F32 => "float",
            DataType::F64 => "double",
        }
    }

    /// The value with this discriminant.
    pub fn from_u8(v: u8) -> Option<DataType> {
        DataType::ALL.get(v as usize).copied()
    }

    /// Number of whole elements in `bytes`, or an error when `bytes` is not a multiple.
    pub fn count_of(self, bytes: usize) -> Result<usize> {
        if !bytes.is_multiple_of(self.size()) {
            return Err(Error::InvalidArgument(
                format!("buffer of {bytes} bytes is not a whole number of {} elements", self.name()).into(),
            ));
        }
        Ok(bytes / self.size())
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = Error;
    /// Accepts nccl-tests' names and the Rust names (`float`/`f32`, `half`/`f16`, ...).
    fn from_str(s: &str) -> Result<DataType> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "int8" | "i8" | "char" => DataType::I8,
            "uint8" | "u8" => DataType::U8,
            "int32" | "i32" | "int" => DataType::I32,
            "uint32" | "u32" => DataType::U32,
            "int64" | "i64" => DataType::I64,
            "uint64" | "u64" => DataType::U64,
            "half" | "f16" | "float16" => DataType::F16,
            "bfloat16" | "bf16" => DataType::BF16,
            "float" | "f32" | "float32" => DataType::F32,
            "double" | "f64" | "float64" => DataType::F64,
            _ => return Err(Error::InvalidArgument(format!("unknown data type '{s}'").into())),
        })
    }
}

/// A reduction operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum (integers wrap around on overflow, as in C).
    Sum = 0,
    /// Product (integers wrap around on overflow).
    Prod = 1,
    /// Minimum.
    Min = 2,
    /// Maximum.
    Max = 3,
    /// Arithmetic mean: sum divided by the number of ranks. Floating types only.
    Avg = 4,
}

impl ReduceOp {
    /// Every operation, in discriminant order.
    pub const ALL: [ReduceOp; 5] =
        [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// The nccl-tests name.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// The value with this discriminant.
    pub fn from_u8(v: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.get(v as usize).copied()
    }

    /// Checks that this operation is defined on `dtype`.
    pub fn check(self, dtype: DataType) -> Result<()> {
        if self == ReduceOp::Avg && !dtype.is_float() {
            return Err(Error::Unsupported(
                format!("avg is defined for floating types only, not {dtype} (use sum and divide)").into(),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<ReduceOp> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            _ => {
                return Err(Error::InvalidArgument(format!("unknown reduction op '{s}'").into()));
            }
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that is one of toroid's element types.
///
/// ```
/// use toroid::{DataType, Element};
/// assert_eq!(<f32 as Element>::DTYPE, DataType::F32);
/// assert_eq!(<half::bf16 as Element>::DTYPE, DataType::BF16);
/// ```
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed {
    /// The matching [`DataType`].
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DataType = DataType::$d; }
    )*};
}
element!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
         half::f16 => F16, half::bf16 => BF16, f32 => F32, f64 => F64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discriminants_round_trip_and_names_parse() {
        for d in DataType::ALL {
            assert_eq!(DataType::from_u8(d as u8), Some(d));
            assert_eq!(d.name().parse::<DataType>().unwrap(), d);
        }
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_u8(op as u8), Some(op));
            assert_eq!(op.name().parse::<ReduceOp>().unwrap(), op);
        }
        assert!(DataType::from_u8(10).is_none());
        assert!("float128".parse::<DataType>().is_err());
    }

    #[test]
    fn avg_only_on_floats() {
        assert!(ReduceOp::Avg.check(DataType::F32).is_ok());
        assert!(ReduceOp::Avg.check(DataType::BF16).is_ok());
        assert!(matches!(ReduceOp::Avg.check(DataType::I32), Err(Error::Unsupported(_))));
        assert!(ReduceOp::Sum.check(DataType::U8).is_ok());
    }

    #[test]
    fn count_of_rejects_partial_elements() {
        assert_eq!(DataType::F32.count_of(16).unwrap(), 4);
        assert!(DataType::F64.count_of(12).is_err());
    }
}
