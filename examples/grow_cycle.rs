//! The elastic cycle, timed side by side in one run: N ranks on this host all-reduce in a loop
//! until one is killed (SIGKILL); the survivors shrink, grow back with a new process (started
//! in advance, waiting for the token) and all-reduce on N ranks again. Then the same recovery
//! done the other way: the new member is killed, the survivors destroy every communicator and
//! create a new one through a fresh store with another waiting process. Both are timed on
//! rank 0 from the moment its all-reduce returns the error to the end of the first all-reduce
//! of N ranks (checked element by element), and from the first survivor's error (the kill
//! detected) to the last rank's end of that all-reduce. Per trial and the median over trials.
//!
//! ```text
//! cargo run --release --example grow_cycle -- [RANKS (8)] [TRIALS (5)] [shm|tcp]
//! ```

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use toroid::rendezvous::{Store, TcpStore};
use toroid::{Communicator, Config, JoinToken, ReduceOp};

const ROLE: &str = "GROW_CYCLE_ROLE";
const DIR: &str = "GROW_CYCLE_DIR";
const PORT: &str = "GROW_CYCLE_REINIT_PORT";
const COUNT: usize = 1 << 16;
const TIMEOUT_S: u64 = 20;

fn main() {
    match std::env::var(ROLE).as_deref() {
        Ok("rank") => rank_body(),
        Ok("joiner") => joiner_body(),
        Ok("reinit") => reinit_body(),
        _ => orchestrate(),
    }
}

fn env_usize(k: &str) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{k} is not set"))
}

fn input(r: usize, i: usize) -> i64 {
    ((r as i64 + 1) * 1_000_003 + i as i64 * 7919) % 1_000_000_007
}

/// All-reduces every rank's input and checks every element.
fn check(comm: &Communicator) {
    let mut v: Vec<i64> = (0..COUNT).map(|i| input(comm.rank(), i)).collect();
    comm.all_reduce(&mut v, ReduceOp::Sum).expect("all-reduce");
    for (i, got) in v.iter().enumerate() {
        let want: i64 = (0..comm.size()).map(|r| input(r, i)).sum();
        assert_eq!(*got, want, "element {i}");
    }
}

/// All-reduces until one fails (the victim kills itself after 100 ms); returns when it did.
fn until_error(comm: &Communicator, victim: usize) -> Instant {
    if comm.rank() == victim {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            // SAFETY: kill(2) on our own pid; no memory is involved.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        });
    }
    let mut buf = vec![1.0f32; 1 << 18];
    let start = Instant::now();
    loop {
        if comm.all_reduce(&mut buf, ReduceOp::Sum).is_err() {
            return Instant::now();
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no error within 30 s");
    }
}

fn write_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

fn wait_file(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(2 * TIMEOUT_S);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            return s;
        }
        assert!(Instant::now() < deadline, "{} never came", path.display());
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// Wall-clock microseconds (the processes of one host share the clock).
fn wall_us() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros())
}

fn dir() -> PathBuf {
    PathBuf::from(std::env::var(DIR).expect("dir"))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn rank_body() {
    let comm = Communicator::from_env().expect("create");
    let n = comm.size();
    let cfg = Config::global().expect("config").clone();
    // 1. Kill, shrink, grow.
    let t0 = until_error(&comm, n - 1);
    let err0 = wall_us();
    let small = comm.shrink(&[n - 1]).expect("shrink");
    let shrunk = t0.elapsed();
    let offer = small.grow_offer(1).expect("grow_offer");
    if small.rank() == 0 {
        write_file(&dir().join("token"), &offer.token().to_string());
    }
    let grown = small.grow(offer).expect("grow");
    let joined = t0.elapsed();
    check(&grown);
    let grow_total = t0.elapsed();
    println!("SPAN grow {err0} {}", wall_us());
    // 2. Kill the new member; destroy everything and re-create through a fresh store.
    let t1 = until_error(&grown, n - 1);
    let err1 = wall_us();
    drop(grown);
    drop(small);
    drop(comm);
    let destroyed = t1.elapsed();
    let addr = format!("127.0.0.1:{}", env_usize(PORT));
    let rank = env_usize("TOROID_RANK");
    let store: Arc<dyn Store> = if rank == 0 {
        let s = TcpStore::serve(&addr, cfg.timeout).expect("serve");
        write_file(&dir().join("reinit"), &addr);
        Arc::new(s)
    } else {
        Arc::new(TcpStore::connect(&addr, cfg.timeout).expect("connect"))
    };
    let fresh = Communicator::with_store(rank, n, store.clone(), &cfg).expect("re-create");
    check(&fresh);
    let reinit_total = t1.elapsed();
    println!("SPAN reinit {err1} {}", wall_us());
    if rank == 0 {
        println!(
            "TIMES {:.1} {:.1} {:.1} {:.1} {:.1}",
            ms(shrunk),
            ms(joined),
            ms(grow_total),
            ms(destroyed),
            ms(reinit_total)
        );
    }
    drop(fresh);
}

fn joiner_body() {
    let token: JoinToken = wait_file(&dir().join("token")).parse().expect("token");
    let rank = token.size() - 1;
    let grown = Communicator::join(&token, rank, Config::global().expect("config")).expect("join");
    check(&grown);
    println!("SPAN grow - {}", wall_us());
    until_error(&grown, rank); // the victim of part 2: dies here
}

fn reinit_body() {
    let addr = wait_file(&dir().join("reinit"));
    let cfg = Config::global().expect("config");
    let n = env_usize("TOROID_WORLD_SIZE");
    let store: Arc<dyn Store> = Arc::new(TcpStore::connect(&addr, cfg.timeout).expect("connect"));
    let fresh = Communicator::with_store(n - 1, n, store, cfg).expect("re-create");
    check(&fresh);
    println!("SPAN reinit - {}", wall_us());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn spawn(role: &str, rank: usize, n: usize, port: u16, reinit: u16, dir: &Path, tcp: bool) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(ROLE, role)
        .env(DIR, dir)
        .env(PORT, reinit.to_string())
        .env("TOROID_RANK", rank.to_string())
        .env("TOROID_WORLD_SIZE", n.to_string())
        .env("TOROID_STORE_ADDR", format!("127.0.0.1:{port}"))
        .env("TOROID_TIMEOUT", TIMEOUT_S.to_string())
        .env("TOROID_DEBUG", std::env::var("TOROID_DEBUG").unwrap_or_else(|_| "OFF".into()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(if std::env::var_os("GROW_CYCLE_VERBOSE").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        });
    if tcp {
        cmd.env("TOROID_SHM_DISABLE", "1");
    }
    cmd.spawn().expect("spawn")
}

/// Milliseconds from the earliest error any survivor saw in `phase` to the last of the `n`
/// ranks' end of the first all-reduce (the `SPAN` lines of every process).
fn span(all: &str, phase: &str, n: usize) -> f64 {
    let (mut first, mut last, mut done) = (u128::MAX, 0u128, 0);
    for l in all.lines().filter_map(|l| l.strip_prefix("SPAN ")) {
        let f: Vec<&str> = l.split(' ').collect();
        if f.len() != 3 || f[0] != phase {
            continue;
        }
        if let Ok(e) = f[1].parse::<u128>() {
            first = first.min(e);
        }
        last = last.max(f[2].parse::<u128>().unwrap_or(0));
        done += 1;
    }
    assert_eq!(done, n, "{phase}: {done} of {n} ranks finished");
    (last.saturating_sub(first)) as f64 / 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn orchestrate() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.first().and_then(|v| v.parse().ok()).unwrap_or(8);
    let trials: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(5);
    let tcp = args.get(2).is_some_and(|v| v == "tcp");
    assert!(n >= 2 && trials >= 1, "usage: grow_cycle [RANKS >= 2] [TRIALS >= 1] [shm|tcp]");
    println!(
        "{n} ranks on this host over {}, {trials} trials; ms from the error on rank 0",
        if tcp { "TCP" } else { "shm" }
    );
    println!(
        "| trial | shrink | grow done | grow: first all-reduce of {n} | from the first error to the last rank's | \
         destroyed | re-create: first all-reduce of {n} | from the first error to the last rank's | ratio (last columns) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut rows: Vec<Vec<f64>> = Vec::new();
    for t in 0..trials {
        let dir = std::env::temp_dir().join(format!("toroid-grow-cycle-{}-{t}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (port, reinit) = (free_port(), free_port());
        let mut kids: Vec<Child> = (0..n).map(|r| spawn("rank", r, n, port, reinit, &dir, tcp)).collect();
        kids.push(spawn("joiner", n - 1, n, port, reinit, &dir, tcp));
        kids.push(spawn("reinit", n - 1, n, port, reinit, &dir, tcp));
        let deadline = Instant::now() + Duration::from_secs(6 * TIMEOUT_S);
        let mut out0 = String::new();
        let mut all = String::new();
        for (i, mut k) in kids.into_iter().enumerate() {
            while k.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = k.kill();
            let o = k.wait_with_output().expect("wait");
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            all.push_str(&text);
            if i == 0 {
                out0 = text;
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        let line = out0
            .lines()
            .find(|l| l.starts_with("TIMES "))
            .unwrap_or_else(|| panic!("trial {t}: rank 0 said {out0:?}"));
        let mut v: Vec<f64> = line[6..].split(' ').map(|x| x.parse().unwrap()).collect();
        v.insert(3, span(&all, "grow", n));
        v.push(span(&all, "reinit", n));
        println!(
            "| {t} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x |",
            v[0],
            v[1],
            v[2],
            v[3],
            v[4],
            v[5],
            v[6],
            v[6] / v[3]
        );
        rows.push(v);
    }
    let col = |i: usize| median(rows.iter().map(|r| r[i]).collect());
    println!(
        "| median | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x |",
        col(0),
        col(1),
        col(2),
        col(3),
        col(4),
        col(5),
        col(6),
        col(6) / col(3)
    );
}
