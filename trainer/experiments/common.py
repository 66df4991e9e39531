"""Helpers shared by the experiment scripts: find the binaries, run the trainer, read its CSVs."""

import csv
import os
import shutil
import subprocess
import sys
import time

TRAINER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKSPACE = os.path.dirname(TRAINER_DIR)


def binary(name):
    """target/release/NAME (honours CARGO_TARGET_DIR); exits with a hint when it is missing."""
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(WORKSPACE, "target"))
    path = os.path.join(target, "release", name)
    if not os.path.exists(path):
        sys.exit(
            f"{path} not found: build it first with\n"
            "  cargo build --release -p toroid-train && cargo build --release --bin toroid-run"
        )
    return path


def finished(out):
    """True when OUT holds a completed run (its log ends with the trainer's last line)."""
    try:
        with open(os.path.join(out, "log.txt")) as f:
            return "toroid-train: done," in f.read()
    except OSError:
        return False


def train(out, args, ranks=1, log=None, reuse=False):
    """Runs toroid-train with ARGS (under toroid-run when RANKS > 1) writing to OUT; returns
    the seconds it took. The log goes to OUT/log.txt. With REUSE, a completed run already in OUT
    is kept (to add seeds or runs to an experiment)."""
    if reuse and finished(out):
        if log:
            log(f"  {os.path.basename(out)}: kept")
        return 0.0
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    # Run from the workspace root with OUT relative to it, so no path the trainer logs names this
    # machine's directories (the logs are committed with the results).
    cmd = [binary("toroid-train")] + [str(a) for a in args] + ["--out", os.path.relpath(out, WORKSPACE)]
    if ranks > 1:
        # A job limit of an hour: 8 ranks sharing 2 cores with other work take well over 10 minutes.
        cmd = [binary("toroid-run"), "-n", str(ranks), "--timeout", "3600", "--"] + cmd
    t = time.time()
    with open(os.path.join(out, "log.txt"), "w") as f:
        # The command as it reads from the workspace root (no machine-specific paths in results).
        f.write(" ".join(os.path.relpath(c, WORKSPACE) if os.path.isabs(c) else c for c in cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=WORKSPACE)
    if r.returncode != 0:
        sys.exit(f"run failed ({r.returncode}): see {out}/log.txt")
    secs = time.time() - t
    # Keep the results small: the CSVs and the log are what the experiments read and show.
    for name in ["checkpoint.safetensors", "checkpoint.json"]:
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    if log:
        log(f"  {os.path.basename(out)}: {secs:.0f} s")
    return secs


def rows(path):
    """The rows of a CSV file as dicts of floats."""
    with open(path) as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def compare_png(png, title, runs, xs, ys):
    """Draws RUNS ([(label, dir)]) with `toroid-train --compare`."""
    cmd = [
        binary("toroid-train"),
        "--compare", png,
        "--compare-title", title,
        "--compare-runs", ",".join(f"{label}={d}" for label, d in runs),
        "--compare-x", ",".join(xs),
        "--compare-y", ",".join(ys),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def table(header, body):
    """A Markdown table (printed and returned)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"
    text = "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in body])
    print(text)
    return text
