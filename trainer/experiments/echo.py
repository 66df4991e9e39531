#!/usr/bin/env python3
"""Data echoing (Choi et al., arXiv 1907.05550) on Fashion-MNIST with an input pipeline made slow
on purpose (--decode-cost-us), so that R = t_up / t_down > 1.

For each insertion point (example-before-aug, example-after-aug, batch) and echo factor E, train
until the test accuracy reaches --target and report the fresh examples read and the training
time (wall clock less evaluation) it took. Evaluations happen every --eval-fresh fresh examples
in every run (every eval_fresh * E / batch steps), so all runs are measured at the same
granularity of fresh data.

Writes OUT/summary.csv, OUT/table.md and OUT/echo.png (test accuracy against fresh examples
and against training time); each run's CSVs are in OUT/<run>/.
"""

import argparse
import math
import os
import statistics

from common import TRAINER_DIR, compare_png, rows, table, train


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(TRAINER_DIR, "experiments", "results", "echo"))
    p.add_argument("--factors", default="1,2,4", help="echo factors E")
    p.add_argument("--points", default="example-before-aug,example-after-aug,batch")
    p.add_argument("--target", type=float, default=0.80, help="target test top-1 accuracy")
    p.add_argument("--decode-cost-us", type=int, default=6000, help="added read time per example")
    p.add_argument("--decode-cost", default="sleep", choices=["sleep", "spin"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--stem", default="imagenet", help="imagenet (4x down-sampling: fast) or small")
    p.add_argument("--eval-fresh", type=int, default=1280, help="fresh examples between evaluations")
    p.add_argument("--max-fresh", type=int, default=40000, help="give up after this many fresh examples")
    p.add_argument("--test-limit", type=int, default=2000)
    p.add_argument("--echo-shuffle", type=int, default=512, help="shuffle buffer after the echo stage")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reuse", action="store_true", help="keep completed runs already in --out")
    a = p.parse_args()
    factors = [int(x) for x in a.factors.split(",")]
    points = a.points.split(",")
    seeds = [int(s) for s in a.seeds.split(",")]
    os.makedirs(a.out, exist_ok=True)
    log = print

    runs = [("none", 1)] + [(pt, e) for pt in points for e in factors if e > 1]
    results = []
    for pt, e in runs:
        for seed in seeds:
            name = f"{pt}-e{e}-s{seed}" if pt != "none" else f"baseline-s{seed}"
            eval_steps = max(1, a.eval_fresh * e // a.batch)
            args = [
                "--model", "resnet18", "--width", a.width, "--stem", a.stem,
                "--batch", a.batch, "--lr", a.lr, "--lr-ref-batch", a.batch, "--decay", "none",
                "--momentum", 0.9, "--weight-decay", 5e-5, "--seed", seed,
                "--epochs", 50, "--max-steps", a.max_fresh * e // a.batch,
                "--test-limit", a.test_limit, "--eval-every", eval_steps, "--target-acc", a.target,
                "--decode-cost-us", a.decode_cost_us, "--decode-cost", a.decode_cost,
                "--workers", 1, "--threads", a.threads, "--log-every", 10, "--checkpoint-every", 0, "--no-plot",
            ]
            if pt != "none":
                args += ["--echo", f"{pt}:{e}", "--echo-shuffle", a.echo_shuffle if pt != "batch" else 0]
            out = os.path.join(a.out, name)
            train(out, args, log=log, reuse=a.reuse)
            evals = rows(os.path.join(out, "evals.csv"))
            hit = next((r for r in evals if r["test_acc"] >= a.target), None)
            steps = rows(os.path.join(out, "steps.csv"))
            rs = [r["r"] for r in steps if r["r"] == r["r"]]
            results.append({
                "point": pt, "E": e, "seed": seed, "dir": out,
                "reached": hit is not None,
                "fresh": hit["fresh"] if hit else float("nan"),
                "steps": hit["step"] if hit else float("nan"),
                "train_s": hit["train_s"] if hit else float("nan"),
                "best_acc": max(r["test_acc"] for r in evals),
                "accs": [r["test_acc"] for r in evals],
                "R": statistics.median(rs) if rs else float("nan"),
                "t_up": statistics.median([r["t_up_s"] for r in steps]),
                "t_down": statistics.median([r["t_down_s"] for r in steps]),
            })

    # Mean over seeds per configuration (the runs that reached the target, for the "to target"
    # columns), and the spread as min-max.
    def vals(pt, e, key):
        return [r[key] for r in results if r["point"] == pt and r["E"] == e and r[key] == r[key]]

    def mean(pt, e, key):
        v = vals(pt, e, key)
        return sum(v) / len(v) if v else float("nan")

    def spread(pt, e, key, fmt, scale=1.0):
        v = [scale * x for x in vals(pt, e, key)]
        if len(v) < 2:
            return format(sum(v) / len(v), fmt) if v else "not reached"
        return f"{format(sum(v) / len(v), fmt)} [{format(min(v), fmt)}-{format(max(v), fmt)}]"

    # A smoother view than the first crossing: the mean test accuracy over the first K
    # evaluations (every run is evaluated every --eval-fresh fresh examples), K the fewest any
    # run made before it stopped.
    k = min(len(r["accs"]) for r in results)
    for r in results:
        r["mean_acc"] = sum(r["accs"][:k]) / k
    base_fresh, base_s = mean("none", 1, "fresh"), mean("none", 1, "train_s")
    def speedups(pt, e, of_means):
        """Baseline time over this run's time, seed by seed (min-max beside the ratio of means)."""
        base = {r["seed"]: r["train_s"] for r in results if r["point"] == "none"}
        v = [base[r["seed"]] / r["train_s"] for r in results if r["point"] == pt and r["E"] == e
             and not math.isnan(r["train_s"]) and not math.isnan(base.get(r["seed"], math.nan))]
        if len(v) < 2:
            return f"{of_means:.2f}x"
        return f"{of_means:.2f}x [{min(v):.2f}-{max(v):.2f}]"

    many = len(seeds) > 1
    rng = " mean [min-max]" if many else ""
    header = ["insertion point", "E", "reached", f"fresh examples to target{rng}", "steps",
              f"train time to target (s){rng}", "R (median)", "t_up (ms)", "t_down (ms)", "fresh vs E=1",
              f"time speed-up{' [per-seed min-max]' if many else ''}", f"mean acc, first {k * a.eval_fresh} fresh"]
    body = []
    for pt, e in runs:
        f, s = mean(pt, e, "fresh"), mean(pt, e, "train_s")
        n_runs = len([r for r in results if r["point"] == pt and r["E"] == e])
        body.append([pt, e, f"{len(vals(pt, e, 'fresh'))} of {n_runs}", spread(pt, e, "fresh", ".0f"),
                     f"{mean(pt, e, 'steps'):.0f}", spread(pt, e, "train_s", ".1f"),
                     f"{mean(pt, e, 'R'):.2f}", f"{1e3 * mean(pt, e, 't_up'):.0f}",
                     f"{1e3 * mean(pt, e, 't_down'):.0f}", f"{f / base_fresh:.2f}",
                     speedups(pt, e, base_s / s), f"{mean(pt, e, 'mean_acc'):.4f}"])
    head = (f"Target {a.target:.0%} test top-1 on {a.test_limit} test images; seeds {seeds}; "
            f"decode cost {a.decode_cost_us} us ({a.decode_cost}); batch {a.batch}")
    print("\n" + head)
    text = table(header, body)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(head + "\n\n" + text + "\n")
    with open(os.path.join(a.out, "summary.csv"), "w") as f:
        keys = ["point", "E", "seed", "reached", "fresh", "steps", "train_s", "best_acc", "mean_acc", "R", "t_up", "t_down"]
        f.write(",".join(keys) + "\n")
        for r in results:
            f.write(",".join(str(r[k]) for k in keys) + "\n")
    png = os.path.join(a.out, "echo.png")
    # Seeds of one configuration share a label, so the figure draws their mean (up to the run that
    # stopped first, at the target).
    compare_png(png, f"Data echoing, Fashion-MNIST, target {a.target:.0%}, mean of seeds {','.join(map(str, seeds))}",
                [(f"{r['point']} E={r['E']}", r["dir"]) for r in results],
                ["fresh", "train_s"], ["test_acc"])
    print(f"\n{png}")


if __name__ == "__main__":
    main()
