//! Stream collectives: collectives on device memory from C, ordered on a CUDA stream as NCCL's are:
//! `toroid_all_reduce_stream`, `toroid_broadcast_stream`, `toroid_all_gather_stream` and
//! `toroid_reduce_scatter_stream` take device pointers (recognised by their attributes) and a
//! `cudaStream_t`/`CUstream` (opaque here; NULL is the legacy default stream), and run through
//! CUDA IPC between the ranks of one host or staged through pinned host memory (`gpu::stream`
//! picks; `gpu::ipc`, `gpu::staged`). `toroid_reduce_stream`, `toroid_all_to_all_stream`,
//! `toroid_send_stream` and `toroid_recv_stream` take the same arguments and are always staged.
//! Blocking for the host: the result is in device memory when the call returns. The `_async`
//! forms of the first four return once the collective is queued, with a `toroid_work` that
//! completes when it has (the IPC path; the staged path completes before returning and gives
//! NULL); the stream is not made to wait for it.
//!
//! Without CUDA (no driver, or built without the `cuda` feature) all return
//! TOROID_UNSUPPORTED with a message saying so; host pointers on a machine with CUDA are
//! TOROID_INVALID_ARGUMENT (the plain entry points take host memory).

use std::ffi::{c_int, c_void};

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use super::boundary::{Handle, WorkHandle};
use super::boundary::{check_out, ffi_boundary, with_comm, write_out};
use super::ops::Args;
use super::types::{RawDatatype, RawRedop, toroid_comm, toroid_result, toroid_work};
use crate::collective::OpKind;
use crate::error::{Error, Result};

/// Runs `kind` on device memory through `gpu::stream`: blocking when `work` is None, else
/// queued with `*work` set to its work (NULL when the call completed before returning). `kind`
/// is the operation's own argument check, reported after the handle and `work` are checked.
///
/// # Safety
/// The C contract of the entry points below.
#[allow(unused_variables)]
unsafe fn run(
    name: &'static str,
    comm: *mut toroid_comm,
    kind: Result<OpKind>,
    a: Args,
    stream: *mut c_void,
    work: Option<*mut *mut toroid_work>,
) -> toroid_result {
    with_comm(name, comm, |h| {
        if let Some(w) = work {
            check_out(w, "work")?;
            // SAFETY: non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(w, std::ptr::null_mut()) };
        }
        let (kind, dtype) = (kind?, a.dtype.get()?);
        // The call runs at once: inside a group it would overtake the calls recorded there.
        super::group::refuse_in_group(h, "a stream collective")?;
        #[cfg(feature = "cuda")]
        {
            let (send, recv) = (a.send as u64, a.recv as u64);
            let Some(out) = work else {
                // SAFETY: forwarded from the C caller (buffers valid on their device, stream live).
                return unsafe {
                    crate::gpu::stream::on_stream(&h.comm, kind, send, recv, a.count, dtype, stream)
                };
            };
            // SAFETY: forwarded from the C caller (buffers valid until the work completes).
            let queued = unsafe {
                crate::gpu::stream::on_stream_async(&h.comm, kind, send, recv, a.count, dtype, stream)
            }?;
            if let Some(w) = queued {
                let handle = WorkHandle {
                    work: w,
                    earlier: Vec::new(),
                    comm: Arc::downgrade(h),
                    timeout: h.comm.timeout(),
                    source: None,
                };
                // SAFETY: `out` was checked above.
                unsafe { write_out(out, WorkHandle::into_handle(Arc::new(handle))) };
            }
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(Error::Unsupported(
                format!("{name}: CUDA is not available: libtoroid was built without the `cuda` feature")
                    .into(),
            ))
        }
    })
}

/// All-reduces `count` elements of `dtype` from device memory `sendbuf` into device memory
/// `recvbuf` (the same pointer: in place) with `op`, ordered on `stream` (a cudaStream_t of the
/// buffers' device, or NULL for the legacy default stream): work enqueued on the stream before
/// the call is complete before its data is read, and the result is in `recvbuf` when the call
/// returns. On the stream-ordered path (TOROID_CUDA_ORDERED=1, every rank its own process on
/// one host) the call returns once the collective is enqueued, as NCCL's: later work on
/// `stream` sees the result, the buffers must stay untouched until the stream has run it, it
/// may be captured in a CUDA graph, and a failure on the device (a rank that never made the
/// call, ranks making different calls) is returned by the next call, which fails the
/// communicator. TOROID_UNSUPPORTED when CUDA is not available; TOROID_INVALID_ARGUMENT for host
/// memory; TOROID_INVALID_USAGE inside a group (the call runs at once, ahead of the calls the
/// group recorded).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_reduce_stream(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    stream: *mut c_void,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_all_reduce_stream",
            comm,
            all_reduce(sendbuf, recvbuf, count, dtype, op),
            stream,
            None,
        )
    }
}

/// Broadcasts `count` elements of `dtype` from device memory `sendbuf` at `root` into device
/// memory `recvbuf` at every rank (the same pointer: in place), ordered on `stream` as
/// toroid_all_reduce_stream. Errors as toroid_all_reduce_stream.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_broadcast_stream(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    root: c_int,
    stream: *mut c_void,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_broadcast_stream",
            comm,
            broadcast(sendbuf, recvbuf, count, dtype, root),
            stream,
            None,
        )
    }
}

/// Gathers every rank's `sendcount` elements of `dtype` in device memory `sendbuf` into every
/// rank's device memory `recvbuf` (size x sendcount elements, rank r's at r x sendcount),
/// ordered on `stream` as toroid_all_reduce_stream. In place (NCCL's form): sendbuf == recvbuf +
/// rank x sendcount elements; other overlaps are TOROID_INVALID_ARGUMENT. Errors as
/// toroid_all_reduce_stream.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_gather_stream(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dtype: RawDatatype,
    stream: *mut c_void,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_all_gather_stream",
            comm,
            all_gather(sendbuf, recvbuf, sendcount, dtype),
            stream,
            None,
        )
    }
}

/// Reduces every rank's device memory `sendbuf` (size x recvcount elements of `dtype`, piece r
/// at r x recvcount) with `op`; rank r receives piece r of the result in device memory
/// `recvbuf` (recvcount elements), ordered on `stream` as toroid_all_reduce_stream. In place:
/// recvbuf == sendbuf + rank x recvcount elements (NCCL's form) or recvbuf == sendbuf; other
/// overlaps are TOROID_INVALID_ARGUMENT. Errors as toroid_all_reduce_stream.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_reduce_scatter_stream(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: RawDatatype,
    op: RawRedop,
    stream: *mut c_void,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_reduce_scatter_stream",
            comm,
            reduce_scatter(sendbuf, recvbuf, recvcount, dtype, op),
            stream,
            None,
        )
    }
}

/// Reduces `count` elements of `dtype` of every rank's device memory `sendbuf` with `op` into
/// device memory `recvbuf` at `root` (NCCL's ncclReduce), ordered on `stream` as
/// toroid_all_reduce_stream. recvbuf is written at the root only (other ranks may pass NULL);
/// in place at the root when sendbuf == recvbuf. Staged through pinned host memory on every
/// path. Errors as toroid_all_reduce_stream.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_reduce_stream(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    root: c_int,
    stream: *mut c_void,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_reduce_stream",
            comm,
            reduce(sendbuf, recvbuf, count, dtype, op, root),
            stream,
            None,
        )
    }
}

/// Block j (count_per_rank elements of `dtype`) of device memory `sendbuf` goes to rank j,
/// arriving as its block `rank` of device memory `recvbuf` (both size x count_per_rank
/// elements; in place when sendbuf == recvbuf), ordered on `stream` as
/// toroid_all_reduce_stream. Staged through pinned host memory on every path. Errors as
/// toroid_all_reduce_stream.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_to_all_stream(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count_per_rank: usize,
    dtype: RawDatatype,
    stream: *mut c_void,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_all_to_all_stream",
            comm,
            all_to_all(sendbuf, recvbuf, count_per_rank, dtype),
            stream,
            None,
        )
    }
}

/// Sends `count` elements of `dtype` of device memory `buf` to `peer`, which posts a matching
/// toroid_recv_stream (NCCL's ncclSend, outside a group), ordered on `stream` as
/// toroid_all_reduce_stream: work enqueued on the stream before the call is complete before
/// `buf` is read. Staged through pinned host memory on every path, as messages of at most
/// 4 MiB: it pairs with toroid_recv_stream, and with a host-memory toroid_recv only up to
/// 4 MiB. Errors as toroid_all_reduce_stream; `peer` equal to this rank is
/// TOROID_INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_send_stream(
    comm: *mut toroid_comm,
    buf: *const c_void,
    count: usize,
    dtype: RawDatatype,
    peer: c_int,
    stream: *mut c_void,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe { stream_call("toroid_send_stream", comm, send(buf, count, dtype, peer), stream, None) }
}

/// Receives `count` elements of `dtype` from `peer` into device memory `buf` (the sender's
/// count must match; NCCL's ncclRecv), ordered on `stream` as toroid_all_reduce_stream: the
/// data is in `buf` when the call returns. Staged through pinned host memory on every path,
/// as toroid_send_stream sends (a host-memory toroid_send matches only up to 4 MiB). Errors
/// as toroid_send_stream.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_recv_stream(
    comm: *mut toroid_comm,
    buf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    peer: c_int,
    stream: *mut c_void,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe { stream_call("toroid_recv_stream", comm, recv(buf, count, dtype, peer), stream, None) }
}

/// The one body of every stream entry point, blocking (`work` None) or `_async`: `call` is the
/// operation, from the same definition for both forms (`all_reduce`, `broadcast`, ... below).
///
/// # Safety
/// The C contract of the entry points.
unsafe fn stream_call(
    name: &'static str,
    comm: *mut toroid_comm,
    (kind, a): (Result<OpKind>, Args),
    stream: *mut c_void,
    work: Option<*mut *mut toroid_work>,
) -> toroid_result {
    // SAFETY: forwarded from the caller.
    ffi_boundary!(name, { unsafe { run(name, comm, kind, a, stream, work) } })
}

/// The operation of toroid_all_reduce_stream and toroid_all_reduce_stream_async.
fn all_reduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
) -> (Result<OpKind>, Args) {
    (op.get().map(OpKind::AllReduce), Args { send: sendbuf, recv: recvbuf, count, dtype })
}

/// The operation of toroid_broadcast_stream and toroid_broadcast_stream_async.
fn broadcast(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    root: c_int,
) -> (Result<OpKind>, Args) {
    (rank_of(root, "root").map(OpKind::Broadcast), Args { send: sendbuf, recv: recvbuf, count, dtype })
}

/// The operation of toroid_all_gather_stream and toroid_all_gather_stream_async.
fn all_gather(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dtype: RawDatatype,
) -> (Result<OpKind>, Args) {
    (Ok(OpKind::AllGather), Args { send: sendbuf, recv: recvbuf, count: sendcount, dtype })
}

/// The operation of toroid_reduce_scatter_stream and toroid_reduce_scatter_stream_async.
fn reduce_scatter(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: RawDatatype,
    op: RawRedop,
) -> (Result<OpKind>, Args) {
    (op.get().map(OpKind::ReduceScatter), Args { send: sendbuf, recv: recvbuf, count: recvcount, dtype })
}

/// The operation of toroid_reduce_stream.
fn reduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    root: c_int,
) -> (Result<OpKind>, Args) {
    (
        op.get().and_then(|op| Ok(OpKind::Reduce(op, rank_of(root, "root")?))),
        Args { send: sendbuf, recv: recvbuf, count, dtype },
    )
}

/// The operation of toroid_all_to_all_stream.
fn all_to_all(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count_per_rank: usize,
    dtype: RawDatatype,
) -> (Result<OpKind>, Args) {
    (Ok(OpKind::AllToAll), Args { send: sendbuf, recv: recvbuf, count: count_per_rank, dtype })
}

/// The operation of toroid_send_stream.
fn send(buf: *const c_void, count: usize, dtype: RawDatatype, peer: c_int) -> (Result<OpKind>, Args) {
    (rank_of(peer, "peer").map(OpKind::Send), Args { send: buf, recv: std::ptr::null_mut(), count, dtype })
}

/// The operation of toroid_recv_stream.
fn recv(buf: *mut c_void, count: usize, dtype: RawDatatype, peer: c_int) -> (Result<OpKind>, Args) {
    (rank_of(peer, "peer").map(OpKind::Recv), Args { send: std::ptr::null(), recv: buf, count, dtype })
}

/// A rank argument from C: negative is an argument error (the range is checked by the call).
fn rank_of(r: c_int, what: &str) -> Result<usize> {
    usize::try_from(r).map_err(|_| Error::InvalidArgument(format!("{what} {r} is negative").into()))
}

/// toroid_all_reduce_stream, asynchronous for the host: returns once the collective is queued,
/// with `*work` set to a work that completes when it has (wait on it, then free it), or to NULL
/// when the call completed before returning (the staged path between hosts) or is enqueued on
/// `stream` (the stream-ordered path: later work on `stream` sees the result). The input is read
/// after the work queued on `stream` before the call; `stream` is NOT made to wait for the
/// collective: the output is ready once the work has completed, and until then nothing may
/// read or write either buffer. Errors as toroid_all_reduce_stream; a failure of the
/// collective itself is the work's (and the communicator's: it is aborted).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_reduce_stream_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    stream: *mut c_void,
    work: *mut *mut toroid_work,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_all_reduce_stream_async",
            comm,
            all_reduce(sendbuf, recvbuf, count, dtype, op),
            stream,
            Some(work),
        )
    }
}

/// toroid_broadcast_stream, asynchronous for the host as toroid_all_reduce_stream_async.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_broadcast_stream_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    root: c_int,
    stream: *mut c_void,
    work: *mut *mut toroid_work,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_broadcast_stream_async",
            comm,
            broadcast(sendbuf, recvbuf, count, dtype, root),
            stream,
            Some(work),
        )
    }
}

/// toroid_all_gather_stream, asynchronous for the host as toroid_all_reduce_stream_async.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_gather_stream_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dtype: RawDatatype,
    stream: *mut c_void,
    work: *mut *mut toroid_work,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_all_gather_stream_async",
            comm,
            all_gather(sendbuf, recvbuf, sendcount, dtype),
            stream,
            Some(work),
        )
    }
}

/// toroid_reduce_scatter_stream, asynchronous for the host as toroid_all_reduce_stream_async.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_reduce_scatter_stream_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: RawDatatype,
    op: RawRedop,
    stream: *mut c_void,
    work: *mut *mut toroid_work,
) -> toroid_result {
    // SAFETY: the C contract above.
    unsafe {
        stream_call(
            "toroid_reduce_scatter_stream_async",
            comm,
            reduce_scatter(sendbuf, recvbuf, recvcount, dtype, op),
            stream,
            Some(work),
        )
    }
}
