#!/usr/bin/env python3
"""Set-up cost of shared memory on one host, two builds side by side.

For each world size, starts that many ranks of `toroid-bench --setup` under `toroid-run` with
shared memory on (the defaults: links on demand, the window) and one all-reduce of --bytes,
alternating the builds in --bin (one or more directories holding toroid-run and toroid-bench,
e.g. an older commit's target/release and this one's), --runs times each. It samples the
segment directory's used bytes (statvfs of /dev/shm) every 0.2 ms during each run and prints
per build and size, as the median over runs: the time from the last rank's start until every
rank returned from set-up and until every rank is ready (its first all-reduce done), the
slowest rank's set-up, and the peak of shared memory in use (the pair segments and the window
while they are mapped, less what was in use before).

    cargo build --release
    git worktree add ../toroid-before <REV> && (cd ../toroid-before && cargo build --release)
    scripts/shm-setup-bench.py --bin ../toroid-before/target/release,target/release --sizes 4,8,16,32

Prints a Markdown table; every run is bounded by --timeout.
"""

import argparse
import os
import re
import statistics
import subprocess
import threading
import time

LINE = re.compile(r"SETUP (.*)")


def used(path):
    s = os.statvfs(path)
    return (s.f_blocks - s.f_bfree) * s.f_frsize


def run(bindir, n, args):
    cmd = [os.path.join(bindir, "toroid-run"), "-n", str(n), "--timeout", str(args.timeout), "--grace", "2",
           "--env", f"TOROID_TIMEOUT={args.timeout}", "--", os.path.join(bindir, "toroid-bench"), "--setup",
           "-b", args.bytes]
    base = used(args.dir)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], used(args.dir) - base)
            time.sleep(0.0002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 30)
    finally:
        done.set()
        t.join()
    ranks = []
    for line in p.stdout.splitlines():
        m = LINE.search(line)
        if m:
            ranks.append({k: float(v) for k, v in (kv.split("=") for kv in m.group(1).split())})
    if p.returncode != 0 or len(ranks) != n or any(r["wrong"] for r in ranks):
        raise SystemExit(f"{bindir} n={n}: status {p.returncode}, {len(ranks)} SETUP lines\n{p.stderr[-3000:]}")
    last = max(r["start_unix_ms"] for r in ranks)
    return {
        "setup_after_last": max(r["start_unix_ms"] + r["setup_ms"] for r in ranks) - last,
        "ready_after_last": max(r["ready_unix_ms"] for r in ranks) - last,
        "setup_max": max(r["setup_ms"] for r in ranks),
        "shm_mib": peak[0] / (1 << 20),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="comma-separated build directories, compared in that order")
    ap.add_argument("--sizes", default="4,8,16,32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bytes", default="64K")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--timeout", type=int, default=120)
    args = ap.parse_args()
    bins = args.bin.split(",")
    rows = {}
    for n in [int(x) for x in args.sizes.split(",")]:
        for _ in range(args.runs):
            for b in bins:
                rows.setdefault((n, b), []).append(run(b, n, args))
    print("| ranks | build | set-up done after the last start (ms) | ready (ms) | slowest set-up (ms) "
          "| peak shared memory (MiB) |")
    print("|---:|---|---:|---:|---:|---:|")
    for (n, b), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {n} | {b} | {med['setup_after_last']:.1f} | {med['ready_after_last']:.1f} "
              f"| {med['setup_max']:.1f} | {med['shm_mib']:.1f} |")


if __name__ == "__main__":
    main()
