//! `scripts/emulated-cluster.sh` end to end: 3 emulated hosts x 2 ranks in network namespaces
//! with shaped links run toroid-bench for every all-reduce algorithm (every value checked by
//! the benchmark), each rank sees its own host, and no namespace is left behind, also when a
//! rank fails. Needs root and `ip`/`tc` (CI has both); otherwise the test says it skipped.

use std::path::Path;
use std::process::{Command, Output};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/emulated-cluster.sh");
const BENCH: &str = env!("CARGO_BIN_EXE_toroid-bench");

/// Why this machine cannot run the emulation, if it cannot.
fn cannot_emulate() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (network namespaces need it)".into());
    }
    for tool in ["ip", "tc"] {
        let found = Command::new(tool).arg("-V").output().map(|o| o.status.success()).unwrap_or(false);
        if !found {
            return Some(format!("`{tool}` is missing (iproute2)"));
        }
    }
    None
}

/// The namespaces a run of the script made (named `tc<pid>h<i>` and `tc<pid>sw`).
fn our_namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("tc") && (n.ends_with("sw") || n.contains('h')))
        .filter(|n| n[2..].chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(str::to_string)
        .collect()
}

fn emulate(args: &[&str]) -> Output {
    Command::new("bash").arg(SCRIPT).args(args).output().expect("the script runs")
}

#[test]
fn every_algorithm_runs_on_emulated_hosts_and_nothing_is_left() {
    if let Some(why) = cannot_emulate() {
        eprintln!("SKIPPED every_algorithm_runs_on_emulated_hosts_and_nothing_is_left: {why}");
        return;
    }
    assert!(Path::new(SCRIPT).exists());
    let before = our_namespaces();
    for algo in ["ring", "hring", "torus2d", "hd", "rd"] {
        let out = emulate(&[
            "-H", "3", "-K", "2", "-r", "1gbit", "-t", "60", "--", BENCH, "-b", "4K", "-e", "1M", "-f", "16",
            "-n", "3", "-w", "1", "-c", "1", "-a", algo,
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{algo}: the emulated run failed\n{stdout}\n{stderr}");
        // Rank 0 prints the table: 3 hosts and every size ran this algorithm with no wrong value.
        assert!(stdout.contains("[0]: # nRanks 6"), "{stdout}");
        assert!(stdout.contains("3 hosts"), "{algo}: the ranks did not see 3 hosts\n{stdout}");
        // Rank 0 reaches its host's other rank by shared memory and the 4 ranks of the other
        // hosts by striped TCP: the veth links report 10 Gbit/s, for which the lanes default
        // to 2 (src/transport/tcp/striped.rs).
        assert!(stdout.contains("[0]: # links of rank 0: shm to 1, tcp-striped to 4"), "{algo}: {stdout}");
        let rows: Vec<&str> =
            stdout.lines().filter(|l| l.starts_with("[0]: ") && l.contains(" float ")).collect();
        assert_eq!(rows.len(), 3, "{algo}: expected 4K, 64K, 1M rows\n{stdout}");
        for row in rows {
            let cols: Vec<&str> = row.split_whitespace().collect();
            assert_eq!(cols.last(), Some(&algo), "{algo}: {row}");
            // `#wrong` of out-of-place and in-place.
            assert_eq!(cols[9], "0", "{algo}: {row}");
            assert_eq!(cols[13], "0", "{algo}: {row}");
        }
    }
    // A failing rank: the script reports it, stops the others and still removes everything.
    let out = emulate(&["-H", "2", "-K", "1", "-t", "30", "--", "sh", "-c", "exit $TOROID_RANK"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 1 failed"));
    assert_eq!(our_namespaces(), before, "namespaces left behind");
}
