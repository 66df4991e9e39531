//! Unit tests of [`super`]: the argument checks, host and device forms, without sockets or a GPU.

use super::*;
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
    RawOp::new(kind, dtype, bufs)
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
    assert!(m.contains("avg is defined for floating types only"), "{m}");
    let m = message(check_device(&call(OpKind::Broadcast(3), DataType::F32, 4, 0, 0), 0, 3).map(drop));
    assert!(m.contains("root 3 is not a rank of this communicator (size 3)"), "{m}");
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

/// The host and device forms of the same invalid call fail with the same error (kind and
/// message): the checks both memories share run once, before anything particular to either
/// (and before any device is looked at).
#[cfg(feature = "cuda")]
#[test]
fn host_and_device_forms_of_one_invalid_call_fail_alike() {
    let device = |kind, dtype, rank| {
        check(&Call::device(&DeviceCall { kind, dtype, count: 4, send: 4096, recv: 8192 }), rank, 3, false)
    };
    let cases = [
        (OpKind::AllReduce(ReduceOp::Avg), DataType::I32, 0),
        (OpKind::ReduceScatter(ReduceOp::Avg), DataType::U8, 1),
        (OpKind::Reduce(ReduceOp::Avg, 0), DataType::I64, 0),
        (OpKind::Reduce(ReduceOp::Sum, 3), DataType::F32, 0),
        (OpKind::Broadcast(7), DataType::F32, 2),
        (OpKind::Send(3), DataType::U8, 0),
        (OpKind::Recv(5), DataType::U8, 0),
        (OpKind::Send(1), DataType::U8, 1),
        (OpKind::Recv(2), DataType::F32, 2),
    ];
    for (kind, dtype, rank) in cases {
        let (a, mut b) = (vec![0u8; 48], vec![0u8; 48]);
        let (inp, out): (&[u8], &mut [u8]) = match kind {
            OpKind::Send(_) => (&a, &mut []),
            OpKind::Recv(_) => (&[], &mut b),
            OpKind::ReduceScatter(_) => (&a, &mut b[..16]),
            _ => (&a, &mut b),
        };
        let host = check(&Call::host(&op(kind, dtype, inp, out)), rank, 3, false)
            .expect_err("an invalid host call passed");
        let dev = device(kind, dtype, rank).expect_err("an invalid device call passed");
        // The same kind (InvalidArgument, Unsupported) and the same message.
        assert_eq!(host, dev, "{kind:?}");
    }
    // A valid call passes the shared checks on both memories (the device form then stops at
    // the pointers, which are not device memory).
    let (a, mut b) = (vec![0u8; 16], vec![0u8; 16]);
    let sum = OpKind::AllReduce(ReduceOp::Sum);
    assert_eq!(
        check(&Call::host(&op(sum, DataType::F32, &a, &mut b)), 0, 3, false).ok(),
        Some(Checked::Host)
    );
    let (send, recv) = (a.as_ptr() as u64, b.as_ptr() as u64);
    let call = Call::device(&DeviceCall { kind: sum, dtype: DataType::F32, count: 4, send, recv });
    let m = check(&call, 0, 3, false).expect_err("host memory is not device memory").to_string();
    assert!(m.contains("sendbuf is host memory, recvbuf is host memory"), "{m}");
}

#[test]
fn all_to_all_v_blocks_add_up_to_the_buffers_and_keep_this_ranks_size() {
    let v = |inp: &[u8], out: &mut [u8], send: &[usize], recv: &[usize], rank: usize| {
        let mut o = op(OpKind::AllToAllV, DataType::I32, inp, out);
        o.splits = Some(split_offsets(send, recv, 3, 4)?);
        validate(&o, rank, 3, false)
    };
    let (a, mut b) = (vec![0u8; 24], vec![0u8; 20]);
    // Rank 1 sends 1, 2, 3 elements and receives 0, 2, 3: its own block is 2 both ways.
    assert!(v(&a, &mut b, &[1, 2, 3], &[0, 2, 3], 1).is_ok());
    let m = message(v(&a, &mut b, &[1, 2, 3], &[0, 1, 4], 1));
    assert!(m.contains("sends itself 8 bytes but expects 4"), "{m}");
    let m = message(v(&a, &mut b, &[1, 2, 2], &[0, 2, 3], 1));
    assert!(m.contains("the input's counts add up to 20 bytes, not its 24"), "{m}");
    let m = message(v(&a, &mut b, &[1, 2, 3], &[0, 2, 2], 1));
    assert!(m.contains("the output's counts add up to 16 bytes, not its 20"), "{m}");
    let m = message(v(&a, &mut b, &[1, 2], &[0, 2, 3], 1));
    assert!(m.contains("send_counts has 2 entries for 3 ranks"), "{m}");
    let m = message(v(&a, &mut b, &[usize::MAX / 2, 2, 3], &[0, 2, 3], 1));
    assert!(m.contains("overflow"), "{m}");
    // No in-place form, and no all-to-all-v without its counts.
    let mut buf = vec![0u8; 24];
    let mut o = op(OpKind::AllToAllV, DataType::I32, &[], &mut buf);
    o.splits = Some(split_offsets(&[1, 2, 3], &[1, 2, 3], 3, 4).expect("offsets"));
    assert!(message(validate(&o, 1, 3, false)).contains("no in-place form"));
    let m = message(validate(&op(OpKind::AllToAllV, DataType::I32, &a, &mut b), 1, 3, false));
    assert!(m.contains("without its counts"), "{m}");
}

#[test]
fn a_batch_of_sends_and_receives_checks_each_and_refuses_overlapping_receives() {
    let mut m = vec![0u8; 64];
    let p = m.as_mut_ptr();
    // Descriptors over one allocation (never run): [0, 16), [8, 24), [32, 48).
    // SAFETY: in bounds of `m`; only addresses and lengths are looked at.
    let (w0, w8, w32) = unsafe {
        (
            RawBufMut::from_raw(p, 16).unwrap(),
            RawBufMut::from_raw(p.add(8), 16).unwrap(),
            RawBufMut::from_raw(p.add(32), 16).unwrap(),
        )
    };
    let item = |kind: OpKind, bufs: RawBufs| RawOp::new(kind, DataType::F32, bufs);
    let batch = |items: Vec<RawOp>| RawOp {
        batch: Some(items.into()),
        ..RawOp::new(OpKind::SendRecv, DataType::U8, RawBufs::None)
    };
    let send = |b: RawBufMut, peer| item(OpKind::Send(peer), RawBufs::Read(b.as_read()));
    let recv = |b: RawBufMut, peer| item(OpKind::Recv(peer), RawBufs::InPlace(b));
    // Two sends may read overlapping memory; receives write apart from everything else.
    assert!(validate(&batch(vec![send(w0, 1), send(w8, 2), recv(w32, 1)]), 0, 3, false).is_ok());
    for bad in
        [vec![send(w0, 1), recv(w8, 2)], vec![recv(w8, 1), send(w0, 2)], vec![recv(w0, 1), recv(w8, 2)]]
    {
        let m = message(validate(&batch(bad), 0, 3, false));
        assert!(m.contains("overlaps another buffer"), "{m}");
    }
    // A receive inside a large send's span, with a small send between them in address order.
    // SAFETY: as above.
    let (big, tiny) =
        unsafe { (RawBufMut::from_raw(p, 64).unwrap(), RawBufMut::from_raw(p.add(4), 4).unwrap()) };
    let m = message(validate(&batch(vec![send(big, 1), send(tiny, 1), recv(w32, 2)]), 0, 3, false));
    assert!(m.contains("overlaps another buffer"), "{m}");
    // Each item is checked as a call of its own.
    let m = message(validate(&batch(vec![send(w0, 0), recv(w32, 1)]), 0, 3, false));
    assert!(m.contains("cannot send to or receive from itself"), "{m}");
    let m = message(validate(&batch(vec![send(w0, 3), recv(w32, 1)]), 0, 3, false));
    assert!(m.contains("peer 3 is not a rank"), "{m}");
    // Only sends and receives, and at least one.
    assert!(validate(&batch(vec![item(OpKind::Barrier, RawBufs::None)]), 0, 3, false).is_err());
    assert!(validate(&batch(vec![]), 0, 3, false).is_err());
}
