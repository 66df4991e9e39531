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

use toroid::internals::gpu::staged::{self, DeviceCollectives};
use toroid::internals::gpu::{self, device::DeviceKernels, kernels, ordered_kernels};
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
    // The stream-ordered kernels: a module of their own (loaded only on that path).
    let ordered = gpu::compile(&ordered_kernels::source()).expect("every stream-ordered kernel compiles");
    for name in ordered_kernels::names() {
        assert!(ordered.contains(&format!(".entry {name}(")), "{name} missing from the PTX");
    }
    println!(
        "{} stream-ordered kernels compiled to {} bytes of PTX",
        ordered_kernels::names().len(),
        ordered.len()
    );
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

// The stream entry points on 3 ranks (need a GPU).
#[path = "gpu/stream.rs"]
mod stream;
