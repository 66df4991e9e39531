//! `toroid-run --status`: the health of a running job, asked from outside it.
//!
//! A job that `toroid-run` starts gets a status directory (`$TMPDIR/toroid-run-<launcher pid>`,
//! mode 0700) in its ranks' `TOROID_STATUS_DIR`; each rank of each communicator leaves its
//! control-plane address there. `--status` reads the directory, asks every rank at once over
//! the control plane (the library's `query_dir`) and prints one JSON document or Prometheus
//! text. It works while the job is stuck: the ranks answer from their control threads.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use toroid::internals::comm::query_dir;
use toroid::internals::trace::prometheus_header;

/// Exit status when every communicator is healthy, when one is not, and when nothing could be
/// asked (2 is clap's usage error).
pub const HEALTHY: i32 = 0;
pub const UNHEALTHY: i32 = 1;
pub const NO_JOB: i32 = 3;

const PREFIX: &str = "toroid-run-";

/// How the answer is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Json,
    Prometheus,
}

/// The status directory of the job of launcher `pid`.
pub fn dir_of(pid: u32) -> PathBuf {
    std::env::temp_dir().join(format!("{PREFIX}{pid}"))
}

/// Creates the status directory of this launcher's job (owner only); `None` (with a warning)
/// when it cannot.
pub fn create_dir() -> Option<PathBuf> {
    use std::os::unix::fs::DirBuilderExt as _;
    sweep();
    let dir = dir_of(std::process::id());
    // A directory left by an earlier launcher with this pid (killed before it cleaned up).
    let _ = std::fs::remove_dir_all(&dir);
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => Some(dir),
        Err(e) => {
            eprintln!(
                "toroid-run: no status directory ({}: {e}); --status will not see this job",
                dir.display()
            );
            None
        }
    }
}

/// Which directory `--status TARGET` means: a launcher's pid, a directory, or (none) the
/// `TOROID_STATUS_DIR` of this environment, else the only job of this user here.
pub fn resolve(target: Option<&str>) -> Result<PathBuf, String> {
    if let Some(t) = target {
        if let Ok(pid) = t.parse::<u32>() {
            return Ok(dir_of(pid));
        }
        return Ok(PathBuf::from(t));
    }
    if let Some(d) = toroid::internals::config::status_dir_from_env() {
        return Ok(d);
    }
    let tmp = std::env::temp_dir();
    let mut found: Vec<PathBuf> = std::fs::read_dir(&tmp)
        .map_err(|e| format!("reading {}: {e}", tmp.display()))?
        .flatten()
        .filter(|e| {
            launcher_of(&e.file_name()).is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
        })
        .filter(|e| owned_by_me(&e.path()))
        .map(|e| e.path())
        .collect();
    found.sort();
    match found.len() {
        0 => Err(format!(
            "no toroid-run job of this user in {} (name one: --status PID or DIR)",
            tmp.display()
        )),
        1 => Ok(found.remove(0)),
        _ => {
            let list: Vec<String> = found.iter().map(|p| p.display().to_string()).collect();
            Err(format!("several jobs; name one (--status PID or DIR): {}", list.join(" ")))
        }
    }
}

/// Removes the status directories of this user's launchers that are gone (killed before they
/// could remove their own).
fn sweep() {
    let Ok(rd) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) =
            name.to_str().and_then(|n| n.strip_prefix(PREFIX)).and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() && owned_by_me(&e.path()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The launcher pid of a status directory's name (`toroid-run-<pid>`).
fn launcher_of(name: &std::ffi::OsStr) -> Option<u32> {
    name.to_str()?.strip_prefix(PREFIX)?.parse().ok()
}

fn owned_by_me(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(p).is_ok_and(|m| m.is_dir() && m.uid() == toroid::internals::sys::user::euid())
}

/// Asks the job behind `dir` and prints the answer; returns the exit status.
pub fn run(dir: &Path, format: Format, grace: Duration) -> i32 {
    let auth = match toroid::internals::config::auth_token_from_env() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("toroid-run: {e}");
            return NO_JOB;
        }
    };
    let t0 = Instant::now();
    let comms = match query_dir(dir, grace, auth.as_ref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("toroid-run: no status from {}: {e}", dir.display());
            return NO_JOB;
        }
    };
    let took = t0.elapsed();
    if comms.is_empty() {
        eprintln!(
            "toroid-run: no communicator has a status entry in {} (not created yet, or all gone)",
            dir.display()
        );
        return NO_JOB;
    }
    match format {
        Format::Json => {
            let doc = serde_json::json!({
                "dir": dir.display().to_string(),
                "answered_ms": took.as_secs_f64() * 1e3,
                "healthy": comms.iter().all(|h| h.healthy),
                "communicators": comms.iter().map(|h| h.to_json()).collect::<Vec<_>>(),
            });
            println!("{doc:#}");
        }
        Format::Prometheus => {
            print!("{}", prometheus_header());
            for h in &comms {
                print!("{}", h.to_prometheus());
            }
        }
    }
    if comms.iter().all(|h| h.healthy) { HEALTHY } else { UNHEALTHY }
}
