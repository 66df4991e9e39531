//! Error text from C: the static description of a result code (`toroid_get_error_string`) and
//! the detail of the last failure of a communicator or of this thread
//! (`toroid_get_last_error`; the texts are kept by `boundary.rs`).

use std::ffi::c_char;

use super::boundary::{self, CommHandle, Handle, ffi_boundary};
use super::types::{RawResult, toroid_comm};

/// A static description of `result`, with a hint on what to do next.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_get_error_string(result: RawResult) -> *const c_char {
    const NAME: &str = "toroid_get_error_string";
    ffi_boundary!(NAME, { boundary::error_string(result).as_ptr() })
}

/// The detail of the last failure on `comm` (of any call on it, or of its async work), or with
/// comm == NULL the last failure of a call made by this thread (how init failures are read).
/// Empty when there was none. The text stays valid until the next toroid_get_last_error call
/// for the same communicator (or, for NULL, on the same thread) that finds a different message.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_get_last_error(comm: *const toroid_comm) -> *const c_char {
    const NAME: &str = "toroid_get_last_error";
    ffi_boundary!(NAME, {
        if comm.is_null() {
            return boundary::thread_error_text();
        }
        match CommHandle::get(comm) {
            Ok(h) => h.error_text(),
            Err(_) => {
                c"toroid_get_last_error: the toroid_comm handle is not live (destroyed, or never created)"
                    .as_ptr()
            }
        }
    })
}
