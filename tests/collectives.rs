//! Every collective, on real data, checked element by element against an independent
//! reference: world sizes 1..=9, counts {0, 1, 7, 4099, 1<<20}, every op, several element
//! types, in place and out of place, every algorithm; as threads and as real processes.

mod util;

use std::time::Instant;

use toroid::Communicator;
use util::cases::run_matrix;

#[test]
fn all_collectives_as_threads() {
    if util::is_child() {
        return;
    }
    for n in 1..=5 {
        let cfg = util::test_config(60.0);
        util::run_threads(n, &cfg, |comm| {
            let failures = run_matrix(&comm, false);
            assert!(failures.is_empty(), "{}", failures.join("\n"));
        });
    }
}

#[test]
fn all_collectives_in_processes() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("communicator from toroid-run's environment");
        let failures = run_matrix(&comm, true);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        return;
    }
    // One host (shared memory: rings between every pair and the shared window)...
    for n in 1..=9 {
        let t = Instant::now();
        let out = util::launch("all_collectives_in_processes", n, &[("TOROID_TIMEOUT", "60")], 600);
        util::assert_success(&out, &format!("{n} ranks"));
        let report = String::from_utf8_lossy(&out.stdout);
        let line = report.lines().find(|l| l.contains("cases in")).unwrap_or("(no report)");
        println!("{line} (job {:.1?})", t.elapsed());
    }
    // ... TCP only, and two emulated hosts (shared memory within, TCP across, no window).
    type Variant<'a> = (&'a str, usize, &'a [(&'a str, &'a str)], &'a [&'a str]);
    let variants: [Variant<'_>; 3] = [
        ("TCP only", 3, &[("TOROID_SHM_DISABLE", "1")], &[]),
        ("2 hosts", 4, &[], &["--emulate-hosts", "2"]),
        ("2 hosts", 7, &[], &["--emulate-hosts", "2"]),
    ];
    for (what, n, env, opts) in variants {
        let t = Instant::now();
        let mut env = env.to_vec();
        env.push(("TOROID_TIMEOUT", "60"));
        let out = util::launch_with("all_collectives_in_processes", n, opts, &env, 600);
        util::assert_success(&out, &format!("{n} ranks, {what}"));
        let report = String::from_utf8_lossy(&out.stdout);
        let line = report.lines().find(|l| l.contains("cases in")).unwrap_or("(no report)");
        println!("{what}: {line} (job {:.1?})", t.elapsed());
    }
}
