"""All-reduces over the "toroid" backend in ranks started by torch.multiprocessing.spawn.

    python python/examples/spawn.py [NPROCS]

No toroid import and no launcher: the parent picks a free port, spawns the ranks, and each one
joins with a tcp:// init_method (torch finds the installed backend by its entry point).
"""

import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, size: int, port: int) -> None:
    dist.init_process_group("toroid", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    x = torch.full((1 << 16,), float(rank + 1))
    dist.all_reduce(x)  # every rank gets 1 + 2 + ... + size
    assert torch.all(x == size * (size + 1) / 2), x[:4]
    print(f"rank {rank} of {size}: all_reduce {x[0].item():.0f} on {dist.get_backend()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    nprocs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(nprocs, port), nprocs=nprocs, join=True)
