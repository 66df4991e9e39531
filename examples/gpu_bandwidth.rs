//! Device reduction kernels against the device's own copy bandwidth, nccl-tests style:
//!
//!     cargo run --release --example gpu_bandwidth [MiB]
//!
//! For f32, bf16 and f64 sums (and the f32 scale `avg` uses), out of place on buffers of MiB
//! mebibytes (default 256), the best of 20 timed runs with CUDA events; "GB/s" counts the bytes
//! each kernel reads and writes (3 x the buffer for a reduction, 2 x for a scale and for the copy),
//! and "of copy" is that against a device-to-device `cuMemcpy` of the same buffer. The PTX comes
//! from `TOROID_GPU_PTX` (compiled elsewhere) or NVRTC (`TOROID_NVRTC_PATH`).
#[cfg(feature = "cuda")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    use toroid::internals::gpu::device::DeviceKernels;
    use toroid::{DataType, ReduceOp};

    let mib: usize = std::env::args().nth(1).map_or(Ok(256), |a| a.parse())?;
    let bytes = mib << 20;
    let ptx = match std::env::var_os("TOROID_GPU_PTX") {
        Some(p) => std::fs::read_to_string(p)?,
        None => toroid::internals::gpu::ptx()?.to_string(),
    };
    let k = DeviceKernels::new(0, &ptx)?;
    let stream = k.stream().clone();
    let a = stream.alloc_zeros::<u8>(bytes)?;
    let b = stream.alloc_zeros::<u8>(bytes)?;
    let mut d = stream.alloc_zeros::<u8>(bytes)?;
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    // Best of 20 (after 3 untimed) of `f`, in seconds.
    let best = |f: &mut dyn FnMut() -> Result<(), Box<dyn std::error::Error>>| -> Result<f64, Box<dyn std::error::Error>> {
        let mut t = f64::INFINITY;
        for i in 0..23 {
            let start = stream.record_event(timing)?;
            f()?;
            let end = stream.record_event(timing)?;
            let ms = start.elapsed_ms(&end)? as f64;
            if i >= 3 {
                t = t.min(ms / 1e3);
            }
        }
        Ok(t)
    };
    let copy = best(&mut || {
        stream.memcpy_dtod(&a, &mut d)?;
        Ok(())
    })?;
    let copy_bw = 2.0 * bytes as f64 / copy / 1e9;
    println!("# {mib} MiB buffers on device 0");
    println!("{:>22} {:>10} {:>9} {:>8}", "kernel", "time us", "GB/s", "of copy");
    println!("{:>22} {:>10.1} {:>9.1} {:>8}", "memcpy dtod", copy * 1e6, copy_bw, "1.00");
    let (pa, pb, pd) = {
        let (pa, _g1) = a.device_ptr(&stream);
        let (pb, _g2) = b.device_ptr(&stream);
        let (pd, _g3) = d.device_ptr_mut(&stream);
        (pa, pb, pd)
    };
    for (dt, op, name) in [
        (DataType::F32, Some(ReduceOp::Sum), "sum float"),
        (DataType::BF16, Some(ReduceOp::Sum), "sum bfloat16"),
        (DataType::F16, Some(ReduceOp::Max), "max half"),
        (DataType::F64, Some(ReduceOp::Sum), "sum double"),
        (DataType::I32, Some(ReduceOp::Prod), "prod int32"),
        (DataType::F32, None, "scale float (avg)"),
    ] {
        let count = bytes / dt.size();
        let t = best(&mut || {
            // SAFETY: three live allocations of `bytes` bytes each, not freed before the
            // events are waited on; `pd` overlaps neither input.
            unsafe {
                match op {
                    Some(op) => k.reduce_into(dt, op, pd, pa, pb, count)?,
                    None => k.scale_into(dt, pd, pa, count, 0.5)?,
                }
            }
            Ok(())
        })?;
        let moved = if op.is_some() { 3.0 } else { 2.0 } * bytes as f64;
        let bw = moved / t / 1e9;
        println!("{name:>22} {:>10.1} {bw:>9.1} {:>8.2}", t * 1e6, bw / copy_bw);
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("built without the `cuda` feature");
}
