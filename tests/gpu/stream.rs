//! The stream entry points (`gpu::stream`, what the C `toroid_*_stream` calls and the torch
//! backend use) on 3 ranks as threads sharing device 0, with CUDA IPC on and off, blocking and
//! asynchronous, against references computed on the CPU. Every test needs a GPU.

use super::*;

/// All-reduce, broadcast, all-gather and reduce-scatter through `gpu::stream::on_stream` (what
/// the C entry points and the torch backend call) on 3 ranks as threads sharing device 0, with CUDA IPC on (reduced on
/// the GPU through the ranks' device windows) and off (staged): every type and op above, 1,
/// 4099 and more elements than one device window holds (two chunks, the last partial), in
/// place and out of place, every element on every rank against a reference computed here
/// (bit for bit, except avg on the staged path: the host algorithms pre-scale, so within a
/// tolerance).
/// With IPC, a call whose count differs on one rank fails on every rank (no rank reads what a
/// peer did not write).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn stream_collectives_through_ipc_and_staged_give_the_reference_on_every_rank() {
    use gpu::ipc::{HALF, WINDOW};
    use gpu::stream::{self, DevicePath};
    const TEST: &str = "stream_collectives_through_ipc_and_staged_give_the_reference_on_every_rank";
    on_three_ranks_with_ipc_and_without(TEST, |comm, ipc, stream, raw| {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (me, n) = (comm.rank(), comm.size());
        let cases: &[(DataType, ReduceOp)] = &[
            (DataType::F32, ReduceOp::Sum),
            (DataType::F32, ReduceOp::Prod),
            (DataType::F32, ReduceOp::Min),
            (DataType::F32, ReduceOp::Max),
            (DataType::F32, ReduceOp::Avg),
            (DataType::F64, ReduceOp::Sum),
            (DataType::F64, ReduceOp::Avg),
            (DataType::F16, ReduceOp::Sum),
            (DataType::BF16, ReduceOp::Max),
            (DataType::I32, ReduceOp::Prod),
            (DataType::I64, ReduceOp::Sum),
            (DataType::U8, ReduceOp::Sum),
            (DataType::I8, ReduceOp::Min),
            (DataType::U64, ReduceOp::Max),
        ];
        let mut checked = 0usize;
        for (c, &(d, op)) in cases.iter().enumerate() {
            let s = d.size();
            // Three IPC chunks (window halves), the last partial and in the first half again.
            let big = WINDOW / s + 1_000_003;
            let counts: &[usize] = if matches!(c, 0 | 10) { &[1, 4099, big] } else { &[1, 4099] };
            for (j, &count) in counts.iter().enumerate() {
                let seed = (c * 10 + j) as u64;
                let inputs: Vec<Vec<u8>> = (0..n).map(|r| exact_values(d, count, r, seed)).collect();
                let want = reference(d, op, &inputs);
                let send = stream.clone_htod(&inputs[me]).expect("copy in");
                let out_of_place = j % 2 == 1;
                let mut recv = stream.alloc_zeros::<u8>(count * s).expect("alloc");
                let (ps, pr) = (send.device_ptr(stream).0, recv.device_ptr_mut(stream).0);
                let target = if out_of_place { pr } else { ps };
                // SAFETY: both allocations hold `count` elements and live past the call.
                unsafe { stream::on_stream(comm, toroid::OpKind::AllReduce(op), ps, target, count, d, raw) }
                    .unwrap_or_else(|e| panic!("rank {me}: {d} {op:?} {count}: {e}"));
                let got = stream.clone_dtoh(if out_of_place { &recv } else { &send }).expect("copy out");
                let bad = if op == ReduceOp::Avg && !ipc {
                    // The host algorithms pre-scale each input by 1/n, then sum: within a
                    // few units in the last place of the sum-then-scale reference.
                    avg_outside_tolerance(d, &got, &want)
                } else {
                    mismatches(d, op, &got, &want)
                };
                assert!(
                    bad.is_empty(),
                    "rank {me} ipc {ipc}: {d} {op:?} count {count}: {} elements differ, first at {}",
                    bad.len(),
                    bad[0]
                );
                if out_of_place {
                    assert_eq!(stream.clone_dtoh(&send).expect("copy"), inputs[me], "sendbuf untouched");
                }
                checked += 1;
            }
        }
        // Broadcast of f64 from rank 1, in place and out of place, one and three chunks.
        for (j, count) in [4099usize, WINDOW / 8 + 77].into_iter().enumerate() {
            let mine = exact_values(DataType::F64, count, me, 900 + j as u64);
            let root_data = exact_values(DataType::F64, count, 1, 900 + j as u64);
            let send = stream.clone_htod(&mine).expect("copy in");
            let mut recv = stream.alloc_zeros::<u8>(count * 8).expect("alloc");
            let (ps, pr) = (send.device_ptr(stream).0, recv.device_ptr_mut(stream).0);
            let target = if j == 1 { pr } else { ps };
            // SAFETY: as above.
            unsafe {
                stream::on_stream(comm, toroid::OpKind::Broadcast(1), ps, target, count, DataType::F64, raw)
            }
            .unwrap_or_else(|e| panic!("rank {me}: broadcast {count}: {e}"));
            let got = stream.clone_dtoh(if j == 1 { &recv } else { &send }).expect("copy out");
            assert!(got == root_data, "rank {me} ipc {ipc}: broadcast of {count} differs from the root's");
            checked += 1;
        }
        // All-gather of i64 (out of place, then NCCL's in-place form) and reduce-scatter of
        // f32 sums and i32 maxima (out of place, NCCL's in-place form, the result at the
        // front of sendbuf), one chunk and several.
        use toroid::OpKind::{AllGather, ReduceScatter};
        for (j, count) in [1usize, 4099, HALF / 8 + 5].into_iter().enumerate() {
            let d = DataType::I64;
            let pieces: Vec<Vec<u8>> = (0..n).map(|r| exact_values(d, count, r, 700 + j as u64)).collect();
            let want = pieces.concat();
            let send = stream.clone_htod(&pieces[me]).expect("copy in");
            let mut recv = stream.alloc_zeros::<u8>(n * count * 8).expect("alloc");
            let (ps, pr) = (send.device_ptr(stream).0, recv.device_ptr_mut(stream).0);
            // SAFETY: `send` holds count, `recv` n x count elements; both live past the call.
            unsafe { stream::on_stream(comm, AllGather, ps, pr, count, d, raw) }
                .unwrap_or_else(|e| panic!("rank {me}: all_gather {count}: {e}"));
            assert!(
                stream.clone_dtoh(&recv).expect("copy") == want,
                "rank {me} ipc {ipc}: all_gather of {count}"
            );
            let mut inplace = vec![0u8; n * count * 8];
            inplace[me * count * 8..(me + 1) * count * 8].copy_from_slice(&pieces[me]);
            let mut buf = stream.clone_htod(&inplace).expect("copy in");
            let pb = buf.device_ptr_mut(stream).0;
            // SAFETY: `buf` holds n x count elements; the send piece is this rank's.
            unsafe { stream::on_stream(comm, AllGather, pb + (me * count * 8) as u64, pb, count, d, raw) }
                .unwrap_or_else(|e| panic!("rank {me}: all_gather in place {count}: {e}"));
            assert!(stream.clone_dtoh(&buf).expect("copy") == want, "rank {me} ipc {ipc}: in place, {count}");
            checked += 2;
            // An overlap that is no in-place form is refused before any rank meets.
            if j == 1 {
                // SAFETY: refused before anything is read or written.
                let e = unsafe { stream::on_stream(comm, AllGather, pb + 8, pb, count, d, raw) }
                    .expect_err("overlap");
                assert!(e.to_string().contains("overlap"), "{e}");
            }
        }
        for (j, count) in [1usize, 4099, HALF / (4 * n) + 3].into_iter().enumerate() {
            for (d, op) in [(DataType::F32, ReduceOp::Sum), (DataType::I32, ReduceOp::Max)] {
                let es = d.size();
                let inputs: Vec<Vec<u8>> =
                    (0..n).map(|r| exact_values(d, n * count, r, 800 + j as u64)).collect();
                let full = reference(d, op, &inputs);
                let want = &full[me * count * es..(me + 1) * count * es];
                for form in 0..3 {
                    // 0: out of place; 1: recv is this rank's piece of send; 2: recv is send.
                    let mut send = stream.clone_htod(&inputs[me]).expect("copy in");
                    let mut recv = stream.alloc_zeros::<u8>(count * es).expect("alloc");
                    let ps = send.device_ptr_mut(stream).0;
                    let pr = match form {
                        0 => recv.device_ptr_mut(stream).0,
                        1 => ps + (me * count * es) as u64,
                        _ => ps,
                    };
                    // SAFETY: `send` holds n x count elements, `recv` count; both live on.
                    unsafe { stream::on_stream(comm, ReduceScatter(op), ps, pr, count, d, raw) }
                        .unwrap_or_else(|e| panic!("rank {me}: reduce_scatter {count} form {form}: {e}"));
                    let got = match form {
                        0 => stream.clone_dtoh(&recv).expect("copy"),
                        1 => stream.clone_dtoh(&send).expect("copy")[me * count * es..(me + 1) * count * es]
                            .to_vec(),
                        _ => stream.clone_dtoh(&send).expect("copy")[..count * es].to_vec(),
                    };
                    let bad = mismatches(d, op, &got, want);
                    assert!(
                        bad.is_empty(),
                        "rank {me} ipc {ipc}: reduce_scatter {d} {op:?} {count} form {form}: {} differ",
                        bad.len()
                    );
                    checked += 1;
                }
            }
        }
        let want_path = if ipc { DevicePath::Ipc } else { DevicePath::Staged };
        assert_eq!(stream::path(comm), Some(want_path), "rank {me}");
        // An average of integers is refused at once, on every rank (nothing is queued);
        // the next call still works.
        let ones = stream.clone_htod(&vec![1.0f32; 5000]).expect("copy in");
        let p = ones.device_ptr(stream).0;
        // SAFETY: `ones` holds 5000 f32 (20000 bytes >= 1000 i32).
        let e = unsafe {
            stream::on_stream(comm, toroid::OpKind::AllReduce(ReduceOp::Avg), p, p, 1000, DataType::I32, raw)
        }
        .expect_err("avg of i32");
        assert!(matches!(e, Error::Unsupported(_)), "rank {me}: {e}");
        // SAFETY: `ones` holds 5000 f32.
        unsafe {
            stream::on_stream(comm, toroid::OpKind::AllReduce(ReduceOp::Sum), p, p, 5000, DataType::F32, raw)
        }
        .expect("all_reduce after the refusal");
        assert!(stream.clone_dtoh(&ones).expect("copy out").iter().all(|&x| x == n as f32), "rank {me}");
        if ipc {
            // Last: one rank asks for one element more. Every rank gets an error saying so
            // (and the communicator fails, as after any failed device collective); none
            // hangs, none reads what a peer did not write.
            let count = 1000 + usize::from(me == 2);
            let buf = stream.alloc_zeros::<f32>(count + 1).expect("alloc");
            let p = buf.device_ptr(stream).0;
            // SAFETY: `buf` holds count + 1 >= count f32.
            let e = unsafe {
                stream::on_stream(
                    comm,
                    toroid::OpKind::AllReduce(ReduceOp::Sum),
                    p,
                    p,
                    count,
                    DataType::F32,
                    raw,
                )
            }
            .expect_err("mismatched counts must fail");
            assert!(e.to_string().contains("disagree"), "rank {me}: {e}");
        }
        if me == 0 {
            println!("{checked} stream collectives per rank matched on {n} ranks, path {want_path:?}");
        }
    });
}

/// Reduce, all-to-all, send and receive through `gpu::stream::on_stream` (what
/// `toroid_reduce_stream`, `toroid_all_to_all_stream`, `toroid_send_stream` and
/// `toroid_recv_stream` call), staged on both paths, on 3 ranks as threads sharing device 0,
/// with CUDA IPC on and off: one element, one staging chunk and three (the last partial), in
/// place and out of place, every element against the reference; a non-root's reduce leaves its
/// recvbuf alone, and a peer out of range or a rank as its own peer is refused. Sends and
/// receives come first, between ranks 0 and 1 only and then around the ring, and must not set
/// up the device path (collective): rank 2 would hang, or pair that set-up with another call.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn reduce_all_to_all_send_and_recv_on_device_memory_give_the_reference() {
    use gpu::stream;
    use toroid::OpKind::{AllToAll, Recv, Reduce, Send};
    const TEST: &str = "reduce_all_to_all_send_and_recv_on_device_memory_give_the_reference";
    on_three_ranks_with_ipc_and_without(TEST, |comm, ipc, stream, raw| {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (me, n) = (comm.rank(), comm.size());
        let mut checked = 0usize;
        // First, before any collective (a send or a receive does not choose the path,
        // which is collective): ranks 0 and 1 swap 4099 f32 while rank 2 does nothing, then
        // every rank sends to the right and receives from the left (even ranks send first),
        // f64, one element, and three staging chunks.
        if me < 2 {
            let other = 1 - me;
            let d = DataType::F32;
            let mine = exact_values(d, 4099, me, 1300);
            let send = stream.clone_htod(&mine).expect("copy in");
            let mut recv = stream.alloc_zeros::<u8>(4099 * 4).expect("alloc");
            let (ps, pr) = (send.device_ptr(stream).0, recv.device_ptr_mut(stream).0);
            // SAFETY (both): each buffer holds 4099 elements and lives past the calls.
            let tx = || unsafe { stream::on_stream(comm, Send(other), ps, 0, 4099, d, raw) };
            let rx = || unsafe { stream::on_stream(comm, Recv(other), 0, pr, 4099, d, raw) };
            let r = if me == 0 { tx().and_then(|()| rx()) } else { rx().and_then(|()| tx()) };
            r.unwrap_or_else(|e| panic!("rank {me}: pair send/recv: {e}"));
            assert!(
                stream.clone_dtoh(&recv).expect("copy") == exact_values(d, 4099, other, 1300),
                "rank {me} ipc {ipc}: pair recv"
            );
            checked += 1;
        }
        for (j, count) in [1usize, 2 * staged::CHUNK / 8 + 3].into_iter().enumerate() {
            let d = DataType::F64;
            let (right, left) = ((me + 1) % n, (me + n - 1) % n);
            let mine = exact_values(d, count, me, 1200 + j as u64);
            let theirs = exact_values(d, count, left, 1200 + j as u64);
            let send = stream.clone_htod(&mine).expect("copy in");
            let mut recv = stream.alloc_zeros::<u8>(count * 8).expect("alloc");
            let (ps, pr) = (send.device_ptr(stream).0, recv.device_ptr_mut(stream).0);
            // SAFETY (both): each buffer holds `count` elements and lives past the calls.
            let tx = || unsafe { stream::on_stream(comm, Send(right), ps, 0, count, d, raw) };
            let rx = || unsafe { stream::on_stream(comm, Recv(left), 0, pr, count, d, raw) };
            let r = if me % 2 == 0 { tx().and_then(|()| rx()) } else { rx().and_then(|()| tx()) };
            r.unwrap_or_else(|e| panic!("rank {me}: send/recv {count}: {e}"));
            assert!(stream.clone_dtoh(&recv).expect("copy") == theirs, "rank {me} ipc {ipc}: recv {count}");
            checked += 1;
        }
        assert_eq!(stream::path(comm), None, "rank {me}: a send or a receive chose the path");
        for (j, d, op) in [(0, DataType::F32, ReduceOp::Sum), (1, DataType::I32, ReduceOp::Max)] {
            let es = d.size();
            for (k, count) in
                [1usize, staged::CHUNK / es, 2 * staged::CHUNK / es + 77].into_iter().enumerate()
            {
                let inputs: Vec<Vec<u8>> =
                    (0..n).map(|r| exact_values(d, count, r, 1000 + j * 10 + k as u64)).collect();
                let want = reference(d, op, &inputs);
                let root = (k + 1) % n;
                // Out of place, then in place.
                let send = stream.clone_htod(&inputs[me]).expect("copy in");
                let mut recv = stream.alloc_zeros::<u8>(count * es).expect("alloc");
                let ps = send.device_ptr(stream).0;
                // (A non-root may pass NULL; passing its buffer checks that it is not written.)
                let pr = recv.device_ptr_mut(stream).0;
                // SAFETY: both allocations hold `count` elements and live past the call.
                unsafe { stream::on_stream(comm, Reduce(op, root), ps, pr, count, d, raw) }
                    .unwrap_or_else(|e| panic!("rank {me}: reduce {d} {count}: {e}"));
                let got = stream.clone_dtoh(&recv).expect("copy out");
                if me == root {
                    let bad = mismatches(d, op, &got, &want);
                    assert!(bad.is_empty(), "rank {me} ipc {ipc}: reduce {d} {count}: {} differ", bad.len());
                } else {
                    assert!(got.iter().all(|&b| b == 0), "rank {me}: a non-root's recvbuf was written");
                }
                let mut buf = stream.clone_htod(&inputs[me]).expect("copy in");
                let pb = buf.device_ptr_mut(stream).0;
                // SAFETY: as above.
                unsafe { stream::on_stream(comm, Reduce(op, root), pb, pb, count, d, raw) }
                    .unwrap_or_else(|e| panic!("rank {me}: reduce in place {d} {count}: {e}"));
                let got = stream.clone_dtoh(&buf).expect("copy out");
                if me == root {
                    assert!(
                        mismatches(d, op, &got, &want).is_empty(),
                        "rank {me} ipc {ipc}: in place {count}"
                    );
                } else {
                    assert!(got == inputs[me], "rank {me}: a non-root's sendbuf changed");
                }
                checked += 2;
            }
        }
        let want_path = if ipc { stream::DevicePath::Ipc } else { stream::DevicePath::Staged };
        assert_eq!(stream::path(comm), Some(want_path), "rank {me}: the first reduce chose the path");
        // All-to-all of i64 blocks: out of place, then in place; one chunk per block and several.
        for (j, count) in [1usize, 4099, staged::CHUNK / 8 / n * 2 + 5].into_iter().enumerate() {
            let d = DataType::I64;
            let blocks: Vec<Vec<u8>> =
                (0..n).map(|r| exact_values(d, n * count, r, 1100 + j as u64)).collect();
            let b = count * 8;
            let want: Vec<u8> = (0..n).flat_map(|r| blocks[r][me * b..(me + 1) * b].to_vec()).collect();
            let send = stream.clone_htod(&blocks[me]).expect("copy in");
            let mut recv = stream.alloc_zeros::<u8>(n * b).expect("alloc");
            let (ps, pr) = (send.device_ptr(stream).0, recv.device_ptr_mut(stream).0);
            // SAFETY: both hold n x count elements and live past the call.
            unsafe { stream::on_stream(comm, AllToAll, ps, pr, count, d, raw) }
                .unwrap_or_else(|e| panic!("rank {me}: all_to_all {count}: {e}"));
            assert!(
                stream.clone_dtoh(&recv).expect("copy") == want,
                "rank {me} ipc {ipc}: all_to_all {count}"
            );
            let mut buf = stream.clone_htod(&blocks[me]).expect("copy in");
            let pb = buf.device_ptr_mut(stream).0;
            // SAFETY: as above.
            unsafe { stream::on_stream(comm, AllToAll, pb, pb, count, d, raw) }
                .unwrap_or_else(|e| panic!("rank {me}: all_to_all in place {count}: {e}"));
            assert!(stream.clone_dtoh(&buf).expect("copy") == want, "rank {me} ipc {ipc}: in place {count}");
            checked += 2;
        }
        // A peer out of range, or this rank as its own peer, is refused before anything moves.
        let one = stream.alloc_zeros::<f32>(4).expect("alloc");
        let p = one.device_ptr(stream).0;
        // SAFETY: refused before anything is read.
        let e = unsafe { stream::on_stream(comm, Send(n), p, 0, 4, DataType::F32, raw) }.expect_err("peer n");
        assert!(e.to_string().contains("is not a rank"), "{e}");
        // SAFETY: as above.
        let e = unsafe { stream::on_stream(comm, Recv(me), 0, p, 4, DataType::F32, raw) }.expect_err("self");
        assert!(e.to_string().contains("itself"), "{e}");
        if me == 0 {
            println!(
                "{checked} reduce, all-to-all and send/recv calls on device memory matched on {n} ranks (ipc {ipc})"
            );
        }
    });
}

/// Runs `body(comm, ipc, stream, raw)` on 3 ranks as threads sharing device 0, first with CUDA
/// IPC on, then off: each rank on a stream of its own (`raw`: that stream as the C entry points
/// take it). Needs a CUDA driver and NVRTC (the IPC path compiles the kernels in the library:
/// NVRTC loaded here, or found by name).
fn on_three_ranks_with_ipc_and_without<F>(test: &str, body: F)
where
    F: Fn(&toroid::Communicator, bool, &std::sync::Arc<cudarc::driver::CudaStream>, *mut std::ffi::c_void)
        + Send
        + Sync
        + Copy
        + 'static,
{
    gpu::driver_available().expect("this test needs a CUDA driver");
    let Some(_) = ptx(test) else { panic!("{test}: no NVRTC") };
    for ipc in [true, false] {
        let mut cfg = util::test_config(120.0);
        cfg.cuda_ipc = ipc;
        util::run_threads(3, &cfg, move |comm| {
            let ctx = cudarc::driver::CudaContext::new(0).expect("device 0");
            let stream = ctx.new_stream().expect("a stream");
            let raw = stream.cu_stream() as *mut std::ffi::c_void;
            body(&comm, ipc, &stream, raw);
        });
    }
}

/// The asynchronous stream path (`gpu::stream::on_stream_async`, what the `_async` C entry
/// points and the torch backend call) on 3 ranks as threads sharing device 0: 8 all-reduces
/// (one to three chunks) and an all-gather issued back to back on one stream without waiting
/// (more than fit in flight at once is not tried), then every work waited for and every
/// element checked against the reference, and a blocking call after them.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn async_stream_collectives_complete_with_the_reference() {
    use gpu::stream::{self, DevicePath};
    const TEST: &str = "async_stream_collectives_complete_with_the_reference";
    gpu::driver_available().expect("this test needs a CUDA driver");
    let Some(_) = ptx(TEST) else { panic!("{TEST}: no NVRTC") };
    let n = 3;
    util::run_threads(n, &util::test_config(120.0), move |comm| {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let me = comm.rank();
        let ctx = cudarc::driver::CudaContext::new(0).expect("device 0");
        let s = ctx.new_stream().expect("a stream");
        let raw = s.cu_stream() as *mut std::ffi::c_void;
        let d = DataType::I64;
        let counts = [1usize, 4099, 3_000_000, 17, 1 << 20, 5, 9_000_001, 64];
        let inputs: Vec<Vec<Vec<u8>>> = counts
            .iter()
            .enumerate()
            .map(|(j, &c)| (0..n).map(|r| exact_values(d, c, r, 1000 + j as u64)).collect())
            .collect();
        let mut bufs: Vec<_> = inputs.iter().map(|x| s.clone_htod(&x[me]).expect("copy in")).collect();
        let mut works = Vec::new();
        for (j, &count) in counts.iter().enumerate() {
            let p = bufs[j].device_ptr_mut(&s).0;
            // SAFETY: `bufs[j]` holds `count` i64 and lives, untouched, until every work has
            // completed.
            let w = unsafe {
                stream::on_stream_async(&comm, toroid::OpKind::AllReduce(ReduceOp::Sum), p, p, count, d, raw)
            }
            .unwrap_or_else(|e| panic!("rank {me}: async all_reduce {count}: {e}"));
            works.push(w.expect("the IPC path queues (a work)"));
        }
        let pieces: Vec<Vec<u8>> = (0..n).map(|r| exact_values(d, 4099, r, 2000)).collect();
        let send = s.clone_htod(&pieces[me]).expect("copy in");
        let mut gathered = s.alloc_zeros::<u8>(n * 4099 * 8).expect("alloc");
        let (ps, pg) = (send.device_ptr(&s).0, gathered.device_ptr_mut(&s).0);
        // SAFETY: `send` holds 4099, `gathered` n x 4099 i64; both live, untouched, past the work.
        let w = unsafe { stream::on_stream_async(&comm, toroid::OpKind::AllGather, ps, pg, 4099, d, raw) }
            .expect("async all_gather")
            .expect("a work");
        for w in works {
            w.wait().expect("work");
        }
        w.wait().expect("all_gather work");
        for (j, buf) in bufs.iter().enumerate() {
            let want = reference(d, ReduceOp::Sum, &inputs[j]);
            assert!(
                s.clone_dtoh(buf).expect("copy out") == want,
                "rank {me}: async all_reduce {j} ({} elements) differs",
                counts[j]
            );
        }
        assert!(
            s.clone_dtoh(&gathered).expect("copy out") == pieces.concat(),
            "rank {me}: async all_gather differs"
        );
        assert_eq!(stream::path(&comm), Some(DevicePath::Ipc));
        // A blocking call after the asynchronous ones.
        let ones = s.clone_htod(&vec![1.0f32; 5000]).expect("copy in");
        let p = ones.device_ptr(&s).0;
        // SAFETY: `ones` holds 5000 f32.
        unsafe {
            stream::on_stream(&comm, toroid::OpKind::AllReduce(ReduceOp::Sum), p, p, 5000, DataType::F32, raw)
        }
        .expect("blocking all_reduce");
        assert!(s.clone_dtoh(&ones).expect("copy out").iter().all(|&x| x == n as f32), "rank {me}");
        if me == 0 {
            println!("{} asynchronous collectives per rank matched on {n} ranks", counts.len() + 1);
        }
    });
}
