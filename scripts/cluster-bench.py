#!/usr/bin/env python3
"""Measures every all-reduce algorithm on an emulated cluster and compares with the cost model.

    scripts/cluster-bench.py [--hosts 4] [--per-host 2] [--rate 1gbit] [--sizes 4K,64K,1M,16M]

For each algorithm (ring, hring, torus2d, hd, rd) and for the automatic choice, runs
toroid-bench on scripts/emulated-cluster.sh and prints, per size: measured time (best of
out-of-place and in-place), the model's prediction, their ratio, which algorithm was fastest,
what the automatic choice picked and how far it is from the fastest. Needs root (namespaces)
and a release build (cargo build --release).

The ranks inherit the environment: where the kernel's default congestion control is BBR, run
with TOROID_TCP_CONGESTION=cubic (BBR stalls halving-doubling's bursts on the shaped links for
tens of milliseconds now and then; see docs/ENV.md).
"""
import argparse, json, os, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ["ring", "hring", "torus2d", "hd", "rd"]


def run(args, algo, out):
    cmd = [os.path.join(ROOT, "scripts/emulated-cluster.sh"), "-H", str(args.hosts), "-K", str(args.per_host),
           "-r", args.rate, "-b", args.burst, "-t", str(args.timeout), "--", os.path.join(ROOT, "target/release/toroid-bench"),
           "-b", args.sizes[0], "-e", args.sizes[-1], "-f", str(args.factor), "-n", str(args.iters),
           "-w", "2", "-c", "1", "-J", out]
    if algo != "auto":
        cmd += ["-a", algo]
    r = subprocess.run(cmd, capture_output=True, text=True)
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
    args = p.parse_args()
    args.sizes = args.sizes.split(",")
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


if __name__ == "__main__":
    main()
