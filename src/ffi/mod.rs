//! The C ABI: every exported function, and nothing else (`include/toroid.h` is generated from
//! this module by cbindgen; see `build.rs`).
//!
//! Conventions (`docs/ARCHITECTURE.md`, "The C ABI contract"): opaque handles;
//! `toroid_<noun>_<verb>` names; every function returns a `toroid_result` and writes its outputs
//! only on success; every pointer and handle is checked; every body runs inside a panic boundary. Helpers live in the sibling modules:
//! [`types`] (the C types), `boundary.rs` (panics, errors, handles), `ops.rs` (arguments to
//! operations), `init.rs` and `store.rs` (set-up).
//!
//! The functions are `unsafe` for Rust callers (they take raw pointers); their safety contract
//! is the C contract written in the header: pointers NULL or valid for the lengths a call
//! implies, buffers of async calls valid until the work completes, handles from toroid.
#![allow(clippy::missing_safety_doc)]

mod boundary;
mod device;
mod dump;
mod group;
mod init;
mod ops;
mod pending;
mod request;
mod shrink;
pub mod stats;
mod store;
pub mod types;
mod wire;

use std::ffi::{c_char, c_int, c_void};

use boundary::{CommHandle, Handle, WorkHandle, check_out, code, fail, ffi_boundary, with_comm, write_out};
use ops::{Args, Coll};
use types::{
    RawDatatype, RawRedop, RawResult, toroid_comm, toroid_config, toroid_result, toroid_store_ops,
    toroid_work,
};

// ---------------------------------------------------------------------------------------------
// Set-up and teardown
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Collectives, blocking
// ---------------------------------------------------------------------------------------------

/// Reduces `count` elements of every rank's `sendbuf` with `op`; every rank receives the result
/// in `recvbuf`. In place when sendbuf == recvbuf; other overlaps are rejected.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_reduce(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
) -> toroid_result {
    const NAME: &str = "toroid_all_reduce";
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    ffi_boundary!(NAME, { unsafe { ops::call(NAME, comm, Coll::AllReduce(op), a) } })
}

/// Reduces every rank's `sendbuf` (size x recvcount elements, rank r's piece at r x recvcount)
/// with `op`; rank r receives piece r of the result in `recvbuf` (recvcount elements).
/// In place (NCCL's form): recvbuf == sendbuf + rank x recvcount elements. Also accepted:
/// recvbuf == sendbuf, which leaves the result at the front of the buffer. In place, the other
/// pieces of sendbuf are overwritten with intermediate values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_reduce_scatter(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: RawDatatype,
    op: RawRedop,
) -> toroid_result {
    const NAME: &str = "toroid_reduce_scatter";
    let a = Args { send: sendbuf, recv: recvbuf, count: recvcount, dtype };
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    ffi_boundary!(NAME, { unsafe { ops::call(NAME, comm, Coll::ReduceScatter(op), a) } })
}

/// Gathers every rank's `sendbuf` (sendcount elements) into every rank's `recvbuf` (size x
/// sendcount elements, rank r's data at r x sendcount). In place (NCCL's form):
/// sendbuf == recvbuf + rank x sendcount elements. Also accepted: sendbuf == recvbuf, with this
/// rank's data at the front of the buffer (it is moved to its place first).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_gather(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dtype: RawDatatype,
) -> toroid_result {
    const NAME: &str = "toroid_all_gather";
    let a = Args { send: sendbuf, recv: recvbuf, count: sendcount, dtype };
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    ffi_boundary!(NAME, { unsafe { ops::call(NAME, comm, Coll::AllGather, a) } })
}

/// Copies `count` elements of `sendbuf` at `root` into every rank's `recvbuf`. sendbuf is read
/// at the root only (other ranks may pass NULL). In place at the root when sendbuf == recvbuf.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_broadcast(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    root: c_int,
) -> toroid_result {
    const NAME: &str = "toroid_broadcast";
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    ffi_boundary!(NAME, { unsafe { ops::call(NAME, comm, Coll::Broadcast(root), a) } })
}

/// Reduces `count` elements of every rank's `sendbuf` with `op` into `recvbuf` at `root`.
/// recvbuf is written at the root only (other ranks may pass NULL); other ranks' sendbuf is
/// only read. In place at the root when sendbuf == recvbuf.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_reduce(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    root: c_int,
) -> toroid_result {
    const NAME: &str = "toroid_reduce";
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    ffi_boundary!(NAME, { unsafe { ops::call(NAME, comm, Coll::Reduce(op, root), a) } })
}

/// Block j (count_per_rank elements) of `sendbuf` goes to rank j, arriving as its block `rank`
/// of `recvbuf`; both buffers hold size x count_per_rank elements. In place when
/// sendbuf == recvbuf.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_to_all(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count_per_rank: usize,
    dtype: RawDatatype,
) -> toroid_result {
    const NAME: &str = "toroid_all_to_all";
    let a = Args { send: sendbuf, recv: recvbuf, count: count_per_rank, dtype };
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    ffi_boundary!(NAME, { unsafe { ops::call(NAME, comm, Coll::AllToAll, a) } })
}

/// Returns once every rank has entered the barrier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_barrier(comm: *mut toroid_comm) -> toroid_result {
    const NAME: &str = "toroid_barrier";
    // SAFETY: no buffers.
    ffi_boundary!(NAME, { unsafe { ops::call(NAME, comm, Coll::Barrier, Args::none()) } })
}

/// Sends `count` elements of `buf` to `peer`, which posts a matching toroid_recv. Messages
/// between two ranks arrive in order.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_send(
    comm: *mut toroid_comm,
    buf: *const c_void,
    count: usize,
    dtype: RawDatatype,
    peer: c_int,
) -> toroid_result {
    const NAME: &str = "toroid_send";
    let a = Args { send: buf, recv: std::ptr::null_mut(), count, dtype };
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    ffi_boundary!(NAME, { unsafe { ops::call(NAME, comm, Coll::Send(peer), a) } })
}

/// Receives `count` elements from `peer` into `buf` (the sender's count must match).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_recv(
    comm: *mut toroid_comm,
    buf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    peer: c_int,
) -> toroid_result {
    const NAME: &str = "toroid_recv";
    let a = Args { send: std::ptr::null(), recv: buf, count, dtype };
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    ffi_boundary!(NAME, { unsafe { ops::call(NAME, comm, Coll::Recv(peer), a) } })
}

/// Receives `count` elements into `buf` from whichever rank sends first (MPI_ANY_SOURCE) and
/// sets *source to that rank. The sender's count must match. Among ranks that have sent, the
/// lowest-numbered is taken first; messages from one rank arrive in order.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_recv_any(
    comm: *mut toroid_comm,
    buf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    source: *mut c_int,
) -> toroid_result {
    const NAME: &str = "toroid_recv_any";
    let a = Args { send: std::ptr::null(), recv: buf, count, dtype };
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(source, "source")?;
            // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
            let from = unsafe { ops::recv_any(h, a)? };
            // SAFETY: `source` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(source, from) };
            Ok(())
        })
    })
}

// ---------------------------------------------------------------------------------------------
// Collectives, async: same arguments plus `work` last; the buffers must stay valid, and
// untouched, until the work completes. Operations of one communicator run in issue order.
// ---------------------------------------------------------------------------------------------

/// toroid_all_reduce, queued; *work is set on success (wait on it, then free it).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_reduce_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_all_reduce_async";
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::AllReduce(op), a, work) } })
}

/// toroid_reduce_scatter, queued (the in-place forms included).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_reduce_scatter_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: RawDatatype,
    op: RawRedop,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_reduce_scatter_async";
    let a = Args { send: sendbuf, recv: recvbuf, count: recvcount, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::ReduceScatter(op), a, work) } })
}

/// toroid_all_gather, queued (the in-place forms included).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_gather_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dtype: RawDatatype,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_all_gather_async";
    let a = Args { send: sendbuf, recv: recvbuf, count: sendcount, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::AllGather, a, work) } })
}

/// toroid_broadcast, queued.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_broadcast_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    root: c_int,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_broadcast_async";
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::Broadcast(root), a, work) } })
}

/// toroid_reduce, queued.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn toroid_reduce_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    root: c_int,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_reduce_async";
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::Reduce(op, root), a, work) } })
}

/// toroid_all_to_all, queued.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_to_all_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count_per_rank: usize,
    dtype: RawDatatype,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_all_to_all_async";
    let a = Args { send: sendbuf, recv: recvbuf, count: count_per_rank, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::AllToAll, a, work) } })
}

/// toroid_barrier, queued: the work completes once every rank has entered the barrier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_barrier_async(
    comm: *mut toroid_comm,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_barrier_async";
    // SAFETY: no buffers.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::Barrier, Args::none(), work) } })
}

/// toroid_send, queued.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_send_async(
    comm: *mut toroid_comm,
    buf: *const c_void,
    count: usize,
    dtype: RawDatatype,
    peer: c_int,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_send_async";
    let a = Args { send: buf, recv: std::ptr::null_mut(), count, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::Send(peer), a, work) } })
}

/// toroid_recv, queued.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_recv_async(
    comm: *mut toroid_comm,
    buf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    peer: c_int,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_recv_async";
    let a = Args { send: std::ptr::null(), recv: buf, count, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::Recv(peer), a, work) } })
}

/// toroid_recv_any, queued; toroid_work_source gives the sender once the work has completed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_recv_any_async(
    comm: *mut toroid_comm,
    buf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_recv_any_async";
    let a = Args { send: std::ptr::null(), recv: buf, count, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    ffi_boundary!(NAME, { unsafe { ops::call_async(NAME, comm, Coll::RecvAny, a, work) } })
}

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

// ---------------------------------------------------------------------------------------------
// Errors and version
// ---------------------------------------------------------------------------------------------

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

/// The library version, "MAJOR.MINOR.PATCH".
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_version() -> *const c_char {
    const NAME: &str = "toroid_version";
    ffi_boundary!(NAME, { boundary::VERSION.as_ptr() })
}
