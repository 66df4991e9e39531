//! Argument checks, for every caller: pure functions of the call, the rank and the size (so
//! they are tested here without sockets). [`validate`] checks an operation on host memory (the
//! Rust API, the queue, and the C ABI for its own argument checks, so both report the same
//! errors); [`check_device`] checks a call on device memory (the stream entry points, through
//! `gpu::host::HostComm::check`), so the GPU path checks nothing itself.

use super::RawOp;
use crate::collective::{Algorithm, OpKind};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::memory::RawBufs;
use crate::tuning;
#[cfg(feature = "cuda")]
use crate::{dtype::ReduceOp, gpu::host::DeviceCall};

/// A send or receive names another rank as its peer (on host and device memory alike).
fn not_self(peer: usize, rank: usize) -> Result<()> {
    if peer == rank {
        return Err(Error::InvalidArgument(
            format!("rank {peer} cannot send to or receive from itself").into(),
        ));
    }
    Ok(())
}

/// Checks everything about `op` that can be checked locally, before any byte moves, for
/// `rank` of a communicator of `size` ranks (`has_window`: `shm_direct` can run). The C ABI
/// checks its arguments with this too, so both report the same errors.
pub(crate) fn validate(op: &RawOp, rank: usize, size: usize, has_window: bool) -> Result<()> {
    let n = size;
    let es = op.dtype.size();
    let (inp, out) = (op.bufs.input_len(), op.bufs.output_len());
    let whole = |what: &str, len: usize| -> Result<usize> {
        if !len.is_multiple_of(es) {
            return Err(Error::InvalidArgument(
                format!("{what} of {len} bytes is not a whole number of {} elements", op.dtype).into(),
            ));
        }
        Ok(len / es)
    };
    let in_place = matches!(op.bufs, RawBufs::InPlace(_));
    let rank_ok = |what: &str, r: usize| -> Result<()> {
        if r >= n {
            return Err(Error::InvalidArgument(
                format!("{what} {r} is not a rank of this communicator (size {n})").into(),
            ));
        }
        Ok(())
    };
    if let Some(w) = op.opts.wire
        && w != op.dtype
        && !matches!(w, DataType::BF16 | DataType::F16)
    {
        return Err(Error::InvalidArgument(
            format!("wire type {w}: a float all-reduce travels in bf16 or f16 (or its own type)").into(),
        ));
    }
    match op.kind {
        OpKind::AllReduce(rop) | OpKind::Reduce(rop, _) => {
            rop.check(op.dtype)?;
            whole("buffer", out.max(inp))?;
            if inp != out && !(matches!(op.kind, OpKind::Reduce(..)) && out == 0) {
                return Err(Error::InvalidArgument(
                    format!("input is {inp} bytes but output is {out}").into(),
                ));
            }
            if let OpKind::Reduce(_, root) = op.kind {
                rank_ok("root", root)?;
            }
        }
        OpKind::ReduceScatter(rop) => {
            rop.check(op.dtype)?;
            let c = whole("input", inp)?;
            if c % n != 0 {
                return Err(Error::InvalidArgument(
                    format!("reduce_scatter input of {c} elements does not split into {n} equal pieces")
                        .into(),
                ));
            }
            if !in_place && out * n != inp {
                return Err(Error::InvalidArgument(
                    format!("reduce_scatter output is {out} bytes; expected input/size = {}", inp / n).into(),
                ));
            }
        }
        OpKind::AllGather | OpKind::SplitExchange => {
            let c = whole("output", out)?;
            if c % n != 0 {
                return Err(Error::InvalidArgument(
                    format!("all_gather output of {c} elements does not split into {n} equal pieces").into(),
                ));
            }
            if !in_place && inp * n != out {
                return Err(Error::InvalidArgument(
                    format!("all_gather output is {out} bytes; expected size x input = {}", inp * n).into(),
                ));
            }
        }
        OpKind::Broadcast(root) => {
            rank_ok("root", root)?;
            whole("buffer", out)?;
            if !in_place && inp != out && (rank == root || inp != 0) {
                return Err(Error::InvalidArgument(
                    format!("input is {inp} bytes but output is {out}").into(),
                ));
            }
        }
        OpKind::AllToAll => {
            let c = whole("buffer", out)?;
            if c % n != 0 || inp != out {
                return Err(Error::InvalidArgument(format!(
                    "all_to_all buffers must be equal and split into {n} blocks (input {inp}, output {out} bytes)"
                ).into()));
            }
        }
        OpKind::Barrier => {}
        OpKind::Probe => {
            if out != crate::tuning::PROBE_LEN * 8 {
                return Err(Error::Internal("probe output has the wrong length".into()));
            }
        }
        OpKind::Send(peer) | OpKind::Recv(peer) => {
            rank_ok("peer", peer)?;
            not_self(peer, rank)?;
            whole("buffer", inp.max(out))?;
        }
        OpKind::RecvAny => {
            if size < 2 {
                return Err(Error::InvalidUsage(
                    "receive from any source on a communicator of one rank: no rank can send".into(),
                ));
            }
            whole("buffer", out)?;
        }
    }
    if let Some(a) = op.opts.algorithm {
        tuning::check_forced(op.kind.coll(), a)?;
        if a == Algorithm::ShmDirect && !has_window {
            return Err(Error::InvalidArgument(
                "algorithm shm_direct needs every rank on one host with a shared-memory window \
                 (not available on this communicator: see TOROID_SHM_DISABLE and the WARN lines at set-up)"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// Checks a call on device memory for `rank` of a communicator of `size` ranks, before
/// anything is set up: the types and ranks, the buffers' sizes and overlaps (only NCCL's
/// in-place forms may overlap) and that the buffers this rank uses are device memory of one
/// device. That device's ordinal, or `None` when there is nothing to do (no elements).
#[cfg(feature = "cuda")]
pub(crate) fn check_device(call: &DeviceCall, rank: usize, size: usize) -> Result<Option<usize>> {
    let DeviceCall { kind, dtype, count, send, recv } = *call;
    let (n, es) = (size, dtype.size());
    let overflow = || Error::InvalidArgument(format!("{n} x {count} elements of {dtype} overflow").into());
    let bytes = count.checked_mul(es).ok_or_else(overflow)?;
    let all = bytes.checked_mul(n).ok_or_else(overflow)?;
    if matches!(
        kind,
        OpKind::AllReduce(ReduceOp::Avg)
            | OpKind::ReduceScatter(ReduceOp::Avg)
            | OpKind::Reduce(ReduceOp::Avg, _)
    ) && !dtype.is_float()
    {
        return Err(Error::Unsupported(format!("avg of {dtype}: averages take float types").into()));
    }
    let me = rank;
    if let OpKind::Broadcast(r) | OpKind::Reduce(_, r) | OpKind::Send(r) | OpKind::Recv(r) = kind
        && r >= n
    {
        let what = if matches!(kind, OpKind::Send(_) | OpKind::Recv(_)) { "peer" } else { "root" };
        return Err(Error::InvalidArgument(format!("{what} {r} is not a rank of {n}").into()));
    }
    if let OpKind::Send(r) | OpKind::Recv(r) = kind {
        not_self(r, me)?;
    }
    if count == 0 {
        return Ok(None);
    }
    // The buffers' sizes (0: not used on this rank: a send's recvbuf, a receive's sendbuf, a
    // non-root's recvbuf of a reduce), and which overlaps are the in-place forms (NCCL's, and
    // for a reduce-scatter the result at the front of sendbuf).
    let mine = (me * bytes) as u64;
    let (send_len, recv_len, in_place) = match kind {
        OpKind::AllGather => (bytes, all, send == recv.wrapping_add(mine)),
        OpKind::ReduceScatter(_) => (all, bytes, recv == send || recv == send.wrapping_add(mine)),
        OpKind::AllReduce(_) | OpKind::Broadcast(_) => (bytes, bytes, send == recv),
        OpKind::Reduce(_, root) => (bytes, if me == root { bytes } else { 0 }, send == recv),
        OpKind::AllToAll => (all, all, send == recv),
        OpKind::Send(_) => (bytes, 0, false),
        OpKind::Recv(_) => (0, bytes, false),
        other => return Err(Error::Unsupported(format!("{other:?} on device memory").into())),
    };
    let overlap = send_len > 0
        && recv_len > 0
        && send < recv.saturating_add(recv_len as u64)
        && recv < send.saturating_add(send_len as u64);
    if overlap && !in_place {
        return Err(Error::InvalidArgument(
            format!("{kind:?} on device memory: sendbuf and recvbuf overlap, and not in an in-place form")
                .into(),
        ));
    }
    // Only the buffers this rank uses must be device memory (of one device).
    let device = |len: usize, ptr: u64| (len > 0).then(|| crate::gpu::cuda::device_of(ptr));
    match (device(send_len, send), device(recv_len, recv)) {
        (Some(Some(a)), Some(Some(b))) if a == b => Ok(Some(a)),
        (Some(Some(a)), None) | (None, Some(Some(a))) => Ok(Some(a)),
        (a, b) => {
            let say = |d: Option<Option<usize>>| match d {
                Some(Some(d)) => format!("on device {d}"),
                Some(None) => "host memory".into(),
                None => "not used".into(),
            };
            Err(Error::InvalidArgument(
                format!(
                    "the stream collectives take device memory of one device: sendbuf is {}, recvbuf is {}",
                    say(a),
                    say(b)
                )
                .into(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::CallOptions;
    use crate::dtype::{DataType, ReduceOp};
    use crate::memory::{RawBuf, RawBufMut};

    /// An operation on `inp` input and `out` output bytes (descriptors only: never run).
    fn op(kind: OpKind, dtype: DataType, inp: &[u8], out: &mut [u8]) -> RawOp {
        let bufs = if inp.is_empty() && out.is_empty() {
            RawBufs::None
        } else if inp.is_empty() {
            RawBufs::InPlace(RawBufMut::new(out))
        } else if out.is_empty() {
            RawBufs::Read(RawBuf::new(inp))
        } else {
            RawBufs::OutOfPlace(RawBuf::new(inp), RawBufMut::new(out))
        };
        RawOp { kind, dtype, bufs, opts: CallOptions::default(), source: None }
    }

    fn message(r: Result<()>) -> String {
        r.expect_err("an invalid operation passed validation").to_string()
    }

    #[test]
    fn reductions_need_equal_whole_buffers_and_a_valid_op() {
        let (a, mut b) = (vec![0u8; 16], vec![0u8; 16]);
        let sum = OpKind::AllReduce(ReduceOp::Sum);
        assert!(validate(&op(sum, DataType::F32, &a, &mut b), 0, 3, false).is_ok());
        let m = message(validate(&op(sum, DataType::F32, &a, &mut b[..12]), 0, 3, false));
        assert!(m.contains("input is 16 bytes but output is 12"), "{m}");
        let m = message(validate(&op(sum, DataType::F64, &a[..12], &mut b[..12]), 0, 3, false));
        assert!(m.contains("not a whole number of"), "{m}");
        let avg = OpKind::AllReduce(ReduceOp::Avg);
        assert!(validate(&op(avg, DataType::I32, &a, &mut b), 0, 3, false).is_err());
        let reduce = OpKind::Reduce(ReduceOp::Sum, 3);
        let m = message(validate(&op(reduce, DataType::F32, &a, &mut b), 0, 3, false));
        assert!(m.contains("root 3 is not a rank"), "{m}");
        // A non-root's reduce may pass no output.
        let reduce = OpKind::Reduce(ReduceOp::Sum, 2);
        assert!(validate(&op(reduce, DataType::F32, &a, &mut []), 0, 3, false).is_ok());
    }

    #[test]
    fn reduce_scatter_and_all_gather_follow_the_size_convention() {
        let (a, mut b) = (vec![0u8; 24], vec![0u8; 8]);
        let rs = OpKind::ReduceScatter(ReduceOp::Max);
        assert!(validate(&op(rs, DataType::I32, &a, &mut b), 1, 3, false).is_ok());
        let m = message(validate(&op(rs, DataType::I32, &a, &mut b[..4]), 1, 3, false));
        assert!(m.contains("expected input/size = 8"), "{m}");
        let m = message(validate(&op(rs, DataType::I32, &a[..20], &mut b[..4]), 1, 3, false));
        assert!(m.contains("does not split into 3 equal pieces"), "{m}");
        let (a, mut b) = (vec![0u8; 8], vec![0u8; 24]);
        assert!(validate(&op(OpKind::AllGather, DataType::I32, &a, &mut b), 2, 3, false).is_ok());
        let m = message(validate(&op(OpKind::AllGather, DataType::I32, &a[..4], &mut b), 2, 3, false));
        assert!(m.contains("expected size x input = 12"), "{m}");
    }

    #[test]
    fn peers_roots_and_forced_algorithms_are_checked() {
        let mut b = vec![0u8; 8];
        let m = message(validate(&op(OpKind::Send(1), DataType::U8, &b.clone(), &mut []), 1, 2, false));
        assert!(m.contains("cannot send to or receive from itself"), "{m}");
        assert!(validate(&op(OpKind::Recv(0), DataType::U8, &[], &mut b), 1, 2, false).is_ok());
        assert!(validate(&op(OpKind::Broadcast(5), DataType::U8, &[], &mut b), 1, 2, false).is_err());
        let mut forced = op(OpKind::AllReduce(ReduceOp::Sum), DataType::U8, &[], &mut b);
        forced.opts.algorithm = Some(Algorithm::ShmDirect);
        assert!(message(validate(&forced, 0, 2, false)).contains("shm_direct needs every rank"));
        assert!(validate(&forced, 0, 2, true).is_ok());
        forced.opts.algorithm = Some(Algorithm::Pairwise);
        assert!(validate(&forced, 0, 2, true).is_err());
        let mut a2a = vec![0u8; 9];
        let m = message(validate(&op(OpKind::AllToAll, DataType::U8, &[], &mut a2a), 0, 2, false));
        assert!(m.contains("split into 2 blocks"), "{m}");
        assert!(validate(&op(OpKind::Barrier, DataType::U8, &[], &mut []), 0, 2, false).is_ok());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_calls_are_checked_before_any_device_is_touched() {
        let call = |kind, dtype, count, send, recv| DeviceCall { kind, dtype, count, send, recv };
        let sum = OpKind::AllReduce(ReduceOp::Sum);
        let avg = OpKind::AllReduce(ReduceOp::Avg);
        let m = message(check_device(&call(avg, DataType::I32, 4, 0, 0), 0, 3).map(drop));
        assert!(m.contains("averages take float types"), "{m}");
        let m = message(check_device(&call(OpKind::Broadcast(3), DataType::F32, 4, 0, 0), 0, 3).map(drop));
        assert!(m.contains("root 3 is not a rank of 3"), "{m}");
        let m = message(check_device(&call(OpKind::Send(1), DataType::F32, 4, 0, 0), 1, 3).map(drop));
        assert!(m.contains("cannot send to or receive from itself"), "{m}");
        let m = message(check_device(&call(sum, DataType::F64, usize::MAX / 4, 0, 0), 0, 3).map(drop));
        assert!(m.contains("overflow"), "{m}");
        // Nothing to do: no device needed.
        assert_eq!(check_device(&call(sum, DataType::F32, 0, 0, 0), 0, 3).ok(), Some(None));
        // Overlapping, not in place: refused before the pointers are looked at.
        let m = message(check_device(&call(sum, DataType::F32, 4, 4096, 4100), 0, 3).map(drop));
        assert!(m.contains("overlap, and not in an in-place form"), "{m}");
        // Host memory is not device memory.
        let host = [0u64; 4];
        let p = host.as_ptr() as u64;
        let m = message(check_device(&call(sum, DataType::F32, 4, p, p), 0, 3).map(drop));
        assert!(m.contains("sendbuf is host memory, recvbuf is host memory"), "{m}");
        let m = message(check_device(&call(OpKind::Send(2), DataType::U8, 8, p, 0), 0, 3).map(drop));
        assert!(m.contains("sendbuf is host memory, recvbuf is not used"), "{m}");
    }
}
