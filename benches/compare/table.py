#!/usr/bin/env python3
"""Reads the result files of run.sh and prints the comparison table.

Every implementation prints nccl-tests' columns (size, count, type, redop, root, then time,
algbw, busbw, #wrong for out-of-place and for in-place). For each rank count and size this takes
the median over runs of each column and prints toroid next to MPI, oneCCL (out-of-place busbw)
and gloo (in-place only: torch all-reduces in place), when their files are there, with the ratio
toroid/other: busbw ratio (> 1: toroid faster) and time.

    table.py DIR 2 4
"""

import glob
import os
import re
import statistics
import sys

ROW = re.compile(r"^(?:\[\d+\]: )?\s*(\d+)\s+(\d+)\s+\S+\s+\S+\s+-?\d+\s+(.*)$")


def parse(path):
    """size -> (oop_time, oop_busbw, ip_time, ip_busbw, wrong, algorithm)"""
    rows = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = ROW.match(line)
            if not m:
                continue
            size = int(m.group(1))
            rest = m.group(3).split()
            try:
                t1, _, b1, w1, t2, _, b2, w2 = rest[:8]
                algo = rest[8] if len(rest) > 8 else ""
                wrong = (0 if w1 == "N/A" else int(w1)) + (0 if w2 == "N/A" else int(w2))
                rows[size] = (float(t1), float(b1), float(t2), float(b2), wrong, algo)
            except ValueError:
                continue
    return rows


def medians(paths):
    runs = [parse(p) for p in paths]
    runs = [r for r in runs if r]
    out = {}
    if not runs:
        return out, 0
    for size in sorted(set().union(*runs)):
        vals = [r[size] for r in runs if size in r]
        out[size] = (
            statistics.median(v[0] for v in vals),
            statistics.median(v[1] for v in vals),
            statistics.median(v[2] for v in vals),
            statistics.median(v[3] for v in vals),
            sum(v[4] for v in vals),
            vals[0][5],
        )
    return out, len(runs)


def bus(size, us, n):
    """nccl-tests busbw for an all-reduce of `size` bytes taking `us` microseconds."""
    return size / 1e3 / us * 2 * (n - 1) / n if us > 0 else float("nan")


def human(size):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def main():
    d = sys.argv[1]
    for n in sys.argv[2:]:
        toroid, kt = medians(sorted(glob.glob(os.path.join(d, f"toroid-n{n}-r*.txt"))))
        mpi, km = medians(sorted(glob.glob(os.path.join(d, f"mpi-n{n}-r*.txt"))))
        gloo, kg = medians(sorted(glob.glob(os.path.join(d, f"gloo-n{n}-r*.txt"))))
        ccl, kc = medians(sorted(glob.glob(os.path.join(d, f"oneccl-n{n}-r*.txt"))))
        print()
        print(f"## {n} ranks: all-reduce, float sum, median of {kt} toroid / {km} MPI"
              + (f" / {kc} oneCCL" if kc else "") + (f" / {kg} gloo" if kg else "") + " runs")
        print("#  busbw in GB/s (decimal), time in us; ratio = toroid busbw / other busbw (time: other / toroid)")
        head = (f"{'size':>8} | {'toroid us':>9} {'MPI us':>9} {'ratio':>5} | {'toroid busbw':>12} {'MPI busbw':>9} "
                f"{'ratio':>5} | {'in-place: toroid':>16} {'MPI':>6} {'ratio':>5}")
        if kc:
            head += f" | {'oneCCL busbw':>12} {'ratio':>5}"
        if kg:
            head += f" | {'gloo':>6} {'ratio':>5}"
        head += " | algorithm"
        print(head)
        print("-" * len(head))
        k = int(n)
        for size in sorted(toroid):
            t = toroid[size]
            m = mpi.get(size)
            # Bandwidths are recomputed from the median times (full precision); every ratio is
            # other time / toroid time, which equals toroid busbw / other busbw.
            line = f"{human(size):>8} | {t[0]:>9.2f} "
            if m:
                line += f"{m[0]:>9.2f} {m[0] / t[0]:>5.2f} | {bus(size, t[0], k):>12.2f} {bus(size, m[0], k):>9.2f} "
                line += f"{m[0] / t[0]:>5.2f} | {bus(size, t[2], k):>16.2f} {bus(size, m[2], k):>6.2f} {m[2] / t[2]:>5.2f}"
            else:
                line += f"{'-':>9} {'-':>5} | {bus(size, t[0], k):>12.2f} {'-':>9} {'-':>5} | "
                line += f"{bus(size, t[2], k):>16.2f} {'-':>6} {'-':>5}"
            c = ccl.get(size)
            if kc:
                line += f" | {bus(size, c[0], k):>12.2f} {c[0] / t[0]:>5.2f}" if c else f" | {'-':>12} {'-':>5}"
            if kg:
                g = gloo.get(size)
                line += f" | {bus(size, g[2], k):>6.2f} {g[2] / t[2]:>5.2f}" if g else f" | {'-':>6} {'-':>5}"
            line += f" | {t[5]}"
            if t[4] or (m and m[4]) or (c and c[4]):
                line += "  WRONG VALUES"
            print(line)


if __name__ == "__main__":
    main()
