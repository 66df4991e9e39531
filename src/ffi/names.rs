//! Static names from C: the library's version (`toroid_version`), and the names of the numbers
//! the C ABI hands out without an enum in the header, the `kind` and `algorithm` of a
//! `toroid_stat` row (`toroid_kind_name`, `toroid_algorithm_name`), so that C and Python print
//! them as toroid's logs and `TOROID_ALGO` do, without copying `collective::CollKind` and
//! `collective::Algorithm` into another language.

use std::ffi::{CString, c_char, c_int};
use std::sync::OnceLock;

use super::boundary::{self, ffi_boundary};
use crate::collective::{Algorithm, CollKind};

/// One name table: (value, NUL-terminated name), built once from the Rust enums' `name()` so
/// the returned pointers are static and nothing is allocated per call.
type Names = Vec<(c_int, CString)>;

fn lookup(table: &'static OnceLock<Names>, build: fn() -> Names, value: c_int) -> *const c_char {
    let names = table.get_or_init(build);
    names.iter().find(|(v, _)| *v == value).map_or(std::ptr::null(), |(_, n)| n.as_ptr())
}

fn c_name(name: &str) -> CString {
    // The names are Rust literals without NUL bytes; an empty name would be a bug, never UB.
    CString::new(name).unwrap_or_default()
}

fn kind_names() -> Names {
    (0..=u8::MAX).filter_map(CollKind::from_u8).map(|k| (c_int::from(k as u8), c_name(k.name()))).collect()
}

fn algorithm_names() -> Names {
    Algorithm::ALL.iter().map(|a| (c_int::from(*a as u8), c_name(a.name()))).collect()
}

/// The name of the collective `kind` of a toroid_stat row ("all_reduce", "reduce_scatter",
/// "all_gather", "broadcast", "reduce", "all_to_all", "barrier", "send/recv", "split",
/// "probe"), as toroid's logs spell it: a static string, or NULL for a value that is no kind.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_kind_name(kind: c_int) -> *const c_char {
    const NAME: &str = "toroid_kind_name";
    static KINDS: OnceLock<Names> = OnceLock::new();
    ffi_boundary!(NAME, { lookup(&KINDS, kind_names, kind) })
}

/// The name of the `algorithm` of a toroid_stat row ("ring", "rd", "tree", ...), as TOROID_ALGO
/// and toroid-bench spell it: a static string, or NULL for a value that is no algorithm.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_algorithm_name(algorithm: c_int) -> *const c_char {
    const NAME: &str = "toroid_algorithm_name";
    static ALGORITHMS: OnceLock<Names> = OnceLock::new();
    ffi_boundary!(NAME, { lookup(&ALGORITHMS, algorithm_names, algorithm) })
}

/// The library version, "MAJOR.MINOR.PATCH".
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_version() -> *const c_char {
    const NAME: &str = "toroid_version";
    ffi_boundary!(NAME, { boundary::VERSION.as_ptr() })
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::*;

    fn text(p: *const c_char) -> Option<String> {
        // SAFETY: NULL or a static NUL-terminated string from the tables above.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    #[test]
    fn names_agree_with_the_rust_enums_and_unknown_values_are_null() {
        // SAFETY: the functions take any integer.
        unsafe {
            assert_eq!(text(toroid_kind_name(1)).as_deref(), Some(CollKind::AllReduce.name()));
            assert_eq!(text(toroid_kind_name(8)).as_deref(), Some("send/recv"));
            assert_eq!(text(toroid_kind_name(0)), None);
            assert_eq!(text(toroid_kind_name(-1)), None);
            assert_eq!(text(toroid_kind_name(256 + 1)), None);
            for a in Algorithm::ALL {
                assert_eq!(text(toroid_algorithm_name(c_int::from(a as u8))).as_deref(), Some(a.name()));
            }
            assert_eq!(text(toroid_algorithm_name(0)), None);
            assert_eq!(text(toroid_algorithm_name(c_int::MAX)), None);
        }
    }
}
