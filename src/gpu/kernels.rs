//! The reduction kernels as CUDA C, one per (type, op), and the scaling kernels `avg` uses:
//! the same contract as the CPU kernels of `crate::reduce`, so that a collective may reduce on
//! either side and get the same bits.
//!
//! - `toroid_<op>_<type>(dst, a, b, n)`: `dst[i] = a[i] ⊕ b[i]` for `n` elements (`dst` may be
//!   `a` or `b`: in place);
//! - `toroid_scale_<type>(dst, src, n, factor)`: `dst[i] = src[i] · factor`, floats only, the
//!   product in the element type for f32/f64 and in f32 for f16/bf16 (`factor` rounded to f32
//!   first, except for f64), as `reduce::scale_into`.
//!
//! Integers wrap (computed in the unsigned type: signed overflow is undefined in C++); float
//! min/max are the same compares as on the CPU (`b < a ? b : a`), so a NaN in `b` is dropped and
//! one in `a` kept; f16 and bf16 are widened to f32, combined and rounded back to nearest even
//! (bf16 by the same integer rounding as the CPU, NaNs kept and quietened; f16 by the PTX
//! conversions, which return the canonical NaN: a NaN result stays a NaN, its payload may
//! differ from the CPU's). Single IEEE operations, no contraction, no flush to zero: results are
//! bit-identical to the CPU's except NaN payloads.
//!
//! Every kernel is grid-stride. When the three pointers are 16-byte aligned the body moves 16
//! bytes per load and store (`uint4`, 4 f32, 8 bf16, ...), and the tail (and everything, when
//! misaligned) goes element by element.

use crate::dtype::{DataType, ReduceOp};

/// How a type is stored and combined in the generated source.
#[derive(Clone, Copy)]
pub(super) enum Repr {
    /// An integer type and its unsigned twin.
    Int(&'static str, &'static str),
    Float(&'static str),
    F16,
    Bf16,
}

pub(super) fn repr(d: DataType) -> Repr {
    match d {
        DataType::I8 => Repr::Int("signed char", "unsigned char"),
        DataType::U8 => Repr::Int("unsigned char", "unsigned char"),
        DataType::I32 => Repr::Int("int", "unsigned int"),
        DataType::U32 => Repr::Int("unsigned int", "unsigned int"),
        DataType::I64 => Repr::Int("long long", "unsigned long long"),
        DataType::U64 => Repr::Int("unsigned long long", "unsigned long long"),
        DataType::F32 => Repr::Float("float"),
        DataType::F64 => Repr::Float("double"),
        DataType::F16 => Repr::F16,
        DataType::BF16 => Repr::Bf16,
    }
}

/// Every element type.
pub const TYPES: [DataType; 10] = DataType::ALL;

/// The ops that are kernels (`Avg` is a scale and a sum).
pub const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

pub(super) fn op_name(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "sum",
        ReduceOp::Prod => "prod",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
        ReduceOp::Avg => "avg",
    }
}

/// The kernel that reduces `d` with `op` (`None` for `Avg`, which is no kernel).
pub fn reduce_kernel(d: DataType, op: ReduceOp) -> Option<String> {
    (op != ReduceOp::Avg).then(|| format!("toroid_{}_{}", op_name(op), d.name()))
}

/// The kernel that scales `d` (`None` for integers).
pub fn scale_kernel(d: DataType) -> Option<String> {
    d.is_float().then(|| format!("toroid_scale_{}", d.name()))
}

/// Every kernel's name.
pub fn names() -> Vec<String> {
    let mut v: Vec<String> =
        TYPES.iter().flat_map(|&d| OPS.iter().filter_map(move |&o| reduce_kernel(d, o))).collect();
    v.extend(TYPES.iter().filter_map(|&d| scale_kernel(d)));
    v
}

/// The helpers every kernel uses. The PTX conversions are for the device only: a host
/// compiler that emulates the kernels (`TR_EMULATION`, tests/ordered_emulation.rs) brings its own.
pub(super) const PRELUDE: &str = r#"
typedef unsigned long long u64_t;
#ifndef TR_EMULATION
__device__ __forceinline__ float h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
#endif
__device__ __forceinline__ float b2f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ unsigned short f2b(float f) {
  unsigned x = __float_as_uint(f);
  unsigned r = (f != f) ? (x | 0x00400000u) : (x + 0x7fffu + ((x >> 16) & 1u));
  return (unsigned short)(r >> 16);
}
"#;

/// The C expression combining `a` and `b` of representation `r` with `op`.
pub(super) fn combine(r: Repr, op: ReduceOp) -> String {
    let pick = |widen: &str, narrow: &str| {
        let (x, y) = (format!("{widen}(a)"), format!("{widen}(b)"));
        let e = match op {
            ReduceOp::Sum => format!("{x} + {y}"),
            ReduceOp::Prod => format!("{x} * {y}"),
            ReduceOp::Min => format!("({y} < {x}) ? {y} : {x}"),
            _ => format!("({y} > {x}) ? {y} : {x}"),
        };
        format!("{narrow}({e})")
    };
    match r {
        Repr::Int(t, u) => match op {
            ReduceOp::Sum => format!("({t})(({u})a + ({u})b)"),
            ReduceOp::Prod => format!("({t})(({u})a * ({u})b)"),
            ReduceOp::Min => "(b < a) ? b : a".into(),
            _ => "(b > a) ? b : a".into(),
        },
        Repr::Float(_) => pick("", ""),
        Repr::F16 => pick("h2f", "f2h"),
        Repr::Bf16 => pick("b2f", "f2b"),
    }
}

pub(super) fn storage(r: Repr) -> &'static str {
    match r {
        Repr::Int(t, _) | Repr::Float(t) => t,
        Repr::F16 | Repr::Bf16 => "unsigned short",
    }
}

/// One grid-stride kernel `name(dst_, <inputs>_, n, <extra>)` computing `dst_[i] = body`, where
/// `body` reads the inputs by their names (`a`, `b`): 16 bytes at a time where every pointer is
/// 16-byte aligned, element by element otherwise and for the tail.
fn kernel(name: &str, t: &str, size: usize, inputs: &[&str], extra: &str, body: &str) -> String {
    let v = 16 / size;
    let params: String = inputs.iter().map(|p| format!(", const {t}* {p}_")).collect();
    let aligned: String = inputs.iter().map(|p| format!(" | (u64_t){p}_")).collect();
    let loads: String =
        inputs.iter().map(|p| format!("    V {p}v; {p}v.u = ((const uint4*){p}_)[i];\n")).collect();
    let lanes: String = inputs.iter().map(|p| format!("const {t} {p} = {p}v.e[k]; ")).collect();
    let elems: String = inputs.iter().map(|p| format!("const {t} {p} = {p}_[j]; ")).collect();
    format!(
        r#"
extern "C" __global__ void {name}({t}* dst_{params}, u64_t n{extra}) {{
  typedef union {{ uint4 u; {t} e[{v}]; }} V;
  const u64_t stride = (u64_t)gridDim.x * blockDim.x;
  const u64_t tid = (u64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const u64_t nv = (((u64_t)dst_{aligned}) & 15) == 0 ? n / {v} : 0;
  for (u64_t i = tid; i < nv; i += stride) {{
{loads}    V r;
    #pragma unroll
    for (int k = 0; k < {v}; k++) {{ {lanes}r.e[k] = {body}; }}
    ((uint4*)dst_)[i] = r.u;
  }}
  for (u64_t j = nv * {v} + tid; j < n; j += stride) {{
    {elems}dst_[j] = {body};
  }}
}}
"#
    )
}

/// The whole CUDA C source of every kernel.
pub fn source() -> String {
    let mut s = String::from(PRELUDE);
    for &d in &TYPES {
        let r = repr(d);
        let t = storage(r);
        for &op in &OPS {
            let Some(name) = reduce_kernel(d, op) else { continue };
            s.push_str(&kernel(&name, t, d.size(), &["a", "b"], "", &combine(r, op)));
        }
        if let Some(name) = scale_kernel(d) {
            let (widen, narrow, kty) = match r {
                Repr::F16 => ("h2f", "f2h", "float"),
                Repr::Bf16 => ("b2f", "f2b", "float"),
                _ if d == DataType::F64 => ("", "", "double"),
                _ => ("", "", "float"),
            };
            let body = format!("{narrow}({widen}(a) * ({kty})factor)");
            s.push_str(&kernel(&name, t, d.size(), &["a"], ", double factor", &body));
        }
    }
    s
}

/// The scaled value of `a` by `factor` as a C expression (floats; `a` for integers, which are
/// never scaled): the same conversions as the scale kernels.
pub(super) fn scale_expr(d: DataType) -> String {
    match repr(d) {
        Repr::F16 => "f2h(h2f(a) * (float)factor)".into(),
        Repr::Bf16 => "f2b(b2f(a) * (float)factor)".into(),
        Repr::Float(_) if d == DataType::F64 => "a * factor".into(),
        Repr::Float(_) => "a * (float)factor".into(),
        Repr::Int(..) => "a".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_has_its_four_reductions_and_floats_a_scale() {
        let names = names();
        assert_eq!(names.len(), 10 * 4 + 4);
        assert!(names.contains(&"toroid_sum_bfloat16".to_string()));
        assert!(names.contains(&"toroid_scale_double".to_string()));
        assert_eq!(reduce_kernel(DataType::F32, ReduceOp::Avg), None);
        assert_eq!(scale_kernel(DataType::I32), None);
        let src = source();
        for n in &names {
            assert_eq!(src.matches(&format!("void {n}(")).count(), 1, "{n}");
        }
        // Signed integers wrap through the unsigned type, never signed overflow.
        assert!(src.contains("(int)((unsigned int)a + (unsigned int)b)"));
    }
}
