//! `toroid_work` from C: the handle an `_async` call returns, waited on, polled, asked for the
//! sender of a receive from any source, and freed.

use std::ffi::c_int;

use super::boundary::{Handle, WorkHandle, check_out, code, fail, ffi_boundary, write_out};
use super::ops;
use super::types::{toroid_result, toroid_work};

/// Waits for `work` and returns its result (TOROID_SUCCESS or the operation's error; again on
/// every later call). timeout_ms < 0: the communicator's timeout. If the work has not completed
/// within the timeout, the communicator is aborted (as at every toroid deadline), the work fails
/// and TOROID_TIMEOUT is returned once it has stopped: use toroid_work_test to poll instead.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_work_wait(work: *mut toroid_work, timeout_ms: i64) -> toroid_result {
    const NAME: &str = "toroid_work_wait";
    ffi_boundary!(NAME, {
        match WorkHandle::get(work) {
            Ok(w) => code(NAME, w.comm.upgrade().as_deref(), ops::wait(&w, timeout_ms)),
            Err(e) => fail(NAME, None, &e),
        }
    })
}

/// Sets *source to the rank a receive from any source (toroid_recv_any_async) took its message
/// from. TOROID_INVALID_USAGE while the work has not finished, when it failed, and for works of
/// other operations.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_work_source(work: *mut toroid_work, source: *mut c_int) -> toroid_result {
    const NAME: &str = "toroid_work_source";
    ffi_boundary!(NAME, {
        let r = WorkHandle::get(work).and_then(|w| {
            check_out(source, "source")?;
            let from = ops::work_source(&w)?;
            // SAFETY: non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(source, from) };
            Ok(())
        });
        code(NAME, None, r)
    })
}

/// Sets *done to 1 if `work` has finished (successfully or not; toroid_work_wait then returns
/// its result at once), else to 0. Never blocks.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_work_test(work: *mut toroid_work, done: *mut c_int) -> toroid_result {
    const NAME: &str = "toroid_work_test";
    ffi_boundary!(NAME, {
        let r = WorkHandle::get(work).and_then(|w| {
            check_out(done, "done")?;
            // SAFETY: non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(done, c_int::from(w.work.test())) };
            Ok(())
        });
        code(NAME, None, r)
    })
}

/// Releases `work`. Freeing a work that has not finished does not cancel it: the operation
/// still runs (its buffers must stay valid until it has; a later blocking call on the same
/// communicator, or toroid_comm_destroy, returns after it). NULL is a no-op.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_work_free(work: *mut toroid_work) {
    const NAME: &str = "toroid_work_free";
    ffi_boundary!(NAME, {
        if !work.is_null()
            && let Err(e) = WorkHandle::remove(work)
        {
            let _ = fail(NAME, None, &e);
        }
    })
}
