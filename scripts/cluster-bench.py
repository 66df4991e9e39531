#!/usr/bin/env python3
"""Measures every all-reduce algorithm on an emulated cluster and compares with the cost model.

    scripts/cluster-bench.py [--hosts 4] [--per-host 2] [--rate 1gbit] [--sizes 4K,64K,1M,16M]
    scripts/cluster-bench.py --nsocks 1,2,4,8 --flow-rate 1gbit --rate 4gbit --sizes 16M

For each algorithm (ring, hring, torus2d, hd, rd) and for the automatic choice, runs
toroid-bench on scripts/emulated-cluster.sh and prints, per size: measured time (best of
out-of-place and in-place), the model's prediction, their ratio, which algorithm was fastest,
what the automatic choice picked and how far it is from the fastest. Needs root (namespaces)
and a release build (cargo build --release).

With --nsocks, measures the automatic choice instead once per TOROID_NSOCKS value (striped
connections), optionally with every connection capped at --flow-rate (emulated-cluster.sh -f):
per size, time, busbw, the share of what the host links allow (the time in which each host's
link carries the 2 (H-1)/H of the buffer that any all-reduce must move, over the time taken),
and the cost model's
prediction (the probe measures the striped link, so the model predicts the striped case).

The ranks inherit the environment: where the kernel's default congestion control is BBR, run
with TOROID_TCP_CONGESTION=cubic (BBR stalls halving-doubling's bursts on the shaped links for
tens of milliseconds now and then; see docs/ENV.md).
"""
import argparse, json, os, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ["ring", "hring", "torus2d", "hd", "rd"]


def run(args, algo, out, env=None):
    flow = ["-f", args.flow_rate] if args.flow_rate else []
    cmd = [os.path.join(ROOT, "scripts/emulated-cluster.sh"), "-H", str(args.hosts), "-K", str(args.per_host),
           "-r", args.rate, "-b", args.burst, *flow, "-t", str(args.timeout), "--",
           os.path.join(ROOT, "target/release/toroid-bench"),
           "-b", args.sizes[0], "-e", args.sizes[-1], "-f", str(args.factor), "-n", str(args.iters),
           "-w", "2", "-c", "1", "-J", out]
    if algo != "auto":
        cmd += ["-a", algo]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if r.returncode != 0:
        sys.exit(f"{algo}: failed\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--burst", default="128kb", help="tc tbf bucket per host link")
    p.add_argument("--sizes", default="4K,16M")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--reps", type=int, default=1, help="runs per algorithm; the median time is used")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--nsocks", help="comma list of TOROID_NSOCKS values: measure striping instead")
    p.add_argument("--flow-rate", help="cap every connection at this rate (emulated-cluster.sh -f)")
    args = p.parse_args()
    args.sizes = args.sizes.split(",")
    if args.nsocks:
        return striping(args)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        # Interleave the algorithms across repetitions so that load changes hit them alike.
        runs = {a: [] for a in ALGOS + ["auto"]}
        for rep in range(args.reps):
            for algo in ALGOS + ["auto"]:
                runs[algo].append(run(args, algo, os.path.join(d, f"{algo}-{rep}.json")))
        for algo, rs in runs.items():
            merged = rs[0]
            for i, row in enumerate(merged["results"]):
                for mode in ("out_of_place", "in_place"):
                    times = sorted(r["results"][i][mode]["time_us"] for r in rs)
                    row[mode]["time_us"] = times[len(times) // 2]
                    row[mode]["wrong"] = sum(r["results"][i][mode]["wrong"] for r in rs)
            results[algo] = merged
    sizes = [r["size"] for r in results["ring"]["results"]]
    rows = []
    print(f"# {args.hosts} hosts x {args.per_host} ranks, links {args.rate}; time in ms (measured / predicted)")
    # auto/best compares two runs (noise included); choice/best compares the forced run of the
    # algorithm that auto picked with the best forced run (the quality of the choice alone).
    head = (f"{'size':>10} " + " ".join(f"{a:>17}" for a in ALGOS)
            + f" {'best':>8} {'auto':>8} {'auto/best':>9} {'choice/best':>11}")
    print(head)
    for i, size in enumerate(sizes):
        cells, best = [], None
        for a in ALGOS:
            r = results[a]["results"][i]
            t = min(r["out_of_place"]["time_us"], r["in_place"]["time_us"]) / 1e3
            pred = r["predicted_us"] / 1e3
            wrong = r["out_of_place"]["wrong"] + r["in_place"]["wrong"]
            if wrong:
                sys.exit(f"{a} at {size}: {wrong} wrong values")
            cells.append(f"{t:8.2f}/{pred:<8.2f}")
            if best is None or t < best[1]:
                best = (a, t)
        ra = results["auto"]["results"][i]
        ta = min(ra["out_of_place"]["time_us"], ra["in_place"]["time_us"]) / 1e3
        rc = results.get(ra["algorithm"], {"results": None})["results"]
        tc = min(rc[i]["out_of_place"]["time_us"], rc[i]["in_place"]["time_us"]) / 1e3 if rc else float("nan")
        print(f"{size:>10} " + " ".join(cells)
              + f" {best[0]:>8} {ra['algorithm']:>8} {ta / best[1]:9.2f} {tc / best[1]:11.2f}")
        rows.append({"size": size, "best": best[0], "auto": ra["algorithm"], "auto_over_best": ta / best[1],
                     "choice_over_best": tc / best[1],
                     **{a: results[a]["results"][i] for a in ALGOS}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def rate_bytes(rate):
    """Bytes per second of a tc rate such as 4gbit."""
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * mult / 8
    return float(rate)


def striping(args):
    """The automatic choice once per TOROID_NSOCKS value, repetitions interleaved."""
    counts = [int(x) for x in args.nsocks.split(",")]
    runs = {k: [] for k in counts}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            for k in counts:
                runs[k].append(run(args, "auto", os.path.join(d, f"n{k}-{rep}.json"), {"TOROID_NSOCKS": str(k)}))
    n = args.hosts * args.per_host
    link = rate_bytes(args.rate)
    print(f"# {args.hosts} hosts x {args.per_host} ranks, host links {args.rate}, per-flow cap "
          f"{args.flow_rate or 'none'}; all-reduce, automatic choice; median of {args.reps}")
    print(f"{'size':>10} {'nsocks':>6} {'algo':>8} {'time ms':>9} {'busbw':>7} {'of link':>7} "
          f"{'pred ms':>8} {'meas/pred':>9} {'vs 1 sock':>9}")
    table = []
    for i, size in enumerate(runs[counts[0]][0]["results"]):
        base = None
        for k in counts:
            rows = [r["results"][i] for r in runs[k]]
            times = sorted(min(r["out_of_place"]["time_us"], r["in_place"]["time_us"]) for r in rows)
            t = times[len(times) // 2] / 1e6
            wrong = sum(r["out_of_place"]["wrong"] + r["in_place"]["wrong"] for r in rows)
            if wrong:
                sys.exit(f"nsocks {k} at {size['size'] if isinstance(size, dict) else size}: {wrong} wrong values")
            nbytes = rows[0]["size"]
            busbw = nbytes / t * 2 * (n - 1) / n
            # What the host links allow: every host must receive (and send) at least
            # 2 (H-1)/H of the buffer through its link (reduce-scatter and all-gather between
            # hosts of what its ranks reduced inside), whatever the algorithm.
            h = args.hosts
            share = (2 * (h - 1) / h * nbytes / link) / t
            pred = rows[0]["predicted_us"] / 1e6
            base = base or t
            print(f"{nbytes:>10} {k:>6} {rows[0]['algorithm']:>8} {t * 1e3:9.2f} {busbw / 1e9:7.3f} "
                  f"{share:7.0%} {pred * 1e3:8.2f} {t / pred:9.2f} {base / t:9.2f}")
            table.append({"size": nbytes, "nsocks": k, "algorithm": rows[0]["algorithm"], "time_s": t,
                          "busbw": busbw, "link_share": share, "predicted_s": pred})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
