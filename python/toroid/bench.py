"""torch's gloo and toroid side by side: all_reduce (or FSDP's all_gather_into_tensor and
reduce_scatter_tensor) through torch.distributed on this machine.

    python -m toroid.bench                          # 2 ranks, 4 KiB to 64 MiB by 4, float32 SUM
    python -m toroid.bench --ranks 4 --sizes 4K,1M,16M --json bench.json
    python -m toroid.bench --backends toroid --dtype bfloat16
    python -m toroid.bench --sizes 4K,64K --call future   # async, through the Work's future (DDP's)
    python -m toroid.bench --op all_gather --sizes 4K,16M  # all_gather_into_tensor (FSDP's)
    python -m toroid.bench --backends gloo,toroid,numpy     # and toroid's own numpy binding

It starts the ranks itself (`python -m toroid.bench --worker`, torch's env:// variables with a
free MASTER_PORT on 127.0.0.1). Every rank creates the world with `init_process_group("gloo")`
and a toroid group over the same ranks with `new_group(backend="toroid")`, so both backends run
in the same processes: for each size, after a warm-up, rounds of gloo calls and rounds of toroid
calls alternate (the first backend swapped each round), so that a change in the machine's load
falls on both. Each call is one `dist.all_reduce` (--op; or one `all_gather_into_tensor`, or
one `reduce_scatter_tensor`, whose size is that of the larger buffer, nccl-tests' convention:
the gathered output, the input to scatter), as a user makes it (--call: blocking, the
default; `wait`: async_op=True, then the Work's wait(); `future`: async_op=True, then
get_future().wait(), the path DDP's gradient buckets take), timed with `time.perf_counter_ns`;
a row reports the median over the calls, the largest over the ranks (gathered with a MAX
all-reduce after the size's calls). busbw = bytes / time * 2(n-1)/n for all_reduce, (n-1)/n
for the others, as nccl-tests defines it. Every size's result of each backend is checked,
element by element, against a reference (the sum of every rank's input, or their
concatenation, or this rank's piece of the sum) computed by each rank itself; a wrong result
fails the run. `numpy` (not in the default set) adds toroid's own Python binding on the toroid
group's communicator (`comm.all_reduce` of a numpy view of the same buffer; all_reduce,
blocking or wait, not bfloat16), to compare the numpy path with torch's. The whole run is
bounded by --timeout: a rank that fails or a run that overstays stops
every rank, and the exit status is nonzero.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import signal
import site
import socket
import statistics
import subprocess
import sys
import tempfile
import time

BACKENDS = ("gloo", "toroid", "numpy")
DEFAULT_BACKENDS = ("gloo", "toroid")
CALLS = ("blocking", "wait", "future")
OPS = ("all_reduce", "all_gather", "reduce_scatter")
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from "4096", "4K", "64M", "1G" (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 4K, 64M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m toroid.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", "-n", type=int, default=2, help="rank processes on this host (default 2)")
    p.add_argument("--sizes", type=lambda t: [parse_size(s) for s in _list(t)],
                   help="comma list of message sizes in bytes, e.g. 4K,64K,1M (overrides -b/-e/-f)")
    p.add_argument("--min-bytes", "-b", type=parse_size, default=4 << 10, help="smallest size (default 4K)")
    p.add_argument("--max-bytes", "-e", type=parse_size, default=64 << 20, help="largest size (default 64M)")
    p.add_argument("--factor", "-f", type=int, default=4, help="ratio of consecutive sizes (default 4)")
    p.add_argument("--dtype", choices=list(_ITEMSIZE), default="float32", help="element type (default float32); op SUM")
    p.add_argument("--backends", type=_list, default=list(DEFAULT_BACKENDS),
                   help="which of gloo,toroid,numpy (default gloo,toroid; numpy: toroid's own binding)")
    p.add_argument("--iters", type=int, help="timed calls per backend and size (default: 2 GiB of messages, "
                                             "20 to 1000 calls: 1000 up to 1 MiB, 32 at 64 MiB)")
    p.add_argument("--rounds", type=int, default=4, help="rounds each size's calls are split into (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per backend and size (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds for the whole run (default 300)")
    p.add_argument("--json", metavar="FILE", help="also write the rows (and the header's facts) to FILE")
    p.add_argument("--seed", type=int, default=1, help="seed of the random inputs (default 1)")
    p.add_argument("--op", choices=OPS, default="all_reduce",
                   help="all_reduce (default), all_gather (all_gather_into_tensor) or reduce_scatter "
                        "(reduce_scatter_tensor), SUM")
    p.add_argument("--call", choices=CALLS, default="blocking",
                   help="how each all_reduce is made: blocking (default); wait: async, then Work.wait(); "
                        "future: async, then Work.get_future().wait()")
    p.add_argument("--worker", metavar="RESULTS", help=argparse.SUPPRESS)  # a rank: rank 0 writes RESULTS
    return p


def sizes_of(args: argparse.Namespace) -> list[int]:
    if args.sizes:
        return args.sizes
    if args.factor < 2 or args.min_bytes > args.max_bytes:
        raise SystemExit("toroid.bench: need --factor >= 2 and --min-bytes <= --max-bytes")
    sizes, s = [], args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= args.factor
    return sizes


def iters_for(size: int, args: argparse.Namespace) -> int:
    """Calls per backend: 2 GiB of messages per backend and size, 20 to 1000 calls."""
    n = args.iters if args.iters else min(1000, max(20, (2 << 30) // size))
    return max(n, args.rounds)


# ---------------------------------------------------------------------------------------------
# A rank


def _inputs(torch, dtype, count: int, seed: int, rank: int, size: int):
    """Rank `rank`'s input for `size` bytes: every rank can make every rank's."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + size)
    if dtype.is_floating_point:
        return (torch.rand(count, generator=g, dtype=torch.float32) * 2 - 1).to(dtype)
    return torch.randint(-1000, 1000, (count,), generator=g, dtype=dtype)


def _check(torch, got, want, bound, backend: str, size: int, rank: int, op: str = "all_reduce") -> None:
    """Every element of `got` equals the float64 reference `want` within `bound` (exact for
    integers)."""
    bad = ((got.double() - want).abs() > bound).nonzero()
    if len(bad):
        i = int(bad[0])
        raise AssertionError(f"{backend} {op} of {size} bytes is wrong on rank {rank}: {len(bad)} of "
                             f"{got.numel()} elements, first at [{i}]: {got[i].item()} instead of "
                             f"{want[i].item()} (tolerance {float(bound[i] if bound.dim() else bound)})")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import toroid
    import toroid.torch  # noqa: F401 - registers "toroid" (an installed package also registers it itself)

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)  # env://; also gathers the timings
    groups = {"gloo": dist.group.WORLD}
    if "toroid" in args.backends or "numpy" in args.backends:
        groups["toroid"] = dist.new_group(backend="toroid", timeout=timeout)
    comm = groups["toroid"].comm if "numpy" in args.backends else None  # (the numpy backend's)
    backends = [b for b in BACKENDS if b in args.backends]
    dtype = getattr(torch, args.dtype)
    results = open(args.worker, "w") if rank == 0 else None
    if results:
        facts = dict(torch=torch.__version__, toroid=toroid.version(), library=toroid.library_path(), ranks=n,
                     cpus=len(os.sched_getaffinity(0)), dtype=args.dtype, op="SUM", backends=backends,
                     call=args.call, collective=args.op)
        print(json.dumps(facts), file=results, flush=True)

    for size in sizes_of(args):
        count = size // dtype.itemsize
        piece = count // n  # (all_gather's input, reduce_scatter's output)
        made = count if args.op != "all_gather" else piece
        mine = _inputs(torch, dtype, made, args.seed, rank, size)
        every = [mine if r == rank else _inputs(torch, dtype, made, args.seed, r, size) for r in range(n)]
        # The reference, from every rank's input made here: their concatenation, or their sum
        # (this rank's piece of it for reduce_scatter) with float sums' rounding bound.
        if args.op == "all_gather":
            want, bound = torch.cat(every).double(), torch.tensor(0.0)
        else:
            want = torch.zeros(count, dtype=torch.float64)
            scale = torch.zeros(count, dtype=torch.float64)
            for x in every:
                want += x.double()
                scale += x.double().abs()
            # float sums in another order round differently: n roundings of at most eps * sum|x|
            bound = scale.mul_(n * torch.finfo(dtype).eps) if dtype.is_floating_point else torch.tensor(0.0)
            if args.op == "reduce_scatter":
                want = want[rank * piece:(rank + 1) * piece]
                bound = bound[rank * piece:(rank + 1) * piece] if bound.dim() else bound
        del every
        buf = torch.empty(piece if args.op == "reduce_scatter" else count, dtype=dtype)  # the output
        arr = buf.numpy() if comm is not None else None  # (the same memory)
        iters = iters_for(size, args)
        times: dict[str, list[int]] = {b: [] for b in backends}

        def calls(b: str, k: int, timed: bool) -> None:
            group, async_op = groups.get(b), args.call != "blocking"
            for _ in range(k):
                if args.op == "all_reduce":
                    buf.copy_(mine)  # each call reduces the inputs, not the last result
                t0 = time.perf_counter_ns()
                if b == "numpy":
                    work = comm.all_reduce(arr, async_op=async_op)  # (in place, SUM)
                elif args.op == "all_gather":
                    work = dist.all_gather_into_tensor(buf, mine, group=group, async_op=async_op)
                elif args.op == "reduce_scatter":
                    work = dist.reduce_scatter_tensor(buf, mine, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
                else:
                    work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
                if args.call == "wait":
                    work.wait()
                elif args.call == "future":
                    work.get_future().wait()
                if timed:
                    times[b].append(time.perf_counter_ns() - t0)

        for b in backends:
            calls(b, max(args.warmup, 1), False)
            _check(torch, buf, want, bound, b, size, rank, args.op)
        for rnd in range(args.rounds):
            for b in backends if rnd % 2 == 0 else backends[::-1]:
                dist.barrier()  # the ranks start each round together
                k = iters // args.rounds + (rnd < iters % args.rounds)
                calls(b, k, True)
                if rnd == args.rounds - 1:
                    _check(torch, buf, want, bound, b, size, rank, args.op)
        p50 = torch.tensor([statistics.median(times[b]) for b in backends], dtype=torch.float64)
        dist.all_reduce(p50, op=dist.ReduceOp.MAX)  # the slowest rank's median
        if results:
            row = dict(bytes=size, count=count, iters=iters)
            for b, ns in zip(backends, p50.tolist()):
                row[f"{b}_p50_us"] = ns / 1e3
                row[f"{b}_busbw_gbps"] = size / ns * (2 if args.op == "all_reduce" else 1) * (n - 1) / n  # GB/s
            if "gloo" in backends and "toroid" in backends:
                row["speedup"] = row["gloo_p50_us"] / row["toroid_p50_us"]
            print(json.dumps(row), file=results, flush=True)
    if results:
        results.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(v, spec: str) -> str:
    return format(v, spec) if v is not None else "-"


def _header(facts: dict) -> list[str]:
    what = _OP_TEXT[facts.get("collective", "all_reduce")]
    op = "" if facts.get("collective") == "all_gather" else f" {facts['op']}"
    return [f"# toroid.bench: {what}{op} {facts['dtype']} through torch.distributed, "
            f"{facts['ranks']} ranks on this host, {facts['cpus']} CPUs",
            f"# torch {facts['torch']} (gloo), toroid {facts['toroid']} "
            f"({facts['library'] or 'libtoroid.so from the system library path'})",
            f"# us: median of a size's calls ({_CALL_TEXT[facts.get('call', 'blocking')]}; calls per backend), "
            "slowest rank; "
            f"busbw GB/s = bytes/time * {'2(n-1)/n' if facts.get('collective', 'all_reduce') == 'all_reduce' else '(n-1)/n'}; "
            "speed-up = gloo us / toroid us",
            f"# {'bytes':>10} {'count':>10} {'calls':>5} {'gloo us':>10} {'toroid us':>10} {'gloo GB/s':>10} "
            f"{'toroid GB/s':>11} {'speed-up':>9}" + (f" {'numpy us':>10} {'numpy GB/s':>10}"
                                                     if "numpy" in facts.get("backends", ()) else "")]


_OP_TEXT = {"all_reduce": "all_reduce in place", "all_gather": "all_gather_into_tensor (bytes: the output)",
            "reduce_scatter": "reduce_scatter_tensor (bytes: the input)"}
_CALL_TEXT = {"blocking": "blocking", "wait": "async, then wait()", "future": "async, then get_future().wait()"}


def _row(r: dict) -> str:
    g, t = r.get("gloo_p50_us"), r.get("toroid_p50_us")
    return (f"  {r['bytes']:>10} {r['count']:>10} {r['iters']:>5} {_fmt(g, '10.1f')} {_fmt(t, '10.1f')} "
            f"{_fmt(r.get('gloo_busbw_gbps'), '10.3f')} {_fmt(r.get('toroid_busbw_gbps'), '11.3f')} "
            f"{_fmt(r.get('speedup'), '8.2f') + ('x' if 'speedup' in r else ' ')}"
            + (f" {r['numpy_p50_us']:10.1f} {r['numpy_busbw_gbps']:10.3f}" if "numpy_p50_us" in r else ""))


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    sizes = sizes_of(args)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(args.ranks),
               LOCAL_WORLD_SIZE=str(args.ranks))
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several ranks per host
    # The ranks import the toroid this process runs: a checkout (on PYTHONPATH, or the cwd, which
    # `-m` puts first) goes on their PYTHONPATH; an installed package is found as it was here.
    root = str(pathlib.Path(__file__).resolve().parents[1])
    if root not in site.getsitepackages() + [site.getusersitepackages()]:
        env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)
    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory(prefix="toroid-bench-") as tmp:
        results = os.path.join(tmp, "results.jsonl")
        procs, logs, lines = [], [], []

        def drain() -> None:  # prints each row as rank 0 finishes it
            if os.path.exists(results):
                with open(results) as f:
                    new = f.read().splitlines(keepends=True)
                for line in new[len(lines):]:
                    if not line.endswith("\n"):
                        break
                    lines.append(line)
                    rec = json.loads(line)
                    print("\n".join(_header(rec)) if len(lines) == 1 else _row(rec), flush=True)

        try:
            for r in range(args.ranks):
                log = open(os.path.join(tmp, f"rank{r}.log"), "w+")
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "toroid.bench", *argv, "--worker", results],
                    env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            failed_at = None
            while True:
                drain()
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = now  # a rank failed: the others get a moment to report theirs
                if now > deadline or (failed_at is not None and now > failed_at + 5):
                    break
                time.sleep(0.05)
        finally:
            killed = [r for r, p in enumerate(procs) if p.poll() is None]
            for r in killed:
                os.killpg(procs[r].pid, signal.SIGKILL)
                procs[r].wait()
        drain()  # the rows written after the last look
        codes = [p.returncode for p in procs]
        failed = [r for r, c in enumerate(codes) if c != 0 and r not in killed]
        if failed or killed or len(lines) != len(sizes) + 1:
            if failed:
                why = f"rank(s) {', '.join(map(str, failed))} failed"
            elif killed:
                why = f"timed out after {args.timeout:g} s (--timeout)"
            else:
                why = f"the ranks ended with {max(len(lines) - 1, 0)} of {len(sizes)} rows"
            stopped = f"; stopped rank(s) {', '.join(map(str, killed))}" if killed else ""
            print(f"toroid.bench: {why}; exit codes {codes}{stopped}", file=sys.stderr)
            for r, log in enumerate(logs):  # the failed ranks' output, or every rank's when none failed
                log.seek(0)
                tail = log.read().splitlines()[-25:]
                if tail and (r in failed or not failed):
                    print(f"--- rank {r}, last lines:\n" + "\n".join(tail), file=sys.stderr)
            return 1
        if args.json:
            facts = json.loads(lines[0])
            with open(args.json, "w") as f:
                json.dump(dict(facts, rows=[json.loads(line) for line in lines[1:]]), f, indent=1)
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown or not args.backends:
        raise SystemExit(f"toroid.bench: --backends takes gloo, toroid and/or numpy, not "
                         f"{','.join(unknown) or 'nothing'}")
    if "numpy" in args.backends and (args.op != "all_reduce" or args.call == "future" or args.dtype == "bfloat16"):
        raise SystemExit("toroid.bench: the numpy backend times a blocking or waited all_reduce (no future) of a "
                         "numpy type (not bfloat16)")
    if args.ranks < 1 or args.rounds < 1:
        raise SystemExit("toroid.bench: need --ranks >= 1 and --rounds >= 1")
    odd = [s for s in sizes_of(args) if s % _ITEMSIZE[args.dtype]]
    if odd:
        raise SystemExit(f"toroid.bench: sizes must be multiples of {_ITEMSIZE[args.dtype]} bytes for {args.dtype}: {odd}")
    if args.op != "all_reduce":  # (each rank's piece a whole number of elements: rounded down, as nccl-tests does)
        unit = _ITEMSIZE[args.dtype] * args.ranks
        args.sizes = [s - s % unit for s in sizes_of(args)]
        if 0 in args.sizes:
            raise SystemExit(f"toroid.bench: {args.op} on {args.ranks} ranks needs sizes of at least {unit} bytes")
    if args.op == "reduce_scatter" and args.call == "future" and "gloo" in args.backends:
        raise SystemExit("toroid.bench: gloo's reduce_scatter_tensor has no future (torch: \"Work::getFuture not "
                         "implemented\"): use --call wait, or --backends toroid")
    if args.worker:
        worker(args)
        return 0
    try:
        return launch(args, argv)
    except KeyboardInterrupt:  # launch has stopped the ranks on its way out
        return 130


if __name__ == "__main__":
    sys.exit(main())
