//! Collectives on device memory from C, ordered on a CUDA stream as NCCL's are:
//! `toroid_all_reduce_stream`, `toroid_broadcast_stream`, `toroid_all_gather_stream` and
//! `toroid_reduce_scatter_stream` take device pointers (recognised by their attributes) and a
//! `cudaStream_t`/`CUstream` (opaque here; NULL is the legacy default stream), and run through
//! CUDA IPC between the ranks of one host or staged through pinned host memory (`gpu::stream`
//! picks; `gpu::ipc`, `gpu::staged`). Blocking for the host: the result is in device memory
//! when the call returns. Their `_async` forms return once the collective is queued, with a
//! `toroid_work` that completes when it has (the IPC path; the staged path completes before
//! returning and gives NULL); the stream is not made to wait for it.
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

/// Runs `kind` on device memory through `gpu::stream`: blocking when `work` is NULL, else
/// queued with `*work` set to its work (NULL when the call completed before returning).
///
/// # Safety
/// The C contract of the entry points below.
#[allow(unused_variables)]
unsafe fn run(
    name: &'static str,
    comm: *mut toroid_comm,
    kind: impl FnOnce() -> Result<OpKind>,
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
        let (kind, dtype) = (kind()?, a.dtype.get()?);
        // The call runs at once: inside a group it would overtake the calls recorded there.
        super::group::refuse_in_group(h, "a stream collective")?;
        #[cfg(feature = "cuda")]
        {
            if let OpKind::Broadcast(root) = kind
                && root >= h.comm.size()
            {
                return Err(Error::InvalidArgument(
                    format!("root {root} is not a rank of {}", h.comm.size()).into(),
                ));
            }
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
/// returns. TOROID_UNSUPPORTED when CUDA is not available; TOROID_INVALID_ARGUMENT for host
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
    const NAME: &str = "toroid_all_reduce_stream";
    let kind = || Ok(OpKind::AllReduce(op.get()?));
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract above.
    ffi_boundary!(NAME, { unsafe { run(NAME, comm, kind, a, stream, None) } })
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
    const NAME: &str = "toroid_broadcast_stream";
    let kind = || {
        usize::try_from(root)
            .map(OpKind::Broadcast)
            .map_err(|_| Error::InvalidArgument(format!("root {root} is negative").into()))
    };
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract above.
    ffi_boundary!(NAME, { unsafe { run(NAME, comm, kind, a, stream, None) } })
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
    const NAME: &str = "toroid_all_gather_stream";
    let kind = || Ok(OpKind::AllGather);
    let a = Args { send: sendbuf, recv: recvbuf, count: sendcount, dtype };
    // SAFETY: the C contract above.
    ffi_boundary!(NAME, { unsafe { run(NAME, comm, kind, a, stream, None) } })
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
    const NAME: &str = "toroid_reduce_scatter_stream";
    let kind = || Ok(OpKind::ReduceScatter(op.get()?));
    let a = Args { send: sendbuf, recv: recvbuf, count: recvcount, dtype };
    // SAFETY: the C contract above.
    ffi_boundary!(NAME, { unsafe { run(NAME, comm, kind, a, stream, None) } })
}

/// toroid_all_reduce_stream, asynchronous for the host: returns once the collective is queued,
/// with `*work` set to a work that completes when it has (wait on it, then free it), or to NULL
/// when the call completed before returning (the staged path between hosts). The input is read
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
    const NAME: &str = "toroid_all_reduce_stream_async";
    let kind = || Ok(OpKind::AllReduce(op.get()?));
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract above.
    ffi_boundary!(NAME, { unsafe { run(NAME, comm, kind, a, stream, Some(work)) } })
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
    const NAME: &str = "toroid_broadcast_stream_async";
    let kind = || {
        usize::try_from(root)
            .map(OpKind::Broadcast)
            .map_err(|_| Error::InvalidArgument(format!("root {root} is negative").into()))
    };
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract above.
    ffi_boundary!(NAME, { unsafe { run(NAME, comm, kind, a, stream, Some(work)) } })
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
    const NAME: &str = "toroid_all_gather_stream_async";
    let kind = || Ok(OpKind::AllGather);
    let a = Args { send: sendbuf, recv: recvbuf, count: sendcount, dtype };
    // SAFETY: the C contract above.
    ffi_boundary!(NAME, { unsafe { run(NAME, comm, kind, a, stream, Some(work)) } })
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
    const NAME: &str = "toroid_reduce_scatter_stream_async";
    let kind = || Ok(OpKind::ReduceScatter(op.get()?));
    let a = Args { send: sendbuf, recv: recvbuf, count: recvcount, dtype };
    // SAFETY: the C contract above.
    ffi_boundary!(NAME, { unsafe { run(NAME, comm, kind, a, stream, Some(work)) } })
}
