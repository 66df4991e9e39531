//! `toroid_comm_shrink`: the C form of [`crate::Communicator::shrink`].

use std::ffi::c_int;

use super::boundary::{CommHandle, Handle, check_out, ffi_boundary, with_comm, write_out};
use super::types::{toroid_comm, toroid_result};
use crate::error::{Error, Result};

/// Builds a communicator of the ranks of `comm` not listed in `failed` (`nfailed` entries), in
/// rank order, through `comm`'s own listeners (no store, no new port). Works on an aborted
/// `comm` (after a failure) as on a healthy one. Every survivor calls it with the same set; the
/// failed ranks do not call it. The new communicator is independent of `comm` (destroy both).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_shrink(
    comm: *mut toroid_comm,
    failed: *const c_int,
    nfailed: c_int,
    out: *mut *mut toroid_comm,
) -> toroid_result {
    const NAME: &str = "toroid_comm_shrink";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(out, "out")?;
            // SAFETY: the caller's promise: `failed` holds `nfailed` ints.
            let list = unsafe { failed_ranks(h.comm.size(), failed, nfailed)? };
            let small = h.comm.shrink(&list)?;
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(out, CommHandle::into_handle(CommHandle::new(small))) };
            Ok(())
        })
    })
}

/// The ranks of a C `failed` list, checked: `nfailed` in `0..=size`, no NULL list with entries,
/// no negative rank (ranks beyond the size are refused by the shrink itself).
///
/// # Safety
/// A non-NULL `failed` must hold `nfailed` readable ints.
pub(super) unsafe fn failed_ranks(size: usize, failed: *const c_int, nfailed: c_int) -> Result<Vec<usize>> {
    let n = usize::try_from(nfailed)
        .map_err(|_| Error::InvalidArgument(format!("nfailed is {nfailed}").into()))?;
    if n > 0 && failed.is_null() {
        return Err(Error::InvalidArgument("failed is NULL with nfailed > 0".into()));
    }
    if n > size {
        return Err(Error::InvalidArgument(format!("nfailed {n} exceeds the size {size}").into()));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: `failed` is non-NULL (checked) and holds `nfailed` ints (the caller's promise);
    // `n` is bounded by the communicator's size.
    let s = unsafe { std::slice::from_raw_parts(failed, n) };
    s.iter()
        .map(|r| {
            usize::try_from(*r)
                .map_err(|_| Error::InvalidArgument(format!("failed rank {r} is negative").into()))
        })
        .collect()
}
