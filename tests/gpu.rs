//! CUDA (`src/gpu`, cargo feature `cuda`): every reduction kernel compiles with NVRTC (no GPU
//! needed: NVRTC from torch's wheel, or `TOROID_NVRTC_PATH`); without a driver, asking for the
//! device is `Unsupported` with a message; with one, every kernel on random data (special
//! values included, aligned and misaligned, lengths that leave tails) gives the CPU kernels'
//! bits, and all-reduce and broadcast on device memory (staged through pinned host memory, on
//! 3 ranks as threads sharing the GPU) give exactly the reference. The tests that need a GPU
//! are `#[ignore]`d, so that `cargo test` reports them as not run (scripts/gpu-check.sh runs
//! them with `--include-ignored`); `TOROID_REQUIRE_NVRTC=1` (scripts/test.sh) makes a missing
//! NVRTC a failure instead of a SKIPPED line.
#![cfg(feature = "cuda")]

mod util;

use std::path::PathBuf;
use std::process::Command;

use toroid::gpu::staged::{self, DeviceCollectives};
use toroid::gpu::{self, device::DeviceKernels, kernels};
use toroid::internals::reduce;
use toroid::{DataType, Error, ReduceOp};

/// NVRTC: `TOROID_NVRTC_PATH`, else the one torch's wheel installed (`nvidia/cu13/lib` or
/// `nvidia/cuda_nvrtc/lib`).
fn nvrtc_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TOROID_NVRTC_PATH") {
        return Some(p.into());
    }
    let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(py)
        .args([
            "-c",
            "import nvidia, os; print('\\n'.join(os.path.join(p, d, 'lib', 'libnvrtc.so.13') \
             for p in nvidia.__path__ for d in ('cu13', 'cuda_nvrtc')))",
        ])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).lines().map(PathBuf::from).find(|p| p.exists())
}

/// The kernels' PTX: from `TOROID_GPU_PTX` (a file compiled elsewhere, for a GPU machine
/// without NVRTC), else compiled here. `None` (after saying why) when neither can be had.
fn ptx(test: &str) -> Option<String> {
    if let Some(p) = std::env::var_os("TOROID_GPU_PTX") {
        return Some(std::fs::read_to_string(p).expect("TOROID_GPU_PTX is readable"));
    }
    let Some(path) = nvrtc_path() else {
        let why = "NVRTC not found (no TOROID_NVRTC_PATH, no nvidia/cu13/lib from torch's wheel)";
        assert!(std::env::var_os("TOROID_REQUIRE_NVRTC").is_none(), "{test}: {why}");
        eprintln!("SKIPPED {test}: {why}");
        return None;
    };
    gpu::load_nvrtc(Some(&path)).expect("NVRTC loads");
    Some(gpu::compile(&kernels::source()).expect("every kernel compiles"))
}

#[test]
fn every_kernel_compiles_with_nvrtc() {
    let Some(ptx) = ptx("every_kernel_compiles_with_nvrtc") else { return };
    for name in kernels::names() {
        assert!(ptx.contains(&format!(".entry {name}(")), "{name} missing from the PTX");
    }
    println!(
        "{} kernels compiled to {} bytes of PTX for {}",
        kernels::names().len(),
        ptx.len(),
        gpu::PTX_ARCH
    );
    if let Some(out) = std::env::var_os("TOROID_WRITE_PTX") {
        std::fs::write(out, &ptx).expect("writing the PTX");
    }
}

#[test]
fn without_a_driver_the_device_is_unsupported_with_a_message() {
    match gpu::driver_available() {
        Ok(()) => eprintln!("SKIPPED without_a_driver_...: this machine has a CUDA driver"),
        Err(e) => {
            assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
            assert!(e.to_string().contains("CUDA is not available"), "{e}");
            let e = DeviceKernels::new(0, "").unwrap_err();
            assert!(e.to_string().contains("CUDA is not available"), "{e}");
        }
    }
}

/// splitmix64.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `count` random elements of `d` as bytes: mostly ordinary values, one in 16 raw bits (NaNs,
/// infinities, subnormals, signed zeros for floats).
fn random(d: DataType, count: usize, seed: u64) -> Vec<u8> {
    let s = d.size();
    let mut out = vec![0u8; count * s];
    for i in 0..count {
        let h = mix(seed ^ (i as u64).wrapping_mul(0x1000_0001));
        let e = &mut out[i * s..(i + 1) * s];
        let raw = h.is_multiple_of(16);
        match d {
            DataType::F32 if !raw => e.copy_from_slice(&((h >> 8) as i32 as f32 / 1e6).to_ne_bytes()),
            DataType::F64 if !raw => e.copy_from_slice(&((h >> 8) as i64 as f64 / 1e12).to_ne_bytes()),
            DataType::F16 if !raw => {
                e.copy_from_slice(&half::f16::from_f32((h >> 40) as i16 as f32 / 1e3).to_bits().to_ne_bytes())
            }
            DataType::BF16 if !raw => e.copy_from_slice(
                &half::bf16::from_f32((h >> 40) as i16 as f32 / 1e3).to_bits().to_ne_bytes(),
            ),
            _ => e.copy_from_slice(&h.to_ne_bytes()[..s]),
        }
    }
    out
}

fn is_nan(d: DataType, e: &[u8]) -> bool {
    match d {
        DataType::F32 => f32::from_ne_bytes(e.try_into().unwrap()).is_nan(),
        DataType::F64 => f64::from_ne_bytes(e.try_into().unwrap()).is_nan(),
        DataType::F16 => half::f16::from_bits(u16::from_ne_bytes(e.try_into().unwrap())).is_nan(),
        DataType::BF16 => half::bf16::from_bits(u16::from_ne_bytes(e.try_into().unwrap())).is_nan(),
        _ => false,
    }
}

/// Elements where `got` differs from `want`: none allowed, except that a NaN may carry another
/// payload where the contract allows it (sums and products; f16 narrowing).
fn mismatches(d: DataType, op: ReduceOp, got: &[u8], want: &[u8]) -> Vec<usize> {
    let s = d.size();
    let payload_free = matches!(op, ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Avg) || d == DataType::F16;
    (0..want.len() / s)
        .filter(|&i| {
            let (g, w) = (&got[i * s..(i + 1) * s], &want[i * s..(i + 1) * s]);
            g != w && !(payload_free && is_nan(d, g) && is_nan(d, w))
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn every_kernel_on_the_device_gives_the_cpu_kernels_bits() {
    const TEST: &str = "every_kernel_on_the_device_gives_the_cpu_kernels_bits";
    gpu::driver_available().expect("this test needs a CUDA driver");
    let Some(ptx) = ptx(TEST) else { panic!("{TEST}: no NVRTC and no TOROID_GPU_PTX") };
    let k = DeviceKernels::new(0, &ptx).expect("kernels load on device 0");
    let stream = k.stream().clone();
    let mut checked = 0usize;
    for &d in &kernels::TYPES {
        let s = d.size();
        let ops: Vec<ReduceOp> =
            kernels::OPS.iter().copied().chain(d.is_float().then_some(ReduceOp::Avg)).collect();
        for op in ops {
            for (count, skew) in [(1usize, 0usize), (7, 1), (4099, 0), (4099, 3), ((1 << 20) + 5, 0)] {
                let seed = mix(checked as u64 + 1);
                // `skew` elements in front: pointers `skew * size` bytes off 16-byte alignment.
                let a = random(d, count + skew, seed);
                let b = random(d, count + skew, seed ^ 0xabc);
                let mut want = vec![0u8; count * s];
                let (ra, rb) = (&a[skew * s..], &b[skew * s..]);
                let factor = 1.0 / 3.0;
                match op {
                    ReduceOp::Avg => reduce::scale_into(d, &mut want, ra, factor),
                    _ => reduce::reduce_into(d, op, &mut want, ra, rb),
                }
                let da = stream.clone_htod(&a).expect("copy a");
                let db = stream.clone_htod(&b).expect("copy b");
                let mut dd = stream.alloc_zeros::<u8>(count * s + skew * s).expect("alloc");
                {
                    use cudarc::driver::{DevicePtr, DevicePtrMut};
                    let (pa, _ga) = da.device_ptr(&stream);
                    let (pb, _gb) = db.device_ptr(&stream);
                    let (pd, _gd) = dd.device_ptr_mut(&stream);
                    let off = (skew * s) as u64;
                    // SAFETY: the three allocations hold `count + skew` elements and live until
                    // the synchronisation below; `dst` overlaps neither input.
                    unsafe {
                        match op {
                            ReduceOp::Avg => k.scale_into(d, pd + off, pa + off, count, factor),
                            _ => k.reduce_into(d, op, pd + off, pa + off, pb + off, count),
                        }
                    }
                    .expect("launch");
                }
                k.synchronize().expect("synchronise");
                let got = stream.clone_dtoh(&dd).expect("copy back");
                let bad = mismatches(d, op, &got[skew * s..], &want);
                assert!(
                    bad.is_empty(),
                    "{d} {op:?} count {count} skew {skew}: {} elements differ, first at {}: got {:?} want {:?} (a {:?} b {:?})",
                    bad.len(),
                    bad[0],
                    &got[(skew + bad[0]) * s..(skew + bad[0] + 1) * s],
                    &want[bad[0] * s..(bad[0] + 1) * s],
                    &ra[bad[0] * s..(bad[0] + 1) * s],
                    &rb[bad[0] * s..(bad[0] + 1) * s],
                );
                checked += 1;
            }
        }
    }
    println!("{checked} kernel runs matched the CPU kernels");
}

#[test]
fn device_collectives_without_a_driver_are_unsupported_and_host_pointers_are_host() {
    let host = [0u8; 64];
    assert!(!staged::is_device_pointer(host.as_ptr() as u64));
    if gpu::driver_available().is_ok() {
        eprintln!("SKIPPED device_collectives_without_a_driver_...: this machine has a CUDA driver");
        return;
    }
    let e = DeviceCollectives::on_device(0).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("CUDA is not available"), "{e}");
}

/// Rank `r`'s element `i` for the staged test: exact in every type used (small integers for
/// f32, any bits for i64, which wraps).
fn staged_value(r: usize, i: usize) -> u64 {
    mix(((r as u64) << 40) ^ i as u64)
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn staged_all_reduce_and_broadcast_on_device_memory_give_the_reference() {
    gpu::driver_available().expect("this test needs a CUDA driver");
    let n = 3;
    util::run_threads(n, &util::test_config(120.0), move |comm| {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let me = comm.rank();
        let mut dc = DeviceCollectives::on_device(0).expect("device collectives");
        let stream = dc.new_stream().expect("a stream");
        // 1, a tail, and 2.6 Mi f32 = 10.4 MB: three chunks, the last partial.
        for count in [1usize, 4099, 2_600_000] {
            // f32 sum of small integers: exact in any order.
            let mine: Vec<f32> = (0..count).map(|i| (staged_value(me, i) % 1000) as f32).collect();
            let mut dev = stream.clone_htod(&mine).expect("copy in");
            let p = {
                let (p, _g) = dev.device_ptr_mut(&stream);
                p
            };
            assert_eq!(staged::device_of(p), Some(0), "a device allocation is device 0's memory");
            // SAFETY: `dev` holds `count` f32 and lives past the call.
            unsafe { dc.all_reduce(&comm, &stream, p, count, DataType::F32, ReduceOp::Sum) }
                .expect("all_reduce");
            let got = stream.clone_dtoh(&dev).expect("copy out");
            for (i, g) in got.iter().enumerate() {
                let want: f32 = (0..n).map(|r| (staged_value(r, i) % 1000) as f32).sum();
                assert_eq!(*g, want, "rank {me}: f32 sum[{i}] of {count}");
            }
            // i64 sum, wrapping.
            let mine: Vec<i64> = (0..count).map(|i| staged_value(me, i) as i64).collect();
            let mut dev = stream.clone_htod(&mine).expect("copy in");
            let p = dev.device_ptr_mut(&stream).0;
            // SAFETY: as above.
            unsafe { dc.all_reduce(&comm, &stream, p, count, DataType::I64, ReduceOp::Sum) }
                .expect("all_reduce");
            let got = stream.clone_dtoh(&dev).expect("copy out");
            for (i, g) in got.iter().enumerate() {
                let want = (0..n).fold(0i64, |s, r| s.wrapping_add(staged_value(r, i) as i64));
                assert_eq!(*g, want, "rank {me}: i64 sum[{i}] of {count}");
            }
            // f64 broadcast from the last rank.
            let mine: Vec<f64> =
                (0..count).map(|i| if me == n - 1 { staged_value(me, i) as f64 } else { -1.0 }).collect();
            let dev = stream.clone_htod(&mine).expect("copy in");
            let p = dev.device_ptr(&stream).0;
            // SAFETY: as above.
            unsafe { dc.broadcast(&comm, &stream, p, count, DataType::F64, n - 1) }.expect("broadcast");
            let got = stream.clone_dtoh(&dev).expect("copy out");
            assert!(
                got.iter().enumerate().all(|(i, g)| *g == staged_value(n - 1, i) as f64),
                "rank {me}: broadcast of {count}"
            );
        }
        if me == 0 {
            println!(
                "staged all_reduce (f32, i64) and broadcast (f64) on device memory matched on {n} ranks"
            );
        }
    });
}

/// `count` elements of `d` for rank `r` whose sums, products (i32/u8 wrap), minima and maxima
/// are exact in every order: small integers for the float types, any bits for the integers.
fn exact_values(d: DataType, count: usize, r: usize, seed: u64) -> Vec<u8> {
    let s = d.size();
    let mut out = vec![0u8; count * s];
    for (i, e) in out.chunks_exact_mut(s).enumerate() {
        let h = mix(seed ^ ((r as u64) << 48) ^ i as u64);
        let small = (h % 101) as i64 - 50; // -50..=50: a product of 3 is exact in f32 and f64
        match d {
            DataType::F32 => e.copy_from_slice(&(small as f32).to_ne_bytes()),
            DataType::F64 => e.copy_from_slice(&(small as f64).to_ne_bytes()),
            DataType::F16 => e.copy_from_slice(&half::f16::from_f32(small as f32).to_bits().to_ne_bytes()),
            DataType::BF16 => e.copy_from_slice(&half::bf16::from_f32(small as f32).to_bits().to_ne_bytes()),
            _ => e.copy_from_slice(&h.to_ne_bytes()[..s]),
        }
    }
    out
}

/// The all-reduce of `inputs` (one per rank) with `op`, reduced here on the CPU in rank order
/// (avg: the sum scaled by 1/n, as the kernels do).
fn reference(d: DataType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let kernel_op = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        let prev = acc.clone();
        reduce::reduce_into(d, kernel_op, &mut acc, &prev, x);
    }
    if op == ReduceOp::Avg {
        let sum = acc.clone();
        reduce::scale_into(d, &mut acc, &sum, 1.0 / inputs.len() as f64);
    }
    acc
}

/// Elements of an average of 3 inputs in -50..=50 (so |value| <= 50) more than 8 epsilon x 50
/// from the reference (f32 and f64 only).
fn avg_outside_tolerance(d: DataType, got: &[u8], want: &[u8]) -> Vec<usize> {
    let (s, eps) = match d {
        DataType::F32 => (4, f32::EPSILON as f64),
        DataType::F64 => (8, f64::EPSILON),
        _ => panic!("avg tolerance for {d}"),
    };
    let val = |e: &[u8]| {
        if s == 4 {
            f32::from_ne_bytes(e.try_into().unwrap()) as f64
        } else {
            f64::from_ne_bytes(e.try_into().unwrap())
        }
    };
    (0..want.len() / s)
        .filter(|&i| {
            (val(&got[i * s..(i + 1) * s]) - val(&want[i * s..(i + 1) * s])).abs() > 8.0 * eps * 50.0
        })
        .collect()
}

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
