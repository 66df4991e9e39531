//! Data echoing and BMUF end to end, with real processes started by `toroid-run`:
//!
//! - BMUF with tau = 1, eta = 0, zeta = 1 on 2 ranks ends with the same parameters as
//!   synchronous SGD (plain SGD: averaging the models after one step each is averaging the
//!   gradients), and sends the same bytes; with `local=reset` the same holds with local momentum
//!   0.9 (it is zeroed at every block), with `local=keep` it does not;
//! - BMUF-Adam on 3 ranks with per-rank batch norm: the trainer compares the ranks' parameter
//!   hashes after every block (`--check-every 1`), the final hashes agree, and the bytes are one
//!   all-reduce of model, m and v per block;
//! - echoing repeats exactly (steps per epoch, examples vs fresh examples) at each insertion
//!   point, and `--echo auto` raises E from the measured R when the input is slow on purpose.
//!
//! Same data and tiny model as `data_parallel.rs`: each run takes seconds.

mod util;

use std::path::Path;

use util::{common, max_diff, out_dir, params, run};

/// The columns of `dir/NAME` by header name, as floats.
fn csv(dir: &Path, name: &str) -> Vec<std::collections::HashMap<String, f64>> {
    let text = std::fs::read_to_string(dir.join(name)).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    lines
        .map(|l| header.iter().zip(l.split(',')).map(|(h, v)| (h.to_string(), v.parse().unwrap())).collect())
        .collect()
}

/// The parameter count the trainer logged.
fn num_params(log: &str) -> f64 {
    let line = log.lines().find(|l| l.contains(" parameters, input")).unwrap();
    line.split(" parameters").next().unwrap().rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn bmuf_with_tau_1_eta_0_zeta_1_is_synchronous_averaging() {
    let (sync, bmuf) = (out_dir("sync-sgd"), out_dir("bmuf-avg"));
    let base = ["--frozen-bn", "--momentum", "0", "--batch", "8", "--max-steps", "5"];
    run(2, &common(&sync, &base));
    // Under BMUF the LR follows the per-rank batch (4, not 8): halve the reference batch so both
    // runs step at the same rate.
    let spec = "tau=1,eta=0,zeta=1,nesterov=false";
    let o = run(2, &common(&bmuf, &[&base[..], &["--bmuf", spec, "--lr-ref-batch", "6"]].concat()));
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    let (ps, pb) = (params(&sync), params(&bmuf));
    let d = max_diff(&ps, &pb);
    eprintln!("BMUF(tau 1, eta 0, zeta 1) vs synchronous SGD: max difference {d:.3e}");
    assert!(d < 2e-5, "model averaging differs from gradient averaging by {d}");
    // Both send the model's size once per step.
    let p = num_params(&log);
    for dir in [&sync, &bmuf] {
        let last = csv(dir, "steps.csv").pop().unwrap();
        assert_eq!(last["bytes"], 5.0 * 4.0 * p, "{}", dir.display());
    }
    // With local=reset every block starts its SGD momentum from zero, so with tau = 1 the local
    // momentum of 0.9 never acts: the same model as synchronous SGD without momentum.
    let reset = out_dir("bmuf-reset");
    let spec = "tau=1,eta=0,zeta=1,nesterov=false,local=reset";
    let with_momentum = ["--frozen-bn", "--momentum", "0.9", "--batch", "8", "--max-steps", "5"];
    run(2, &common(&reset, &[&with_momentum[..], &["--bmuf", spec, "--lr-ref-batch", "6"]].concat()));
    let d = max_diff(&ps, &params(&reset));
    eprintln!("BMUF(tau 1, eta 0, local=reset, momentum 0.9) vs synchronous SGD without momentum: {d:.3e}");
    assert!(d < 2e-5, "local momentum was not reset at every block: differs by {d}");
    // And keeping it (the momentum then acts) gives another model.
    let keep = out_dir("bmuf-keep");
    let spec = "tau=1,eta=0,zeta=1,nesterov=false,local=keep";
    run(2, &common(&keep, &[&with_momentum[..], &["--bmuf", spec, "--lr-ref-batch", "6"]].concat()));
    assert!(max_diff(&ps, &params(&keep)) > 1e-4);
    for dir in [sync, bmuf, reset, keep] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn bmuf_adam_ranks_hold_identical_models_after_each_block() {
    let out = out_dir("bmuf-adam");
    let args = ["--batch", "12", "--max-steps", "6", "--optimizer", "adam", "--lr", "0.01"];
    let spec = "tau=2,eta=auto,zeta=1,nesterov=true,first=moments";
    let o = run(3, &common(&out, &[&args[..], &["--bmuf", spec]].concat()));
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(log.contains("eta: 0.6666"), "{log}");
    let hashes: Vec<&str> = log.lines().filter_map(|l| l.split("parameter hash ").nth(1)).collect();
    assert_eq!(hashes.len(), 3, "{log}");
    assert!(hashes.iter().all(|h| *h == hashes[0]), "{hashes:?}");
    // Three blocks, each one all-reduce of parameters, m and v.
    let last = csv(&out, "steps.csv").pop().unwrap();
    assert_eq!(last["bytes"], 3.0 * 3.0 * 4.0 * num_params(&log));
    // The corrected moments and the naive average lead to different models.
    let naive = out_dir("bmuf-adam-naive");
    let spec = "tau=2,eta=auto,zeta=1,nesterov=true,moments=naive,first=moments";
    run(3, &common(&naive, &[&args[..], &["--bmuf", spec]].concat()));
    assert!(max_diff(&params(&out), &params(&naive)) > 1e-4);
    // The first moment reset at every block: the ranks still agree, on another model.
    let reset = out_dir("bmuf-adam-first-reset");
    let spec = "tau=2,eta=auto,zeta=1,nesterov=true,first=reset";
    let o = run(3, &common(&reset, &[&args[..], &["--bmuf", spec]].concat()));
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(log.contains("first: Reset"), "{log}");
    let hashes: Vec<&str> = log.lines().filter_map(|l| l.split("parameter hash ").nth(1)).collect();
    assert!(hashes.len() == 3 && hashes.iter().all(|h| *h == hashes[0]), "{hashes:?}");
    assert!(max_diff(&params(&out), &params(&reset)) > 1e-4);
    for dir in [out, naive, reset] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn echoing_repeats_exactly_and_counts_fresh_examples() {
    // 240 examples, batch 8: 30 steps per epoch without echoing.
    for (echo, steps) in [("example-before-aug:2", 60.0), ("example-after-aug:3", 90.0), ("batch:2", 60.0)] {
        let out = out_dir(&format!("echo-{}", echo.replace(':', "")));
        run(1, &common(&out, &["--batch", "8", "--echo", echo, "--echo-shuffle", "16"]));
        let last = csv(&out, "steps.csv").pop().unwrap();
        assert_eq!(last["step"], steps, "{echo}");
        assert_eq!(last["examples"], 8.0 * steps, "{echo}");
        assert_eq!(last["fresh"], 240.0, "{echo}");
        let _ = std::fs::remove_dir_all(out);
    }
}

#[test]
fn echo_auto_follows_the_measured_ratio() {
    // 50 ms per read: t_up = 400 ms per batch of 8, several steps of this tiny model (whose
    // step takes about 0.1 s on 2 busy cores: R ~ 4, well clear of the 2 asserted; 25 ms per
    // read gave R = 1.99 once, on a loaded machine).
    let out = out_dir("echo-auto");
    let slow = ["--decode-cost-us", "50000", "--decode-cost", "sleep", "--echo", "auto", "--log-every", "5"];
    let o = run(
        1,
        &common(&out, &[&slow[..], &["--batch", "8", "--epochs", "2", "--train-limit", "120"]].concat()),
    );
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    let rows = csv(&out, "steps.csv");
    let first = &rows[0];
    assert_eq!(first["echo"], 1.0);
    assert!(first["r"] > 2.0 && (first["t_up_s"] - 0.4).abs() < 0.1, "{first:?}");
    let last = rows.last().unwrap();
    // A window served wholly from the echo buffer times no upstream work; it reports the last
    // measured t_up, so every row has an R.
    assert!(rows.iter().all(|r| r["r"].is_finite() && r["t_up_s"] > 0.0), "{rows:?}");
    // The factor is the one chosen at the epoch start from the R measured then.
    let chosen = log
        .lines()
        .find_map(|l| l.split("echo auto: R = ").nth(1))
        .and_then(|rest| rest.split(',').next())
        .and_then(|r| r.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no 'echo auto: R = ' line:\n{log}"));
    assert!(chosen > 2.0, "R at the epoch start {chosen}\n{log}");
    assert_eq!(last["echo"], chosen.floor().clamp(1.0, 8.0), "{last:?}\n{log}");
    // Epoch 2 took E times as many steps; every example was fresh once per epoch.
    assert_eq!(last["step"], 15.0 + 15.0 * last["echo"]);
    assert_eq!(last["fresh"], 240.0);
    let _ = std::fs::remove_dir_all(out);
}
