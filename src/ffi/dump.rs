//! `toroid_comm_dump`: the stall report of a communicator on demand, into the caller's buffer
//! (C has no owned strings to hand back, and a fixed buffer keeps the call usable from a
//! watchdog that must not allocate through a foreign allocator).

use std::ffi::c_char;

use super::boundary::{ffi_boundary, with_comm};
use super::types::{toroid_comm, toroid_result};
use crate::error::Error;

/// Writes the stall report of `comm` to `buf` as NUL-terminated text, truncated to `len` bytes
/// including the NUL (at a character boundary): the conclusion line first, then one line per
/// rank (the last operation it completed, the one it is in with phase, step, whom it waits on
/// and for how long, or dead / not answering). Asks every other rank (each within two
/// seconds); fails nothing, callable from any thread, also while an operation runs. `buf` may
/// be NULL only when `len` is 0 (nothing is written). A row is about 200 bytes: 64 KiB holds
/// the report of some 300 ranks.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_dump(
    comm: *const toroid_comm,
    buf: *mut c_char,
    len: usize,
) -> toroid_result {
    const NAME: &str = "toroid_comm_dump";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            if buf.is_null() && len > 0 {
                return Err(Error::InvalidArgument("buf is NULL but len is not 0".into()));
            }
            let text = h.comm.dump()?;
            if len == 0 {
                return Ok(());
            }
            let mut n = text.len().min(len - 1);
            while !text.is_char_boundary(n) {
                n -= 1;
            }
            // SAFETY: `buf` is non-NULL (checked) and holds `len` bytes (the caller's promise);
            // `n + 1 <= len`, and the source is our own string, which cannot overlap it.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
            Ok(())
        })
    })
}
