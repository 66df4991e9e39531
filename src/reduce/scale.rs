//! Scaling by a constant, for floating types only: how `avg` pre-scales its inputs before a
//! sum (as NCCL does). The same per-level loops as the reductions, through `Elem::map`.

use half::{bf16, f16};

use super::elem::{view, view_mut};
use super::kernels::{Level, level};
use crate::dtype::DataType;

/// `dst[i] = src[i] · factor` for floating types (used to pre-scale `avg` inputs).
///
/// The product is taken in the element type for `f32`/`f64` (`x * factor as f32` for `f32`) and
/// in `f32` for `f16`/`bf16` (`T::from_f32(x.to_f32() * factor as f32)`).
///
/// # Panics
/// When the lengths differ or are not a whole number of elements, or `dtype` is an integer type.
pub fn scale_into(dtype: DataType, dst: &mut [u8], src: &[u8], factor: f64) {
    scale_into_at(level(), dtype, dst, src, factor);
}

/// In-place form of [`scale_into`].
///
/// # Panics
/// When the length is not a whole number of elements, or `dtype` is an integer type.
pub fn scale_inplace(dtype: DataType, buf: &mut [u8], factor: f64) {
    scale_inplace_at(level(), dtype, buf, factor);
}

fn scale_into_at(level: Level, dtype: DataType, dst: &mut [u8], src: &[u8], factor: f64) {
    assert_eq!(dst.len(), src.len(), "scale_into: length mismatch");
    assert!(dtype.is_float(), "scale_into: {dtype} is not a floating type");
    assert!(dst.len().is_multiple_of(dtype.size()), "scale_into: partial element");
    let k = factor as f32;
    // SAFETY (each arm): `level` came from `level()` or `Level::supported()`.
    unsafe {
        match dtype {
            DataType::F32 => level.map::<f32>(view_mut(dst), view(src), move |x| x * k),
            DataType::F64 => level.map::<f64>(view_mut(dst), view(src), move |x| x * factor),
            DataType::F16 => level.map::<f16>(view_mut(dst), view(src), move |x| x * k),
            DataType::BF16 => level.map::<bf16>(view_mut(dst), view(src), move |x| x * k),
            _ => unreachable!(),
        }
    }
}

fn scale_inplace_at(level: Level, dtype: DataType, buf: &mut [u8], factor: f64) {
    assert!(dtype.is_float(), "scale_inplace: {dtype} is not a floating type");
    assert!(buf.len().is_multiple_of(dtype.size()), "scale_inplace: partial element");
    let k = factor as f32;
    // SAFETY (each arm): `level` came from `level()` or `Level::supported()`.
    unsafe {
        match dtype {
            DataType::F32 => level.map_inplace::<f32>(view_mut(buf), move |x| x * k),
            DataType::F64 => level.map_inplace::<f64>(view_mut(buf), move |x| x * factor),
            DataType::F16 => level.map_inplace::<f16>(view_mut(buf), move |x| x * k),
            DataType::BF16 => level.map_inplace::<bf16>(view_mut(buf), move |x| x * k),
            _ => unreachable!(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::testutil::{Buf, LENS, Rng, is_nan, random_elems};

    #[test]
    fn scale_matches_scalar_reference() {
        let mut rng = Rng(42);
        for level in Level::supported() {
            for dtype in [DataType::F32, DataType::F64, DataType::F16, DataType::BF16] {
                for factor in [0.5, 1.0 / 3.0, 3.0, -0.125, 1e-30] {
                    for n in LENS {
                        for offset in [0, 1] {
                            let size = dtype.size();
                            let src = random_elems(&mut rng, dtype, n);
                            let s = Buf::new(&src, offset);
                            let mut out = Buf::new(&vec![0; src.len()], 1 - offset);
                            scale_into_at(level, dtype, out.bytes_mut(), s.bytes(), factor);
                            let mut inplace = Buf::new(&src, offset);
                            scale_inplace_at(level, dtype, inplace.bytes_mut(), factor);
                            assert_eq!(
                                inplace.bytes(),
                                out.bytes(),
                                "{level:?} {dtype} scale_inplace differs"
                            );

                            let k = factor as f32;
                            for (i, (x, got)) in src.chunks(size).zip(out.bytes().chunks(size)).enumerate() {
                                let h = u16::from_ne_bytes(x.try_into().unwrap_or([0; 2]));
                                // The documented formulas, computed independently.
                                let want = match dtype {
                                    DataType::F32 => {
                                        ((f32::from_ne_bytes(x.try_into().unwrap()) as f64 * k as f64) as f32)
                                            .to_ne_bytes()
                                            .to_vec()
                                    }
                                    DataType::F64 => (f64::from_ne_bytes(x.try_into().unwrap()) * factor)
                                        .to_ne_bytes()
                                        .to_vec(),
                                    DataType::F16 => {
                                        f16::from_f32(f16::from_bits(h).to_f32() * k).to_ne_bytes().to_vec()
                                    }
                                    _ => {
                                        bf16::from_f32(bf16::from_bits(h).to_f32() * k).to_ne_bytes().to_vec()
                                    }
                                };
                                assert!(
                                    got == want || (is_nan(dtype, &want) && is_nan(dtype, got)),
                                    "{level:?} {dtype} scale {factor} n {n} offset {offset} [{i}]: {x:02x?} -> {got:02x?}, want {want:02x?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "not a floating type")]
    fn integer_scale_into_panics() {
        scale_into(DataType::I32, &mut [0; 4], &[0; 4], 0.5);
    }

    #[test]
    #[should_panic(expected = "not a floating type")]
    fn integer_scale_inplace_panics() {
        scale_inplace(DataType::U8, &mut [0; 4], 0.5);
    }

    #[test]
    #[should_panic(expected = "scale_into: length mismatch")]
    fn scale_length_mismatch_panics() {
        scale_into(DataType::F32, &mut [0; 4], &[0; 8], 0.5);
    }
}
