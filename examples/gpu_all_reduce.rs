//! All-reduce on device memory, nccl-tests columns: ranks as processes under the launcher,
//!
//!     toroid-run -n 2 target/release/examples/gpu_all_reduce [max MiB]
//!
//! or as threads of one process (one CUDA context: no time slicing between the contexts of
//! several processes on one GPU), `gpu_all_reduce [max MiB] --threads N`. `TOROID_CUDA_IPC=0`
//! for the staged path. Each rank all-reduces (sum, f32, out of place) buffers of 1 MiB up to
//! max MiB (default 256) on device 0 through the C entry points' path
//! (`gpu::stream::on_stream`, on a stream of its own); rank 0 prints, per size, the mean time
//! of 10 calls after 3 untimed ones (host clock: the calls are blocking), the algorithm
//! bandwidth (bytes / time) and the bus bandwidth (x 2(n-1)/n, as nccl-tests), and the path
//! taken. The first element of the result is checked against the sum of every rank's. The PTX
//! comes from NVRTC (`TOROID_NVRTC_PATH`).
#[cfg(feature = "cuda")]
fn rank_main(
    comm: toroid::Communicator,
    max_mib: usize,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    use toroid::internals::gpu::stream;
    use toroid::{DataType, OpKind, ReduceOp};

    let (me, n) = (comm.rank(), comm.size());
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let s = ctx.new_stream()?;
    let raw = s.cu_stream() as *mut std::ffi::c_void;
    if me == 0 {
        println!("# {n} ranks, f32 sum out of place on device 0");
        println!(
            "{:>12} {:>12} {:>10} {:>9} {:>9}  path",
            "size (B)", "count", "time (us)", "algbw", "busbw"
        );
    }
    let mut mib = 1;
    while mib <= max_mib {
        let count = (mib << 20) / 4;
        let send = s.clone_htod(&vec![(me + 1) as f32; count])?;
        let mut recv = s.alloc_zeros::<f32>(count)?;
        let (ps, pr) = (send.device_ptr(&s).0, recv.device_ptr_mut(&s).0);
        let run = || {
            // SAFETY: both allocations hold `count` f32 and live past the call.
            unsafe {
                stream::on_stream(&comm, OpKind::AllReduce(ReduceOp::Sum), ps, pr, count, DataType::F32, raw)
            }
        };
        for _ in 0..3 {
            run()?;
        }
        comm.barrier()?;
        let t0 = std::time::Instant::now();
        for _ in 0..10 {
            run()?;
        }
        let t = t0.elapsed().as_secs_f64() / 10.0;
        let first = s.clone_dtoh(&recv.slice(0..1))?[0];
        let want = (n * (n + 1) / 2) as f32;
        if first != want {
            return Err(format!("rank {me}: result {first}, expected {want}").into());
        }
        if me == 0 {
            let bytes = (count * 4) as f64;
            let algbw = bytes / t / 1e9;
            println!(
                "{:>12} {count:>12} {:>10.1} {algbw:>9.2} {:>9.2}  {:?}",
                count * 4,
                t * 1e6,
                algbw * 2.0 * (n - 1) as f64 / n as f64,
                stream::path(&comm).ok_or("no path")?
            );
        }
        comm.barrier()?;
        mib *= 4;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let max_mib: usize = args.first().map_or(Ok(256), |a| a.parse())?;
    let threads = match args.iter().position(|a| a == "--threads") {
        Some(i) => Some(args.get(i + 1).ok_or("--threads N")?.parse::<usize>()?),
        None => None,
    };
    let Some(n) = threads else {
        return rank_main(toroid::Communicator::from_env()?, max_mib);
    };
    let cfg = toroid::Config::global()?.clone();
    let store: std::sync::Arc<dyn toroid::rendezvous::Store> =
        std::sync::Arc::new(toroid::rendezvous::MemStore::new());
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let (store, cfg) = (store.clone(), cfg.clone());
            std::thread::spawn(move || {
                rank_main(toroid::Communicator::with_store(r, n, store, &cfg)?, max_mib)
            })
        })
        .collect();
    for r in ranks {
        r.join().map_err(|_| "a rank panicked")??;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("built without the `cuda` feature");
}
