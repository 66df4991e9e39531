//! `toroid_comm_dump` and `toroid_comm_health`: the stall report and the health document of a
//! communicator on demand, into the caller's buffer (C has no owned strings to hand back, and
//! a fixed buffer keeps the calls usable from a watchdog that must not allocate through a
//! foreign allocator).

use std::ffi::{c_char, c_int};
use std::time::Duration;

use super::boundary::{check_out, ffi_boundary, with_comm, write_out};
use super::types::{TOROID_HEALTH_JSON, TOROID_HEALTH_PROMETHEUS, toroid_comm, toroid_result};
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

/// Writes the health of `comm` to `buf` as NUL-terminated text: with `format`
/// TOROID_HEALTH_JSON one JSON document, with TOROID_HEALTH_PROMETHEUS Prometheus text (see
/// docs/OBSERVABILITY.md section 8): every rank alive, stopped or dead, the operation it is in
/// and how long it has waited there, the verdict, and the ranks ranked by how late they enter
/// collectives. Asks every other rank at once, each within `grace_ms` milliseconds (0: the
/// default, 60; at most 60000); fails nothing, callable from any thread, also while an
/// operation runs or the job is stuck. `*needed` (non-NULL) gets the bytes the text takes with
/// its NUL; when that is more than `len`, nothing is written and the call returns
/// TOROID_INVALID_ARGUMENT (about 400 bytes per rank is enough for JSON).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_health(
    comm: *const toroid_comm,
    format: c_int,
    grace_ms: u32,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> toroid_result {
    const NAME: &str = "toroid_comm_health";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(needed, "needed")?;
            if buf.is_null() && len > 0 {
                return Err(Error::InvalidArgument("buf is NULL but len is not 0".into()));
            }
            if grace_ms > 60_000 {
                return Err(Error::InvalidArgument(format!("grace_ms {grace_ms}: at most 60000").into()));
            }
            let grace = if grace_ms == 0 {
                crate::comm::HEALTH_GRACE
            } else {
                Duration::from_millis(grace_ms.into())
            };
            let text = match format {
                TOROID_HEALTH_JSON => h.comm.health(grace)?.to_json().to_string(),
                TOROID_HEALTH_PROMETHEUS => {
                    let health = h.comm.health(grace)?;
                    format!("{}{}", crate::trace::health::prometheus_header(), health.to_prometheus())
                }
                f => {
                    return Err(Error::InvalidArgument(
                        format!("format {f}: expected TOROID_HEALTH_JSON or TOROID_HEALTH_PROMETHEUS").into(),
                    ));
                }
            };
            // SAFETY: `needed` is non-NULL (checked) and points to a size_t (the caller's promise).
            unsafe { write_out(needed, text.len() + 1) };
            if text.len() + 1 > len {
                return Err(Error::InvalidArgument(
                    format!(
                        "len {len} is too small for the health text ({} bytes with the NUL)",
                        text.len() + 1
                    )
                    .into(),
                ));
            }
            // SAFETY: `buf` is non-NULL (len > 0 here, so checked above) and holds `len` bytes
            // (the caller's promise); `text.len() + 1 <= len`; the source is our own string.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
                *buf.add(text.len()) = 0;
            }
            Ok(())
        })
    })
}
