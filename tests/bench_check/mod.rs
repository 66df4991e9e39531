//! Shared by `tests/bench_cli.rs` and `tests/launchers.rs`: runs a job (a launcher starting
//! `toroid-bench`) bounded in time, killing it and everything it started on timeout or when the
//! test fails, and checks the benchmark's nccl-tests output row by row.

#![allow(dead_code)]

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use toroid::internals::sys::process;

pub const BENCH: &str = env!("CARGO_BIN_EXE_toroid-bench");
pub const TOROID_RUN: &str = env!("CARGO_BIN_EXE_toroid-run");

/// A temporary directory, removed on drop (also when the test panics).
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("toroid-{tag}-{}-{nanos}", std::process::id()));
        fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Sends `sig` to process group `pgid` (ESRCH, no such group, is fine; the project's own
/// `sys::process::kill_group` refuses group 0, which would be the test's own group).
pub fn kill_group(pgid: u32, sig: process::Signal) {
    let _ = process::kill_group(pgid, sig);
}

/// A child started in its own process group. Dropping it stops the group: SIGTERM (launchers
/// stop what they started), then SIGKILL after `grace`.
pub struct Group {
    pub child: Child,
    pub name: String,
    grace: Duration,
    reaped: bool,
}

impl Group {
    /// Starts `cmd` as the leader of a new process group, stdin closed.
    pub fn spawn(name: &str, cmd: &mut Command) -> Group {
        cmd.stdin(Stdio::null()).process_group(0);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Group { child, name: name.to_string(), grace: Duration::from_secs(5), reaped: false }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status if it has exited (then it is reaped).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        let s = self.child.try_wait().unwrap_or_else(|e| panic!("wait for {}: {e}", self.name));
        if s.is_some() {
            self.reaped = true;
            // Whatever it left in its group goes with it.
            kill_group(self.child.id(), process::SIGKILL);
        }
        s
    }

    /// Waits until it exits or `deadline` passes (then None; it is still running).
    pub fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM to the group, SIGKILL to it after the grace period; reaps the leader.
    pub fn stop(&mut self) {
        if self.reaped {
            return;
        }
        kill_group(self.child.id(), process::SIGTERM);
        if self.wait_until(Instant::now() + self.grace).is_none() {
            kill_group(self.child.id(), process::SIGKILL);
            let _ = self.child.kill();
            let _ = self.child.wait();
            self.reaped = true;
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A finished job.
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    /// Both streams, for failure messages.
    pub fn show(&self) -> String {
        format!("status {}\n--- stdout\n{}\n--- stderr\n{}", self.status, self.stdout, self.stderr)
    }
}

/// Runs `cmd` in its own process group with stdout and stderr in files of `dir`; after `limit`
/// the group is stopped and the test fails naming `what` and showing the output so far.
pub fn run_bounded(what: &str, cmd: &mut Command, dir: &TempDir, limit: Duration) -> Finished {
    let tag: String = what.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let (out, err) = (dir.join(&format!("{tag}.out")), dir.join(&format!("{tag}.err")));
    cmd.stdout(fs::File::create(&out).expect("create stdout file"));
    cmd.stderr(fs::File::create(&err).expect("create stderr file"));
    let mut job = Group::spawn(what, cmd);
    let status = job.wait_until(Instant::now() + limit);
    if status.is_none() {
        job.stop();
    }
    let stdout = fs::read_to_string(&out).unwrap_or_default();
    let stderr = fs::read_to_string(&err).unwrap_or_default();
    match status {
        Some(status) => Finished { status, stdout, stderr },
        None => panic!(
            "{what}: still running after {limit:?}; stopped\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        ),
    }
}

/// Removes from `cmd`'s environment every launcher variable this process has, so that a test
/// run inside a launcher (or with TOROID_* set) starts its jobs clean.
pub fn clean_launcher_env(cmd: &mut Command) -> &mut Command {
    const EXACT: &[&str] =
        &["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"];
    const PREFIXES: &[&str] = &["TOROID_", "SLURM_", "OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "TORCHELASTIC_"];
    for (k, _) in std::env::vars_os() {
        let Some(k) = k.to_str() else { continue };
        if EXACT.contains(&k) || PREFIXES.iter().any(|p| k.starts_with(p)) {
            cmd.env_remove(k);
        }
    }
    // A rank that loses its peers gives up after a minute instead of TOROID_TIMEOUT's 300 s.
    cmd.env("TOROID_TIMEOUT", "60")
}

/// One result row of toroid-bench.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub size: usize,
    pub count: usize,
    pub dtype: String,
    pub redop: String,
    pub root: String,
    /// Out of place, then in place: (time us, algbw, busbw, #wrong).
    pub results: [(f64, f64, f64, String); 2],
    pub algorithm: String,
}

/// Strips a launcher's line prefix such as `[0]: ` or `[default0]:`.
fn strip_prefix(line: &str) -> &str {
    if line.starts_with('[')
        && let Some(end) = line.find("]:")
    {
        return line[end + 2..].trim_start();
    }
    line
}

/// The result rows of toroid-bench's output (every line that is not a comment and starts with
/// a number).
pub fn rows(stdout: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    for line in stdout.lines().map(strip_prefix) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if line.starts_with('#') || f.first().and_then(|s| s.parse::<usize>().ok()).is_none() {
            continue;
        }
        assert!(f.len() >= 14, "result row with {} fields: {line}", f.len());
        let num = |i: usize| -> f64 {
            f[i].parse().unwrap_or_else(|_| panic!("field {i} '{}' is not a number: {line}", f[i]))
        };
        let part = |i: usize| (num(i), num(i + 1), num(i + 2), f[i + 3].to_string());
        rows.push(Row {
            size: f[0].parse().unwrap(),
            count: f[1].parse().unwrap_or_else(|_| panic!("count '{}': {line}", f[1])),
            dtype: f[2].into(),
            redop: f[3].into(),
            root: f[4].into(),
            results: [part(5), part(9)],
            algorithm: f[13].into(),
        });
    }
    rows
}

/// What a toroid-bench run of float sums should print: one row per (size, count).
pub struct Expect<'a> {
    pub ranks: usize,
    pub redop: &'a str,
    pub root: &'a str,
    pub rows: Vec<(usize, usize)>,
}

/// Sizes and counts (nccl-tests' convention) of a float run over `sizes` bytes on `n` ranks.
pub fn float_rows(collective: &str, n: usize, sizes: &[usize]) -> Vec<(usize, usize)> {
    sizes
        .iter()
        .map(|&b| {
            let elems = b / 4;
            match collective {
                "reduce_scatter" | "all_gather" | "all_to_all" => {
                    let total = elems - elems % n;
                    (total * 4, total / n)
                }
                _ => (b, elems),
            }
        })
        .collect()
}

/// Asserts that `job` succeeded and printed exactly the expected rows, every one with
/// `#wrong` 0 out of place and in place, then returns them.
pub fn assert_bench_ok(what: &str, job: &Finished, want: &Expect) -> Vec<Row> {
    assert!(job.status.success(), "{what} failed: {}", job.show());
    let header = format!("# nRanks {} ", want.ranks);
    assert!(
        job.stdout.lines().map(strip_prefix).any(|l| l.starts_with(&header)),
        "{what}: no '{header}' line: {}",
        job.show()
    );
    let got = rows(&job.stdout);
    let sizes: Vec<(usize, usize)> = got.iter().map(|r| (r.size, r.count)).collect();
    assert_eq!(sizes, want.rows, "{what}: (size, count) of the rows: {}", job.show());
    for r in &got {
        assert_eq!(
            (r.dtype.as_str(), r.redop.as_str(), r.root.as_str()),
            ("float", want.redop, want.root),
            "{what}: {r:?}"
        );
        for (t, algbw, busbw, wrong) in &r.results {
            assert_eq!(wrong, "0", "{what}: wrong values in {r:?}: {}", job.show());
            assert!(t.is_finite() && *t > 0.0, "{what}: time {t} in {r:?}");
            assert!(
                algbw.is_finite() && *algbw >= 0.0 && busbw.is_finite() && *busbw >= 0.0,
                "{what}: {r:?}"
            );
        }
        assert!(!r.algorithm.is_empty());
    }
    assert!(
        job.stdout.lines().map(strip_prefix).any(|l| l == "# Out of bounds values : 0 OK"),
        "{what}: no '# Out of bounds values : 0 OK': {}",
        job.show()
    );
    got
}
