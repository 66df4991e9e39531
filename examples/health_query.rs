//! The health query at scale, timed: `toroid-run -n N` starts N ranks of this program, which
//! all-reduce in a loop with one rank (the straggler) sleeping before every call; then
//! `toroid-run --status` is asked, from outside, K times in each of three states of the job:
//! running (the straggler must rank first, the job healthy), stuck (the straggler skipped a
//! collective a second ago: it must be named, and rank first), and stopped (the straggler gets SIGSTOP: it
//! must be reported stopped). Prints, per state, the verdict checks and the query's time as
//! `toroid-run --status` measured it (median and worst) and as this program saw the command
//! (process start included).
//!
//! ```text
//! cargo build --release --bin toroid-run --example health_query
//! target/release/examples/health_query [RANKS (64)] [QUERIES (20)]
//! ```

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use toroid::{Communicator, ReduceOp};

const ROLE: &str = "HEALTH_QUERY_ROLE";
const STRAGGLER: usize = 5;
const SLOW_MS: u64 = 10;

fn main() {
    if std::env::var(ROLE).as_deref() == Ok("rank") {
        return rank_body();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(64);
    let k: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20);
    assert!(n > STRAGGLER, "RANKS must be above {STRAGGLER}");
    orchestrate(n, k);
}

/// The file whose existence makes the straggler skip its next collective.
fn skip_flag() -> PathBuf {
    std::env::temp_dir()
        .join(format!("toroid-health-query-skip-{}", std::env::var("HEALTH_QUERY_ID").unwrap_or_default()))
}

fn rank_body() {
    let comm = Communicator::from_env().expect("communicator");
    let mut buf = vec![1.0f32; 256];
    let flag = skip_flag();
    loop {
        if comm.rank() == STRAGGLER {
            std::thread::sleep(Duration::from_millis(SLOW_MS));
            if flag.exists() {
                // Skips the collective: the others wait in it until the job is ended.
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        if comm.all_reduce(&mut buf, ReduceOp::Sum).is_err() {
            std::thread::sleep(Duration::from_secs(3600));
        }
        buf.fill(1.0);
    }
}

fn toroid_run() -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    exe.parent().and_then(|d| d.parent()).map(|d| d.join("toroid-run")).expect("target directory")
}

/// Runs `toroid-run --status PID` once: its exit code, its document and the command's time.
fn ask(pid: u32) -> (i32, serde_json::Value, f64) {
    let t = Instant::now();
    let out = Command::new(toroid_run())
        .args(["--status", &pid.to_string()])
        .output()
        .expect("toroid-run --status");
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let doc = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), doc, ms)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn orchestrate(n: usize, k: usize) {
    let id = std::process::id().to_string();
    let _ = std::fs::remove_file(skip_flag_for(&id));
    let mut job: Child = Command::new(toroid_run())
        .args(["-n", &n.to_string(), "--timeout", "600", "--env", &format!("{ROLE}=rank"), "--env"])
        .arg(format!("HEALTH_QUERY_ID={id}"))
        .args(["--env", "TOROID_TIMEOUT=300", "--"])
        .arg(std::env::current_exe().expect("own path"))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("toroid-run");
    let pid = job.id();
    // Until every rank's entry is there and the job has run a while.
    let t = Instant::now();
    loop {
        let (_, doc, _) = ask(pid);
        let size = doc["communicators"][0]["size"].as_u64().unwrap_or(0) as usize;
        let done = doc["communicators"][0]["ranks"][0]["completed"].as_u64().unwrap_or(0);
        if size == n && done >= 40 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "the job did not start: {doc:#}");
        std::thread::sleep(Duration::from_millis(200));
    }
    println!(
        "{n} ranks on this host; rank {STRAGGLER} sleeps {SLOW_MS} ms before each all-reduce; {k} queries per state\n"
    );
    println!(
        "{:<9} {:>6} {:>15} {:>15} {:>16}  verdict",
        "state", "ok", "query median", "query worst", "command median"
    );
    let mut straggler_pid = 0u32;
    for state in ["running", "stuck", "stopped"] {
        match state {
            "stuck" => {
                std::fs::write(skip_flag_for(&id), b"skip").expect("flag");
                // A rank counts as behind once it is out of the collective the others wait in
                // for a second (before that it may be between two calls: `trace::report`).
                std::thread::sleep(Duration::from_millis(1200));
            }
            "stopped" => {
                // SAFETY: kill(2) on a rank of the job this program started; no memory involved.
                unsafe { libc::kill(straggler_pid as i32, libc::SIGSTOP) };
                std::thread::sleep(Duration::from_millis(200));
            }
            _ => {}
        }
        let (mut q, mut c, mut ok, mut verdict) = (Vec::new(), Vec::new(), 0, String::new());
        for _ in 0..k {
            let (code, doc, ms) = ask(pid);
            let comm = &doc["communicators"][0];
            straggler_pid = comm["ranks"][STRAGGLER]["pid"].as_u64().unwrap_or(straggler_pid as u64) as u32;
            let first = comm["stragglers"][0]["rank"].as_u64();
            let right = match state {
                "running" => code == 0 && first == Some(STRAGGLER as u64),
                "stuck" => {
                    code == 1 && first == Some(STRAGGLER as u64) && comm["ranks"][STRAGGLER]["named"] == true
                }
                _ => code == 1 && comm["ranks"][STRAGGLER]["state"] == "stopped",
            };
            ok += usize::from(right);
            if !right && std::env::var_os("HEALTH_QUERY_DEBUG").is_some() {
                eprintln!("{state}: exit {code}: {doc:#}");
            }
            verdict = comm["verdict"].as_str().unwrap_or("").to_string();
            q.push(doc["answered_ms"].as_f64().unwrap_or(f64::NAN));
            c.push(ms);
        }
        let worst = q.iter().copied().fold(0.0, f64::max);
        let v: String = verdict.chars().take(90).collect();
        println!(
            "{state:<9} {:>6} {:>12.1} ms {:>12.1} ms {:>13.1} ms  {v}",
            format!("{ok}/{k}"),
            median(q.clone()),
            worst,
            median(c.clone())
        );
    }
    // SAFETY: as above: the launcher this program started (it stops its ranks).
    unsafe { libc::kill(straggler_pid as i32, libc::SIGCONT) };
    // SAFETY: as above.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let _ = job.wait();
    let _ = std::fs::remove_file(skip_flag_for(&id));
}

fn skip_flag_for(id: &str) -> PathBuf {
    std::env::temp_dir().join(format!("toroid-health-query-skip-{id}"))
}
