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

With --wire f32,bf16 (any of f32, bf16, f16), measures the automatic choice once per wire type
(TOROID_WIRE_DTYPE; f32 leaves it unset): per size, time, the model's prediction of that form
(the compressed one: exact within hosts, narrow between them), and the speed-up over the first
type, measured and predicted.

With --calls K, measures a step of K float all-reduces of the first size (toroid-bench --calls):
one by one, as one group, and as K persistent requests, each with the model's prediction
(persistent: the same as separate calls, the model prices no per-call work), and the speed-ups.

The ranks inherit the environment: where the kernel's default congestion control is BBR, run
with TOROID_TCP_CONGESTION=cubic (BBR stalls halving-doubling's bursts on the shaped links for
tens of milliseconds now and then; see docs/ENV.md).
"""
import argparse, json, os, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ["ring", "hring", "torus2d", "hd", "rd"]


def run(args, algo, out, env=None, extra=()):
    flow = ["-f", args.flow_rate] if args.flow_rate else []
    cmd = [os.path.join(ROOT, "scripts/emulated-cluster.sh"), "-H", str(args.hosts), "-K", str(args.per_host),
           "-r", args.rate, "-b", args.burst, *flow, "-t", str(args.timeout), "--",
           os.path.join(ROOT, "target/release/toroid-bench"),
           "-b", args.sizes[0], "-e", args.sizes[-1], "-f", str(args.factor), "-n", str(args.iters),
           "-w", "2", "-c", "1", "-J", out, *extra]
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
    p.add_argument("--wire", help="comma list of wire types (f32, bf16, f16): measure compression instead")
    p.add_argument("--calls", type=int, help="all-reduces per step: measure separate, grouped and persistent")
    args = p.parse_args()
    args.sizes = args.sizes.split(",")
    if args.nsocks:
        return striping(args)
    if args.wire:
        return compression(args)
    if args.calls:
        return calls(args)
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


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def compression(args):
    """The automatic choice once per wire type, repetitions interleaved."""
    types = args.wire.split(",")
    runs = {w: [] for w in types}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            for w in types:
                env = {} if w == "f32" else {"TOROID_WIRE_DTYPE": w}
                runs[w].append(run(args, "auto", os.path.join(d, f"{w}-{rep}.json"), env))
    print(f"# {args.hosts} hosts x {args.per_host} ranks, host links {args.rate}; float sum all-reduce, "
          f"automatic choice, wire type as TOROID_WIRE_DTYPE; median of {args.reps}")
    print(f"{'size':>10} {'wire':>5} {'algo':>8} {'time ms':>9} {'pred ms':>8} {'meas/pred':>9} "
          f"{'speed-up':>8} {'pred speed-up':>13}")
    table = []
    for i in range(len(runs[types[0]][0]["results"])):
        base = None
        for w in types:
            rows = [r["results"][i] for r in runs[w]]
            t = median(min(r["out_of_place"]["time_us"], r["in_place"]["time_us"]) for r in rows) / 1e6
            wrong = sum(r["out_of_place"]["wrong"] + r["in_place"]["wrong"] for r in rows)
            if wrong:
                # toroid-bench's check values are small integers, exact in bf16 and f16 too.
                sys.exit(f"wire {w} at {rows[0]['size']}: {wrong} wrong values")
            # Each run probes its own cost model on the shaped links: the median prediction.
            pred = median(r["predicted_us"] for r in rows) / 1e6
            base = base or (t, pred)
            print(f"{rows[0]['size']:>10} {w:>5} {rows[0]['algorithm']:>8} {t * 1e3:9.2f} {pred * 1e3:8.2f} "
                  f"{t / pred:9.2f} {base[0] / t:8.2f} {base[1] / pred:13.2f}")
            table.append({"size": rows[0]["size"], "wire": w, "algorithm": rows[0]["algorithm"], "time_s": t,
                          "predicted_s": pred})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


def calls(args):
    """A step of --calls all-reduces: separate, grouped, persistent, repetitions kept apart."""
    got = []
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            got.append(run(args, "auto", os.path.join(d, f"calls-{rep}.json"), extra=["--calls", str(args.calls)]))
    if any(g["wrong"] for g in got):
        sys.exit(f"wrong values: {[g['wrong'] for g in got]}")
    m = {k: median(g[k] for g in got) for k in ("separate_us", "grouped_us", "persistent_us")}
    p = got[0]
    print(f"# {args.hosts} hosts x {args.per_host} ranks, host links {args.rate}; a step of {p['calls']} float sum "
          f"all-reduces of {p['size']} B; median of {args.reps}; ms")
    print(f"{'form':>10} {'time ms':>9} {'pred ms':>8} {'meas/pred':>9} {'speed-up':>8} {'pred speed-up':>13}")
    pred = {"separate_us": p["predicted_separate_us"], "grouped_us": p["predicted_grouped_us"],
            "persistent_us": p["predicted_separate_us"]}
    for k in ("separate_us", "grouped_us", "persistent_us"):
        print(f"{k[:-3]:>10} {m[k] / 1e3:9.2f} {pred[k] / 1e3:8.2f} {m[k] / pred[k]:9.2f} "
              f"{m['separate_us'] / m[k]:8.2f} {pred['separate_us'] / pred[k]:13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": got, "median": m, "predicted": pred}, f, indent=1)


if __name__ == "__main__":
    main()
