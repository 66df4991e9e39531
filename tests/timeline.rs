//! The timeline end to end: a 4-rank `toroid-bench` under `toroid-run` with `TOROID_TIMELINE`,
//! merged by `toroid-run`, parsed as JSON and checked against the trace-event format: every
//! event has the fields its phase type needs, every rank and communicator has a named track,
//! every phase lies inside its collective, and every rank recorded the same collectives, each
//! sequence number once.

mod bench_check;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use bench_check::{BENCH, TOROID_RUN, TempDir, clean_launcher_env, run_bounded};
use serde_json::Value;

/// A collective's span on its track: start, end (us), sequence number, name.
type Span = (f64, f64, u64, String);

#[test]
fn a_four_rank_benchmark_leaves_one_valid_trace_with_every_rank() {
    let dir = TempDir::new("timeline");
    let path = dir.join("trace.json");
    let mut cmd = Command::new(TOROID_RUN);
    clean_launcher_env(&mut cmd)
        .args([
            "-n",
            "4",
            "--timeout",
            "120",
            "--",
            BENCH,
            "-b",
            "4K",
            "-e",
            "1M",
            "-f",
            "4",
            "-n",
            "5",
            "-w",
            "2",
        ])
        .env("TOROID_TIMELINE", &path);
    let done = run_bounded("toroid-bench with a timeline", &mut cmd, &dir, Duration::from_secs(150));
    assert!(done.status.success(), "{}\n{}", done.stdout, done.stderr);
    assert!(done.stderr.contains("toroid-run: timeline of 4 ranks"), "{}", done.stderr);
    for r in 0..4 {
        assert!(!dir.join(&format!("trace.json.rank{r}.json")).exists(), "rank files are merged away");
    }
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("valid JSON");
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let num = |e: &Value, k: &str| e[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {e}"));
    let mut names: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut colls: BTreeMap<(u64, u64), Vec<Span>> = BTreeMap::new();
    let mut phases: Vec<((u64, u64), f64, f64, u64)> = Vec::new();
    for e in events {
        let ph = e["ph"].as_str().expect("ph");
        let track = (num(e, "pid") as u64, num(e, "tid") as u64);
        assert!(e["name"].is_string(), "{e}");
        num(e, "ts");
        match ph {
            "M" => {
                assert!(e["args"]["name"].is_string(), "{e}");
                if e["name"] == "thread_name" {
                    names.insert(track);
                }
            }
            "X" => {
                let (ts, dur) = (num(e, "ts"), num(e, "dur"));
                assert!(dur >= 0.0, "{e}");
                let seq = e["args"]["seq"].as_u64().expect("seq");
                match e["cat"].as_str() {
                    Some("collective") => {
                        assert!(e["args"]["algorithm"].is_string() && e["args"]["bytes"].is_u64(), "{e}");
                        assert_eq!(e["args"]["state"], "done", "{e}");
                        colls.entry(track).or_default().push((
                            ts,
                            ts + dur,
                            seq,
                            e["name"].as_str().unwrap().into(),
                        ));
                    }
                    Some("phase") => phases.push((track, ts, ts + dur, seq)),
                    other => panic!("category {other:?}: {e}"),
                }
            }
            other => panic!("phase type {other}: {e}"),
        }
    }
    let pids: BTreeSet<u64> = colls.keys().map(|t| t.0).collect();
    assert_eq!(pids, (0..4).collect(), "one process per rank");
    assert!(colls.keys().all(|t| names.contains(t)), "every track is named");
    // Times are microseconds since the Unix epoch (about 1.8e15): as f64 they are exact to a
    // quarter of a microsecond, so "inside" allows one.
    for (track, start, end, seq) in &phases {
        let inside =
            colls[track].iter().any(|(s, e, q, _)| q == seq && *s - 1.0 <= *start && *end <= *e + 1.0);
        assert!(inside, "phase of #{seq} on {track:?} outside its collective");
    }
    // Every rank ran the same collectives: the same sequence numbers with the same names.
    let mut per_rank: Vec<Vec<(u64, String)>> = Vec::new();
    for spans in colls.values() {
        let mut v: Vec<(u64, String)> = spans.iter().map(|(_, _, q, n)| (*q, n.clone())).collect();
        v.sort();
        let seqs: Vec<u64> = v.iter().map(|x| x.0).collect();
        assert_eq!(seqs, (1..=v.len() as u64).collect::<Vec<_>>(), "each sequence number once");
        per_rank.push(v);
    }
    assert!(per_rank.windows(2).all(|w| w[0] == w[1]), "every rank recorded the same collectives");
    let n = per_rank[0].iter().filter(|x| x.1 == "all_reduce").count();
    // 5 sizes (4K..1M by 4), 2 warm-up and 5 timed iterations each, plus the cost model's one.
    assert!(n >= 5 * 7, "{n} all-reduces");
    assert!(!phases.is_empty());
    eprintln!("timeline: {} events, {} all-reduces per rank, {} phases", events.len(), n, phases.len());
}

#[test]
fn halving_doubling_shows_its_fold_reduce_scatter_and_all_gather_phases() {
    // 3 ranks: rank 0 folds into rank 1 (reduce), ranks 1 and 2 halve and double
    // (reduce-scatter, all-gather), rank 1 hands the result back to rank 0 (broadcast).
    let dir = TempDir::new("timeline-hd");
    let path = dir.join("trace.json");
    let mut cmd = Command::new(TOROID_RUN);
    clean_launcher_env(&mut cmd)
        .args(["-n", "3", "--timeout", "120", "--", BENCH, "-b", "4K", "-e", "4K", "-n", "2", "-w", "1"])
        .env("TOROID_TIMELINE", &path)
        .env("TOROID_ALGO", "hd");
    let done = run_bounded(
        "toroid-bench halving-doubling with a timeline",
        &mut cmd,
        &dir,
        Duration::from_secs(150),
    );
    assert!(done.status.success(), "{}\n{}", done.stdout, done.stderr);
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("valid JSON");
    let mut phases: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    for e in trace["traceEvents"].as_array().expect("traceEvents") {
        if e["cat"] == "phase" {
            let pid = e["pid"].as_u64().expect("pid");
            phases.entry(pid).or_default().insert(e["name"].as_str().expect("name").into());
        }
    }
    let has = |r: u64, names: &[&str]| names.iter().all(|n| phases.get(&r).is_some_and(|p| p.contains(*n)));
    assert!(has(0, &["reduce", "broadcast"]), "rank 0: {phases:?}");
    assert!(has(1, &["reduce", "reduce_scatter", "all_gather", "broadcast"]), "rank 1: {phases:?}");
    assert!(has(2, &["reduce_scatter", "all_gather"]), "rank 2: {phases:?}");
}
