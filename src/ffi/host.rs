//! Host-memory collectives and point-to-point from C: `toroid_all_reduce`, ...,
//! `toroid_recv_any`, and their `_async` forms (same arguments plus `work` last; the buffers
//! must stay valid, and untouched, until the work completes; operations of one communicator run
//! in issue order).
//!
//! Each operation is defined once, by a function from its C arguments to the collective and its
//! buffers (`all_reduce`, `broadcast`, ...), which both entry points call; [`collective`] is the
//! one body that runs it blocking or queued. The entry points themselves are written out because
//! the header is generated from them (cbindgen reads declarations, not macro expansions). The
//! argument checks and the run are `ops.rs`'s.

use std::ffi::{c_int, c_void};

use super::boundary::{check_out, ffi_boundary, with_comm, write_out};
use super::ops::{self, Args, Coll};
use super::types::{RawDatatype, RawRedop, toroid_comm, toroid_result, toroid_work};

/// How an entry point's operation completes: before the call returns, or queued, with `*work`
/// set on success.
#[derive(Clone, Copy)]
pub(super) enum Completion {
    /// The call returns once the operation has completed (or been recorded in a group).
    Blocking,
    /// The call returns once the operation is queued; the work handle is written here.
    Queued(*mut *mut toroid_work),
}

/// The one body of every host collective entry point, blocking or `_async`.
///
/// # Safety
/// The C contract: the buffers of `a` valid for the call's lengths until it returns (blocking)
/// or until the work completes (queued); `work` NULL or valid for a write.
unsafe fn collective(
    name: &'static str,
    comm: *mut toroid_comm,
    (coll, a): (Coll, Args),
    how: Completion,
) -> toroid_result {
    ffi_boundary!(name, {
        match how {
            // SAFETY: forwarded from the caller.
            Completion::Blocking => unsafe { ops::call(name, comm, coll, a) },
            // SAFETY: forwarded from the caller.
            Completion::Queued(work) => unsafe { ops::call_async(name, comm, coll, a, work) },
        }
    })
}

/// The operation of toroid_all_reduce and toroid_all_reduce_async.
fn all_reduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
) -> (Coll, Args) {
    (Coll::AllReduce(op), Args { send: sendbuf, recv: recvbuf, count, dtype })
}

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
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe {
        collective(
            "toroid_all_reduce",
            comm,
            all_reduce(sendbuf, recvbuf, count, dtype, op),
            Completion::Blocking,
        )
    }
}

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
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe {
        collective(
            "toroid_all_reduce_async",
            comm,
            all_reduce(sendbuf, recvbuf, count, dtype, op),
            Completion::Queued(work),
        )
    }
}

/// The operation of toroid_reduce_scatter and toroid_reduce_scatter_async.
fn reduce_scatter(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: RawDatatype,
    op: RawRedop,
) -> (Coll, Args) {
    (Coll::ReduceScatter(op), Args { send: sendbuf, recv: recvbuf, count: recvcount, dtype })
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
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe {
        collective(
            "toroid_reduce_scatter",
            comm,
            reduce_scatter(sendbuf, recvbuf, recvcount, dtype, op),
            Completion::Blocking,
        )
    }
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
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe {
        collective(
            "toroid_reduce_scatter_async",
            comm,
            reduce_scatter(sendbuf, recvbuf, recvcount, dtype, op),
            Completion::Queued(work),
        )
    }
}

/// The operation of toroid_all_gather and toroid_all_gather_async.
fn all_gather(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dtype: RawDatatype,
) -> (Coll, Args) {
    (Coll::AllGather, Args { send: sendbuf, recv: recvbuf, count: sendcount, dtype })
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
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe {
        collective(
            "toroid_all_gather",
            comm,
            all_gather(sendbuf, recvbuf, sendcount, dtype),
            Completion::Blocking,
        )
    }
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
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe {
        collective(
            "toroid_all_gather_async",
            comm,
            all_gather(sendbuf, recvbuf, sendcount, dtype),
            Completion::Queued(work),
        )
    }
}

/// The operation of toroid_broadcast and toroid_broadcast_async.
fn broadcast(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    root: c_int,
) -> (Coll, Args) {
    (Coll::Broadcast(root), Args { send: sendbuf, recv: recvbuf, count, dtype })
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
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe {
        collective(
            "toroid_broadcast",
            comm,
            broadcast(sendbuf, recvbuf, count, dtype, root),
            Completion::Blocking,
        )
    }
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
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe {
        collective(
            "toroid_broadcast_async",
            comm,
            broadcast(sendbuf, recvbuf, count, dtype, root),
            Completion::Queued(work),
        )
    }
}

/// The operation of toroid_reduce and toroid_reduce_async.
fn reduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    root: c_int,
) -> (Coll, Args) {
    (Coll::Reduce(op, root), Args { send: sendbuf, recv: recvbuf, count, dtype })
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
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe {
        collective(
            "toroid_reduce",
            comm,
            reduce(sendbuf, recvbuf, count, dtype, op, root),
            Completion::Blocking,
        )
    }
}

/// toroid_reduce, queued.
#[unsafe(no_mangle)]
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
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe {
        collective(
            "toroid_reduce_async",
            comm,
            reduce(sendbuf, recvbuf, count, dtype, op, root),
            Completion::Queued(work),
        )
    }
}

/// The operation of toroid_all_to_all and toroid_all_to_all_async.
fn all_to_all(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count_per_rank: usize,
    dtype: RawDatatype,
) -> (Coll, Args) {
    (Coll::AllToAll, Args { send: sendbuf, recv: recvbuf, count: count_per_rank, dtype })
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
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe {
        collective(
            "toroid_all_to_all",
            comm,
            all_to_all(sendbuf, recvbuf, count_per_rank, dtype),
            Completion::Blocking,
        )
    }
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
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe {
        collective(
            "toroid_all_to_all_async",
            comm,
            all_to_all(sendbuf, recvbuf, count_per_rank, dtype),
            Completion::Queued(work),
        )
    }
}

/// The operation of toroid_all_to_all_v and toroid_all_to_all_v_async.
fn all_to_all_v(
    sendbuf: *const c_void,
    send_counts: *const usize,
    recvbuf: *mut c_void,
    recv_counts: *const usize,
    dtype: RawDatatype,
) -> (Coll, Args) {
    (Coll::AllToAllV(send_counts, recv_counts), Args { send: sendbuf, recv: recvbuf, count: 0, dtype })
}

/// All-to-all with blocks of any size (MPI's Alltoallv, packed): `send_counts[j]` elements of
/// `sendbuf`, after the blocks for ranks below j, go to rank j, and `recv_counts[j]` elements
/// from rank j land in `recvbuf` after the blocks from ranks below j. Both arrays hold `size`
/// counts; `send_counts[j]` here must equal `recv_counts[rank]` at rank j (where a pair
/// disagrees, the receiver fails with its block untouched and aborts the communicator, so the
/// next call fails on every rank). Out of place only; counts may be 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_to_all_v(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    send_counts: *const usize,
    recvbuf: *mut c_void,
    recv_counts: *const usize,
    dtype: RawDatatype,
) -> toroid_result {
    // SAFETY: the C contract: buffers and counts valid for the call's lengths until it returns.
    unsafe {
        collective(
            "toroid_all_to_all_v",
            comm,
            all_to_all_v(sendbuf, send_counts, recvbuf, recv_counts, dtype),
            Completion::Blocking,
        )
    }
}

/// toroid_all_to_all_v, queued (the counts are read before it returns; the buffers stay in
/// use until the work completes).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_to_all_v_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    send_counts: *const usize,
    recvbuf: *mut c_void,
    recv_counts: *const usize,
    dtype: RawDatatype,
    work: *mut *mut toroid_work,
) -> toroid_result {
    // SAFETY: the C contract: counts valid until it returns, buffers until the work completes.
    unsafe {
        collective(
            "toroid_all_to_all_v_async",
            comm,
            all_to_all_v(sendbuf, send_counts, recvbuf, recv_counts, dtype),
            Completion::Queued(work),
        )
    }
}

/// The operation of toroid_barrier and toroid_barrier_async.
fn barrier() -> (Coll, Args) {
    (Coll::Barrier, Args::none())
}

/// Returns once every rank has entered the barrier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_barrier(comm: *mut toroid_comm) -> toroid_result {
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe { collective("toroid_barrier", comm, barrier(), Completion::Blocking) }
}

/// toroid_barrier, queued: the work completes once every rank has entered the barrier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_barrier_async(
    comm: *mut toroid_comm,
    work: *mut *mut toroid_work,
) -> toroid_result {
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe { collective("toroid_barrier_async", comm, barrier(), Completion::Queued(work)) }
}

/// The operation of toroid_send and toroid_send_async.
fn send(buf: *const c_void, count: usize, dtype: RawDatatype, peer: c_int) -> (Coll, Args) {
    (Coll::Send(peer), Args { send: buf, recv: std::ptr::null_mut(), count, dtype })
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
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe { collective("toroid_send", comm, send(buf, count, dtype, peer), Completion::Blocking) }
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
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe { collective("toroid_send_async", comm, send(buf, count, dtype, peer), Completion::Queued(work)) }
}

/// The operation of toroid_recv and toroid_recv_async.
fn recv(buf: *mut c_void, count: usize, dtype: RawDatatype, peer: c_int) -> (Coll, Args) {
    (Coll::Recv(peer), Args { send: std::ptr::null(), recv: buf, count, dtype })
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
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe { collective("toroid_recv", comm, recv(buf, count, dtype, peer), Completion::Blocking) }
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
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe { collective("toroid_recv_async", comm, recv(buf, count, dtype, peer), Completion::Queued(work)) }
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
    let (_, a) = recv_any(buf, count, dtype);
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

/// The operation of toroid_recv_any and toroid_recv_any_async (the blocking form writes the
/// sender to its `source` argument; the queued one keeps it for toroid_work_source).
fn recv_any(buf: *mut c_void, count: usize, dtype: RawDatatype) -> (Coll, Args) {
    (Coll::RecvAny, Args { send: std::ptr::null(), recv: buf, count, dtype })
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
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe {
        collective("toroid_recv_any_async", comm, recv_any(buf, count, dtype), Completion::Queued(work))
    }
}
