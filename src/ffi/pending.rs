//! The non-blocking forms of creation and shrink (grow's are `grow.rs`'s): the C side of [`crate::PendingComm`].
//!
//! A `toroid_pending *` is a handle like the others (`boundary.rs`): looked up before use, its
//! number never reused. The set-up runs on a thread of toroid's own, so these forms take no
//! caller's store (its callbacks could not be called off the caller's thread).

use std::ffi::c_int;
use std::sync::Arc;

use super::boundary::{
    CommHandle, Handle, Registry, check_out, code, fail, ffi_boundary, with_comm, write_out,
};
use super::types::{toroid_comm, toroid_config, toroid_pending, toroid_result};
use crate::comm::PendingComm;
use crate::error::Result;

/// What a `toroid_pending *` stands for.
pub(crate) struct PendingHandle {
    pending: PendingComm,
}

static PENDING: Registry<PendingHandle> = Registry::new();

impl Handle for PendingHandle {
    type C = toroid_pending;
    const NAME: &'static str = "toroid_pending";
    fn registry() -> &'static Registry<Self> {
        &PENDING
    }
}

/// Registers `p` and writes its handle to `out` (checked non-NULL by the caller).
///
/// # Safety
/// `out` must be valid for a write.
pub(super) unsafe fn hand_out(out: *mut *mut toroid_pending, p: PendingComm) {
    let h = PendingHandle::into_handle(Arc::new(PendingHandle { pending: p }));
    // SAFETY: forwarded from the caller.
    unsafe { write_out(out, h) }
}

/// toroid_comm_init_env in the background: returns at once with *out set to a pending
/// communicator; poll it with toroid_pending_test, take the communicator with
/// toroid_pending_wait, give up with toroid_pending_abort. The set-up's errors come from
/// toroid_pending_wait.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_init_env_async(out: *mut *mut toroid_pending) -> toroid_result {
    const NAME: &str = "toroid_comm_init_env_async";
    ffi_boundary!(NAME, {
        let r = check_out(out, "out").and_then(|_| crate::Communicator::from_env_async()).map(|p| {
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { hand_out(out, p) }
        });
        code(NAME, None, r)
    })
}

/// toroid_comm_init in the background (see toroid_comm_init_env_async). `config` is read
/// before this returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_init_async(
    out: *mut *mut toroid_pending,
    config: *const toroid_config,
) -> toroid_result {
    const NAME: &str = "toroid_comm_init_async";
    ffi_boundary!(NAME, {
        let r = check_out(out, "out")
            // SAFETY: the caller passes NULL or a valid config.
            .and_then(|_| unsafe { super::init::launch_of(config) })
            .and_then(|(launch, cfg)| crate::Communicator::from_launch_async(launch, cfg))
            .map(|p| {
                // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
                unsafe { hand_out(out, p) }
            });
        code(NAME, None, r)
    })
}

/// toroid_comm_shrink in the background (see toroid_comm_init_env_async). `failed` is read
/// before this returns. Aborting it gives up `comm`'s one shrink.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_shrink_async(
    comm: *mut toroid_comm,
    failed: *const c_int,
    nfailed: c_int,
    out: *mut *mut toroid_pending,
) -> toroid_result {
    const NAME: &str = "toroid_comm_shrink_async";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(out, "out")?;
            // SAFETY: the caller's promise: `failed` holds `nfailed` ints.
            let list = unsafe { super::shrink::failed_ranks(h.comm.size(), failed, nfailed)? };
            let p = h.comm.shrink_async(&list)?;
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { hand_out(out, p) };
            Ok(())
        })
    })
}

/// Runs `f` on the pending communicator behind `p`.
fn with_pending(
    name: &'static str,
    p: *const toroid_pending,
    f: impl FnOnce(&PendingHandle) -> Result<()>,
) -> toroid_result {
    match PendingHandle::get(p) {
        Ok(h) => code(name, None, f(&h)),
        Err(e) => fail(name, None, &e),
    }
}

/// Sets *done to 1 once the set-up has finished, successfully or not (toroid_pending_wait then
/// returns at once), else to 0. Never blocks.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_pending_test(
    pending: *mut toroid_pending,
    done: *mut c_int,
) -> toroid_result {
    const NAME: &str = "toroid_pending_test";
    ffi_boundary!(NAME, {
        with_pending(NAME, pending, |h| {
            check_out(done, "done")?;
            // SAFETY: non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(done, c_int::from(h.pending.is_done())) };
            Ok(())
        })
    })
}

/// Waits for the set-up (bounded by its timeout) and sets *out to the new communicator, or
/// returns the set-up's error (TOROID_ABORTED after toroid_pending_abort). The communicator is
/// handed out once: a later call gives TOROID_INVALID_USAGE. Free `pending` afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_pending_wait(
    pending: *mut toroid_pending,
    out: *mut *mut toroid_comm,
) -> toroid_result {
    const NAME: &str = "toroid_pending_wait";
    ffi_boundary!(NAME, {
        with_pending(NAME, pending, |h| {
            check_out(out, "out")?;
            let comm = h.pending.wait()?;
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(out, CommHandle::into_handle(CommHandle::new(comm))) };
            Ok(())
        })
    })
}

/// Gives up the set-up: returns once its thread has stopped (within about 100 ms) and dropped
/// what it had made, a communicator not yet taken included; toroid_pending_wait then gives
/// TOROID_ABORTED. No-op once the communicator was taken.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_pending_abort(pending: *mut toroid_pending) -> toroid_result {
    const NAME: &str = "toroid_pending_abort";
    ffi_boundary!(NAME, {
        with_pending(NAME, pending, |h| {
            h.pending.abort();
            Ok(())
        })
    })
}

/// Releases `pending`, aborting its set-up if it has not finished (as toroid_pending_abort)
/// and dropping a communicator never taken. NULL is a no-op.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_pending_free(pending: *mut toroid_pending) {
    const NAME: &str = "toroid_pending_free";
    ffi_boundary!(NAME, {
        if !pending.is_null() {
            match PendingHandle::remove(pending) {
                Ok(h) => h.pending.abort(),
                Err(e) => {
                    let _ = fail(NAME, None, &e);
                }
            }
        }
    })
}
