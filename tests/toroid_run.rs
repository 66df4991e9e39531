//! Integration tests of the `toroid-run` launcher, with `sh -c '...'` programs as ranks.
//!
//! Every launcher run is bounded (killed and failed after `LIMIT`); output goes to files in a
//! temporary directory that is removed at the end of each test.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const BIN: &str = env!("CARGO_BIN_EXE_toroid-run");
/// Upper bound on any launcher run in these tests.
const LIMIT: Duration = Duration::from_secs(20);

/// A temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!("toroid-run-{name}-{}-{nanos}", std::process::id()));
        fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The launcher's result.
struct Run {
    code: Option<i32>,
    stdout: Vec<u8>,
    stderr: String,
    elapsed: Duration,
}

/// Starts the launcher with stdout and stderr going to files in `dir`.
fn start(dir: &TempDir, args: &[&str]) -> Child {
    let out = fs::File::create(dir.path("launcher.out")).expect("create stdout file");
    let err = fs::File::create(dir.path("launcher.err")).expect("create stderr file");
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("start toroid-run")
}

/// Waits for the launcher (killing it and failing after `LIMIT`) and collects its output.
fn finish(dir: &TempDir, mut child: Child, started: Instant) -> Run {
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for toroid-run") {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("toroid-run still running after {LIMIT:?}");
        }
        thread::sleep(Duration::from_millis(10));
    };
    Run {
        code: status.code(),
        stdout: fs::read(dir.path("launcher.out")).expect("read stdout"),
        stderr: fs::read_to_string(dir.path("launcher.err")).expect("read stderr"),
        elapsed: started.elapsed(),
    }
}

fn run(dir: &TempDir, args: &[&str]) -> Run {
    let started = Instant::now();
    finish(dir, start(dir, args), started)
}

fn stdout_lines(run: &Run) -> Vec<String> {
    String::from_utf8_lossy(&run.stdout).lines().map(str::to_string).collect()
}

/// Splits `[r]: rest` into (r, rest).
fn split_prefix(line: &str) -> (usize, &str) {
    let (rank, rest) = line
        .strip_prefix('[')
        .and_then(|l| l.split_once("]: "))
        .unwrap_or_else(|| panic!("line without a rank prefix: {line:?}"));
    (rank.parse().expect("rank number"), rest)
}

/// `key=value` words of a line.
fn fields(rest: &str) -> BTreeMap<&str, &str> {
    rest.split_whitespace().filter_map(|w| w.split_once('=')).collect()
}

/// True when `pid` names a live process (a zombie counts as gone: it waits only to be reaped).
fn alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks that the process exists.
    let exists = unsafe { libc::kill(pid, 0) } == 0;
    let zombie = fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(true);
    exists && !zombie
}

/// Asserts that every pid is gone within a few seconds (signals are delivered asynchronously).
/// PID reuse within these few seconds is not a practical concern.
fn assert_all_gone(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|&p| alive(p)) {
        let left: Vec<_> = pids.iter().filter(|&&p| alive(p)).collect();
        assert!(Instant::now() < deadline, "still running: {left:?}");
        thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `dir` holds `n` files named `prefix*` (written by the ranks), then reads the pids.
fn wait_for_pids(dir: &TempDir, prefix: &str, n: usize) -> Vec<i32> {
    let deadline = Instant::now() + LIMIT;
    loop {
        let pids: Vec<i32> = fs::read_dir(&dir.0)
            .expect("read temp dir")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
            .filter_map(|e| fs::read_to_string(e.path()).ok()?.trim().parse().ok())
            .collect();
        if pids.len() == n {
            return pids;
        }
        assert!(Instant::now() < deadline, "ranks did not write {n} pid files");
        thread::sleep(Duration::from_millis(20));
    }
}

/// Shell snippet that writes `value` to `dir/name` atomically (write then rename).
fn write_file(dir: &Path, name: &str, value: &str) -> String {
    let path = dir.join(name);
    let p = path.display();
    format!("echo {value} > {p}.tmp && mv {p}.tmp {p}")
}

#[test]
fn every_rank_gets_its_variables_and_prefix() {
    let dir = TempDir::new("vars");
    let script = "echo rank=$TOROID_RANK size=$TOROID_WORLD_SIZE store=$TOROID_STORE_ADDR \
                  local=$TOROID_LOCAL_RANK/$TOROID_LOCAL_SIZE host=${TOROID_HOST_ID-unset}";
    let run = run(&dir, &["-n", "3", "--", "sh", "-c", script]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let lines = stdout_lines(&run);
    assert_eq!(lines.len(), 3, "{lines:?}");
    let mut ranks = Vec::new();
    let mut stores = Vec::new();
    for line in &lines {
        let (r, rest) = split_prefix(line);
        let f = fields(rest);
        assert_eq!(f["rank"], r.to_string(), "{line}");
        assert_eq!(f["size"], "3", "{line}");
        assert_eq!(f["local"], format!("{r}/3"), "{line}");
        assert_eq!(f["host"], "unset", "{line}");
        ranks.push(r);
        stores.push(f["store"].to_string());
    }
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2]);
    assert!(stores.iter().all(|s| *s == stores[0]), "{stores:?}");
    let port = stores[0].strip_prefix("127.0.0.1:").and_then(|p| p.parse::<u16>().ok());
    assert!(port.is_some_and(|p| p > 0), "store address {}", stores[0]);
}

#[test]
fn emulated_hosts_follow_r_times_h_over_n() {
    let dir = TempDir::new("hosts");
    let script = "echo host=$TOROID_HOST_ID local=$TOROID_LOCAL_RANK size=$TOROID_LOCAL_SIZE";
    let run = run(&dir, &["-n", "5", "--emulate-hosts", "2", "--", "sh", "-c", script]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let (n, h) = (5, 2);
    let mut seen = Vec::new();
    for line in stdout_lines(&run) {
        let (r, rest) = split_prefix(&line);
        let f = fields(rest);
        let host = r * h / n;
        let same: Vec<usize> = (0..n).filter(|&q| q * h / n == host).collect();
        let local = same.iter().position(|&q| q == r).expect("rank on its host");
        assert_eq!(f["host"], format!("host{host}"), "{line}");
        assert_eq!(f["local"], local.to_string(), "{line}");
        assert_eq!(f["size"], same.len().to_string(), "{line}");
        seen.push(r);
    }
    seen.sort_unstable();
    assert_eq!(seen, [0, 1, 2, 3, 4]);
}

#[test]
fn failing_rank_stops_the_others() {
    let dir = TempDir::new("fail");
    // Ranks 0 and 2 record their pid and their child's (the `sleep`), then wait; rank 1 waits for
    // those records and exits 3.
    let d = &dir.0;
    let script = format!(
        "if [ $TOROID_RANK = 1 ]; then \
           while [ $(ls {d} | grep -c '^child') -lt 2 ]; do sleep 0.02; done; exit 3; \
         fi; \
         {}; sleep 30 & {}; wait",
        write_file(d, "rank.$TOROID_RANK", "$$"),
        write_file(d, "child.$TOROID_RANK", "$!"),
        d = d.display(),
    );
    let run = run(&dir, &["-n", "3", "--", "sh", "-c", &script]);
    assert_eq!(run.code, Some(3), "stderr: {}", run.stderr);
    assert!(run.elapsed < Duration::from_secs(10), "{:?}", run.elapsed);
    assert!(
        run.stderr.contains("toroid-run: rank 1 (pid ")
            && run.stderr.contains(") exited with status 3; stopping the other 2 ranks"),
        "stderr: {}",
        run.stderr
    );
    let mut pids = wait_for_pids(&dir, "rank.", 2);
    pids.extend(wait_for_pids(&dir, "child.", 2));
    assert_all_gone(&pids);
}

#[test]
fn rank_killed_by_a_signal_gives_128_plus_signal() {
    let dir = TempDir::new("signal");
    let script = "if [ $TOROID_RANK = 1 ]; then kill -9 $$; fi; exec sleep 30";
    let run = run(&dir, &["-n", "2", "--", "sh", "-c", script]);
    assert_eq!(run.code, Some(137), "stderr: {}", run.stderr);
    assert!(run.elapsed < Duration::from_secs(10), "{:?}", run.elapsed);
    assert!(run.stderr.contains("killed by signal 9"), "stderr: {}", run.stderr);
}

#[test]
fn missing_program_exits_127() {
    let dir = TempDir::new("missing");
    let run = run(&dir, &["-n", "2", "--", "/nonexistent/toroid-xyz", "a"]);
    assert_eq!(run.code, Some(127));
    assert!(
        run.stderr.contains("toroid-run: cannot start '/nonexistent/toroid-xyz': No such file or directory"),
        "stderr: {}",
        run.stderr
    );
}

#[test]
fn usage_errors_exit_2() {
    let dir = TempDir::new("usage");
    for args in [
        &["-n", "0", "--", "true"][..],
        &["-n", "2", "--emulate-hosts", "3", "--", "true"],
        &["-n", "2", "--emulate-hosts", "0", "--", "true"],
        &["-n", "2"],
        &["-n", "2", "--env", "NOEQUALS", "--", "true"],
    ] {
        let run = run(&dir, args);
        assert_eq!(run.code, Some(2), "{args:?}: {}", run.stderr);
    }
}

#[test]
fn timeout_stops_the_job() {
    let dir = TempDir::new("timeout");
    let script = format!("{}; sleep 30", write_file(&dir.0, "rank.$TOROID_RANK", "$$"));
    let run = run(&dir, &["-n", "2", "--timeout", "1", "--", "sh", "-c", &script]);
    assert_eq!(run.code, Some(124), "stderr: {}", run.stderr);
    assert!(run.elapsed < Duration::from_secs(10), "{:?}", run.elapsed);
    assert!(run.stderr.contains("timeout"), "stderr: {}", run.stderr);
    assert_all_gone(&wait_for_pids(&dir, "rank.", 2));
}

#[test]
fn grace_period_ends_in_sigkill() {
    let dir = TempDir::new("grace");
    // Every rank ignores SIGTERM (the ignoring is inherited by `sleep`); rank 0 exits 1 once all
    // have recorded their pid (and so ignore SIGTERM already).
    let script = format!(
        "trap '' TERM; {}; \
         if [ $TOROID_RANK = 0 ]; then \
           while [ $(ls {d} | grep -c '^rank') -lt 3 ]; do sleep 0.02; done; exit 1; \
         fi; sleep 30",
        write_file(&dir.0, "rank.$TOROID_RANK", "$$"),
        d = dir.0.display(),
    );
    let args = ["-n", "3", "--grace", "1", "--", "sh", "-c", &script];
    let run = run(&dir, &args);
    assert_eq!(run.code, Some(1), "stderr: {}", run.stderr);
    assert!(run.elapsed >= Duration::from_millis(900), "{:?}", run.elapsed);
    assert!(run.elapsed < Duration::from_secs(10), "{:?}", run.elapsed);
    assert_all_gone(&wait_for_pids(&dir, "rank.", 3));
}

#[test]
fn sigint_is_forwarded_to_the_ranks() {
    let dir = TempDir::new("sigint");
    // Each rank reports the SIGINT; its background `sleep` ignores SIGINT (sh does that for
    // background jobs) and so must be killed by the launcher's final sweep of the group.
    let script = format!(
        "trap 'echo got INT; exit 5' INT; sleep 30 & {}; wait",
        write_file(&dir.0, "child.$TOROID_RANK", "$!")
    );
    let started = Instant::now();
    let child = start(&dir, &["-n", "2", "--", "sh", "-c", &script]);
    let pids = wait_for_pids(&dir, "child.", 2);
    // SAFETY: kill has no memory-safety preconditions; the pid is our own child, not yet reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let run = finish(&dir, child, started);
    assert_eq!(run.code, Some(130), "stderr: {}", run.stderr);
    assert!(run.stderr.contains("received SIGINT"), "stderr: {}", run.stderr);
    let mut lines = stdout_lines(&run);
    lines.sort();
    assert_eq!(lines, ["[0]: got INT", "[1]: got INT"]);
    assert_all_gone(&pids);
}

#[test]
fn ranks_die_with_a_killed_launcher() {
    let dir = TempDir::new("pdeathsig");
    let script = format!("{}; exec sleep 30", write_file(&dir.0, "rank.$TOROID_RANK", "$$"));
    let mut child = start(&dir, &["-n", "2", "--", "sh", "-c", &script]);
    let pids = wait_for_pids(&dir, "rank.", 2);
    // Give the ranks time to exec (the pid file is written just before).
    thread::sleep(Duration::from_millis(100));
    let launcher = child.id();
    child.kill().expect("SIGKILL the launcher");
    child.wait().expect("reap the launcher");
    assert_all_gone(&pids);
    // A killed launcher cannot remove its status directory (the next launcher sweeps it).
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("toroid-run-{launcher}")));
}

#[test]
fn output_is_copied_line_by_line_as_bytes() {
    let dir = TempDir::new("output");
    // Many lines from several ranks: every line must come out whole with its own prefix.
    let script = "i=0; while [ $i -lt 300 ]; do \
                    echo \"r=$TOROID_RANK i=$i xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"; \
                    i=$((i+1)); done; \
                  printf 'bad\\377byte\\n'; echo to-stderr >&2; printf 'no-newline'";
    let run = run(&dir, &["-n", "3", "--", "sh", "-c", script]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let mut counts = [0usize; 3];
    for line in run.stdout.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let text = String::from_utf8_lossy(line);
        let (r, rest) = split_prefix(&text);
        if rest == "no-newline" {
            continue;
        }
        if rest.starts_with("bad") {
            let mut expected = format!("[{r}]: ").into_bytes();
            expected.extend_from_slice(b"bad\xffbyte");
            assert_eq!(line, expected, "{text}");
            continue;
        }
        let f = fields(rest);
        assert_eq!(f["r"], r.to_string(), "{text}");
        assert_eq!(f["i"], counts[r].to_string(), "lines of rank {r} out of order: {text}");
        assert_eq!(rest.len(), format!("r={r} i={} ", counts[r]).len() + 51, "{text}");
        counts[r] += 1;
    }
    assert_eq!(counts, [300; 3]);
    for r in 0..3 {
        let tail = format!("[{r}]: no-newline\n");
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(stdout.contains(&tail), "missing {tail:?}");
        assert!(run.stderr.contains(&format!("[{r}]: to-stderr\n")), "{}", run.stderr);
    }
}

#[test]
fn no_prefix_and_env() {
    let dir = TempDir::new("noprefix");
    let args = [
        "-n",
        "2",
        "--no-prefix",
        "--env",
        "TR_A=x=y",
        "--env",
        "TR_B=",
        "--",
        "sh",
        "-c",
        "echo \"$TR_A|$TR_B|${TR_B+set}\"",
    ];
    let run = run(&dir, &args);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    assert_eq!(stdout_lines(&run), ["x=y||set", "x=y||set"]);
}

#[test]
fn ranks_are_bound_to_distinct_cpus_by_default() {
    let dir = TempDir::new("bind");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        eprintln!("skipped: needs at least 2 CPUs, this machine has {cpus}");
        return;
    }
    let show = "grep Cpus_allowed_list /proc/self/status | cut -f2";
    let run = run(&dir, &["-n", "2", "--", "sh", "-c", show]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    // Drop the "[r]: " prefixes so that only the CPU lists are compared.
    let mut lists: Vec<String> = stdout_lines(&run)
        .iter()
        .map(|l| l.split_once(": ").map_or(l.as_str(), |x| x.1).to_string())
        .collect();
    lists.sort();
    assert_eq!(lists.len(), 2);
    assert_ne!(lists[0], lists[1], "both ranks on the same CPUs: {lists:?}");
    let run = run_none(&dir, show);
    assert!(run.iter().all(|l| l.contains('-') || l.contains(',')), "--bind-to none still bound: {run:?}");
}

fn run_none(dir: &TempDir, show: &str) -> Vec<String> {
    let r = run(dir, &["-n", "2", "--bind-to", "none", "--", "sh", "-c", show]);
    stdout_lines(&r)
}
