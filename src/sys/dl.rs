//! `dlopen(3)`: whether a shared library can be loaded, and loading one by path so that a later
//! load by its name finds it (the dynamic loader matches loaded libraries by their soname).

use std::ffi::{CStr, CString};

/// Loads `name` (a soname such as `libcuda.so.1`, or a path) for the life of the process.
/// `Err` carries the loader's message. (Only the CUDA layer loads libraries.)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn load(name: &str) -> Result<(), String> {
    let c = CString::new(name).map_err(|_| format!("{name:?}: a NUL in the name"))?;
    // SAFETY: `c` is a valid C string for the call; the flags are valid. Loading runs the
    // library's initialisers, which is what loading a library means; the handle is kept open on
    // purpose (never `dlclose`d), so nothing it returns can dangle.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        // SAFETY: dlerror returns NULL or a valid C string owned by the loader, read at once.
        let e = unsafe { libc::dlerror() };
        let msg = if e.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated, valid until the next dl* call on this thread.
            unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
        };
        return Err(msg);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn libc_loads_and_a_missing_library_is_an_error_with_the_loaders_message() {
        assert!(super::load("libc.so.6").is_ok());
        let e = super::load("libtoroid-no-such-library.so.7").unwrap_err();
        assert!(e.contains("libtoroid-no-such-library"), "{e}");
    }
}
