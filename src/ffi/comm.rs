//! The communicator's life from C: creating one (from the environment, a config, or the
//! caller's store), splitting it, asking its rank and size, aborting and destroying it. The
//! asynchronous creation (`toroid_comm_init_async`, ...) is `pending.rs`'s; shrinking is
//! `shrink.rs`'s.

use std::ffi::{c_int, c_void};

use super::boundary::{CommHandle, Handle, check_out, code, ffi_boundary, with_comm, write_out};
use super::init;
use super::types::{toroid_comm, toroid_config, toroid_result, toroid_store_ops};

/// Creates a communicator from the launcher's environment: TOROID_RANK / TOROID_WORLD_SIZE /
/// TOROID_STORE_ADDR (set by toroid-run), else torchrun's, Slurm's or MPI's variables (see
/// docs/ENV.md). Every rank of the job calls it; it returns once all are connected.
/// On failure *out is untouched and toroid_get_last_error(NULL) has the detail.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_init_env(out: *mut *mut toroid_comm) -> toroid_result {
    const NAME: &str = "toroid_comm_init_env";
    ffi_boundary!(NAME, {
        let r = check_out(out, "out").and_then(|_| crate::Communicator::from_env()).map(|comm| {
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(out, CommHandle::into_handle(CommHandle::new(comm))) }
        });
        code(NAME, None, r)
    })
}

/// Creates a communicator from explicit settings (see toroid_config; set its struct_size to
/// sizeof(toroid_config)). Rank 0 serves the TCP store at config->store_addr and the others
/// connect to it. On failure *out is untouched and toroid_get_last_error(NULL) has the detail.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_init(
    out: *mut *mut toroid_comm,
    config: *const toroid_config,
) -> toroid_result {
    const NAME: &str = "toroid_comm_init";
    ffi_boundary!(NAME, {
        // SAFETY: the caller passes NULL or a valid config.
        let r = check_out(out, "out").and_then(|_| unsafe { init::from_config(config) }).map(|comm| {
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(out, CommHandle::into_handle(CommHandle::new(comm))) }
        });
        code(NAME, None, r)
    })
}

/// Creates a communicator of `size` ranks as `rank`, meeting the others through the caller's
/// key-value store (how a framework hands over its own store; see toroid_store_ops). The
/// callbacks are called with `store_ctx` only during this call and only on this thread.
/// Every rank calls it the same number of times on the same store. On failure *out is
/// untouched and toroid_get_last_error(NULL) has the detail.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_init_with_store(
    out: *mut *mut toroid_comm,
    rank: c_int,
    size: c_int,
    ops: *const toroid_store_ops,
    store_ctx: *mut c_void,
) -> toroid_result {
    const NAME: &str = "toroid_comm_init_with_store";
    ffi_boundary!(NAME, {
        // SAFETY: the caller passes NULL or valid ops whose callbacks accept `store_ctx`.
        let r = check_out(out, "out").and_then(|_| unsafe { init::with_store(rank, size, ops, store_ctx) });
        let r = r.map(|comm| {
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(out, CommHandle::into_handle(CommHandle::new(comm))) }
        });
        code(NAME, None, r)
    })
}

/// toroid_comm_init_with_store with explicit settings: `config` gives the rank, size, timeout
/// (of set-up and of every later call) and interface; its `store_addr` must be NULL (the store
/// is the caller's). How a framework passes its process group's timeout.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_init_with_store_config(
    out: *mut *mut toroid_comm,
    config: *const toroid_config,
    ops: *const toroid_store_ops,
    store_ctx: *mut c_void,
) -> toroid_result {
    const NAME: &str = "toroid_comm_init_with_store_config";
    ffi_boundary!(NAME, {
        // SAFETY: the caller passes NULL or a valid config, and NULL or valid ops whose
        // callbacks accept `store_ctx`.
        let r =
            check_out(out, "out").and_then(|_| unsafe { init::with_store_config(config, ops, store_ctx) });
        let r = r.map(|comm| {
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(out, CommHandle::into_handle(CommHandle::new(comm))) }
        });
        code(NAME, None, r)
    })
}

/// Splits `comm` into sub-communicators: ranks passing the same `color` form one, ordered by
/// `key` (ties by rank in `comm`). A rank passing a negative color (TOROID_SPLIT_NOCOLOR)
/// takes part but joins none: *out is set to NULL. A collective: every rank of `comm` calls it.
/// The new communicator is independent of `comm` (destroy both).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_split(
    comm: *mut toroid_comm,
    color: c_int,
    key: c_int,
    out: *mut *mut toroid_comm,
) -> toroid_result {
    const NAME: &str = "toroid_comm_split";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(out, "out")?;
            let sub = h.comm.split(u32::try_from(color).ok(), i64::from(key))?;
            let handle = sub.map_or(std::ptr::null_mut(), |c| CommHandle::into_handle(CommHandle::new(c)));
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(out, handle) };
            Ok(())
        })
    })
}

/// This process's rank in `comm`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_rank(comm: *const toroid_comm, rank: *mut c_int) -> toroid_result {
    const NAME: &str = "toroid_comm_rank";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(rank, "rank")?;
            let r = c_int::try_from(h.comm.rank()).unwrap_or(c_int::MAX);
            // SAFETY: non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(rank, r) };
            Ok(())
        })
    })
}

/// The number of ranks in `comm`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_size(comm: *const toroid_comm, size: *mut c_int) -> toroid_result {
    const NAME: &str = "toroid_comm_size";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(size, "size")?;
            let n = c_int::try_from(h.comm.size()).unwrap_or(c_int::MAX);
            // SAFETY: non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(size, n) };
            Ok(())
        })
    })
}

/// Aborts `comm`: pending and later operations fail with TOROID_ABORTED and the peers are told.
/// Never blocks. The handle stays valid until toroid_comm_destroy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_abort(comm: *mut toroid_comm) -> toroid_result {
    const NAME: &str = "toroid_comm_abort";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            h.comm.abort();
            Ok(())
        })
    })
}

/// Revokes `comm` (NCCL's ncclCommRevoke, MPI's MPIX_Comm_revoke): every operation queued or
/// running on it fails with TOROID_ABORTED, on this rank and on every other rank (which need
/// not call it), and later operations fail at once; the error names the revoke. What a
/// recovery needs stays: the handle, the control plane (toroid_comm_health, toroid_comm_dump)
/// and the listeners toroid_comm_shrink builds the survivors' communicator through. Idempotent;
/// never blocks; callable from any thread. The handle stays valid until toroid_comm_destroy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_revoke(comm: *mut toroid_comm) -> toroid_result {
    const NAME: &str = "toroid_comm_revoke";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            h.comm.revoke();
            Ok(())
        })
    })
}

/// Sets `*revoked` to 1 once `comm` is revoked (toroid_comm_revoke on this rank, or on another
/// rank and seen here by a failed operation), else 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_is_revoked(
    comm: *const toroid_comm,
    revoked: *mut c_int,
) -> toroid_result {
    const NAME: &str = "toroid_comm_is_revoked";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(revoked, "revoked")?;
            // SAFETY: non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(revoked, c_int::from(h.comm.is_revoked())) };
            Ok(())
        })
    })
}

/// Releases `comm`, after its queued operations have finished (call toroid_comm_abort first to
/// make them fail fast). NULL is a no-op returning TOROID_SUCCESS; a handle that was already
/// destroyed gives TOROID_INVALID_USAGE. Work handles of `comm` stay valid until freed. When
/// operations still queued or running fail meanwhile, the handle is released all the same and
/// the first failure's code is returned; toroid_get_last_error(NULL) says how many failed. In a
/// process forked after `comm` was created, it releases the handle and returns
/// TOROID_INVALID_USAGE (the child never owned the connections).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_destroy(comm: *mut toroid_comm) -> toroid_result {
    const NAME: &str = "toroid_comm_destroy";
    ffi_boundary!(NAME, {
        if comm.is_null() {
            return toroid_result::TOROID_SUCCESS;
        }
        // Drained and dropped here, outside the registry's lock: waits for queued work, and
        // reports the operations that failed meanwhile (nobody else may be left to see them).
        code(NAME, None, CommHandle::remove(comm).and_then(|h| h.comm.drain()))
    })
}
