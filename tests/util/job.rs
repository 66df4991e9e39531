//! A job of real rank processes for the fault matrix and the soak, watched from outside.
//!
//! Each rank is the test binary re-run as one test (`crate::util::is_child`) in its own process
//! group, so that a rank's forked children are found and killed with it. Ranks report what
//! happens to them as lines `@@ EVENT <unix ms> ...` on stdout; the harness reads them as they
//! come, records when it injected a fault (same clock), and at the end accounts for what was
//! left behind: processes still alive in the job's process groups and shared-memory names of
//! the job's processes. Dropping a [`Job`] kills and reaps everything it started.
//!
//! Included with `#[path]`; it uses `crate::util`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use std::os::unix::process::CommandExt;

/// Milliseconds since the Unix epoch: the one clock ranks and harness both stamp events with.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Prints one event line of a rank (`@@ NAME <ms> detail`), flushed at once so that the harness
/// sees it even if the rank dies right after.
pub fn event(name: &str, detail: &str) {
    use std::io::Write;
    let line = format!("@@ {name} {} {}\n", now_ms(), detail.replace('\n', " | "));
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

/// One parsed event line.
#[derive(Debug, Clone)]
pub struct Event {
    pub name: String,
    pub ms: u64,
    pub detail: String,
}

/// Parses the event lines out of a rank's output.
pub fn events_of(lines: &[String]) -> Vec<Event> {
    lines
        .iter()
        .filter_map(|l| {
            let rest = &l[l.find("@@ ")? + 3..];
            let mut it = rest.splitn(3, ' ');
            let name = it.next()?.to_string();
            let ms = it.next()?.parse().ok()?;
            Some(Event { name, ms, detail: it.next().unwrap_or("").to_string() })
        })
        .collect()
}

/// One rank process and the lines it has printed so far (stdout and stderr, in arrival order).
pub struct Rank {
    pub child: Child,
    pub pid: u32,
    pub lines: Arc<Mutex<Vec<String>>>,
    readers: Vec<JoinHandle<()>>,
    pub status: Option<std::process::ExitStatus>,
}

impl Rank {
    pub fn events(&self) -> Vec<Event> {
        events_of(&self.lines.lock().unwrap())
    }
    pub fn event(&self, name: &str) -> Option<Event> {
        self.events().into_iter().find(|e| e.name == name)
    }
    pub fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// After the process exited: waits (at most 2 s) until its output has been read to the end,
    /// so that the events it printed last are seen (the exit can be noticed before the readers
    /// take its last lines from the pipes). A child it left holding the pipes keeps them open:
    /// then whatever arrived within the bound is what there is.
    fn drain(&self) {
        let t = Instant::now();
        while !self.readers.iter().all(|h| h.is_finished()) && t.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

fn reader(src: impl Read + Send + 'static, lines: Arc<Mutex<Vec<String>>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for l in BufReader::new(src).lines() {
            match l {
                Ok(l) => lines.lock().unwrap().push(l),
                Err(_) => break,
            }
        }
    })
}

/// The rank processes of one job.
pub struct Job {
    pub ranks: Vec<Rank>,
    /// Where the job's shared-memory names live.
    pub shm_dir: PathBuf,
    pub store_port: u16,
    pub started_ms: u64,
    /// `finish` ran: the groups are gone (their ids may be reused), Drop leaves them alone.
    finished: bool,
}

impl Job {
    /// Starts `n` ranks of test `test` with the common `env` and per-rank `env_of(rank)`.
    pub fn spawn(
        test: &str,
        n: usize,
        env: &[(String, String)],
        env_of: impl Fn(usize) -> Vec<(String, String)>,
    ) -> Job {
        let exe = std::env::current_exe().unwrap();
        let port = crate::util::free_port();
        let started_ms = now_ms();
        let ranks = (0..n)
            .map(|r| {
                let mut cmd = Command::new(&exe);
                cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
                    .env(crate::util::CHILD_VAR, "1")
                    .env("TOROID_RANK", r.to_string())
                    .env("TOROID_WORLD_SIZE", n.to_string())
                    .env("TOROID_STORE_ADDR", format!("127.0.0.1:{port}"))
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .process_group(0);
                for (k, v) in env.iter().cloned().chain(env_of(r)) {
                    cmd.env(k, v);
                }
                let mut child = cmd.spawn().expect("spawn rank");
                let lines = Arc::new(Mutex::new(Vec::new()));
                let readers = vec![
                    reader(child.stdout.take().unwrap(), lines.clone()),
                    reader(child.stderr.take().unwrap(), lines.clone()),
                ];
                Rank { pid: child.id(), child, lines, readers, status: None }
            })
            .collect();
        let shm_dir = env
            .iter()
            .find(|(k, _)| k == "TOROID_SHM_DIR")
            .map(|(_, v)| PathBuf::from(v))
            .unwrap_or_else(|| PathBuf::from("/dev/shm"));
        Job { ranks, shm_dir, store_port: port, started_ms, finished: false }
    }

    /// Waits until every rank in `which` printed event `name` (or exited), or `deadline`.
    pub fn wait_event(&self, which: &[usize], name: &str, deadline: Instant) -> bool {
        loop {
            let all = which.iter().all(|&r| self.ranks[r].event(name).is_some() || !self.running(r));
            if all {
                // An exited rank's last lines may still be in the pipe.
                which
                    .iter()
                    .filter(|&&r| self.ranks[r].event(name).is_none())
                    .for_each(|&r| self.ranks[r].drain());
                return which.iter().all(|&r| self.ranks[r].event(name).is_some());
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn running(&self, r: usize) -> bool {
        crate::util::alive(self.ranks[r].pid)
    }

    /// Waits for the ranks in `which` to exit until `deadline`; returns the ranks that did not
    /// (hung), which are then killed.
    pub fn wait_exit(&mut self, which: &[usize], deadline: Instant) -> Vec<usize> {
        let mut hung = Vec::new();
        for &r in which {
            let rank = &mut self.ranks[r];
            if rank.status.is_some() {
                continue;
            }
            rank.status = crate::util::wait_until(&mut rank.child, deadline);
            if rank.status.is_none() {
                hung.push(r);
            } else {
                rank.drain();
            }
        }
        hung
    }

    /// Sends `sig` to rank `r`'s process (not its group).
    pub fn signal(&self, r: usize, sig: i32) {
        // SAFETY: kill(2) on a pid this job started and has not reaped yet; no memory involved.
        unsafe { libc::kill(self.ranks[r].pid as i32, sig) };
    }

    /// The pids of every process still alive in the job's process groups.
    pub fn survivors(&self) -> Vec<u32> {
        let groups: Vec<u32> = self.ranks.iter().map(|r| r.pid).collect();
        processes_in_groups(&groups)
    }

    /// Ends the job: kills every rank and reaps it, then counts (and kills) what is still alive
    /// in its process groups after a short grace, and removes (and counts) shared-memory names
    /// of its processes. Returns (processes left, shm names left).
    pub fn finish(&mut self) -> (usize, usize) {
        for r in 0..self.ranks.len() {
            if self.ranks[r].status.is_none() {
                let _ = self.ranks[r].child.kill();
                self.ranks[r].status = self.ranks[r].child.wait().ok();
            }
        }
        // A killed process takes a moment to go; what is still there after a second was left.
        let t = Instant::now();
        let mut left = self.survivors();
        while !left.is_empty() && t.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(20));
            left = self.survivors();
        }
        self.kill_groups();
        for r in &mut self.ranks {
            for h in r.readers.drain(..) {
                let _ = h.join();
            }
        }
        let pids: Vec<u32> = self.ranks.iter().map(|r| r.pid).collect();
        let shm = remove_shm_names(&self.shm_dir, &pids);
        self.finished = true;
        (left.len(), shm)
    }

    fn kill_groups(&self) {
        for r in &self.ranks {
            // SAFETY: killpg(2) on a process group this job created (the rank's own pid).
            unsafe { libc::killpg(r.pid as i32, libc::SIGKILL) };
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.kill_groups();
        for r in &mut self.ranks {
            if r.status.is_none() {
                let _ = r.child.kill();
                let _ = r.child.wait();
            }
        }
        let pids: Vec<u32> = self.ranks.iter().map(|r| r.pid).collect();
        remove_shm_names(&self.shm_dir, &pids);
    }
}

/// Pids of live (not zombie) processes whose process group is one of `groups`.
pub fn processes_in_groups(groups: &[u32]) -> Vec<u32> {
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return found };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // Fields after the command name: state ppid pgrp ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { continue };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 2 && f[0] != "Z" && f[2].parse::<u32>().is_ok_and(|g| groups.contains(&g)) {
            found.push(pid);
        }
    }
    found
}

/// Removes toroid's shared-memory names (`toroid-<pid>-...`) created by one of `pids` in `dir`;
/// returns how many there were.
pub fn remove_shm_names(dir: &Path, pids: &[u32]) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut n = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("toroid-") else { continue };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| pids.contains(&p)) {
            let _ = std::fs::remove_file(e.path());
            n += 1;
        }
    }
    n
}

/// A TCP socket of a process, from `/proc/<pid>/net/tcp` (IPv4 only: the tests use 127.0.0.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSock {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub listening: bool,
}

fn parse_addr(hex: &str) -> Option<SocketAddr> {
    let (ip, port) = hex.split_once(':')?;
    let ip = u32::from_str_radix(ip, 16).ok()?;
    let port = u16::from_str_radix(port, 16).ok()?;
    // The kernel prints the address in host (little-endian) byte order.
    Some(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip.swap_bytes()), port)))
}

/// The TCP sockets (listening and established) that process `pid` holds open.
pub fn tcp_sockets(pid: u32) -> Vec<TcpSock> {
    let mut inodes = Vec::new();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            if let Ok(t) = std::fs::read_link(fd.path()) {
                let t = t.to_string_lossy().into_owned();
                if let Some(i) = t.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
                    inodes.push(i.to_string());
                }
            }
        }
    }
    let Ok(table) = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")) else { return Vec::new() };
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 10 || !inodes.iter().any(|i| i == f[9]) {
                return None;
            }
            let listening = f[3] == "0A";
            let established = f[3] == "01";
            (listening || established).then_some(TcpSock {
                local: parse_addr(f[1])?,
                remote: parse_addr(f[2])?,
                listening,
            })
        })
        .collect()
}

/// Resets one established TCP connection with `ss -K` (the kernel's SOCK_DESTROY: the socket
/// fails with ECONNABORTED and the peer gets a reset). Returns whether `ss` succeeded.
pub fn reset_connection(s: &TcpSock) -> bool {
    let filter = format!(
        "src {} sport = :{} dst {} dport = :{}",
        s.local.ip(),
        s.local.port(),
        s.remote.ip(),
        s.remote.port()
    );
    Command::new("ss")
        .args(["-K", "-t", "-n"])
        .args(filter.split(' '))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A directory removed (with what is in it) when dropped, also when a test panics.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(what: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("toroid-{what}-{}-{}", std::process::id(), now_ms()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
