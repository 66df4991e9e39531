#!/usr/bin/env python3
"""BMUF and BMUF-Adam against synchronous SGD on Fashion-MNIST, N = 2 and 4 ranks (processes
under toroid-run; on a 2-core machine 4 processes share the cores, which slows them but does not
change the numbers that are compared).

Every run sees the same number of training examples (all ranks together, --examples) and is
evaluated every --eval-examples examples. Runs:
  sync-sgd      synchronous SGD, per-rank batch b (global N*b, LR scaled linearly)
  bmuf-sgd      BMUF with momentum-SGD local steps (per-rank batch b, LR as for one worker of b)
  adam-naive    BMUF-Adam, moments of the next block = plain average
  adam-corr     BMUF-Adam, moments corrected as Chen, Ding and Huo (ICASSP 2020)
and the single-worker baselines (N = 1, batch b): sgd, adam.

Writes OUT/summary.csv, OUT/table.md, OUT/bmuf-N<n>.png (test accuracy and training loss against
examples and against MB all-reduced per rank); each run's CSVs are in OUT/<run>/.
"""

import argparse
import os

from common import TRAINER_DIR, compare_png, rows, table, train


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(TRAINER_DIR, "experiments", "results", "bmuf"))
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--tau", type=int, default=8)
    p.add_argument("--nesterov", default="true", choices=["true", "false"], help="Nesterov block momentum")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch b")
    p.add_argument("--examples", type=int, default=61440, help="training examples per run, all ranks")
    p.add_argument("--eval-examples", type=int, default=6144)
    p.add_argument("--sgd-lr", type=float, default=0.1, help="SGD LR for batch b")
    p.add_argument("--adam-lr", type=float, default=1e-3)
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--stem", default="imagenet", help="imagenet (4x down-sampling: fast) or small")
    p.add_argument("--test-limit", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="sync-sgd,bmuf-sgd,adam-naive,adam-corr")
    p.add_argument("--baselines", default="sgd,adam")
    p.add_argument("--reuse", action="store_true", help="keep completed runs already in --out")
    p.add_argument("--reference", default="", help="more runs for the figures, LABEL=DIR,...; "
                   "a label ending in -n<k> goes only into the figure for N = k")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    b, tau = a.batch, a.tau

    def common(n, lr):
        steps = a.examples // (n * b)
        every = max(1, a.eval_examples // (n * b))
        return steps, [
            "--model", "resnet18", "--width", a.width, "--stem", a.stem,
            "--batch", n * b, "--lr", lr, "--lr-ref-batch", b, "--decay", "none",
            "--weight-decay", 5e-5, "--seed", a.seed, "--epochs", 50, "--max-steps", steps,
            "--test-limit", a.test_limit, "--eval-every", every, "--threads", 1,
            "--log-every", 10, "--checkpoint-every", 0, "--no-plot", "--check-every", 1,
        ]

    results = []

    def record(name, n, kind, out, steps, syncs):
        ev = rows(os.path.join(out, "evals.csv"))
        last = ev[-1]
        results.append({"run": name, "N": n, "kind": kind, "dir": out, "steps": steps, "syncs": syncs,
                        "examples": last["examples"], "bytes": last["bytes"], "final_acc": last["test_acc"],
                        "best_acc": max(r["test_acc"] for r in ev), "final_loss": last["test_loss"]})

    for base in [x for x in a.baselines.split(",") if x]:
        lr = a.adam_lr if base == "adam" else a.sgd_lr
        steps, args = common(1, lr)
        args += ["--optimizer", base]
        out = os.path.join(a.out, f"single-{base}")
        train(out, args, log=print, reuse=a.reuse)
        record(f"single-{base}", 1, base, out, steps, 0)

    for n in [int(x) for x in a.ranks.split(",")]:
        for kind in [x for x in a.runs.split(",") if x]:
            if kind == "sync-sgd":
                steps, args = common(n, a.sgd_lr)
                syncs = steps
            else:
                adam = kind.startswith("adam")
                steps, args = common(n, a.adam_lr if adam else a.sgd_lr)
                moments = "naive" if kind == "adam-naive" else "corrected"
                args += ["--bmuf", f"tau={tau},eta=auto,zeta=1,nesterov={a.nesterov},moments={moments}"]
                args += ["--optimizer", "adam" if adam else "sgd"]
                syncs = -(-steps // tau)
            out = os.path.join(a.out, f"{kind}-n{n}")
            train(out, args, ranks=n, log=print, reuse=a.reuse)
            record(f"{kind}-n{n}", n, kind, out, steps, syncs)

    header = ["run", "N", "steps per rank", "all-reduce rounds", "MB all-reduced per rank",
              "examples", "final test acc", "best test acc", "final test loss"]
    body = [[r["run"], r["N"], r["steps"], r["syncs"], f"{r['bytes'] / 1e6:.1f}", f"{r['examples']:.0f}",
             f"{100 * r['final_acc']:.2f}%", f"{100 * r['best_acc']:.2f}%", f"{r['final_loss']:.4f}"]
            for r in results]
    print(f"\nFashion-MNIST, ResNet-18 width {a.width}, per-rank batch {b}, tau {tau}, nesterov {a.nesterov}, "
          f"{a.examples} examples per run, test on {a.test_limit} images")
    text = table(header, body)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "summary.csv"), "w") as f:
        keys = ["run", "N", "steps", "syncs", "bytes", "examples", "final_acc", "best_acc", "final_loss"]
        f.write(",".join(keys) + "\n")
        for r in results:
            f.write(",".join(str(r[k]) for k in keys) + "\n")
    singles = [(r["run"], r["dir"]) for r in results if r["N"] == 1]
    refs = [tuple(x.rsplit("=", 1)) for x in a.reference.split(",") if "=" in x]
    for n in sorted({r["N"] for r in results if r["N"] > 1}):
        mine = [(label, d) for label, d in refs if "-n" not in label or label.endswith(f"-n{n}")]
        png = os.path.join(a.out, f"bmuf-N{n}.png")
        bm = "Nesterov" if a.nesterov == "true" else "classical"
        compare_png(png, f"BMUF ({bm} block momentum) vs synchronous SGD, N = {n}, tau = {tau}",
                    singles + mine + [(r["run"], r["dir"]) for r in results if r["N"] == n],
                    ["examples", "mb"], ["test_acc", "train_loss"])
        print(png)


if __name__ == "__main__":
    main()
