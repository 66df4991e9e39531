//! A stranger attacks rank 0's rendezvous store while a real job of three rank processes sets
//! up. Rank 0 starts alone: it serves the store and waits in it for the others, the stranger
//! attacks, rank 0's memory is read from /proc, then ranks 1 and 2 start (with the stranger's
//! silent or dripping connections still open) and every rank must finish its collectives with
//! correct data. The store serves only during set-up (rank 0 stops it once every rank has
//! connected), so set-up is when a stranger can reach it.
//!
//! Rank 0's memory may grow by at most [`RSS_SLACK_KIB`] (resident set and its high-water mark):
//! a stranger without the token is held to a few dozen bytes per connection; one speaking to a
//! store without a token can make the server queue one answer of at most `MAX_FRAME` (about
//! 64 KiB) beyond `MAX_OUTPUT` (64 KiB), and hold one frame of input, plus what it stores (up to
//! `MAX_STORED`, 4 MiB, counted separately where a test stores).

mod util;

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use toroid::rendezvous::{MAX_STORED, MAX_VALUE};
use toroid::{Communicator, ReduceOp};

/// Growth of rank 0's memory allowed for one attack (KiB): the queued answer and buffered input
/// above (about 2.3 MiB, with the allocator's doubling of a growing buffer up to twice that),
/// and a margin for the allocator's arenas.
const RSS_SLACK_KIB: u64 = 3 * 1024;
const TOKEN: &str = "store-attack-test-token";
const N: usize = 3;

/// The body of every rank: join, then all-reduces of integer data checked exactly.
fn rank_body() {
    let comm = Communicator::from_env().expect("communicator");
    let (r, n) = (comm.rank() as i64, comm.size() as i64);
    for (round, len) in [(0i64, 1000usize), (1, 100_000), (2, 7)].iter().copied() {
        let mut buf: Vec<i64> = (0..len as i64).map(|i| i * (r + 1) + round).collect();
        comm.all_reduce(&mut buf, ReduceOp::Sum).expect("all_reduce");
        for (i, v) in buf.iter().enumerate() {
            let i = i as i64;
            assert_eq!(*v, i * n * (n + 1) / 2 + n * round, "rank {r} round {round} element {i}");
        }
    }
    println!("RESULT ok rank {r}");
}

/// Rank 0's resident set and its high-water mark, KiB.
fn memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("rank 0 is running");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The job's rank processes and their output files; dropping it kills what still runs and
/// removes the files.
struct Job {
    test: &'static str,
    port: u16,
    token: bool,
    dir: PathBuf,
    ranks: Vec<Child>,
}

impl Job {
    fn new(test: &'static str, token: bool) -> Job {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let dir = std::env::temp_dir().join(format!("toroid-store-attack-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Job { test, port: util::free_port(), token, dir, ranks: Vec::new() }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    fn spawn(&mut self, r: usize) {
        let out = File::create(self.dir.join(format!("rank{r}.log"))).unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", self.test, "--nocapture", "--test-threads=1"])
            .env(util::CHILD_VAR, "1")
            .env("TOROID_RANK", r.to_string())
            .env("TOROID_WORLD_SIZE", N.to_string())
            .env("TOROID_STORE_ADDR", self.addr().to_string())
            .env("TOROID_TIMEOUT", "20")
            .env_remove("TOROID_AUTH_TOKEN")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if self.token {
            cmd.env("TOROID_AUTH_TOKEN", TOKEN);
        }
        self.ranks.push(cmd.spawn().expect("spawn rank"));
    }

    /// Starts rank 0 and waits until its store accepts connections and it waits for the others.
    fn start_rank0(&mut self) -> u32 {
        self.spawn(0);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(self.addr()).is_err() {
            assert!(Instant::now() < deadline, "rank 0's store did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Let rank 0 reach its wait for rank 1's address.
        std::thread::sleep(Duration::from_millis(300));
        self.ranks[0].id()
    }

    /// Starts ranks 1 and 2 and asserts that every rank finishes with correct data.
    fn finish(&mut self) {
        for r in 1..N {
            self.spawn(r);
        }
        let deadline = Instant::now() + Duration::from_secs(40);
        for r in 0..N {
            let status = util::wait_until(&mut self.ranks[r], deadline);
            let log = std::fs::read_to_string(self.dir.join(format!("rank{r}.log"))).unwrap_or_default();
            assert_eq!(status.map(|s| s.success()), Some(true), "rank {r} failed:\n{log}");
            assert!(log.contains(&format!("RESULT ok rank {r}")), "rank {r}:\n{log}");
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.ranks {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `attack` against rank 0's store during set-up; what it returns (open connections, a
/// dripping thread) lives until the job has finished. Returns rank 0's memory before and after.
fn under_attack<T>(
    test: &'static str,
    token: bool,
    attack: impl FnOnce(SocketAddr) -> T,
) -> (u64, u64, u64, u64) {
    let mut job = Job::new(test, token);
    let pid = job.start_rank0();
    let (rss0, hwm0) = memory(pid);
    let held = attack(job.addr());
    std::thread::sleep(Duration::from_millis(300));
    let (rss1, hwm1) = memory(pid);
    println!("{test}: rank 0 VmRSS {rss0} -> {rss1} KiB, VmHWM {hwm0} -> {hwm1} KiB (token: {token})");
    job.finish();
    drop(held);
    (rss0, rss1, hwm0, hwm1)
}

fn assert_bounded((rss0, rss1, hwm0, hwm1): (u64, u64, u64, u64), extra_kib: u64) {
    let limit = RSS_SLACK_KIB + extra_kib;
    assert!(rss1.saturating_sub(rss0) <= limit, "VmRSS grew {rss0} -> {rss1} KiB (limit {limit})");
    assert!(hwm1.saturating_sub(hwm0) <= limit, "VmHWM grew {hwm0} -> {hwm1} KiB (limit {limit})");
}

// --- the stranger's side of the store protocol (version 2), by hand ---

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(payload);
    f
}

/// A hello without authentication. `STORE_ATTACK_PROTOCOL=1` speaks the protocol before
/// authentication existed (to measure the old server with the same tests).
fn plain_hello() -> Vec<u8> {
    let v1 = std::env::var("STORE_ATTACK_PROTOCOL").is_ok_and(|v| v == "1");
    let mut p = b"TRDV".to_vec();
    p.extend_from_slice(&(if v1 { 1u32 } else { 2 }).to_le_bytes());
    if !v1 {
        p.push(0);
    }
    frame(&p)
}

fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn get(key: &str) -> Vec<u8> {
    let mut p = vec![2u8];
    p.extend_from_slice(&0u64.to_le_bytes());
    bytes(&mut p, key.as_bytes());
    frame(&p)
}

fn set(key: &str, value: &[u8]) -> Vec<u8> {
    let mut p = vec![1u8];
    bytes(&mut p, key.as_bytes());
    bytes(&mut p, value);
    frame(&p)
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// One answer, or `None` once the server closed (answers above 2 MiB are refused unread).
fn answer(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0; 4];
    s.read_exact(&mut len).ok()?;
    let len = u32::from_le_bytes(len) as usize;
    assert!(len <= 2 << 20, "answer of {len} bytes");
    let mut body = vec![0; len];
    s.read_exact(&mut body).ok()?;
    Some(body)
}

/// Everything the server sends until it closes.
fn drain(s: &mut TcpStream) -> Vec<u8> {
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    all
}

#[test]
fn with_the_token_a_stranger_reads_nothing_and_changes_nothing() {
    if util::is_child() {
        return rank_body();
    }
    let m = under_attack("with_the_token_a_stranger_reads_nothing_and_changes_nothing", true, |addr| {
        // A plain client: refused, and nothing pipelined behind the hello is answered.
        let mut s = connect(addr);
        let mut req = plain_hello();
        req.extend(get("toroid/gen1/id"));
        req.extend(set("toroid/gen1/addr/1", b"10.6.6.6:1"));
        s.write_all(&req).unwrap();
        let a = answer(&mut s).expect("an answer to the hello");
        assert_ne!(a[0], 0, "a plain hello must be refused");
        assert!(String::from_utf8_lossy(&a).contains("TOROID_AUTH_TOKEN"));
        let rest = drain(&mut s);
        assert!(rest.is_empty(), "sent after the refusal: {rest:?}");
        // A client with a guessed token: its proof fails, nothing else is answered.
        let mut p = b"TRDV".to_vec();
        p.extend_from_slice(&2u32.to_le_bytes());
        p.push(1);
        p.extend_from_slice(&[7; 16]);
        let mut s = connect(addr);
        s.write_all(&frame(&p)).unwrap();
        let challenge = answer(&mut s).expect("a challenge");
        assert_eq!(challenge.len(), 2 + 16 + 32);
        let mut req = frame(&[0x55; 32]);
        req.extend(get("toroid/gen1/id"));
        s.write_all(&req).unwrap();
        let a = answer(&mut s).expect("an answer to the proof");
        assert_ne!(a[0], 0);
        assert!(drain(&mut s).is_empty());
    });
    assert_bounded(m, 0);
}

#[test]
fn without_the_token_a_stranger_reads_the_job_s_addresses() {
    if util::is_child() {
        return rank_body();
    }
    // Documented: without TOROID_AUTH_TOKEN the store is open to anyone who reaches its port
    // during set-up: the communicator id and every published address can be read.
    let m = under_attack("without_the_token_a_stranger_reads_the_job_s_addresses", false, |addr| {
        let mut s = connect(addr);
        s.write_all(&plain_hello()).unwrap();
        assert_eq!(answer(&mut s).unwrap()[0], 0);
        s.write_all(&get("toroid/gen1/addr/0")).unwrap();
        let a = answer(&mut s).unwrap();
        assert_eq!(a[0], 0);
        assert!(String::from_utf8_lossy(&a[1..]).starts_with("127.0.0.1:"), "{a:?}");
    });
    assert_bounded(m, 0);
}

#[test]
fn two_hundred_pipelined_gets_of_a_large_value_cost_rank_0_little() {
    if util::is_child() {
        return rank_body();
    }
    // Without a token (the worst case): the stranger stores the largest value it may, then asks
    // for it 200 times without reading.
    let m = under_attack("two_hundred_pipelined_gets_of_a_large_value_cost_rank_0_little", false, |addr| {
        let mut s = connect(addr);
        s.write_all(&plain_hello()).unwrap();
        assert_eq!(answer(&mut s).unwrap()[0], 0);
        s.write_all(&set("big", &vec![1; MAX_VALUE])).unwrap();
        assert_eq!(answer(&mut s).unwrap(), [0]);
        s.write_all(&get("big").repeat(200)).unwrap();
        s // held, unread, until the job is done
    });
    assert_bounded(m, (MAX_VALUE / 1024) as u64);
}

#[test]
fn big_sets_up_to_the_caps_then_a_disconnect_are_bounded() {
    if util::is_child() {
        return rank_body();
    }
    let m = under_attack("big_sets_up_to_the_caps_then_a_disconnect_are_bounded", false, |addr| {
        // A frame claiming 60 MiB: refused from its header, nothing allocated.
        let mut s = connect(addr);
        s.write_all(&plain_hello()).unwrap();
        assert_eq!(answer(&mut s).unwrap()[0], 0);
        s.write_all(&(60u32 << 20).to_le_bytes()).unwrap();
        assert!(String::from_utf8_lossy(&answer(&mut s).unwrap()).contains("exceeds"));
        assert!(drain(&mut s).is_empty());
        // Values of the largest size until the store is full, then gone.
        let mut s = connect(addr);
        s.write_all(&plain_hello()).unwrap();
        assert_eq!(answer(&mut s).unwrap()[0], 0);
        let value = vec![3; MAX_VALUE];
        let mut stored = 0;
        loop {
            s.write_all(&set(&format!("junk/{stored}"), &value)).unwrap();
            let a = answer(&mut s).unwrap();
            if a != [0] {
                assert!(String::from_utf8_lossy(&a).contains("store full"), "{a:?}");
                break;
            }
            stored += 1;
            assert!(stored <= MAX_STORED / MAX_VALUE, "stored {stored} values of the largest size");
        }
    });
    // What it stored stays until the server stops: bounded by MAX_STORED.
    assert_bounded(m, (MAX_STORED / 1024) as u64);
}

#[test]
fn a_wait_on_millions_of_keys_is_refused() {
    if util::is_child() {
        return rank_body();
    }
    let m = under_attack("a_wait_on_millions_of_keys_is_refused", false, |addr| {
        let mut s = connect(addr);
        s.write_all(&plain_hello()).unwrap();
        assert_eq!(answer(&mut s).unwrap()[0], 0);
        // 4 million empty keys: 4 bytes each, so the frame is 16 MB.
        let n = 4_000_000u32;
        let mut p = vec![4u8];
        p.extend_from_slice(&u64::MAX.to_le_bytes());
        p.extend_from_slice(&n.to_le_bytes());
        p.resize(p.len() + 4 * n as usize, 0);
        let _ = s.write_all(&frame(&p)); // the server may close before all of it is written
        let a = answer(&mut s).expect("an answer");
        assert_ne!(a[0], 0);
        assert!(String::from_utf8_lossy(&a).contains("limit"), "{}", String::from_utf8_lossy(&a));
    });
    assert_bounded(m, 0);
}

#[test]
fn a_flood_of_connections_does_not_stop_set_up() {
    if util::is_child() {
        return rank_body();
    }
    let m = under_attack("a_flood_of_connections_does_not_stop_set_up", true, |addr| {
        // Held open and silent while the other ranks join.
        (0..1000).map(|_| TcpStream::connect(addr).unwrap()).collect::<Vec<_>>()
    });
    assert_bounded(m, 0);
}

#[test]
fn a_silent_connection_is_dropped_and_does_not_stop_set_up() {
    if util::is_child() {
        return rank_body();
    }
    let start = Instant::now();
    let mut silent = None;
    let m = under_attack("a_silent_connection_is_dropped_and_does_not_stop_set_up", true, |addr| {
        let s = connect(addr);
        silent = Some(s.try_clone().unwrap());
        s
    });
    // Closed by the server: at its handshake deadline, or when it stopped after set-up.
    let mut s = silent.unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(drain(&mut s).is_empty());
    assert!(start.elapsed() < Duration::from_secs(30));
    assert_bounded(m, 0);
}

#[test]
fn a_connection_dripping_a_byte_a_second_does_not_stop_set_up() {
    if util::is_child() {
        return rank_body();
    }
    let m = under_attack("a_connection_dripping_a_byte_a_second_does_not_stop_set_up", true, |addr| {
        let mut s = connect(addr);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let drip = std::thread::spawn(move || {
            let hello = plain_hello();
            for b in hello.iter().cycle().take(30) {
                if flag.load(std::sync::atomic::Ordering::Relaxed) || s.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        });
        // Stops the drip when the job is done.
        struct Stop(std::sync::Arc<std::sync::atomic::AtomicBool>, Option<std::thread::JoinHandle<()>>);
        impl Drop for Stop {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
                if let Some(t) = self.1.take() {
                    let _ = t.join();
                }
            }
        }
        Stop(stop, Some(drip))
    });
    assert_bounded(m, 0);
}
