//! `--timeline` end to end: a 2-rank data-parallel run under `toroid-run` leaves one trace
//! (merged by toroid-run) in the trace-event format with, for each rank, the trainer's own
//! spans (data, forward, backward, optimiser) on its application track and toroid's all-reduces
//! on the communicator's track, so the overlap of the gradient all-reduce with the backward pass
//! is visible.

mod util;

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use util::{common, out_dir, toroid_run};

#[test]
fn a_two_rank_run_leaves_one_trace_with_trainer_and_collective_spans() {
    let out = out_dir("timeline");
    std::fs::create_dir_all(&*out).unwrap();
    let trace = out.join("trace.json");
    let trace_arg = trace.display().to_string();
    // The variable for toroid-run, which merges the ranks' files into the path when the job
    // ends; the trainer's flag names the same path.
    let args = common(&out, &["--batch", "8", "--max-steps", "4", "--timeline", &trace_arg]);
    let done = Command::new(toroid_run())
        .args(["-n", "2", "--timeout", "300", "--"])
        .arg(env!("CARGO_BIN_EXE_toroid-train"))
        .args(&args)
        .env("TOROID_TIMELINE", &trace)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{err}");
    assert!(err.contains("toroid-run: timeline of 2 ranks"), "{err}");
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).expect("merged trace")).expect("JSON");
    let events = v["traceEvents"].as_array().expect("traceEvents");
    let mut by_rank: BTreeMap<u64, BTreeSet<(String, String)>> = BTreeMap::new();
    for e in events {
        assert!(
            e["ph"].is_string() && e["pid"].is_u64() && e["tid"].is_u64() && e["name"].is_string(),
            "{e}"
        );
        if e["ph"] == "X" {
            assert!(e["dur"].as_f64().is_some_and(|d| d >= 0.0) && e["ts"].as_f64().is_some(), "{e}");
            let cat = e["cat"].as_str().unwrap_or_default().to_string();
            by_rank
                .entry(e["pid"].as_u64().unwrap())
                .or_default()
                .insert((cat, e["name"].as_str().unwrap().into()));
        }
    }
    assert_eq!(by_rank.keys().copied().collect::<Vec<_>>(), vec![0, 1], "both ranks");
    for (rank, spans) in &by_rank {
        for name in ["data", "forward", "backward", "optimiser (waits for the gradients)"] {
            assert!(spans.contains(&("trainer".into(), name.into())), "rank {rank} lacks {name}: {spans:?}");
        }
        assert!(spans.contains(&("collective".into(), "all_reduce".into())), "rank {rank}: {spans:?}");
    }
}
