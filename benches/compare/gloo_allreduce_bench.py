#!/usr/bin/env python3
"""Times torch.distributed all_reduce on the gloo backend the way toroid-bench times toroid.

Run under torchrun (one process per rank):

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 gloo_allreduce_bench.py -b 4K -e 64M -f 4

Sizes from -b to -e bytes times -f, -w warm-up and -n timed iterations, float sum. torch
all-reduces in place, so the out-of-place columns repeat the in-place ones. Ranks are not bound
to CPUs: gloo progresses on a background thread of its own, which binding to one CPU would make
share it with the caller. Prints nccl-tests' columns.
"""

import argparse
import time

import torch
import torch.distributed as dist


def size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-b", type=size, default=4096)
    p.add_argument("-e", type=size, default=64 << 20)
    p.add_argument("-f", type=int, default=4)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-w", type=int, default=5)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if rank == 0:
        print(f"# gloo_allreduce_bench (torch {torch.__version__}, gloo, float, sum)")
        print(f"# nRanks {n} minBytes {a.b} maxBytes {a.e} step: {a.f}(factor) warmup iters: {a.w} iters: {a.n}")
    bytes_ = a.b
    while bytes_ <= a.e:
        count = bytes_ // 4
        idx = torch.arange(count, dtype=torch.int64)
        def fresh():
            return ((rank * 7 + idx * 3) % 5).to(torch.float32)
        buf = fresh()
        for _ in range(a.w):
            dist.all_reduce(buf)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(a.n):
            dist.all_reduce(buf)
        secs = torch.tensor([(time.perf_counter() - t) / max(a.n, 1)], dtype=torch.float64)
        dist.all_reduce(secs)
        mean = secs.item() / n
        buf = fresh()
        dist.all_reduce(buf)
        want = sum(((r * 7 + idx * 3) % 5).to(torch.float32) for r in range(n))
        wrong = torch.tensor([int((buf != want).sum())])
        dist.all_reduce(wrong)
        algbw = bytes_ / 1e9 / mean
        busbw = algbw * 2 * (n - 1) / n
        if rank == 0:
            cols = f"{mean * 1e6:7.2f}  {algbw:6.2f}  {busbw:6.2f}  {int(wrong):6d}"
            print(f"{bytes_:12d}  {count:12d}  {'float':>8}  {'sum':>6}  {-1:6d}  {cols}  {cols}  gloo", flush=True)
        bytes_ *= a.f
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
