#!/usr/bin/env python3
"""Set-up cost at scale: full mesh against connections on demand, on one host.

For each world size and each TOROID_CONNECT mode, starts that many ranks of
`toroid-bench --setup` under `toroid-run` with TCP only (TOROID_SHM_DISABLE=1) and one forced
torus2d all-reduce of a small buffer, and prints per mode and size: the job's wall time, each
rank's set-up time (`from_env`, init to ready) and its first all-reduce (which opens the links
on demand), the peers it linked to, the sockets it holds (/proc/self/fd: links, listener, store
connection; rank 0 also serves the store), its CPU time (user and system, all threads) until
set-up returned and in all (summed over ranks), and its memory (VmRSS, VmHWM), as median and maximum
over ranks; the launch spread (first to last rank's start: toroid-run starting the
processes) and the time from the last rank's start until every rank has returned from set-up
and until every rank is ready (its all-reduce done): what set-up itself costs once everyone is
there. Each run is bounded by --timeout; a run that fails or times out is reported as such.

    cargo build --release
    scripts/setup-scale.py --sizes 16,64,256 --modes mesh,lazy --runs 3

Prints a Markdown table (the ones in docs/measurements/setup-scale.md) and, with
--json FILE, every rank's numbers.
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"SETUP (.*)")


def grid(n):
    """The squarest X x Y grid of n ranks (X >= Y)."""
    y = int(math.isqrt(n))
    while n % y:
        y -= 1
    return n // y, y


def run(n, mode, args):
    x, y = grid(n)
    env = {
        "TOROID_SHM_DISABLE": "1",
        "TOROID_CONNECT": mode,
        "TOROID_ALGO": "torus2d",
        "TOROID_TORUS_SHAPE": f"{x}x{y}",
        "TOROID_TIMEOUT": str(args.timeout),
    }
    cmd = [os.path.join(args.bin, "toroid-run"), "-n", str(n), "--timeout", str(args.timeout), "--grace", "2"]
    for k, v in env.items():
        cmd += ["--env", f"{k}={v}"]
    cmd += ["--", os.path.join(args.bin, "toroid-bench"), "--setup", "-b", args.bytes, "-a", "torus2d"]
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 60)
    wall = time.monotonic() - t
    ranks = []
    for line in p.stdout.splitlines():
        m = LINE.search(line)
        if m:
            ranks.append({k: float(v) for k, v in (kv.split("=") for kv in m.group(1).split())})
    ok = p.returncode == 0 and len(ranks) == n and all(r["wrong"] == 0 for r in ranks)
    if not ok:
        sys.stderr.write(f"{mode} n={n}: status {p.returncode}, {len(ranks)} SETUP lines\n{p.stderr[-3000:]}\n")
    return {"n": n, "mode": mode, "grid": [x, y], "wall_s": wall, "ok": ok, "ranks": ranks}


def summary(res):
    rs = res["ranks"]
    if not rs:
        return None
    col = lambda k: [r[k] for r in rs]
    med = statistics.median
    total = [r["setup_ms"] + r["first_ms"] for r in rs]
    starts, readies = col("start_unix_ms"), col("ready_unix_ms")
    return {
        "spread": max(starts) - min(starts),
        "cpu_med": med(col("setup_cpu_ms")),
        "cpu_max": max(col("setup_cpu_ms")),
        "cpu_total": sum(col("cpu_ms")) / 1e3,
        "after_last": max(readies) - max(starts),
        "setup_after_last": max(r["start_unix_ms"] + r["setup_ms"] for r in rs) - max(starts),
        "wall": res["wall_s"],
        "setup_med": med(col("setup_ms")),
        "setup_max": max(col("setup_ms")),
        "first_max": max(col("first_ms")),
        "ready_max": max(total),
        "peers_max": max(col("peers")),
        "sockets_med": med(col("sockets")),
        "sockets_max": max(col("sockets")),
        "rss_med": med(col("rss_kb")) / 1024,
        "hwm_max": max(col("hwm_kb")) / 1024,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--modes", default="mesh,lazy")
    ap.add_argument("--runs", type=int, default=1, help="runs per size and mode (the median run by ready time is shown)")
    ap.add_argument("--bytes", default="4K", help="all-reduce size (toroid-bench -b)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--json", help="write every rank's numbers here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    results = []
    for n in sizes:
        # Interleave the modes so that a noisy moment of the shared machine hits both.
        for _ in range(args.runs):
            for mode in modes:
                r = run(n, mode, args)
                s = summary(r)
                results.append(r)
                if s:
                    print(f"# {mode} n={n}: ok={r['ok']} wall {s['wall']:.1f} s, ready max {s['ready_max']:.0f} ms, "
                          f"peers max {s['peers_max']:.0f}, sockets max {s['sockets_max']:.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    print()
    print("| ranks | connect | grid | job wall s | launch spread ms | last start to all set up ms | last start to all ready ms | set-up ms median / max "
          "| set-up CPU ms median / max | job CPU s | first all-reduce ms max | ready ms max | peers max "
          "| sockets median / max | RSS MiB median | peak RSS MiB max |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        for mode in modes:
            runs = [r for r in results if r["n"] == n and r["mode"] == mode and r["ok"]]
            if not runs:
                print(f"| {n} | {mode} | | failed | | | | | | | | | | | | |")
                continue
            runs.sort(key=lambda r: summary(r)["ready_max"])
            r = runs[len(runs) // 2]
            s = summary(r)
            print(f"| {n} | {mode} | {r['grid'][0]}x{r['grid'][1]} | {s['wall']:.1f} | {s['spread']:.0f} | {s['setup_after_last']:.0f} | {s['after_last']:.0f} "
                  f"| {s['setup_med']:.0f} / {s['setup_max']:.0f} | {s['cpu_med']:.0f} / {s['cpu_max']:.0f} | {s['cpu_total']:.1f} "
                  f"| {s['first_max']:.0f} | {s['ready_max']:.0f} | {s['peers_max']:.0f} "
                  f"| {s['sockets_med']:.0f} / {s['sockets_max']:.0f} | {s['rss_med']:.1f} | {s['hwm_max']:.1f} |")


if __name__ == "__main__":
    main()
