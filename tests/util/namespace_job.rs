//! A job whose shared-memory directory is a tiny private tmpfs: `unshare -m` gives the ranks a
//! mount namespace of their own, a shell mounts the tmpfs there (never touching the host's
//! `/dev/shm`) and starts the ranks in it; when the last of them exits the namespace and its
//! mount go away. Needs root (CI runs as root).
//!
//! Included with `#[path]` by `tests/faults.rs`; it uses `crate::job` and `crate::Outcome`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use std::os::unix::process::CommandExt;

use crate::Outcome;
use crate::job::{TempDir, events_of, processes_in_groups, remove_shm_names};

/// Mounts the tmpfs, starts the ranks in the background with their output in files, waits.
const SCRIPT: &str = r#"mount -t tmpfs -o size="$FAULT_TMPFS_SIZE",mode=1777 tmpfs "$FAULT_TMPFS" || exit 97
i=0
while [ "$i" -lt "$TOROID_WORLD_SIZE" ]; do
  TOROID_RANK=$i "$FAULT_EXE" --exact "$FAULT_TEST" --nocapture --test-threads=1 >"$FAULT_LOGS/rank$i.log" 2>&1 &
  i=$((i + 1))
done
wait"#;

/// Runs `n` ranks of test `test` with shared memory in a tmpfs of `size` (`mount -o size=`),
/// bounded by `bound`. As expected when every rank finishes its verified collectives (`DONE`);
/// the note says whether set-up failed with a clear error about shared memory instead.
pub fn run_in_small_tmpfs(
    test: &str,
    n: usize,
    env: &[(String, String)],
    size: &str,
    bound: Duration,
) -> Outcome {
    let dir = TempDir::new("test-shm-full");
    let mnt = dir.0.join("shm");
    std::fs::create_dir_all(&mnt).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c", SCRIPT])
        .env(crate::util::CHILD_VAR, "1")
        .env("TOROID_WORLD_SIZE", n.to_string())
        .env("TOROID_STORE_ADDR", format!("127.0.0.1:{}", crate::util::free_port()))
        .env("TOROID_SHM_DIR", &mnt)
        .env("FAULT_TMPFS", &mnt)
        .env("FAULT_TMPFS_SIZE", size)
        .env("FAULT_EXE", &exe)
        .env("FAULT_TEST", test)
        .env("FAULT_LOGS", &dir.0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Outcome { note: format!("cannot run unshare: {e}"), ..Outcome::default() },
    };
    let group = child.id();
    let status = crate::util::wait_until(&mut child, Instant::now() + bound);
    let hangs = usize::from(status.is_none());
    // What is still alive in the group after a second was left behind.
    let t = Instant::now();
    let mut left = processes_in_groups(&[group]);
    while !left.is_empty() && t.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(20));
        left = processes_in_groups(&[group]);
    }
    // SAFETY: killpg(2) on the process group this function created.
    unsafe { libc::killpg(group as i32, libc::SIGKILL) };
    let _ = child.wait();

    let logs: Vec<String> = (0..n)
        .map(|r| std::fs::read_to_string(dir.0.join(format!("rank{r}.log"))).unwrap_or_default())
        .collect();
    let events: Vec<_> =
        logs.iter().map(|l| events_of(&l.lines().map(String::from).collect::<Vec<_>>())).collect();
    let has = |r: usize, name: &str| events[r].iter().find(|e| e.name == name);
    let pids: Vec<u32> =
        (0..n).filter_map(|r| has(r, "START").and_then(|e| e.detail.trim().parse().ok())).collect();
    // The tmpfs was visible only inside the namespace: on the host its mount point must be
    // empty, and the host's /dev/shm must hold nothing of these processes.
    let shm_left = remove_shm_names(Path::new("/dev/shm"), &pids) + count_entries(&mnt);
    let done = (0..n).all(|r| has(r, "DONE").is_some());
    let windowless = (0..n).all(|r| has(r, "READY").is_some_and(|e| e.detail.contains("window=false")));
    let clear_error = (0..n).all(|r| {
        has(r, "SETUP_ERROR")
            .is_some_and(|e| e.detail.contains("shared-memory") || e.detail.contains("TOROID_SHM"))
    });
    // Which links fell back: each rank logs "shared memory unavailable for K of M peers".
    let fallbacks: Vec<&str> = logs
        .iter()
        .flat_map(|l| l.lines())
        .filter_map(|x| {
            x.split_once("unavailable for ").and_then(|(_, t)| t.split_once(" peers")).map(|(k, _)| k)
        })
        .collect();
    let note = if done {
        format!(
            "every rank finished correctly (shared window: {}; TCP kept for {fallbacks:?} peers per rank)",
            if windowless { "none" } else { "some" }
        )
    } else if clear_error {
        format!(
            "set-up failed on every rank with a clear error: {}",
            has(0, "SETUP_ERROR").map_or("", |e| &e.detail)
        )
    } else {
        let d: Vec<String> = (0..n)
            .map(|r| {
                let ev: Vec<String> = events[r].iter().map(|e| format!("{} {}", e.name, e.detail)).collect();
                let tail = &logs[r][logs[r].len().saturating_sub(300)..];
                format!("rank {r}: {} (tail: {tail})", ev.join(" / "))
            })
            .collect();
        format!("exit {status:?}: {}", d.join("; "))
    };
    // Observed: the links fall back to TCP and the job finishes (see `shm_full` in faults.rs).
    Outcome { ok: done, hangs, procs_left: left.len(), shm_left, worst_ms: None, note }
}

fn count_entries(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}
