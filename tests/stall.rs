//! The stall report with real processes: four ranks run all-reduces, one of them (the culprit)
//! stops, skips a collective, issues a different one, dies, or is merely slow, and every
//! surviving rank's error must carry the one line that names it, within the timeout plus a few
//! seconds. Each case runs over shared memory and over TCP (`TOROID_SHM_DISABLE=1`).
//!
//! Ranks print `ERROR <category> after <ms> ms: <error>` (the failing call's duration) or
//! `DONE`; the harness waits for the survivors, then kills a stopped culprit.

mod util;

use std::time::{Duration, Instant};

use toroid::{Communicator, ReduceOp};

const TIMEOUT_S: u64 = 4;
const N: usize = 4;
const ITERS: usize = 20;
/// The iteration at which the culprit misbehaves (collective `#(FIRST + AT)`).
const AT: usize = 10;
const COUNT: usize = 1024;
/// How long a rank stays up after its error (more than the report's 2 s grace).
const LINGER_MS: u64 = 2500;

/// One rank's part: all-reduces, with the culprit misbehaving at iteration `AT`.
fn rank_body(case: &str, culprit: usize) {
    let comm = Communicator::from_env().unwrap();
    let mut buf = vec![1.0f32; COUNT];
    let report = |e: toroid::Error, t: Instant| {
        println!("ERROR {} after {} ms: {e}", e.category(), t.elapsed().as_millis());
        // Stay up a moment, as a job does while it logs and cleans up: a rank that fails at
        // the same time as this one may still be asking for snapshots, and would find this
        // process gone (reported as such: see docs/OBSERVABILITY.md, section 3).
        std::thread::sleep(Duration::from_millis(LINGER_MS));
    };
    for i in 0..ITERS {
        let t = Instant::now();
        if comm.rank() == culprit && i == AT {
            match case {
                // SAFETY: kill(2) on our own pid; no memory is involved.
                "stop" => unsafe {
                    libc::kill(libc::getpid(), libc::SIGSTOP);
                },
                // SAFETY: as above.
                "die" => unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                },
                "skip" => {
                    // User code that skipped the collective and runs past the others' timeout;
                    // the abort (and its line) arrives at the next call.
                    std::thread::sleep(Duration::from_secs(TIMEOUT_S + 3));
                    continue;
                }
                "different" => {
                    if let Err(e) = comm.broadcast(&mut buf, 0) {
                        return report(e, t);
                    }
                    continue;
                }
                "slow" => std::thread::sleep(Duration::from_millis(TIMEOUT_S * 1000 / 2)),
                _ => panic!("unknown case {case}"),
            }
        }
        if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
            return report(e, t);
        }
        buf.fill(1.0);
    }
    println!("DONE");
}

/// Runs `test` (this test's own name) as 4 rank processes and checks every survivor's line.
/// `expect(line, lines)` judges one survivor's error line; `lines` has every rank's, by rank.
fn run_case(
    test: &str,
    case: &str,
    culprit: usize,
    tcp: bool,
    expect: impl Fn(&str, &[Option<&str>]) -> bool,
) {
    if util::is_child() {
        let case = std::env::var("STALL_CASE").unwrap();
        let culprit = std::env::var("STALL_CULPRIT").unwrap().parse().unwrap();
        return rank_body(&case, culprit);
    }
    let mut children = util::spawn_ranks(test, N, |_| {
        let mut env = vec![
            ("TOROID_TIMEOUT".to_string(), TIMEOUT_S.to_string()),
            ("STALL_CASE".to_string(), case.to_string()),
            ("STALL_CULPRIT".to_string(), culprit.to_string()),
        ];
        if tcp {
            env.push(("TOROID_SHM_DISABLE".into(), "1".into()));
        }
        env
    });
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    // The culprit when it stops or dies is not waited for with the others.
    let odd = if matches!(case, "stop" | "die") { Some(children.remove(culprit)) } else { None };
    let deadline = Instant::now() + Duration::from_secs(TIMEOUT_S * 2 + 30);
    let (statuses, mut outputs) = util::wait_all(children, deadline);
    if let Some(mut c) = odd {
        let _ = c.kill(); // SIGKILL ends a stopped process too
        let _ = c.wait();
        outputs.insert(culprit, String::new());
    }
    let survivors: Vec<usize> = (0..N).filter(|&r| r != culprit || !matches!(case, "stop" | "die")).collect();
    let lines: Vec<Option<&str>> = outputs.iter().map(|o| util::error_line(o).map(|(l, _)| l)).collect();
    for (i, &r) in survivors.iter().enumerate() {
        let out = &outputs[r];
        assert_eq!(statuses[i].map(|s| s.success()), Some(true), "rank {r} did not exit cleanly:\n{out}");
        if case == "slow" {
            assert!(
                out.contains("DONE") && !out.contains("ERROR"),
                "rank {r}: a slow rank is no error:\n{out}"
            );
            continue;
        }
        let (line, ms) = util::error_line(out).unwrap_or_else(|| panic!("rank {r} saw no error:\n{out}"));
        assert!(expect(line, &lines), "rank {r}: wrong conclusion: {line}\n{out}");
        // Within the timeout plus the report's grace and a margin (the skipping rank's call
        // fails at once: its error waited for it).
        assert!(ms < (TIMEOUT_S + 5) * 1000, "rank {r} took {ms} ms: {line}");
    }
    for pid in pids {
        assert!(!util::alive(pid), "process {pid} still running");
    }
}

/// The line ends its conclusion with the ranks that wait, the culprit not among them. (Which
/// waiters are listed depends on who had exited before they were asked: a rank that failed
/// exits at once, and is then left out.)
fn waiters_ok(line: &str, culprit: usize) -> bool {
    let Some(i) = line.find(" on it").or_else(|| line.find(" on them")) else { return false };
    let head = &line[..i];
    let Some(j) = head.rfind("; ") else { return false };
    let list = head[j + 2..].trim_end_matches(" wait").trim_end_matches(" waits");
    !list.is_empty() && !list.contains(&culprit.to_string())
}

fn stop(test: &str, culprit: usize, tcp: bool) {
    let want = format!("rank {culprit} is not answering (stopped or hung) during all_reduce #");
    run_case(test, "stop", culprit, tcp, |l, _| l.contains(&want) && waiters_ok(l, culprit));
}

fn skip(test: &str, culprit: usize, tcp: bool) {
    let want = format!("rank {culprit} never entered all_reduce #");
    let alone =
        |l: &str| l.contains(&want) && l.contains("(last seen in all_reduce #") && waiters_ok(l, culprit);
    run_case(test, "skip", culprit, tcp, |l, lines| alone(l) || late_bystanders(l, culprit, lines, &alone));
}

/// Under load a rank can still be on its way into the collective when a waiter takes the
/// snapshots; the report then truly lists it beside the culprit ("ranks 0-1 never entered
/// all_reduce #13"). That is right only if the culprit is in the group, no waiter is, and each
/// other rank in it later entered and, in its own line, named the culprit `alone`.
fn late_bystanders(line: &str, culprit: usize, lines: &[Option<&str>], alone: &dyn Fn(&str) -> bool) -> bool {
    let Some(i) = line.find(" never entered all_reduce #") else { return false };
    let head = &line[..i];
    let from = head.rfind(": ").max(head.rfind("; ")).map_or(0, |j| j + 2);
    let Some(group) = rank_list(&head[from..]) else { return false };
    group.contains(&culprit)
        && group.len() > 1
        && waiters_ok(line, culprit)
        && group.iter().all(|&r| r == culprit || lines.get(r).copied().flatten().is_some_and(alone))
}

/// The ranks of a report's list: "rank 3", "ranks 0-1", "ranks 1, 3, 5-7".
fn rank_list(s: &str) -> Option<Vec<usize>> {
    let list = s.strip_prefix("ranks ").or_else(|| s.strip_prefix("rank "))?;
    let mut ranks = Vec::new();
    for part in list.split(", ") {
        match part.split_once('-') {
            Some((a, b)) => ranks.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
            None => ranks.push(part.parse().ok()?),
        }
    }
    Some(ranks)
}

fn different(test: &str, culprit: usize, tcp: bool) {
    // The culprit is the minority; the majority lists the ranks that had entered the collective
    // when their snapshots were taken (a rank on its way is not in either group).
    let want = format!("rank {culprit} and rank");
    let tail = format!(": broadcast {COUNT} x float root 0 vs all_reduce {COUNT} x float sum");
    run_case(test, "different", culprit, tcp, |l, _| {
        let Some(i) = l.find(&want) else { return false };
        let Some(j) = l[i..].find(" disagree at #") else { return false };
        !l[i + want.len()..i + j].contains(&culprit.to_string()) && l[i + j..].contains(&tail)
    });
}

fn die(test: &str, culprit: usize, tcp: bool) {
    let want = format!("rank {culprit} died during all_reduce #");
    run_case(test, "die", culprit, tcp, |l, _| l.contains(&want) && waiters_ok(l, culprit));
}

/// The harness's own judgement of a late bystander (no processes): accepted only with the
/// culprit in the group and the bystander's own line naming the culprit alone.
#[test]
fn a_late_bystander_is_judged_by_its_own_line() {
    let alone = |l: &str| l.contains("rank 0 never entered all_reduce #") && waiters_ok(l, 0);
    let r1 = "timeout: rank 0 never entered all_reduce #13 (last seen in all_reduce #12); ranks 1-3 wait on it: ...";
    let r2 = "timeout: ranks 0-1 never entered all_reduce #13 (last seen in all_reduce #12); ranks 2-3 wait on them: ...";
    assert!(late_bystanders(r2, 0, &[None, Some(r1), Some(r2), Some(r1)], &alone));
    // The bystander's own line blames someone else, or it has none: rejected.
    assert!(!late_bystanders(r2, 0, &[None, Some(r2), Some(r2), Some(r1)], &alone));
    assert!(!late_bystanders(r2, 0, &[None, None, Some(r2), Some(r1)], &alone));
    // The culprit is not in the group, or a waiter is the culprit: rejected.
    let wrong =
        "timeout: ranks 1-2 never entered all_reduce #13 (last seen in all_reduce #12); rank 3 waits on them";
    assert!(!late_bystanders(wrong, 0, &[None, Some(r1), Some(r1), Some(r1)], &alone));
    let waiter = "timeout: ranks 0-1 never entered all_reduce #13 (last seen in all_reduce #12); ranks 0, 2 wait on them";
    assert!(!late_bystanders(waiter, 0, &[None, Some(r1), Some(r1), Some(r1)], &alone));
    assert_eq!(rank_list("ranks 1, 3, 5-7"), Some(vec![1, 3, 5, 6, 7]));
    assert_eq!(rank_list("rank 4"), Some(vec![4]));
}

#[test]
fn stopped_rank_shm() {
    stop("stopped_rank_shm", 2, false);
}
#[test]
fn stopped_rank_tcp() {
    stop("stopped_rank_tcp", 2, true);
}
#[test]
fn skipped_collective_shm() {
    skip("skipped_collective_shm", 1, false);
}
#[test]
fn skipped_collective_tcp() {
    skip("skipped_collective_tcp", 1, true);
}
#[test]
fn skipped_collective_by_rank_zero_shm() {
    skip("skipped_collective_by_rank_zero_shm", 0, false);
}
#[test]
fn skipped_collective_by_rank_zero_tcp() {
    skip("skipped_collective_by_rank_zero_tcp", 0, true);
}
#[test]
fn different_collective_shm() {
    different("different_collective_shm", 3, false);
}
#[test]
fn different_collective_tcp() {
    different("different_collective_tcp", 3, true);
}
#[test]
fn dead_rank_shm() {
    die("dead_rank_shm", 2, false);
}
#[test]
fn dead_rank_tcp() {
    die("dead_rank_tcp", 2, true);
}
#[test]
fn slow_rank_shm() {
    run_case("slow_rank_shm", "slow", 1, false, |_, _| true);
}
#[test]
fn slow_rank_tcp() {
    run_case("slow_rank_tcp", "slow", 1, true, |_, _| true);
}

/// `dump()` on a healthy job: every rank answers, nobody is blamed, a row per rank.
#[test]
fn dump_of_a_healthy_job_names_every_rank_and_blames_nobody() {
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let mut buf = vec![1.0f32; COUNT];
        for _ in 0..3 {
            comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        }
        let d = comm.dump().unwrap();
        println!("DUMP {}", d.replace('\n', " | "));
        // Keep every rank's control plane up until all have dumped.
        comm.barrier().unwrap();
        return;
    }
    let children = util::spawn_ranks("dump_of_a_healthy_job_names_every_rank_and_blames_nobody", N, |_| {
        vec![("TOROID_TIMEOUT".into(), "20".into())]
    });
    let (statuses, outputs) = util::wait_all(children, Instant::now() + Duration::from_secs(60));
    for r in 0..N {
        let out = &outputs[r];
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r}:\n{out}");
        let d = out
            .lines()
            .find_map(|l| l.find("DUMP ").map(|i| &l[i + 5..]))
            .unwrap_or_else(|| panic!("rank {r}:\n{out}"));
        assert!(d.starts_with("stall report: no "), "rank {r}: {d}");
        assert!(!d.contains("never entered") && !d.contains("died") && !d.contains("not answering"), "{d}");
        for p in 0..N {
            assert!(d.contains(&format!(" | {p} ")), "rank {r}'s dump lacks a row for rank {p}: {d}");
        }
    }
}

/// `SIGUSR1` to a rank prints the report of its communicator on stderr and stops nothing.
#[test]
fn sigusr1_prints_the_report_and_the_job_goes_on() {
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        println!("READY");
        let start = Instant::now();
        // Keep collectives going while the harness signals (a barrier every 50 ms for 3 s).
        while start.elapsed() < Duration::from_secs(3) {
            comm.barrier().unwrap();
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("DONE");
        return;
    }
    let children = util::spawn_ranks("sigusr1_prints_the_report_and_the_job_goes_on", 2, |_| {
        vec![("TOROID_TIMEOUT".into(), "20".into())]
    });
    let pid = children[1].id();
    // Communicators are up within a second on an idle host; signal well inside the 3 s loop.
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: kill(2) on our own child; no memory is involved.
    unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
    let (statuses, outputs) = util::wait_all(children, Instant::now() + Duration::from_secs(40));
    for r in 0..2 {
        assert_eq!(statuses[r].map(|s| s.success()), Some(true), "rank {r}:\n{}", outputs[r]);
        assert!(outputs[r].contains("DONE"), "rank {r}:\n{}", outputs[r]);
    }
    assert!(
        outputs[1].contains("rank 1 of communicator") && outputs[1].contains("(SIGUSR1): stall report: "),
        "{}",
        outputs[1]
    );
    assert!(!outputs[0].contains("(SIGUSR1)"), "only the signalled rank prints:\n{}", outputs[0]);
}

/// `kill -USR1 <toroid-run>`: every rank prints its report, and the job goes on.
#[test]
fn toroid_run_passes_sigusr1_on_to_every_rank() {
    if util::is_child() {
        let comm = Communicator::from_env().unwrap();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(3) {
            comm.barrier().unwrap();
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("DONE");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_toroid-run"))
        .args(["-n", "2", "--timeout", "60", "--env", &format!("{}=1", util::CHILD_VAR)])
        .args(["--env", "TOROID_TIMEOUT=20", "--"])
        .arg(exe)
        .args(["--exact", "toroid_run_passes_sigusr1_on_to_every_rank", "--nocapture", "--test-threads=1"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: kill(2) on our own child; no memory is involved.
    unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
    let (statuses, outputs) = util::wait_all(vec![child], Instant::now() + Duration::from_secs(60));
    let out = &outputs[0];
    assert_eq!(statuses[0].map(|s| s.success()), Some(true), "{out}");
    for r in 0..2 {
        assert!(
            out.contains(&format!("[{r}]: toroid: rank {r} of communicator")),
            "rank {r} printed no report:\n{out}"
        );
        assert!(
            out.lines().any(|l| l.starts_with(&format!("[{r}]: ")) && l.contains("DONE")),
            "rank {r} did not go on:\n{out}"
        );
    }
}
