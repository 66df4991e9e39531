//! Helpers for integration tests: ranks as threads or as real processes, random data and an
//! independent reference (f64 for floats, wrapping i128 for integers).

#![allow(dead_code)]

pub mod cases;
pub mod data;

use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use toroid::rendezvous::{MemStore, Store};
use toroid::{Communicator, Config};

/// Set in the environment of ranks started by [`launch`]; the test function then runs its
/// rank body instead of spawning.
pub const CHILD_VAR: &str = "TOROID_TEST_CHILD";

/// True inside a rank process started by [`launch`] or [`spawn_ranks`].
pub fn is_child() -> bool {
    std::env::var_os(CHILD_VAR).is_some()
}

/// A configuration for tests: short timeout unless given.
pub fn test_config(timeout_s: f64) -> Config {
    Config { timeout: Duration::from_secs_f64(timeout_s), ..Config::default() }
}

/// Runs `body` on `n` ranks that are threads of this process, each with its own communicator.
pub fn run_threads<F>(n: usize, cfg: &Config, body: F)
where
    F: Fn(Communicator) + Send + Sync + 'static,
{
    let cfg = cfg.clone();
    run_threads_with(n, move |_| cfg.clone(), body)
}

/// As [`run_threads`], with a configuration per rank (host identities, torus shapes).
pub fn run_threads_with<C, F>(n: usize, cfg_of: C, body: F)
where
    C: Fn(usize) -> Config,
    F: Fn(Communicator) + Send + Sync + 'static,
{
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let body = Arc::new(body);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let store = store.clone();
            let body = body.clone();
            let cfg = cfg_of(r);
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .spawn(move || {
                    let comm = Communicator::with_store(r, n, store, &cfg).expect("communicator");
                    body(comm);
                })
                .unwrap()
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        if let Err(e) = h.join() {
            std::panic::resume_unwind(Box::new(format!("rank {r} panicked: {e:?}")));
        }
    }
}

/// Re-runs the test `test_name` of this test binary as `n` rank processes under `toroid-run`
/// (which prefixes their output and stops them all when one fails), bounded by `timeout_s`.
pub fn launch(test_name: &str, n: usize, env: &[(&str, &str)], timeout_s: u64) -> Output {
    launch_with(test_name, n, &[], env, timeout_s)
}

/// As [`launch`], with extra `toroid-run` options (`--emulate-hosts H`).
pub fn launch_with(test_name: &str, n: usize, opts: &[&str], env: &[(&str, &str)], timeout_s: u64) -> Output {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_toroid-run"));
    cmd.arg("-n").arg(n.to_string()).arg("--timeout").arg(timeout_s.to_string()).arg("--grace").arg("2");
    cmd.args(opts);
    cmd.arg("--env").arg(format!("{CHILD_VAR}=1"));
    for (k, v) in env {
        cmd.arg("--env").arg(format!("{k}={v}"));
    }
    cmd.arg("--").arg(exe).args(["--exact", test_name, "--nocapture", "--test-threads=1"]);
    cmd.stdin(Stdio::null());
    cmd.output().expect("toroid-run starts")
}

/// Asserts that a launched job succeeded, showing its output when it did not.
pub fn assert_success(out: &Output, what: &str) {
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A free TCP port on loopback (bind, read, close).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts `n` rank processes of test `test_name` directly (no launcher), so that a test can
/// watch each one; `env_of(rank)` adds per-rank variables.
pub fn spawn_ranks(test_name: &str, n: usize, env_of: impl Fn(usize) -> Vec<(String, String)>) -> Vec<Child> {
    let exe = std::env::current_exe().unwrap();
    let port = free_port();
    (0..n)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args(["--exact", test_name, "--nocapture", "--test-threads=1"])
                .env(CHILD_VAR, "1")
                .env("TOROID_RANK", r.to_string())
                .env("TOROID_WORLD_SIZE", n.to_string())
                .env("TOROID_STORE_ADDR", format!("127.0.0.1:{port}"))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env_of(r) {
                cmd.env(k, v);
            }
            cmd.spawn().expect("spawn rank")
        })
        .collect()
}

/// Waits for `child` until `deadline`; kills it if it is still running then.
pub fn wait_until(child: &mut Child, deadline: Instant) -> Option<std::process::ExitStatus> {
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for every child until `deadline` (killing those still running then), and returns each
/// one's exit status (`None`: killed at the deadline) and its stdout and stderr together.
pub fn wait_all(
    children: Vec<Child>,
    deadline: Instant,
) -> (Vec<Option<std::process::ExitStatus>>, Vec<String>) {
    children
        .into_iter()
        .map(|mut c| {
            let status = wait_until(&mut c, deadline);
            let o = c.wait_with_output().unwrap();
            (status, format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
        })
        .unzip()
}

/// The first `ERROR <kind> after <ms> ms: ...` line a rank printed (from `ERROR` on), and its
/// milliseconds.
pub fn error_line(out: &str) -> Option<(&str, u64)> {
    let line = out.lines().find_map(|l| l.find("ERROR ").map(|i| &l[i..]))?;
    let ms = line.split(" after ").nth(1)?.split(' ').next()?.parse().ok()?;
    Some((line, ms))
}

/// True while a process with this pid exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

/// True while the process with this pid is stopped (`SIGSTOP`: state `T`).
pub fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(')').next().unwrap_or("").trim_start().starts_with('T'))
}

/// SIGKILLs this process after `delay`, from a thread of its own (a rank dying mid-operation).
pub fn kill_self_after(delay: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        // SAFETY: kill(2) on our own pid; no memory is involved.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    });
}

/// All-reduces a buffer of `elems` floats in a loop until a call fails (within 60 s); returns
/// the error and the milliseconds it took to come.
pub fn all_reduce_until_error(comm: &Communicator, elems: usize) -> (toroid::Error, u128) {
    let mut buf = vec![1.0f32; elems];
    let start = Instant::now();
    loop {
        if let Err(e) = comm.all_reduce(&mut buf, toroid::ReduceOp::Sum) {
            return (e, start.elapsed().as_millis());
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no error within 60 s");
    }
}

/// A barrier as a raw operation (what `submit_raw_with_hooks` queues around hooks in tests).
pub fn barrier_op() -> toroid::internals::comm::RawOp {
    toroid::internals::comm::RawOp {
        kind: toroid::OpKind::Barrier,
        dtype: toroid::DataType::U8,
        bufs: toroid::internals::memory::RawBufs::None,
        opts: toroid::CallOptions::default(),
        source: None,
        splits: None,
        batch: None,
    }
}
