//! Grow with real processes: a rank killed mid-loop, the survivors shrink, and a new process
//! joins them with the survivors' token (over shared memory and over TCP), every rank then
//! all-reducing exactly; a healthy communicator grown by two processes that join in the
//! background, one of which first tries a forged token and is refused; and a grow nobody joins,
//! which fails on every old rank within the timeout.
//!
//! The token goes from the old rank 0 to the new processes through a file the test names, as a
//! framework's own store or orchestrator would carry it.

mod util;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use toroid::{Communicator, Config, JoinToken, ReduceOp};

const TIMEOUT_S: u64 = 10;
const COUNT: usize = 10_000;
/// The token file's path, in every process of a case.
const TOKEN_VAR: &str = "GROW_TEST_TOKEN";
/// Set (to the rank to join as) in the new processes.
const JOIN_VAR: &str = "GROW_TEST_JOIN_AS";

/// Rank `r`'s input (the new process that takes rank `r` has the same): random 40-bit values,
/// so that sums of a few stay exact in i64.
fn input(r: usize, i: usize) -> i64 {
    (util::data::mix(((r as u64) << 32) ^ i as u64 ^ 0x6e7) >> 24) as i64
}

/// All-reduces rank inputs on `comm` and checks every element against the sum computed here.
fn check_sum(comm: &Communicator) {
    let mut v: Vec<i64> = (0..COUNT).map(|i| input(comm.rank(), i)).collect();
    comm.all_reduce(&mut v, ReduceOp::Sum).expect("all-reduce on the grown communicator");
    for (i, got) in v.iter().enumerate() {
        let want: i64 = (0..comm.size()).map(|r| input(r, i)).sum();
        assert_eq!(*got, want, "element {i}");
    }
}

fn env(tcp: bool, token: &Path) -> Vec<(String, String)> {
    let mut e = vec![
        ("TOROID_TIMEOUT".to_string(), TIMEOUT_S.to_string()),
        (TOKEN_VAR.to_string(), token.display().to_string()),
    ];
    if tcp {
        e.push(("TOROID_SHM_DISABLE".into(), "1".into()));
    }
    e
}

/// Rank 0's side of the hand-over: the token, written whole (renamed into place).
fn publish(token: &JoinToken) {
    let path = PathBuf::from(std::env::var(TOKEN_VAR).expect("token path"));
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, token.to_string()).expect("write token");
    std::fs::rename(&tmp, &path).expect("rename token");
}

/// A new process: joins as rank `JOIN_VAR` with the token in the file (and, with `forged`,
/// first with a forged copy, which must be refused).
fn joiner_body(forged: bool) -> Communicator {
    let rank: usize = std::env::var(JOIN_VAR).unwrap().parse().unwrap();
    let text = std::fs::read_to_string(std::env::var(TOKEN_VAR).unwrap()).expect("token file");
    let token: JoinToken = text.parse().expect("token parses");
    let cfg = Config::global().expect("config");
    if forged {
        // The same address and size with another secret: the grow's store refuses it.
        let mut bad = text.clone();
        let i = "toroid-join1/".len() + token.size().to_string().len() + 1;
        let flip = if &bad[i..i + 1] == "0" { "1" } else { "0" };
        bad.replace_range(i..i + 1, flip);
        let t = Instant::now();
        let e = Communicator::join(&bad.parse().unwrap(), rank, cfg).expect_err("a forged token joined");
        println!("FORGED REFUSED in {} ms: {e}", t.elapsed().as_millis());
    }
    let t = Instant::now();
    let pending = Communicator::join_async(&token, rank, cfg).expect("join_async");
    while !pending.is_done() {
        assert!(t.elapsed() < Duration::from_secs(2 * TIMEOUT_S), "join not done");
        std::thread::sleep(Duration::from_millis(1));
    }
    let comm = pending.wait().unwrap_or_else(|e| panic!("join as rank {rank}: {e}"));
    println!("JOINED in {} ms as rank {} of {}", t.elapsed().as_millis(), comm.rank(), comm.size());
    comm
}

/// Starts a new process of test `test` that joins as `rank`.
fn spawn_joiner(test: &str, rank: usize, env: &[(String, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(util::CHILD_VAR, "1")
        .env(JOIN_VAR, rank.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn joiner")
}

/// Waits for the token file (the old ranks' offer), at most until `deadline`.
fn wait_for_token(path: &Path, deadline: Instant) -> bool {
    while Instant::now() < deadline {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

/// A temporary directory for one case's token (removed on drop).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("toroid-grow-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Old rank body: rank 3 of 4 dies mid-loop; the others see the error, shrink, offer one
/// rank, and grow back to 4 with the process that joins; everyone checks an all-reduce.
fn replaced_rank_body() {
    let comm = Communicator::from_env().expect("create");
    if comm.rank() == 3 {
        util::kill_self_after(Duration::from_millis(300));
    }
    let (err, ms) = util::all_reduce_until_error(&comm, 1 << 18);
    println!("ERROR {} after {ms} ms: {err}", err.category());
    let t = Instant::now();
    let small = comm.shrink(&[3]).unwrap_or_else(|e| panic!("rank {}: shrink: {e}", comm.rank()));
    let shrunk = t.elapsed();
    let offer = small.grow_offer(1).expect("grow_offer");
    assert_eq!(offer.token().size(), 4);
    if small.rank() == 0 {
        publish(offer.token());
    }
    let offered = t.elapsed();
    let grown = small.grow(offer).unwrap_or_else(|e| panic!("rank {}: grow: {e}", small.rank()));
    assert_eq!((grown.rank(), grown.size()), (comm.rank(), 4), "old ranks keep their ranks");
    let g = t.elapsed();
    // Neither probed again: the survivors' and the grown communicator's cost model is the
    // parent's measured one (the new process is on the parent's host).
    assert_eq!(small.cost_model().0, comm.cost_model().0, "the shrink inherits the cost model");
    assert_eq!(grown.cost_model().0, comm.cost_model().0, "the grow inherits the cost model");
    assert_ne!(comm.cost_model().0, &toroid::internals::tuning::CostModel::default(), "the parent probed");
    check_sum(&grown);
    println!(
        "CYCLE shrink {} ms, offer {} ms, grow {} ms, first all-reduce {} ms (after the error)",
        shrunk.as_millis(),
        offered.as_millis(),
        g.as_millis(),
        t.elapsed().as_millis()
    );
    println!("SUM OK");
}

fn replaced_rank_case(test: &str, tcp: bool) {
    let dir = TempDir::new(if tcp { "tcp" } else { "shm" });
    let token = dir.0.join("token");
    let env = env(tcp, &token);
    let children = util::spawn_ranks(test, 4, |_| env.clone());
    let deadline = Instant::now() + Duration::from_secs(3 * TIMEOUT_S + 30);
    assert!(wait_for_token(&token, deadline), "no token was offered");
    let mut all = children;
    all.push(spawn_joiner(test, 3, &env));
    let pids: Vec<u32> = all.iter().map(|c| c.id()).collect();
    let (statuses, outputs) = util::wait_all(all, deadline);
    assert_eq!(statuses[3].and_then(|s| s.signal()), Some(libc::SIGKILL), "rank 3 should die by SIGKILL");
    for r in [0, 1, 2, 4] {
        let out = &outputs[r];
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "process {r} did not exit cleanly:\n{out}");
        assert!(out.contains("SUM OK"), "process {r}:\n{out}");
    }
    assert!(outputs[4].contains("JOINED") && outputs[4].contains("as rank 3 of 4"), "{}", outputs[4]);
    for line in outputs[0].lines().filter_map(|l| l.find("CYCLE").map(|i| &l[i..])) {
        println!("rank 0: {line}");
    }
    for pid in pids {
        assert!(!util::alive(pid), "process {pid} still running");
    }
}

/// A child process of a replaced-rank case runs its part; the test process runs the case.
fn replaced_rank_test(test: &str, tcp: bool) {
    if !util::is_child() {
        return replaced_rank_case(test, tcp);
    }
    if std::env::var_os(JOIN_VAR).is_some() {
        check_sum(&joiner_body(false));
        println!("SUM OK");
    } else {
        replaced_rank_body();
    }
}

#[test]
fn a_killed_rank_is_replaced_by_a_new_process_over_shm() {
    replaced_rank_test("a_killed_rank_is_replaced_by_a_new_process_over_shm", false);
}

#[test]
fn a_killed_rank_is_replaced_by_a_new_process_over_tcp() {
    replaced_rank_test("a_killed_rank_is_replaced_by_a_new_process_over_tcp", true);
}

#[test]
fn a_healthy_communicator_grows_by_two_and_a_forged_token_is_refused() {
    let test = "a_healthy_communicator_grows_by_two_and_a_forged_token_is_refused";
    if util::is_child() {
        if std::env::var_os(JOIN_VAR).is_some() {
            let forged = std::env::var(JOIN_VAR).unwrap() == "2";
            check_sum(&joiner_body(forged));
        } else {
            let comm = Communicator::from_env().expect("create");
            let offer = comm.grow_offer(2).expect("grow_offer");
            if comm.rank() == 0 {
                publish(offer.token());
            }
            let pending = comm.grow_async(offer).expect("grow_async");
            let grown = pending.wait().unwrap_or_else(|e| panic!("rank {}: grow: {e}", comm.rank()));
            assert_eq!((grown.rank(), grown.size()), (comm.rank(), 4));
            check_sum(&grown);
            // The old communicator still works.
            check_sum(&comm);
        }
        println!("SUM OK");
        return;
    }
    let dir = TempDir::new("healthy");
    let token = dir.0.join("token");
    let env = env(false, &token);
    let mut all = util::spawn_ranks(test, 2, |_| env.clone());
    let deadline = Instant::now() + Duration::from_secs(3 * TIMEOUT_S + 30);
    assert!(wait_for_token(&token, deadline), "no token was offered");
    all.push(spawn_joiner(test, 2, &env));
    all.push(spawn_joiner(test, 3, &env));
    let (statuses, outputs) = util::wait_all(all, deadline);
    for (p, out) in outputs.iter().enumerate() {
        assert_eq!(statuses[p].map(|s| s.success()), Some(true), "process {p} failed:\n{out}");
        assert!(out.contains("SUM OK"), "process {p}:\n{out}");
    }
    let forged = outputs[2].lines().find_map(|l| l.find("FORGED REFUSED").map(|i| &l[i..]));
    let forged = forged.unwrap_or_else(|| panic!("the forged token was not tried:\n{}", outputs[2]));
    println!("process 2: {forged}");
    assert!(forged.contains("join as rank 2 of 4"), "the refusal says what failed: {forged}");
}

#[test]
fn a_grow_nobody_joins_fails_on_every_old_rank_within_the_timeout() {
    let test = "a_grow_nobody_joins_fails_on_every_old_rank_within_the_timeout";
    const SHORT_S: u64 = 3;
    if util::is_child() {
        let comm = Communicator::from_env().expect("create");
        let offer = comm.grow_offer(1).expect("grow_offer");
        let t = Instant::now();
        let e = comm.grow(offer).expect_err("a grow without its new rank succeeded");
        println!("GROW FAILED in {} ms: {} {e}", t.elapsed().as_millis(), e.category());
        return;
    }
    let dir = TempDir::new("nobody");
    let token = dir.0.join("token");
    let mut env = env(false, &token);
    env[0].1 = SHORT_S.to_string();
    let children = util::spawn_ranks(test, 3, |_| env.clone());
    let deadline = Instant::now() + Duration::from_secs(4 * SHORT_S + 30);
    let (statuses, outputs) = util::wait_all(children, deadline);
    for (r, out) in outputs.iter().enumerate() {
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r} failed:\n{out}");
        let line = out
            .lines()
            .find_map(|l| l.find("GROW FAILED in ").map(|i| &l[i..]))
            .unwrap_or_else(|| panic!("rank {r}:\n{out}"));
        let ms: u64 = line["GROW FAILED in ".len()..].split(' ').next().unwrap().parse().unwrap();
        assert!(ms <= (SHORT_S + 3) * 1000, "rank {r} failed after {ms} ms: {line}");
        assert!(line.contains("rank 3"), "the error names the missing rank: {line}");
    }
}
