//! `toroid-train`: see `toroid-train --help`.

use clap::Parser;

fn main() {
    let args = toroid_train::cli::Args::parse();
    // candle sizes its thread pools from the number of physical cores, ignoring the CPU affinity
    // that launchers (toroid-run, mpirun, Slurm) give each rank; two ranks bound to one core each
    // would then run two spinning threads per core, which measured 40% slower than one. Use the
    // CPUs this process may run on, unless the user chose (--threads or the variables).
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"] {
        if args.threads.is_some() || std::env::var_os(var).is_none() {
            // SAFETY: no other thread exists yet (nothing has been spawned before this point), so
            // nothing can read the environment concurrently.
            unsafe { std::env::set_var(var, threads.to_string()) };
        }
    }
    if let Some(path) = &args.timeline {
        // SAFETY: as above, no other thread exists yet.
        unsafe { std::env::set_var("TOROID_TIMELINE", path) };
    }
    if let Err(e) = toroid_train::train::run(args) {
        eprintln!("toroid-train: error: {e}");
        std::process::exit(1);
    }
}
