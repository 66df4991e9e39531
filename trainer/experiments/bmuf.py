#!/usr/bin/env python3
"""BMUF and BMUF-Adam against synchronous SGD and Adam on Fashion-MNIST, N = 4 and 8 ranks
(processes under toroid-run; on a 2-core machine 4 or 8 processes share the cores, which slows
them but does not change the numbers that are compared).

Every run sees the same training examples (all ranks together: --epochs whole epochs, or
--examples), with the same learning-rate schedule over them (--decay, cosine by default), and is
evaluated every --eval-examples examples on --test-limit test images. Runs:
  sync-sgd      synchronous SGD, per-rank batch b (global N*b, LR scaled linearly)
  sync-adam     synchronous Adam, per-rank batch b (global N*b, LR scaled by sqrt(N), the
                square-root rule for adaptive methods: Malladi et al., NeurIPS 2022)
  bmuf-sgd      BMUF with momentum-SGD local steps (per-rank batch b, LR as for one worker of b);
                block momentum as --nesterov/--form/--local say (defaults: the papers' Nesterov
                block momentum, eta = 1 - 1/N, zeta = 1, local momentum reset at every block)
  adam-naive    BMUF-Adam, moments of the next block = plain average
  adam-corr     BMUF-Adam, moments corrected as Chen, Ding and Huo (ICASSP 2020), the first
                moment then reset at every block unless --first moments
and the single-worker baselines (N = 1, batch b): sgd, adam.

Each is repeated for every seed in --seeds. Writes OUT/summary.csv (one row per run and seed),
OUT/table.md (means over seeds, and the issue's goals checked against them), OUT/bmuf-N<n>.png
(test accuracy and training loss against examples and against MB all-reduced per rank, the
mean over the seeds); each run's CSVs are in OUT/s<seed>/<run>/.
"""

import argparse
import math
import os

from common import TRAINER_DIR, compare_png, rows, table, train

TRAIN_EXAMPLES = 60000  # Fashion-MNIST's training set


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(TRAINER_DIR, "experiments", "results", "bmuf-first-reset"))
    p.add_argument("--ranks", default="4,8")
    p.add_argument("--tau", type=int, default=8)
    p.add_argument("--eta", default="auto", help="block momentum: auto (1 - 1/N, the papers') or a number")
    p.add_argument("--nesterov", default="true", choices=["true", "false"], help="Nesterov block momentum")
    p.add_argument("--form", default="paper", choices=["paper", "kept"],
                   help="where the Nesterov look-ahead goes (the trainer's --bmuf form=)")
    p.add_argument("--local", default="reset", choices=["keep", "reset"],
                   help="local SGD momentum at block boundaries (the trainer's --bmuf local=)")
    p.add_argument("--first", default="reset", choices=["moments", "reset"],
                   help="BMUF-Adam's first moment at block boundaries (the trainer's --bmuf first=): "
                   "zeroed like local=reset (the default), or as --bmuf moments= sets it (the "
                   "article's; results/bmuf-nesterov/ was made with it)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch b")
    p.add_argument("--epochs", type=int, default=6,
                   help="epochs per run (every run sees the same examples); 0: --examples instead")
    p.add_argument("--examples", type=int, default=61440, help="training examples per run with --epochs 0")
    p.add_argument("--decay", default="cosine", choices=["none", "cosine"], help="LR decay over the run")
    p.add_argument("--eval-examples", type=int, default=15000)
    p.add_argument("--sgd-lr", type=float, default=0.1, help="SGD LR for batch b")
    p.add_argument("--adam-lr", type=float, default=1e-3)
    p.add_argument("--bmuf-adam-lr", default="same", choices=["same", "sqrt"],
                   help="BMUF-Adam's local LR: --adam-lr (same), or --adam-lr / sqrt(N) (sqrt: block "
                        "momentum multiplies the step by about N, so the block-level step follows the "
                        "square-root rule that synchronous Adam follows)")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="LR warm-up from zero over this many epochs, every run (0: none)")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--stem", default="imagenet", help="imagenet (4x down-sampling: fast) or small")
    p.add_argument("--test-limit", type=int, default=10000)
    p.add_argument("--seeds", default="0")
    p.add_argument("--runs", default="sync-sgd,bmuf-sgd,sync-adam,adam-corr")
    p.add_argument("--baselines", default="sgd,adam")
    p.add_argument("--reuse", action="store_true", help="keep completed runs already in --out")
    p.add_argument("--reference", default="", help="more runs for the figures, LABEL=DIR,...; "
                   "a label ending in -n<k> goes only into the figure for N = k")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    b, tau = a.batch, a.tau
    seeds = [int(s) for s in a.seeds.split(",")]

    def common(n, lr, seed, ref_batch=b):
        if a.epochs:
            steps = a.epochs * (TRAIN_EXAMPLES // (n * b))
            length = ["--epochs", a.epochs]
        else:
            steps = a.examples // (n * b)
            length = ["--epochs", 50, "--max-steps", steps]
        every = max(1, a.eval_examples // (n * b))
        return steps, length + [
            "--model", "resnet18", "--width", a.width, "--stem", a.stem,
            "--batch", n * b, "--lr", lr, "--lr-ref-batch", ref_batch, "--decay", a.decay,
            "--weight-decay", 5e-5, "--seed", seed,
            *(["--warmup-epochs", a.warmup, "--warmup-from", 0] if a.warmup else []),
            "--test-limit", a.test_limit, "--eval-every", every, "--threads", 1,
            "--log-every", 10, "--checkpoint-every", 0, "--no-plot", "--check-every", 1,
        ]

    results = []

    def record(name, n, kind, seed, out, steps, syncs):
        ev = rows(os.path.join(out, "evals.csv"))
        last = ev[-1]
        results.append({"run": name, "N": n, "kind": kind, "seed": seed, "dir": out, "steps": steps,
                        "syncs": syncs, "examples": last["examples"], "bytes": last["bytes"],
                        "final_acc": last["test_acc"], "best_acc": max(r["test_acc"] for r in ev),
                        "final_loss": last["test_loss"]})

    for seed in seeds:
        for base in [x for x in a.baselines.split(",") if x]:
            lr = a.adam_lr if base == "adam" else a.sgd_lr
            steps, args = common(1, lr, seed)
            args += ["--optimizer", base]
            out = os.path.join(a.out, f"s{seed}", f"single-{base}")
            train(out, args, log=print, reuse=a.reuse)
            record(f"single-{base}", 1, base, seed, out, steps, 0)

        for n in [int(x) for x in a.ranks.split(",")]:
            for kind in [x for x in a.runs.split(",") if x]:
                if kind == "sync-sgd":
                    steps, args = common(n, a.sgd_lr, seed)
                    syncs = steps
                elif kind == "sync-adam":
                    # --lr is quoted for the global batch itself, so the trainer scales nothing.
                    steps, args = common(n, a.adam_lr * math.sqrt(n), seed, ref_batch=n * b)
                    args += ["--optimizer", "adam"]
                    syncs = steps
                else:
                    adam = kind.startswith("adam")
                    local = a.adam_lr / (math.sqrt(n) if a.bmuf_adam_lr == "sqrt" else 1.0)
                    steps, args = common(n, local if adam else a.sgd_lr, seed)
                    moments = "naive" if kind == "adam-naive" else "corrected"
                    args += ["--bmuf", f"tau={tau},eta={a.eta},zeta=1,nesterov={a.nesterov},moments={moments},"
                             f"form={a.form},local={a.local},first={a.first}"]
                    args += ["--optimizer", "adam" if adam else "sgd"]
                    syncs = -(-steps // tau)
                out = os.path.join(a.out, f"s{seed}", f"{kind}-n{n}")
                train(out, args, ranks=n, log=print, reuse=a.reuse)
                record(f"{kind}-n{n}", n, kind, seed, out, steps, syncs)

    # One row per run, the accuracies as the mean over seeds (and each seed's value).
    names = list(dict.fromkeys(r["run"] for r in results))
    of = {name: [r for r in results if r["run"] == name] for name in names}
    mean = lambda name, key: sum(r[key] for r in of[name]) / len(of[name])
    header = ["run", "N", "steps per rank", "all-reduce rounds", "MB all-reduced per rank",
              "examples", "final test acc (mean)", "per seed", "best test acc (mean)", "final test loss (mean)"]
    body = []
    for name in names:
        r0 = of[name][0]
        body.append([name, r0["N"], r0["steps"], r0["syncs"], f"{r0['bytes'] / 1e6:.1f}", f"{r0['examples']:.0f}",
                     f"{100 * mean(name, 'final_acc'):.2f}%",
                     " / ".join(f"{100 * r['final_acc']:.2f}" for r in of[name]),
                     f"{100 * mean(name, 'best_acc'):.2f}%", f"{mean(name, 'final_loss'):.4f}"])
    length = f"{a.epochs} epochs" if a.epochs else f"{a.examples} examples"
    head = (f"Fashion-MNIST, ResNet-18 width {a.width}, per-rank batch {b}, tau {tau}, nesterov {a.nesterov}, "
            + (f"eta {a.eta}, " if a.eta != "auto" else "")
            + (f"LR warm-up from zero over {a.warmup} epochs, " if a.warmup else "")
            + f"BMUF-Adam first moment {a.first}, "
            + f"{length} per run, LR decay {a.decay}, test on {a.test_limit} images, seeds {seeds}")
    print("\n" + head)
    text = table(header, body)
    # The claims, stated against the numbers above: each BMUF run against its synchronous
    # counterpart at the same N (and BMUF-Adam against one worker), with the traffic beside.
    goals = []
    for n in sorted({r["N"] for r in results if r["N"] > 1}):
        for bm, sync in [(f"bmuf-sgd-n{n}", f"sync-sgd-n{n}"), (f"adam-corr-n{n}", f"sync-adam-n{n}"),
                         (f"adam-naive-n{n}", f"sync-adam-n{n}"), (f"adam-corr-n{n}", "single-adam")]:
            if bm in of and sync in of:
                gap = 100 * (mean(sync, "final_acc") - mean(bm, "final_acc"))
                b0, s0 = of[bm][0], of[sync][0]
                goals.append(f"N={n}: {sync} minus {bm}: {gap:+.2f} points "
                             f"({'within' if gap <= 1.0 else 'NOT within'} 1 point); "
                             f"{b0['syncs']} all-reduce rounds and {b0['bytes'] / 1e6:.0f} MB per rank against "
                             f"{s0['syncs']} and {s0['bytes'] / 1e6:.0f} MB")
    for g in goals:
        print(g)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(head + "\n\n" + text + "\n\n" + "".join(f"- {g}\n" for g in goals))
    with open(os.path.join(a.out, "summary.csv"), "w") as f:
        keys = ["run", "N", "seed", "steps", "syncs", "bytes", "examples", "final_acc", "best_acc", "final_loss"]
        f.write(",".join(keys) + "\n")
        for r in results:
            f.write(",".join(str(r[k]) for k in keys) + "\n")
    first = [r for r in results if r["seed"] == seeds[0]]
    singles = [(r["run"], r["dir"]) for r in first if r["N"] == 1]
    refs = [tuple(x.rsplit("=", 1)) for x in a.reference.split(",") if "=" in x]
    for n in sorted({r["N"] for r in first if r["N"] > 1}):
        mine = [(label, d) for label, d in refs if "-n" not in label or label.endswith(f"-n{n}")]
        png = os.path.join(a.out, f"bmuf-N{n}.png")
        bm = "Nesterov" if a.nesterov == "true" else "classical"
        mine_n = [(r["run"], r["dir"]) for r in results if r["N"] == n]
        every = [(r["run"], r["dir"]) for r in results if r["N"] == 1] + mine + mine_n
        compare_png(png, f"N = {n}, tau = {tau}: BMUF ({bm}; SGD momentum {a.local}, Adam's m {a.first}) and "
                    f"synchronous, mean of seeds {','.join(map(str, seeds))}",
                    every, ["examples", "mb"], ["test_acc", "train_loss"])
        print(png)


if __name__ == "__main__":
    main()
