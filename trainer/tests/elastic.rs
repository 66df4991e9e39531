//! `--elastic` end to end: 3 ranks train (started here, not by toroid-run, which would stop
//! everyone when one dies); mid-epoch one is killed with SIGKILL; the 2 survivors shrink, go on
//! from the parameters before the failed step and finish the run. Checked: both survivors exit
//! 0 and say which rank was lost, they end with bit-identical parameters (their 64-bit hashes of
//! every element agree), `steps.csv` has every step once, and the loss after the kill keeps
//! falling. Once killing rank 2, once rank 0 (the survivor that becomes rank 0 takes over the
//! metrics files).

mod util;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use util::{common, out_dir};

const RANKS: usize = 3;
/// Steps per epoch: 480 examples at a global batch of 12.
const STEPS_PER_EPOCH: u64 = 40;
const EPOCHS: u64 = 2;
/// The victim dies once rank 0 has logged this many steps (of the first epoch's 40).
const KILL_AFTER: usize = 12;

/// The ranks, killed (SIGKILL) when dropped, so that a failing test leaves no process.
struct Job(Vec<Option<Child>>);

impl Drop for Job {
    fn drop(&mut self) {
        for c in self.0.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `steps.csv`'s (step, loss) rows so far.
fn steps(out: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(out.join("steps.csv")).unwrap_or_default();
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            Some((f.first()?.parse().ok()?, f.get(4)?.parse().ok()?))
        })
        .collect()
}

fn log_of(out: &Path, r: usize) -> PathBuf {
    out.join(format!("rank{r}.log"))
}

fn mean(v: &[(u64, f64)]) -> f64 {
    v.iter().map(|x| x.1).sum::<f64>() / v.len() as f64
}

fn kill_one_of_three(name: &str, victim: usize) {
    let out = out_dir(name);
    std::fs::create_dir_all(&*out).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let args = common(
        &out,
        &[
            "--train-limit",
            "480",
            "--batch",
            "12",
            "--epochs",
            &EPOCHS.to_string(),
            "--threads",
            "1",
            "--elastic",
        ],
    );
    let mut job = Job(Vec::new());
    for r in 0..RANKS {
        let log = File::create(log_of(&out, r)).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_toroid-train"))
            .args(&args)
            .env("TOROID_RANK", r.to_string())
            .env("TOROID_WORLD_SIZE", RANKS.to_string())
            .env("TOROID_STORE_ADDR", format!("127.0.0.1:{port}"))
            .env("TOROID_TIMEOUT", "30")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("starting toroid-train");
        job.0.push(Some(child));
    }
    let deadline = Instant::now() + Duration::from_secs(150);
    let logs = |out: &Path| -> String {
        (0..RANKS)
            .map(|r| format!("--- rank {r}\n{}", std::fs::read_to_string(log_of(out, r)).unwrap_or_default()))
            .collect()
    };
    while steps(&out).len() < KILL_AFTER {
        assert!(Instant::now() < deadline, "no progress before the kill:\n{}", logs(&out));
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut dead = job.0[victim].take().unwrap();
    dead.kill().unwrap(); // SIGKILL
    dead.wait().unwrap();
    let before = steps(&out);
    let survivors: Vec<usize> = (0..RANKS).filter(|r| *r != victim).collect();
    for &r in &survivors {
        let child = job.0[r].as_mut().unwrap();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            assert!(Instant::now() < deadline, "rank {r} did not finish:\n{}", logs(&out));
            std::thread::sleep(Duration::from_millis(50));
        };
        job.0[r] = None;
        assert!(status.success(), "rank {r} failed ({status:?}):\n{}", logs(&out));
    }
    let all = logs(&out);
    // Both survivors say who was lost, and end with the same parameters.
    let mut hashes = Vec::new();
    for &r in &survivors {
        let text = std::fs::read_to_string(log_of(&out, r)).unwrap();
        assert!(
            text.contains(&format!("ranks [{victim}] lost at step"))
                && text.contains("continuing on 2 ranks"),
            "rank {r}:\n{all}"
        );
        if let Some(l) = text.lines().find(|l| l.contains("lost at step")) {
            eprintln!("{l}");
        }
        let h = text
            .lines()
            .find_map(|l| l.split("parameter hash ").nth(1))
            .unwrap_or_else(|| panic!("rank {r} printed no hash:\n{all}"))
            .to_string();
        hashes.push(h);
    }
    assert_eq!(hashes[0], hashes[1], "the survivors' parameters differ:\n{all}");
    // Every step once, in order, to the end of the run.
    let rows = steps(&out);
    let numbers: Vec<u64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(numbers, (1..=EPOCHS * STEPS_PER_EPOCH).collect::<Vec<_>>(), "steps.csv:\n{all}");
    // The loss keeps falling after the kill: the mean of the last 10 steps is well below that
    // of the 10 steps before the kill, and of the first 5.
    let k = before.len();
    let (first, last) = (mean(&rows[..5]), mean(&rows[rows.len() - 10..]));
    let at_kill = mean(&rows[k - 10..k]);
    eprintln!("loss: first 5 steps {first:.4}, 10 before the kill {at_kill:.4}, last 10 {last:.4}");
    assert!(last < 0.8 * at_kill && last < 0.8 * first, "loss {first} -> {at_kill} -> {last}:\n{all}");
}

#[test]
fn a_killed_rank_leaves_two_survivors_that_finish_with_identical_parameters() {
    kill_one_of_three("elastic-rank2", 2);
}

#[test]
fn the_survivors_go_on_when_rank_0_dies() {
    kill_one_of_three("elastic-rank0", 0);
}
