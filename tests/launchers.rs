//! toroid-bench under real launchers on this host: Open MPI's `mpirun`, PyTorch's `torchrun`
//! and Slurm's `srun` (a one-node Slurm cluster that the test configures, starts and stops
//! itself, with its own munge daemon). No store address is given: every job finds its store from
//! the launcher's own variables (a private file store for mpirun and srun on one host; under
//! torchrun, a port rank 0 publishes in torchrun's own store at MASTER_ADDR:MASTER_PORT). Each
//! run is bounded in time, every value is checked (`-c 1`, `#wrong` 0 on every row, exit 0), and
//! everything started is stopped and removed even when a check fails.
//!
//! A missing launcher fails its test with what to install (`scripts/setup.sh` installs them all:
//! openmpi-bin, slurm-wlm and munge from Debian, torch from PyPI).

mod bench_check;

use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use bench_check::{BENCH, Expect, Group, TempDir, assert_bench_ok, float_rows, run_bounded};

/// Upper bound on one launcher job (torchrun imports torch first: seconds on a loaded machine).
const LIMIT: Duration = Duration::from_secs(120);
const SIZES: [usize; 5] = [4096, 8192, 16384, 32768, 65536];
/// The benchmark's arguments besides the collective: 4K to 64K doubling, every value checked.
const BENCH_ARGS: [&str; 10] = ["-b", "4K", "-e", "64K", "-n", "2", "-w", "1", "-c", "1"];

/// The path of `tool` in PATH or the system directories (daemons live in /usr/sbin), or a test
/// failure saying what to install.
fn require(tool: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{tool} not found: install {package} (scripts/setup.sh installs everything the tests need)"
            )
        })
}

fn expect(collective: &str, n: usize) -> Expect<'static> {
    let redop = if matches!(collective, "all_reduce" | "reduce_scatter" | "reduce") { "sum" } else { "none" };
    Expect { ranks: n, redop, root: "-1", rows: float_rows(collective, n, &SIZES) }
}

fn is_root() -> bool {
    toroid::internals::sys::user::euid() == 0
}

/// The single-host job stores of launcher `tag` under toroid's private base directory
/// (`job-<tag>-<key>`): the same before and after a test means nothing was left behind.
fn job_dirs(tag: &str) -> Vec<PathBuf> {
    let base = toroid::rendezvous::env::private_base();
    let prefix = format!("job-{tag}-");
    let mut v: Vec<PathBuf> =
        fs::read_dir(&base).map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect()).unwrap_or_default();
    v.retain(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix)));
    v.sort();
    v
}

#[test]
fn mpirun_on_one_host() {
    let mpirun = require("mpirun", "openmpi-bin");
    let dir = TempDir::new("mpirun");
    let before = job_dirs("ompi");
    for (n, collective) in [(2, "all_reduce"), (3, "reduce_scatter")] {
        let what = format!("mpirun -n {n} toroid-bench --collective {collective}");
        let mut cmd = Command::new(&mpirun);
        bench_check::clean_launcher_env(&mut cmd);
        // Open MPI refuses root without these; --oversubscribe allows more ranks than cores.
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        cmd.args(["--oversubscribe", "-n", &n.to_string(), BENCH, "--collective", collective])
            .args(BENCH_ARGS);
        let job = run_bounded(&what, &mut cmd, &dir, LIMIT);
        assert_bench_ok(&what, &job, &expect(collective, n));
    }
    assert_eq!(job_dirs("ompi"), before, "single-host stores left behind");
}

/// The python that has torch, or a test failure saying what to install.
fn torch_python() -> String {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", "import torch.distributed.run"]).output();
    match probe {
        Ok(o) if o.status.success() => python,
        Ok(o) => panic!(
            "{python} cannot import torch.distributed.run: install torch (`pip install torch`; \
             scripts/setup.sh does): {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("cannot run {python}: {e}; install python3 and torch (scripts/setup.sh does)"),
    }
}

/// `torchrun <args> --no-python toroid-bench` on 2 ranks, every value checked.
fn torchrun_bench(what: &str, args: &[&str]) {
    let python = torch_python();
    let dir = TempDir::new("torchrun");
    let mut cmd = Command::new(&python);
    bench_check::clean_launcher_env(&mut cmd);
    // torchrun's own default of OMP_NUM_THREADS=1 (and its warning about it).
    cmd.env("OMP_NUM_THREADS", "1");
    // torchrun makes its own torchelastic_* directory under TMPDIR and leaves it behind: keep
    // it inside the test's directory, which is removed.
    cmd.env("TMPDIR", dir.path());
    cmd.args(["-m", "torch.distributed.run"])
        .args(args)
        .args(["--nproc-per-node", "2", "--no-python", BENCH])
        .args(BENCH_ARGS);
    let job = run_bounded(what, &mut cmd, &dir, LIMIT);
    assert_bench_ok(what, &job, &expect("all_reduce", 2));
}

#[test]
fn torchrun_standalone() {
    torchrun_bench("torchrun --standalone --nproc-per-node 2 toroid-bench", &["--standalone"]);
}

/// toroid's store takes a free port and publishes it in torchrun's own store: the port after
/// `MASTER_PORT` (the rule before torchrun's store was used) held by another socket does not
/// matter.
#[test]
fn torchrun_with_the_port_after_master_port_taken() {
    // A listener on some port q, and q - 1 free as torchrun's MASTER_PORT.
    let (held, master) = (0..50)
        .find_map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
            let q = l.local_addr().ok()?.port();
            let free = std::net::TcpListener::bind(("127.0.0.1", q.checked_sub(1)?)).is_ok();
            free.then_some((l, q - 1))
        })
        .expect("no pair of adjacent ports with the lower one free");
    let port = master.to_string();
    let what = format!("torchrun --master-port {port} toroid-bench, port {} held", master + 1);
    torchrun_bench(&what, &["--master-addr", "127.0.0.1", "--master-port", &port]);
    drop(held);
}

/// A one-node Slurm cluster in a temporary directory: its own munge daemon (own key and socket),
/// slurmctld and slurmd in the foreground as children, on free ports. Dropping it cancels its
/// jobs, stops the daemons and removes the directory.
struct Slurm {
    // Declared first: dropped (stopped) before the directory goes.
    daemons: Vec<Group>,
    conf: PathBuf,
    dir: TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn mkdir(p: &Path, mode: u32) {
    fs::create_dir_all(p).unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

impl Slurm {
    fn start() -> Slurm {
        assert!(
            is_root(),
            "the Slurm test starts slurmd, which must run as root to launch tasks: run the tests as \
             root (CI does)"
        );
        let munged = require("munged", "munge");
        let slurmctld = require("slurmctld", "slurm-wlm (slurmctld)");
        let slurmd = require("slurmd", "slurm-wlm (slurmd)");
        require("srun", "slurm-wlm (slurm-client)");
        require("sinfo", "slurm-wlm (slurm-client)");

        let dir = TempDir::new("slurm");
        // munged wants every directory above its socket searchable by all, and its key private.
        mkdir(dir.path(), 0o755);
        let (key_dir, run, state, spool, log) =
            (dir.join("key"), dir.join("run"), dir.join("state"), dir.join("spool"), dir.join("log"));
        mkdir(&key_dir, 0o700);
        for d in [&run, &state, &spool, &log] {
            mkdir(d, 0o755);
        }
        let mut slurm = Slurm { daemons: Vec::new(), conf: dir.join("slurm.conf"), dir };

        // A fresh random key (munged accepts 32 bytes and more), readable by root only.
        let key = key_dir.join("munge.key");
        let mut bytes = [0u8; 1024];
        fs::File::open("/dev/urandom").unwrap().read_exact(&mut bytes).unwrap();
        fs::write(&key, bytes).unwrap();
        fs::set_permissions(&key, fs::Permissions::from_mode(0o600)).unwrap();
        let socket = run.join("munge.sock");
        let mut cmd = Command::new(munged);
        cmd.arg("--foreground")
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--pid-file={}", run.join("munged.pid").display()))
            .arg(format!("--seed-file={}", key_dir.join("munged.seed").display()))
            .arg(format!("--log-file={}", log.join("munged.log").display()))
            .stdout(fs::File::create(log.join("munged.out")).unwrap())
            .stderr(fs::File::create(log.join("munged.err")).unwrap());
        slurm.daemons.push(Group::spawn("munged", &mut cmd));
        slurm.wait_for("munged's socket", Duration::from_secs(20), |_| socket.exists());

        let conf = format!(
            "# One-node cluster of tests/launchers.rs.
ClusterName=toroidtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket}
CredType=cred/munge
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd.pid
SlurmctldLogFile={log}/slurmctld.log
SlurmdLogFile={log}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# Take the node as configured (4 CPUs) whatever the hardware, so 4 tasks fit on 2 cores.
SlurmdParameters=config_overrides
NodeName=localhost NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=10 State=UP OverSubscribe=YES
",
            ctld_port = free_port(),
            d_port = free_port(),
            socket = socket.display(),
            state = state.display(),
            spool = spool.display(),
            run = run.display(),
            log = log.display(),
        );
        fs::write(&slurm.conf, conf).unwrap();
        let mut ctld = Command::new(slurmctld);
        ctld.args(["-D", "-i", "-f"])
            .arg(&slurm.conf)
            .env("SLURM_CONF", &slurm.conf)
            .stdout(fs::File::create(log.join("slurmctld.out")).unwrap())
            .stderr(fs::File::create(log.join("slurmctld.err")).unwrap());
        slurm.daemons.push(Group::spawn("slurmctld", &mut ctld));
        let mut d = Command::new(slurmd);
        d.args(["-D", "-N", "localhost", "-f"])
            .arg(&slurm.conf)
            .env("SLURM_CONF", &slurm.conf)
            .stdout(fs::File::create(log.join("slurmd.out")).unwrap())
            .stderr(fs::File::create(log.join("slurmd.err")).unwrap());
        slurm.daemons.push(Group::spawn("slurmd", &mut d));
        slurm.wait_for("the node to be idle (sinfo)", Duration::from_secs(60), |s| {
            s.command("sinfo")
                .args(["-h", "-n", "localhost", "-o", "%t"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle")
        });
        slurm
    }

    /// A Slurm client command talking to this cluster only.
    fn command(&self, tool: &str) -> Command {
        let mut cmd = Command::new(tool);
        bench_check::clean_launcher_env(&mut cmd);
        cmd.env("SLURM_CONF", &self.conf);
        cmd
    }

    /// Polls `ready` every 100 ms until `limit`; fails with the daemons' logs, or at once when
    /// a daemon exited.
    fn wait_for(&mut self, what: &str, limit: Duration, ready: impl Fn(&Slurm) -> bool) {
        let deadline = Instant::now() + limit;
        loop {
            if ready(self) {
                return;
            }
            let exited: Vec<String> = self
                .daemons
                .iter_mut()
                .filter_map(|d| d.try_wait().map(|s| format!("{} exited ({s})", d.name)))
                .collect();
            if !exited.is_empty() || Instant::now() >= deadline {
                panic!(
                    "waiting for {what}: {}\n{}",
                    if exited.is_empty() { format!("not after {limit:?}") } else { exited.join(", ") },
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn logs(&self) -> String {
        let mut s = String::new();
        for name in ["munged.log", "munged.err", "slurmctld.log", "slurmctld.err", "slurmd.log", "slurmd.err"]
        {
            let text = fs::read_to_string(self.dir.join("log").join(name)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            s.push_str(&format!("--- {name} (last lines)\n"));
            for l in tail.iter().rev() {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        // Cancel whatever is left (a timed-out step) so that its tasks go, give slurmd a moment
        // to reap them, then stop slurmd, slurmctld and munged in that order.
        if self.daemons.len() == 3 {
            if let Ok(mut c) = self.command("scancel").args(["--full", "--quiet", "--user", "root"]).spawn() {
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline && !matches!(c.try_wait(), Ok(Some(_))) {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = c.kill();
                let _ = c.wait();
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                let jobs = self.command("squeue").args(["-h", "-o", "%i"]).output();
                if jobs.is_ok_and(|o| o.status.success() && o.stdout.is_empty()) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        while let Some(mut d) = self.daemons.pop() {
            d.stop();
        }
    }
}

#[test]
fn srun_on_a_one_node_slurm_cluster() {
    let slurm = Slurm::start();
    let dir = TempDir::new("srun");
    let before = job_dirs("slurm");
    for (n, collective) in [(2, "all_reduce"), (4, "all_gather")] {
        let what = format!("srun -N1 -n {n} toroid-bench --collective {collective}");
        let mut cmd = slurm.command("srun");
        cmd.args([
            "-N1",
            "-n",
            &n.to_string(),
            "--time=5",
            "--kill-on-bad-exit=1",
            BENCH,
            "--collective",
            collective,
        ])
        .args(BENCH_ARGS);
        let job = run_bounded(&what, &mut cmd, &dir, LIMIT);
        if !job.status.success() {
            panic!("{what} failed: {}\n{}", job.show(), slurm.logs());
        }
        assert_bench_ok(&what, &job, &expect(collective, n));
    }
    assert_eq!(job_dirs("slurm"), before, "single-host stores left behind");
}
