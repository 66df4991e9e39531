//! `--setup`: what set-up cost this rank (wall and CPU time, sockets, memory), printed as one
//! `SETUP` line after a first checked all-reduce.

use std::time::{Duration, Instant};

use toroid::{CallOptions, Communicator, ReduceOp};

/// `--setup`: one float sum all-reduce after set-up, checked, and this rank's `SETUP` line.
pub(crate) fn setup_report(
    comm: &Communicator,
    started_unix: f64,
    setup: Duration,
    setup_cpu: f64,
    bytes: usize,
    opts: CallOptions,
) -> toroid::Result<u64> {
    let (n, me) = (comm.size(), comm.rank());
    let count = (bytes / 4).max(1);
    let mut recv: Vec<f32> = (0..count).map(|i| ((me + i) % 7) as f32).collect();
    let t = Instant::now();
    comm.all_reduce_with(&mut recv, ReduceOp::Sum, opts)?;
    let first = t.elapsed();
    let ready_unix = unix_ms();
    let wrong =
        (0..count).filter(|&i| recv[i] != (0..n).map(|r| ((r + i) % 7) as f32).sum::<f32>()).count() as u64;
    let sockets = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    println!(
        "SETUP rank={me} size={n} start_unix_ms={started_unix:.3} ready_unix_ms={ready_unix:.3} setup_cpu_ms={setup_cpu:.3} cpu_ms={:.3} setup_ms={:.3} first_ms={:.3} peers={} sockets={sockets} rss_kb={} hwm_kb={} wrong={wrong}",
        cpu_ms(),
        setup.as_secs_f64() * 1e3,
        first.as_secs_f64() * 1e3,
        comm.connected_peers().len(),
        kb("VmRSS:"),
        kb("VmHWM:"),
    );
    Ok(wrong)
}

/// Milliseconds since the Unix epoch (the ranks of one host share the clock).
pub(crate) fn unix_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// CPU time (user and system, every thread) this process used so far, in milliseconds.
pub(crate) fn cpu_ms() -> f64 {
    toroid::internals::sys::cpu::process_cpu_time().map_or(0.0, |d| d.as_secs_f64() * 1e3)
}
