//! `toroid-run`: start N ranks of a program on this host, like torchrun.
//!
//! Every rank gets the `TOROID_*` variables that `rendezvous::env` reads, its output is re-emitted
//! line by line with a `[rank]: ` prefix, and when one rank fails the others are stopped
//! (SIGTERM, a grace period, SIGKILL) and the launcher exits with the failing rank's code.

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

use clap::{CommandFactory, Parser, error::ErrorKind};

mod status;
use toroid::internals::sys::process::{self, CpuSet, SIGHUP, SIGINT, SIGKILL, SIGTERM, SIGUSR1, Signal};

const ABOUT: &str = "Start N ranks of a program on this host (a small torchrun for toroid)";

const LONG_ABOUT: &str = "\
Start N ranks of PROGRAM on this host (a small torchrun for toroid).

Every rank gets, besides the launcher's own environment:
  TOROID_RANK=r  TOROID_WORLD_SIZE=N  TOROID_LOCAL_RANK  TOROID_LOCAL_SIZE
  TOROID_STORE_ADDR=127.0.0.1:PORT   (PORT: a free port; rank 0 serves the store there)
  TOROID_HOST_ID=host<h>             (only with --emulate-hosts)
then the --env pairs, which win over all of these.
With TOROID_TIMELINE=path, the ranks' timeline files are merged into path when the job ends.

Each line a rank writes to stdout or stderr is re-emitted on the same stream as '[r]: line'.
Ranks run with stdin on /dev/null, each in its own process group.

When a rank exits non-zero or is killed by a signal, the others get SIGTERM, then SIGKILL after
the grace period, and toroid-run exits with that rank's status (128+signal when killed).
SIGINT, SIGTERM and SIGHUP sent to toroid-run are forwarded to every rank, with the same
shutdown. Ranks are killed (SIGKILL) even when toroid-run itself is killed (processes that a
rank started itself are not covered then).
SIGUSR1 sent to toroid-run is passed on to every rank process (not its group) and does not
stop the job: each rank prints the stall report of its communicators to stderr
(kill -USR1 <toroid-run pid>; see TOROID_DUMP_ON_SIGNAL).

Exit status: 0 when every rank succeeds; the first failing rank's status; 124 on --timeout;
128+signal when toroid-run was interrupted; 127 when PROGRAM is not found, 126 when it
cannot be run; 2 on a usage error.";

const EXAMPLES: &str = "\
Examples:
  toroid-run -n 4 -- ./target/release/toroid-bench -b 8 -e 128M
  toroid-run -n 8 --emulate-hosts 2 --timeout 600 --env TOROID_DEBUG=INFO -- python train.py";

#[derive(Parser, Debug)]
#[command(
    name = "toroid-run",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_help = EXAMPLES,
    override_usage = "toroid-run -n N [OPTIONS] -- PROGRAM [ARGS]..."
)]
struct Cli {
    /// Number of ranks to start (at least 1).
    #[arg(short = 'n', long = "nprocs", value_name = "N", required_unless_present = "status",
          value_parser = clap::value_parser!(u32).range(1..))]
    nprocs: Option<u32>,

    /// Print the health of a running job and exit, instead of starting one: TARGET is the
    /// job's toroid-run pid or its status directory (default: TOROID_STATUS_DIR, else the
    /// only job of this user). Every rank is asked at once over the control plane, also while
    /// the job is stuck. Exit status 0: healthy; 1: a rank is dead, stopped or named by the
    /// verdict; 3: nothing to ask.
    #[arg(long, value_name = "TARGET", num_args = 0..=1, conflicts_with_all = ["nprocs", "command"])]
    status: Option<Option<String>>,

    /// --status output: one JSON document, or Prometheus text.
    #[arg(long, value_enum, default_value = "json", requires = "status")]
    format: status::Format,

    /// --status: milliseconds each rank has to answer (a rank that takes the connection and
    /// does not answer in time is reported stopped).
    #[arg(long, value_name = "MS", default_value = "60", requires = "status",
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    answer_within: u64,

    /// Pretend the ranks are on H hosts (1..=N): rank r is on host r*H/N, consecutive ranks share
    /// a host, uneven splits allowed. Sets TOROID_HOST_ID=host<h> and the local rank and size.
    #[arg(long, value_name = "H")]
    emulate_hosts: Option<u32>,

    /// Store address given to every rank instead of 127.0.0.1:<free port>.
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_addr, conflicts_with = "port")]
    store_addr: Option<String>,

    /// Store port on 127.0.0.1 instead of a free one.
    #[arg(long, value_name = "PORT")]
    port: Option<u16>,

    /// Stop the whole job after SECS seconds and exit with status 124.
    #[arg(long, value_name = "SECS", value_parser = parse_timeout)]
    timeout: Option<Duration>,

    /// Seconds between SIGTERM and SIGKILL when stopping the ranks.
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = parse_secs)]
    grace: Duration,

    /// Re-emit the ranks' lines without the '[r]: ' prefix.
    #[arg(long)]
    no_prefix: bool,

    /// CPU binding of the ranks: `auto` gives each rank an equal share of the CPUs the launcher
    /// may use (one CPU each when ranks outnumber CPUs; no binding for a single rank), as mpirun
    /// binds by default; `core` binds rank r to one CPU (r mod CPUs); `none` leaves placement
    /// to the scheduler (use it when ranks run their own thread pools across all CPUs).
    #[arg(long, value_enum, default_value = "auto")]
    bind_to: Bind,

    /// Set K=V in every rank's environment (repeatable; wins over the TOROID_* set here).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<(String, String)>,

    /// The program to run and its arguments (after `--`).
    #[arg(
        value_name = "PROGRAM",
        required_unless_present = "status",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    command: Vec<OsString>,
}

/// How ranks are bound to CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Bind {
    Auto,
    Core,
    None,
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> Vec<usize> {
    let cpus = CpuSet::allowed().map(|s| s.cpus()).unwrap_or_default();
    if cpus.is_empty() { (0..thread::available_parallelism().map_or(1, |n| n.get())).collect() } else { cpus }
}

/// The CPUs rank `r` of `n` is bound to, if any.
fn binding(bind: Bind, r: usize, n: usize, cpus: &[usize]) -> Option<Vec<usize>> {
    let c = cpus.len();
    match bind {
        Bind::None => None,
        Bind::Auto if n == 1 => None,
        Bind::Auto if n <= c => {
            let k = c / n;
            Some(cpus[r * k..(r + 1) * k].to_vec())
        }
        Bind::Auto | Bind::Core => Some(vec![cpus[r % c]]),
    }
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.parse().map_err(|_| format!("'{s}' is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("'{s}' is not a duration"))
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    parse_secs(s).and_then(|d| if d.is_zero() { Err("must be > 0".into()) } else { Ok(d) })
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("'{s}' is not K=V")),
    }
}

fn parse_addr(s: &str) -> Result<String, String> {
    match s.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(s.to_string()),
        _ => Err(format!("'{s}' is not HOST:PORT")),
    }
}

/// Where a rank sits when the job pretends to span `hosts` hosts.
#[derive(Debug, PartialEq, Eq)]
struct Place {
    host: usize,
    local_rank: usize,
    local_size: usize,
}

/// Rank r is on host r*H/N: consecutive ranks share a host, every host gets at least one rank
/// when 1 <= H <= N.
fn layout(n: usize, hosts: usize) -> Vec<Place> {
    let host = |r: usize| r * hosts / n;
    (0..n)
        .map(|r| Place {
            host: host(r),
            local_rank: (0..r).filter(|&q| host(q) == host(r)).count(),
            local_size: (0..n).filter(|&q| host(q) == host(r)).count(),
        })
        .collect()
}

/// Sends `sig` to the process group of a rank (its pid: see `spawn`), so that a rank's own
/// children (`sh -c 'prog'`, worker processes) are reached too. ESRCH (group gone) is fine.
/// A reaped rank's pid is not handed out again while its group still has members, so this
/// never hits a stranger's group in practice.
fn signal_group(pid: u32, sig: Signal) {
    let _ = process::kill_group(pid, sig);
}

/// Passes SIGUSR1 on to every running rank: each prints its stall report (the rank process
/// only, not its group: processes it exec'd keep SIGUSR1's default action, which ends them).
fn dump_ranks(job: &[Rank]) {
    eprintln!("toroid-run: received SIGUSR1; passing it to every rank (stall report on stderr)");
    for rank in job.iter().filter(|r| r.status.is_none()) {
        let _ = toroid::internals::sys::signal::send(rank.pid, SIGUSR1);
    }
}

/// Starts one rank with its stdout and stderr piped.
fn spawn(cli: &Cli, env: &[(&str, String)], cpus: Option<&[usize]>) -> io::Result<Child> {
    let mut cmd = Command::new(&cli.command[0]);
    cmd.args(&cli.command[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .envs(cli.env.iter().cloned())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Each rank gets its own process group (pgid = its pid). Then (1) stopping a rank reaches
    // its whole tree with kill(-pgid), not only the top process (`sh -c`, Python workers), and
    // (2) a Ctrl-C at the terminal, which goes to the foreground group, reaches only the
    // launcher, which forwards it exactly once to every rank and then runs the usual shutdown;
    // in the launcher's group every rank would get it twice, racing our shutdown. The cost:
    // ranks are not in the terminal's foreground group, so stdin is /dev/null (a read of the
    // terminal would stop them with SIGTTIN), and Ctrl-Z stops only the launcher.
    cmd.process_group(0);
    // Ranks get SIGKILL when the thread that forked them exits: we spawn from the main thread,
    // which lives until the launcher exits.
    process::kill_child_with_parent(&mut cmd);
    // The CPU set is built here, before the fork, so the child only makes the system call.
    if let Some(cpus) = cpus.filter(|c| !c.is_empty()) {
        process::bind_child(&mut cmd, CpuSet::new(cpus));
    }
    cmd.spawn()
}

/// Starts a thread that copies `src` line by line to stdout or stderr, each line prefixed and
/// written whole under the stream's lock, so lines of different ranks never mix. Bytes pass
/// unchanged (no UTF-8 needed). The thread sends `()` on `lines` after each line and drops its
/// sender when `src` closes.
fn pump(src: Option<impl Read + Send + 'static>, prefix: &[u8], to_stderr: bool, lines: &Sender<()>) {
    if let Some(src) = src {
        let (prefix, lines) = (prefix.to_vec(), lines.clone());
        thread::spawn(move || copy_lines(src, &prefix, to_stderr, &lines));
    }
}

fn copy_lines(src: impl Read, prefix: &[u8], to_stderr: bool, lines: &Sender<()>) {
    let mut src = BufReader::new(src);
    let mut line = prefix.to_vec();
    loop {
        line.truncate(prefix.len());
        match src.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        // On a write error (whoever reads our output went away) stop copying: closing the rank's
        // pipe gives it EPIPE/SIGPIPE, as if it wrote to that reader itself.
        let written = if to_stderr {
            let mut out = io::stderr().lock();
            out.write_all(&line).and_then(|()| out.flush())
        } else {
            let mut out = io::stdout().lock();
            out.write_all(&line).and_then(|()| out.flush())
        };
        if written.is_err() {
            break;
        }
        let _ = lines.send(());
    }
}

struct Rank {
    child: Child,
    pid: u32,
    status: Option<ExitStatus>,
}

/// Exit code of a finished rank: its code, or 128+signal.
fn exit_code(st: ExitStatus) -> i32 {
    st.code().or(st.signal().map(|s| 128 + s)).unwrap_or(1)
}

fn describe(st: ExitStatus) -> String {
    match st.signal() {
        Some(s) => format!("killed by signal {s}"),
        None => format!("exited with status {}", exit_code(st)),
    }
}

fn signal_name(sig: Signal) -> String {
    match sig {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        SIGHUP => "SIGHUP".into(),
        _ => format!("signal {sig}"),
    }
}

fn ranks(n: usize) -> String {
    format!("{n} rank{}", if n == 1 { "" } else { "s" })
}

/// Reaps every rank that finished; returns the first that failed in this pass.
fn poll(ranks: &mut [Rank]) -> Option<usize> {
    let mut failed = None;
    for (r, rank) in ranks.iter_mut().enumerate() {
        if rank.status.is_some() {
            continue;
        }
        let st = match rank.child.try_wait() {
            Ok(None) => continue,
            Ok(Some(st)) => st,
            Err(e) => {
                let pid = rank.pid;
                eprintln!("toroid-run: cannot wait for rank {r} (pid {pid}): {e}");
                ExitStatus::from_raw(1 << 8)
            }
        };
        rank.status = Some(st);
        if !st.success() && failed.is_none() {
            failed = Some(r);
        }
    }
    failed
}

fn running(ranks: &[Rank]) -> usize {
    ranks.iter().filter(|k| k.status.is_none()).count()
}

/// Sends `first` to every rank, waits up to `grace` for them (a second signal to the launcher
/// cuts it short), then SIGKILLs what is left, including the ranks' leftover children.
fn shutdown(ranks: &mut [Rank], first: Signal, grace: Duration) {
    for rank in ranks.iter() {
        signal_group(rank.pid, first);
    }
    process::clear_caught_signal();
    let now = Instant::now();
    let deadline = now.checked_add(grace).unwrap_or(now + Duration::from_secs(365 * 24 * 3600));
    while running(ranks) > 0 && Instant::now() < deadline && process::caught_signal().is_none() {
        poll(ranks);
        thread::sleep(POLL);
    }
    for rank in ranks.iter_mut() {
        signal_group(rank.pid, SIGKILL);
        if rank.status.is_none() {
            let st = rank.child.wait();
            rank.status = Some(st.unwrap_or(ExitStatus::from_raw(SIGKILL)));
        }
    }
}

const POLL: Duration = Duration::from_millis(20);
/// How long to keep copying output after the last rank exited, counted from the last line.
const DRAIN: Duration = Duration::from_secs(2);

fn main() {
    let cli = Cli::parse();
    if let Some(target) = &cli.status {
        let code = match status::resolve(target.as_deref()) {
            Ok(dir) => status::run(&dir, cli.format, Duration::from_millis(cli.answer_within)),
            Err(e) => {
                eprintln!("toroid-run: {e}");
                status::NO_JOB
            }
        };
        std::process::exit(code);
    }
    let n = cli.nprocs.map_or(1, |n| n as usize);
    let hosts = cli.emulate_hosts.map_or(1, |h| h as usize);
    if !(1..=n).contains(&hosts) {
        let msg = format!("--emulate-hosts must be in 1..={n}");
        Cli::command().error(ErrorKind::ValueValidation, msg).exit();
    }
    let store = match (&cli.store_addr, cli.port) {
        (Some(addr), _) => addr.clone(),
        (None, Some(port)) => format!("127.0.0.1:{port}"),
        // Bound then closed: another process could take the port before rank 0 binds it, a
        // race every launcher that picks a port this way accepts.
        (None, None) => match TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
            Ok(addr) => addr.to_string(),
            Err(e) => fail(1, format!("cannot find a free port: {e}")),
        },
    };
    // The last SIGINT/SIGTERM/SIGHUP received is recorded, for the main loop to act on.
    if let Err(e) = process::catch_signals(&[SIGINT, SIGTERM, SIGHUP, SIGUSR1]) {
        fail(1, format!("cannot install signal handlers: {e}"));
    }

    // The status directory for `--status`, unless the ranks are given their own.
    let own_status = cli.env.iter().all(|(k, _)| k != "TOROID_STATUS_DIR")
        && toroid::internals::config::status_dir_from_env().is_none();
    let status_dir = if own_status { status::create_dir() } else { None };
    let (lines, rx) = mpsc::channel();
    let mut job: Vec<Rank> = Vec::with_capacity(n);
    let cpus = allowed_cpus();
    for (r, place) in layout(n, hosts).into_iter().enumerate() {
        let mut env = vec![
            ("TOROID_RANK", r.to_string()),
            ("TOROID_WORLD_SIZE", n.to_string()),
            ("TOROID_LOCAL_RANK", place.local_rank.to_string()),
            ("TOROID_LOCAL_SIZE", place.local_size.to_string()),
            ("TOROID_STORE_ADDR", store.clone()),
        ];
        if cli.emulate_hosts.is_some() {
            env.push(("TOROID_HOST_ID", format!("host{}", place.host)));
        }
        if let Some(d) = &status_dir {
            env.push(("TOROID_STATUS_DIR", d.display().to_string()));
        }
        let mut child = match spawn(&cli, &env, binding(cli.bind_to, r, n, &cpus).as_deref()) {
            Ok(child) => child,
            Err(e) => {
                let program = cli.command[0].to_string_lossy();
                let msg = e.to_string();
                let msg = msg.split(" (os error").next().unwrap_or_default();
                eprintln!("toroid-run: cannot start '{program}': {msg}");
                shutdown(&mut job, SIGTERM, cli.grace);
                remove_status_dir(status_dir.as_deref());
                let not_found = e.kind() == io::ErrorKind::NotFound;
                std::process::exit(if not_found { 127 } else { 126 });
            }
        };
        let prefix = match cli.no_prefix {
            true => Vec::new(),
            false => format!("[{r}]: ").into_bytes(),
        };
        pump(child.stdout.take(), &prefix, false, &lines);
        pump(child.stderr.take(), &prefix, true, &lines);
        job.push(Rank { pid: child.id(), child, status: None });
    }
    drop(lines);

    let start = Instant::now();
    let mut code = 0;
    while running(&job) > 0 {
        let sig = process::caught_signal();
        if sig == Some(SIGUSR1) {
            process::clear_caught_signal();
            dump_ranks(&job);
            continue;
        }
        let (first, why) = if let Some(r) = poll(&mut job) {
            let st = job[r].status.unwrap_or_default();
            code = exit_code(st);
            let why = format!("rank {r} (pid {}) {}", job[r].pid, describe(st));
            match running(&job) {
                0 => (SIGTERM, why),
                k => (SIGTERM, format!("{why}; stopping the other {}", ranks(k))),
            }
        } else if let Some(sig) = sig {
            code = 128 + sig;
            let k = ranks(running(&job));
            (sig, format!("received {}; forwarding it to {k}", signal_name(sig)))
        } else if let Some(t) = cli.timeout.filter(|&t| start.elapsed() >= t) {
            code = 124;
            let k = ranks(running(&job));
            (SIGTERM, format!("timeout after {} s; stopping {k}", t.as_secs_f64()))
        } else {
            thread::sleep(POLL);
            continue;
        };
        eprintln!("toroid-run: {why}");
        shutdown(&mut job, first, cli.grace);
    }

    // Copy what the ranks left in their pipes (the channel disconnects when every copying thread
    // is done). A pipe still open after its rank exited is held by a process the rank left
    // behind: stop waiting when no line came for DRAIN.
    loop {
        match rx.recv_timeout(DRAIN) {
            Ok(()) => {}
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                eprintln!("toroid-run: output still open after the ranks exited; not waiting");
                break;
            }
        }
    }
    merge_timeline(&cli, n);
    remove_status_dir(status_dir.as_deref());
    std::process::exit(code);
}

fn remove_status_dir(dir: Option<&std::path::Path>) {
    if let Some(d) = dir {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// With `TOROID_TIMELINE=path` (in this environment or `--env`), merges the ranks' timeline files
/// into `path` (see `trace::timeline`).
fn merge_timeline(cli: &Cli, n: usize) {
    let from_env = toroid::internals::config::timeline_path_from_env();
    let from_cli =
        cli.env.iter().rev().find(|(k, _)| k == "TOROID_TIMELINE").map(|(_, v)| std::path::PathBuf::from(v));
    let Some(path) = from_cli.or(from_env) else { return };
    match toroid::internals::trace::timeline::merge(&path, n) {
        Ok(events) => eprintln!("toroid-run: timeline of {n} ranks, {events} events: {}", path.display()),
        Err(e) => eprintln!("toroid-run: could not merge the timeline into {}: {e}", path.display()),
    }
}

fn fail(code: i32, msg: String) -> ! {
    eprintln!("toroid-run: {msg}");
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binding_shares_cpus_evenly() {
        let cpus = [0, 1, 2, 3, 4, 5, 6, 7];
        assert_eq!(binding(Bind::Auto, 0, 1, &cpus), None);
        assert_eq!(binding(Bind::Auto, 1, 2, &cpus), Some(vec![4, 5, 6, 7]));
        assert_eq!(binding(Bind::Auto, 2, 3, &cpus), Some(vec![4, 5]));
        assert_eq!(binding(Bind::Auto, 9, 10, &cpus), Some(vec![1]));
        assert_eq!(binding(Bind::Core, 1, 2, &cpus), Some(vec![1]));
        assert_eq!(binding(Bind::None, 1, 2, &cpus), None);
        assert_eq!(binding(Bind::Auto, 1, 2, &[3, 9]), Some(vec![9]));
    }

    #[test]
    fn layout_follows_r_times_h_over_n() {
        let hosts: Vec<_> = layout(5, 2).iter().map(|p| (p.host, p.local_rank, p.local_size)).collect();
        assert_eq!(hosts, [(0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 2), (1, 1, 2)]);
        for n in 1..=9 {
            for h in 1..=n {
                let places = layout(n, h);
                for (r, p) in places.iter().enumerate() {
                    assert_eq!(p.host, r * h / n);
                    assert!(p.local_rank < p.local_size);
                }
                assert_eq!(places.last().map(|p| p.host), Some(h - 1));
            }
        }
    }

    #[test]
    fn cli_rejects_zero_ranks_and_parses_env() {
        assert!(Cli::try_parse_from(["toroid-run", "-n", "0", "--", "true"]).is_err());
        let cli = Cli::try_parse_from(["toroid-run", "-n", "2", "--env", "A=b=c", "--", "x", "-y"]);
        let cli = cli.expect("valid command line");
        assert_eq!(cli.env, [("A".to_string(), "b=c".to_string())]);
        assert_eq!(cli.command, [OsString::from("x"), OsString::from("-y")]);
        Cli::command().debug_assert();
    }
}
