#!/usr/bin/env python3
"""Encrypted links against plaintext, side by side in one run.

    scripts/encryption-bench.py [--runs 3] [--ranks 2] [--sizes 4K..64M] [--cluster] [--crypto]

Runs toroid-bench on N ranks over loopback TCP (no shared memory) alternately with
TOROID_ENCRYPT=0 and =1 (TOROID_AUTH_TOKEN set for both), --runs times, and prints per size the
median time and busbw of each (best of out-of-place and in-place) and the ratio encrypted /
plaintext. --cluster adds the same comparison on the emulated cluster (scripts/emulated-cluster.sh,
4 hosts x 2 ranks, 1 Gbit/s per host link, shared memory within a host as usual: needs root).
--crypto runs `cargo bench --bench record` beside it: what sealing and opening AES-128-GCM
records costs one core. Needs a release build (cargo build --release).
"""

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release"


def bench_rows(cmd, env):
    """(size, time us, busbw) per size of rank 0's toroid-bench table, best of both placements."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    rows = {}
    for line in out.stdout.splitlines():
        f = line.split()
        if len(f) >= 13 and f[0] == "[0]:" and f[1].isdigit():
            size = int(f[1])
            rows[size] = (min(float(f[6]), float(f[10])), max(float(f[8]), float(f[12])))
    if not rows:
        sys.exit(f"no results from {' '.join(map(str, cmd))}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return rows


def compare(name, cmd_of, runs):
    results = {0: [], 1: []}
    for _ in range(runs):
        for enc in (0, 1):
            env = dict(os.environ, TOROID_ENCRYPT=str(enc), TOROID_AUTH_TOKEN="encryption-bench")
            results[enc].append(bench_rows(cmd_of(), env))
    print(f"\n{name}: median of {runs} interleaved runs, busbw in GB/s and time (time only at 4 KiB)")
    print("| size | plaintext | encrypted | encrypted / plaintext |")
    print("|---:|---:|---:|---:|")
    for size in sorted(results[0][0]):
        t0 = statistics.median(r[size][0] for r in results[0])
        t1 = statistics.median(r[size][0] for r in results[1])
        b0 = statistics.median(r[size][1] for r in results[0])
        b1 = statistics.median(r[size][1] for r in results[1])
        label = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        if size <= 4096:
            print(f"| {label} (time) | {t0:.1f} us | {t1:.1f} us | {t1 / t0:.2f}x the time |")
        else:
            print(f"| {label} | {b0:.3g} ({t0 / 1000:.3g} ms) | {b1:.3g} ({t1 / 1000:.3g} ms) | {b1 / b0:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--min", default="4K")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--cluster", action="store_true")
    ap.add_argument("--crypto", action="store_true")
    a = ap.parse_args()
    for b in ("toroid-run", "toroid-bench"):
        if not (BIN / b).exists():
            sys.exit(f"{BIN / b} is missing: cargo build --release")
    bench = [str(BIN / "toroid-bench"), "-b", a.min, "-e", a.max, "-f", "4", "-n", "20", "-w", "5"]
    compare(
        f"{a.ranks} ranks over loopback TCP",
        lambda: [str(BIN / "toroid-run"), "-n", str(a.ranks), "--env", "TOROID_SHM_DISABLE=1", "--", *bench],
        a.runs,
    )
    if a.cluster:
        cluster = [str(ROOT / "scripts" / "emulated-cluster.sh"), "-H", "4", "-K", "2", "-r", "1gbit", "-t", "300", "--",
                   str(BIN / "toroid-bench"), "-b", "4K", "-e", "16M", "-f", "4096", "-n", "10", "-w", "2"]
        compare("emulated cluster, 4 hosts x 2 ranks, 1 Gbit/s per host", lambda: cluster, a.runs)
    if a.crypto:
        print("\nAES-128-GCM records on one core (cargo bench --bench record):")
        out = subprocess.run(["cargo", "bench", "--bench", "record", "--", "--warm-up-time", "1",
                              "--measurement-time", "2"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        lines = out.stdout.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("record/") and "time:" in line and i + 1 < len(lines):
                print(f"  {line.split()[0]:<24} {' '.join(lines[i + 1].split()[1:])}")


if __name__ == "__main__":
    main()
