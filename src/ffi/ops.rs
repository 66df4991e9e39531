//! From C arguments to a validated [`RawOp`]: element type and op checked as integers, byte
//! lengths computed without overflow, buffers classified as in place or out of place, and the
//! pieces that NCCL's in-place layouts need moved.
//!
//! | collective | in place when | NULL allowed |
//! |---|---|---|
//! | all_reduce, all_to_all | `sendbuf == recvbuf` | with count 0 |
//! | reduce_scatter | `recvbuf == sendbuf + rank*recvcount` (NCCL), or `recvbuf == sendbuf` (result moved to the front after the operation) | with count 0 |
//! | all_gather | `sendbuf == recvbuf + rank*sendcount` (NCCL), or `sendbuf == recvbuf` (own data moved from the front to piece `rank` before the operation) | with count 0 |
//! | broadcast | `sendbuf == recvbuf` at the root | `sendbuf` on non-roots (not read) |
//! | reduce | `sendbuf == recvbuf` at the root | `recvbuf` on non-roots (not written) |
//!
//! Other overlaps of the two buffers are rejected. The moves run on the communicator's worker
//! thread in issue order (hooks), so they are ordered with the caller's other async work on the
//! same buffer.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::boundary::{CommHandle, Handle, WorkHandle, check_out, non_negative, with_comm, write_out};
use super::types::{RawDatatype, RawRedop, toroid_comm, toroid_result, toroid_work};
use crate::Communicator;
use crate::collective::{CallOptions, OpKind};
use crate::comm::{Hook, Hooks, RawOp};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::memory::{RawBuf, RawBufMut, RawBufs};

/// A collective as named by the C call, with its unvalidated integer arguments.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Coll {
    AllReduce(RawRedop),
    ReduceScatter(RawRedop),
    AllGather,
    Broadcast(c_int),
    Reduce(RawRedop, c_int),
    AllToAll,
    /// Counts (elements) to send to each rank, to receive from each: `size` entries each.
    AllToAllV(*const usize, *const usize),
    Barrier,
    Send(c_int),
    Recv(c_int),
    RecvAny,
}

/// The buffer arguments of a C call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Args {
    pub(crate) send: *const c_void,
    pub(crate) recv: *mut c_void,
    /// Elements, as the C function names them (per rank for reduce_scatter, all_gather and
    /// all_to_all).
    pub(crate) count: usize,
    pub(crate) dtype: RawDatatype,
}

impl Args {
    pub(crate) fn none() -> Args {
        Args {
            send: std::ptr::null(),
            recv: std::ptr::null_mut(),
            count: 0,
            dtype: RawDatatype(DataType::U8 as c_int),
        }
    }
}

/// An operation ready to run.
pub(crate) struct Prepared {
    op: RawOp,
    hooks: Hooks,
}

impl Prepared {
    /// The operation and the moves around it.
    pub(crate) fn into_parts(self) -> (RawOp, Hooks) {
        (self.op, self.hooks)
    }
}

/// `count * per * elem` bytes, refused when it does not fit a slice (`isize::MAX`).
fn byte_len(count: usize, per: usize, elem: usize) -> Result<usize> {
    count
        .checked_mul(per)
        .and_then(|c| c.checked_mul(elem))
        .filter(|b| isize::try_from(*b).is_ok())
        .ok_or_else(|| {
            let what = if per == 1 { String::new() } else { format!(" x {per} ranks") };
            Error::InvalidArgument(
                format!("count {count}{what} x {elem}-byte elements overflows the address space").into(),
            )
        })
}

/// # Safety
/// `p` must be valid for reads of `len` bytes until the operation completes (the C caller's
/// promise, see the header).
unsafe fn send_buf(p: *const c_void, len: usize, what: &str) -> Result<RawBuf> {
    check_range(p.addr(), len, what)?;
    // SAFETY: forwarded from the caller.
    unsafe { RawBuf::from_raw(p.cast(), len) }
        .map_err(|_| Error::InvalidArgument(format!("{what} is NULL").into()))
}

/// # Safety
/// `p` must be valid for reads and writes of `len` bytes until the operation completes (the C
/// caller's promise, see the header).
unsafe fn recv_buf(p: *mut c_void, len: usize, what: &str) -> Result<RawBufMut> {
    check_range(p.addr(), len, what)?;
    // SAFETY: forwarded from the caller.
    unsafe { RawBufMut::from_raw(p.cast(), len) }
        .map_err(|_| Error::InvalidArgument(format!("{what} is NULL").into()))
}

/// A buffer must not wrap around the end of the address space.
fn check_range(addr: usize, len: usize, what: &str) -> Result<()> {
    if addr.checked_add(len).is_none() {
        return Err(Error::InvalidArgument(format!("{what} at {addr:#x} + {len} bytes wraps around").into()));
    }
    Ok(())
}

/// An all-to-all-v's counts (elements, `n` to send and `n` to receive) as the byte offsets of
/// its blocks (`RawOp::splits`), refused when a pointer is NULL or a total overflows.
///
/// # Safety
/// Each non-NULL pointer must be valid for reads of `n` counts (the C caller's promise).
unsafe fn block_offsets(send: *const usize, recv: *const usize, n: usize, es: usize) -> Result<Arc<[usize]>> {
    let counts = |p: *const usize, what: &str| {
        if p.is_null() {
            return Err(Error::InvalidArgument(format!("{what} is NULL").into()));
        }
        // SAFETY: non-NULL, and valid for `n` reads as the caller promises.
        Ok(unsafe { std::slice::from_raw_parts(p, n) })
    };
    crate::comm::split_offsets(counts(send, "send_counts")?, counts(recv, "recv_counts")?, n, es)
}

/// A rank argument: non-negative and below the communicator's size.
fn rank_arg(v: c_int, n: usize, what: &str) -> Result<usize> {
    let r = non_negative(v, what)?;
    if r >= n {
        return Err(Error::InvalidArgument(
            format!("{what} {r} is not a rank of this communicator (size {n})").into(),
        ));
    }
    Ok(r)
}

/// A raw pointer that a hook may carry to the worker thread.
struct HookPtr(*mut u8);
// SAFETY: the pointer is the caller's buffer, valid until the operation completes (the C
// contract); the hook runs on the worker thread before completion is reported.
unsafe impl Send for HookPtr {}

/// A hook that moves `len` bytes within the buffer at `base` from offset `from` to `to`
/// (memmove semantics).
fn mover(base: *mut u8, from: usize, to: usize, len: usize) -> Hook {
    let p = HookPtr(base);
    Box::new(move || {
        let p = p;
        // SAFETY: `base` spans at least `max(from, to) + len` bytes (the operation's buffer,
        // checked when the op was built) and is valid and reserved for this operation until it
        // completes; `ptr::copy` allows overlap.
        unsafe { std::ptr::copy(p.0.add(from), p.0.add(to), len) }
    })
}

/// Builds the operation for `coll` on `comm` from the C arguments.
///
/// # Safety
/// The buffers of `a` must be valid for the lengths the call implies (reads of the send
/// buffer, reads and writes of the receive buffer) until the operation completes.
pub(crate) unsafe fn prepare(
    comm: &Communicator,
    coll: Coll,
    a: Args,
    opts: CallOptions,
) -> Result<Prepared> {
    // SAFETY: every buffer descriptor built below comes from `a`'s pointers with the lengths
    // the call implies, valid as the caller promises.
    unsafe {
        let n = comm.size();
        let me = comm.rank();
        let dtype = if matches!(coll, Coll::Barrier) { DataType::U8 } else { a.dtype.get()? };
        let es = dtype.size();
        let mut hooks = Hooks::default();
        let mut splits = None;
        let (kind, bufs) = match coll {
            Coll::AllReduce(op) => {
                let op = op.get()?;
                let b = byte_len(a.count, 1, es)?;
                (
                    OpKind::AllReduce(op),
                    RawBufs::from_pair(send_buf(a.send, b, "sendbuf")?, recv_buf(a.recv, b, "recvbuf")?)?,
                )
            }
            Coll::ReduceScatter(op) => {
                let op = op.get()?;
                let piece = byte_len(a.count, 1, es)?;
                let total = byte_len(a.count, n, es)?;
                let (s, d) = (a.send.addr(), a.recv.addr());
                let bufs = if total > 0 && (d == s || Some(d) == s.checked_add(me * piece)) {
                    // In place: the whole send buffer is read and written.
                    let buf = recv_buf(a.send.cast_mut(), total, "sendbuf")?;
                    if d == s && me != 0 {
                        hooks.after = Some(mover(a.send.cast_mut().cast(), me * piece, 0, piece));
                    }
                    RawBufs::InPlace(buf)
                } else {
                    RawBufs::from_pair(
                        send_buf(a.send, total, "sendbuf")?,
                        recv_buf(a.recv, piece, "recvbuf")?,
                    )?
                };
                (OpKind::ReduceScatter(op), bufs)
            }
            Coll::AllGather => {
                let piece = byte_len(a.count, 1, es)?;
                let total = byte_len(a.count, n, es)?;
                let (s, d) = (a.send.addr(), a.recv.addr());
                let bufs = if total > 0 && (s == d || Some(s) == d.checked_add(me * piece)) {
                    let buf = recv_buf(a.recv, total, "recvbuf")?;
                    if s == d && me != 0 {
                        hooks.before = Some(mover(a.recv.cast(), 0, me * piece, piece));
                    }
                    RawBufs::InPlace(buf)
                } else {
                    RawBufs::from_pair(
                        send_buf(a.send, piece, "sendbuf")?,
                        recv_buf(a.recv, total, "recvbuf")?,
                    )?
                };
                (OpKind::AllGather, bufs)
            }
            Coll::Broadcast(root) => {
                let root = rank_arg(root, n, "root")?;
                let b = byte_len(a.count, 1, es)?;
                let recv = recv_buf(a.recv, b, "recvbuf")?;
                let bufs = if me == root {
                    RawBufs::from_pair(send_buf(a.send, b, "sendbuf")?, recv)?
                } else {
                    // sendbuf is read at the root only.
                    RawBufs::InPlace(recv)
                };
                (OpKind::Broadcast(root), bufs)
            }
            Coll::Reduce(op, root) => {
                let op = op.get()?;
                let root = rank_arg(root, n, "root")?;
                let b = byte_len(a.count, 1, es)?;
                let send = send_buf(a.send, b, "sendbuf")?;
                let bufs = if me == root {
                    RawBufs::from_pair(send, recv_buf(a.recv, b, "recvbuf")?)?
                } else {
                    // recvbuf is written at the root only: a non-root passes an empty output (the
                    // communicator reads `send` and writes nothing).
                    // An empty descriptor points at nothing.
                    RawBufs::OutOfPlace(send, RawBufMut::from_raw(std::ptr::null_mut(), 0)?)
                };
                (OpKind::Reduce(op, root), bufs)
            }
            Coll::AllToAll => {
                let b = byte_len(a.count, n, es)?;
                (
                    OpKind::AllToAll,
                    RawBufs::from_pair(send_buf(a.send, b, "sendbuf")?, recv_buf(a.recv, b, "recvbuf")?)?,
                )
            }
            Coll::AllToAllV(send_counts, recv_counts) => {
                let offsets = block_offsets(send_counts, recv_counts, n, es)?;
                let (send, recv) = (offsets[n], offsets[2 * n + 1]);
                splits = Some(offsets);
                (
                    OpKind::AllToAllV,
                    RawBufs::from_pair(
                        send_buf(a.send, send, "sendbuf")?,
                        recv_buf(a.recv, recv, "recvbuf")?,
                    )?,
                )
            }
            Coll::Barrier => (OpKind::Barrier, RawBufs::None),
            Coll::Send(peer) => {
                let peer = rank_arg(peer, n, "peer")?;
                let b = byte_len(a.count, 1, es)?;
                (OpKind::Send(peer), RawBufs::Read(send_buf(a.send, b, "buf")?))
            }
            Coll::Recv(peer) => {
                let peer = rank_arg(peer, n, "peer")?;
                let b = byte_len(a.count, 1, es)?;
                (OpKind::Recv(peer), RawBufs::InPlace(recv_buf(a.recv, b, "buf")?))
            }
            Coll::RecvAny => {
                let b = byte_len(a.count, 1, es)?;
                (OpKind::RecvAny, RawBufs::InPlace(recv_buf(a.recv, b, "buf")?))
            }
        };
        // A receive from any source reports its sender here (usize::MAX until it has one).
        let source = matches!(kind, OpKind::RecvAny).then(|| Arc::new(AtomicUsize::new(usize::MAX)));
        let op = RawOp { kind, dtype, bufs, opts, source, splits, batch: None };
        // The same checks as every Rust call, so both report the same errors.
        crate::comm::validate(&op, me, n, comm.has_shared_window())?;
        Ok(Prepared { op, hooks })
    }
}

/// Runs `coll` and waits for it; returns the sender of a receive from any source.
///
/// # Safety
/// The buffers of `a` must be valid for the lengths the call implies until it returns.
pub(crate) unsafe fn blocking(
    h: &Arc<CommHandle>,
    coll: Coll,
    a: Args,
    opts: CallOptions,
) -> Result<Option<usize>> {
    if matches!(coll, Coll::RecvAny) {
        super::group::refuse_in_group(h, "a receive from any source")?;
    }
    // SAFETY: forwarded from the caller.
    let p = unsafe { prepare(&h.comm, coll, a, opts)? };
    let source = p.op.source.clone();
    let Some((op, hooks)) = super::group::record(h, p.op, p.hooks) else {
        return Ok(None); // recorded; runs at toroid_group_end
    };
    // SAFETY: forwarded from the caller.
    unsafe { run_prepared(h, Prepared { op, hooks })? };
    Ok(source.map(|s| s.load(Ordering::Acquire)))
}

/// # Safety
/// As [`blocking`].
unsafe fn run_prepared(h: &Arc<CommHandle>, p: Prepared) -> Result<()> {
    if p.hooks.before.is_none() && p.hooks.after.is_none() {
        // SAFETY: forwarded from the caller; this call returns after the operation.
        return unsafe { h.comm.run(p.op) };
    }
    // Moves within the buffer must be ordered with queued async work: go through the queue.
    // SAFETY: the buffers stay valid until this function returns, after the wait.
    let w = unsafe { h.comm.submit_raw_with_hooks(p.op, None, p.hooks)? };
    w.wait_timeout(h.comm.timeout())
}

/// Runs a receive from any source and returns its sender.
///
/// # Safety
/// As [`blocking`].
pub(crate) unsafe fn recv_any(h: &Arc<CommHandle>, a: Args) -> Result<c_int> {
    // SAFETY: forwarded from the caller.
    let from = unsafe { blocking(h, Coll::RecvAny, a, CallOptions::default())? };
    from.and_then(|r| c_int::try_from(r).ok())
        .ok_or_else(|| Error::Internal("a receive from any source completed without a sender".into()))
}

/// The sender of a finished, successful receive from any source.
pub(crate) fn work_source(w: &WorkHandle) -> Result<c_int> {
    let slot = w
        .source
        .as_ref()
        .ok_or_else(|| Error::InvalidUsage("the work is not a receive from any source".into()))?;
    if !w.work.test() {
        return Err(Error::InvalidUsage("the receive has not finished (wait on the work first)".into()));
    }
    if let Some(e) = w.work.error() {
        return Err(Error::InvalidUsage(format!("the receive failed, so it has no sender: {e}").into()));
    }
    c_int::try_from(slot.load(Ordering::Acquire))
        .map_err(|_| Error::Internal("a receive from any source completed without a sender".into()))
}

/// Queues `coll` and returns its work handle.
///
/// # Safety
/// The buffers of `a` must stay valid, and untouched by anything else, until the work completes.
pub(crate) unsafe fn submit(
    h: &Arc<CommHandle>,
    coll: Coll,
    a: Args,
    opts: CallOptions,
) -> Result<*mut toroid_work> {
    super::group::refuse_in_group(h, "an async call")?;
    // SAFETY: forwarded from the caller.
    let p = unsafe { prepare(&h.comm, coll, a, opts)? };
    let source = p.op.source.clone();
    // SAFETY: forwarded from the caller.
    let work = unsafe { h.comm.submit_raw_with_hooks(p.op, None, p.hooks)? };
    let handle =
        WorkHandle { work, earlier: Vec::new(), comm: Arc::downgrade(h), timeout: h.comm.timeout(), source };
    Ok(WorkHandle::into_handle(Arc::new(handle)))
}

/// Waits for a work, `timeout_ms < 0` meaning the communicator's timeout.
pub(crate) fn wait(w: &WorkHandle, timeout_ms: i64) -> Result<()> {
    let d = u64::try_from(timeout_ms).map_or(w.timeout, Duration::from_millis);
    let r = w.work.wait_timeout(d);
    if matches!(r, Err(Error::Timeout(_))) {
        return r; // this wait's own deadline, which aborted the rest
    }
    // Done in order: the earlier works are done too, and the first failure (which aborted the
    // communicator, failing the later ones) is the one to report.
    w.earlier.iter().find_map(|e| e.error()).map_or(r, Err)
}

/// A blocking collective call from C, as a result code.
///
/// # Safety
/// As [`blocking`].
pub(crate) unsafe fn call(
    name: &'static str,
    comm: *const toroid_comm,
    coll: Coll,
    a: Args,
) -> toroid_result {
    // SAFETY: forwarded from the caller.
    with_comm(name, comm, |h| unsafe { blocking(h, coll, a, CallOptions::default()) }.map(|_| ()))
}

/// An async collective call from C, as a result code; `*out` is written on success only.
///
/// # Safety
/// As [`submit`]; `out` NULL or valid for a write.
pub(crate) unsafe fn call_async(
    name: &'static str,
    comm: *const toroid_comm,
    coll: Coll,
    a: Args,
    out: *mut *mut toroid_work,
) -> toroid_result {
    with_comm(name, comm, |h| {
        check_out(out, "work")?;
        // SAFETY: forwarded from the caller.
        let w = unsafe { submit(h, coll, a, CallOptions::default())? };
        // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
        unsafe { write_out(out, w) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::{MemStore, Store};

    #[test]
    fn byte_lengths_refuse_overflow() {
        assert_eq!(byte_len(10, 3, 4).unwrap(), 120);
        assert!(byte_len(usize::MAX / 2, 1, 4).is_err());
        assert!(byte_len(usize::MAX / 8, 2, 4).is_err());
        assert!(byte_len(isize::MAX as usize / 4 + 1, 1, 4).is_err());
        assert!(check_range(usize::MAX - 3, 8, "b").is_err());
    }

    /// Runs `f` on rank 1 of a 3-rank world of threads (ranks 0 and 2 only connect).
    fn on_rank_1(f: impl FnOnce(&Communicator) + Send + 'static) {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let cfg = crate::Config { timeout: Duration::from_secs(20), ..crate::Config::default() };
        let mut f = Some(f);
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let (store, cfg) = (store.clone(), cfg.clone());
                    let f = if r == 1 { f.take() } else { None };
                    s.spawn(move || {
                        let c = Communicator::with_store(r, 3, store, &cfg).unwrap();
                        if let Some(f) = f {
                            f(&c);
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        });
    }

    fn args(send: *const u8, recv: *mut u8, count: usize, dtype: DataType) -> Args {
        Args { send: send.cast(), recv: recv.cast(), count, dtype: RawDatatype(dtype as c_int) }
    }

    #[test]
    fn buffers_are_classified_as_the_c_contract_says() {
        on_rank_1(|c| {
            let sum = RawRedop(0);
            let mut buf = vec![0u8; 3 * 16];
            let p = buf.as_mut_ptr();
            let at = |off: usize| p.wrapping_add(off);
            let kind = |coll, a| {
                // SAFETY: `buf` outlives the descriptors, which are only classified, never run.
                unsafe { prepare(c, coll, a, CallOptions::default()) }
                    .map(|p| (p.op.bufs, p.hooks.before.is_some(), p.hooks.after.is_some()))
            };
            // reduce_scatter: NCCL's in-place form, the front form (moved after), out of place,
            // and a partial overlap.
            let rs = Coll::ReduceScatter(sum);
            assert!(matches!(
                kind(rs, args(p, at(16), 4, DataType::F32)),
                Ok((RawBufs::InPlace(_), false, false))
            ));
            assert!(matches!(kind(rs, args(p, p, 4, DataType::F32)), Ok((RawBufs::InPlace(_), false, true))));
            let mut out = [0u8; 16];
            assert!(matches!(
                kind(rs, args(p, out.as_mut_ptr(), 4, DataType::F32)),
                Ok((RawBufs::OutOfPlace(..), false, false))
            ));
            assert!(matches!(kind(rs, args(p, at(8), 4, DataType::F32)), Err(Error::InvalidArgument(_))));
            // all_gather: NCCL's form, the front form (moved before), a partial overlap.
            let ag = Coll::AllGather;
            assert!(matches!(
                kind(ag, args(at(16), p, 4, DataType::F32)),
                Ok((RawBufs::InPlace(_), false, false))
            ));
            assert!(matches!(kind(ag, args(p, p, 4, DataType::F32)), Ok((RawBufs::InPlace(_), true, false))));
            assert!(matches!(kind(ag, args(at(4), p, 4, DataType::F32)), Err(Error::InvalidArgument(_))));
            // broadcast from another root ignores sendbuf; reduce at a non-root writes nothing.
            let null = std::ptr::null::<u8>();
            assert!(matches!(
                kind(Coll::Broadcast(0), args(null, p, 4, DataType::F32)),
                Ok((RawBufs::InPlace(_), ..))
            ));
            match kind(Coll::Reduce(sum, 0), args(p, std::ptr::null_mut(), 4, DataType::F32)) {
                Ok((RawBufs::OutOfPlace(s, r), ..)) => assert!(s.len() == 16 && r.is_empty()),
                other => panic!("{:?}", other.map(|x| x.0)),
            }
            // At the root, NULL is refused.
            assert!(matches!(
                kind(Coll::Broadcast(1), args(null, p, 4, DataType::F32)),
                Err(Error::InvalidArgument(_))
            ));
            // Unknown dtype and op, negative and out-of-range roots.
            let bad = Args { dtype: RawDatatype(10), ..args(p, p, 1, DataType::F32) };
            assert!(matches!(kind(Coll::AllReduce(sum), bad), Err(Error::InvalidArgument(_))));
            let bad = Args { dtype: RawDatatype(-1), ..args(p, p, 1, DataType::F32) };
            assert!(matches!(kind(Coll::AllReduce(sum), bad), Err(Error::InvalidArgument(_))));
            assert!(matches!(
                kind(Coll::AllReduce(RawRedop(5)), args(p, p, 1, DataType::F32)),
                Err(Error::InvalidArgument(_))
            ));
            assert!(matches!(
                kind(Coll::Broadcast(-1), args(p, p, 1, DataType::F32)),
                Err(Error::InvalidArgument(_))
            ));
            assert!(matches!(
                kind(Coll::Reduce(sum, 3), args(p, p, 1, DataType::F32)),
                Err(Error::InvalidArgument(_))
            ));
            // Count overflow.
            assert!(matches!(
                kind(Coll::AllToAll, args(p, p, usize::MAX / 2, DataType::U8)),
                Err(Error::InvalidArgument(_))
            ));
        });
    }
}
