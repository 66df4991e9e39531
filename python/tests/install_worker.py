"""A rank of test_install.py's scenarios: torch as a user of the installed package calls it, with
no toroid import before the process group exists (torch must find the backend itself)."""

import os
import sys

import torch
import torch.distributed as dist


def mixed(backend: str) -> None:
    """`backend` gives "cpu" to toroid and "cuda" to another backend: CPU collectives go through
    toroid's backend inside torch's own ProcessGroup, the other device keeps its backend."""
    assert "toroid" not in sys.modules  # nothing imported it before the group: torch loads it
    dist.init_process_group(backend)
    assert "toroid.torch" in sys.modules  # torch did, through the entry point
    rank, size = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    cpu = pg._get_backend(torch.device("cpu"))
    assert type(cpu).__module__.startswith("toroid.torch"), type(cpu)
    other = backend.split("cuda:")[1] if "cuda:" in backend else None
    if other is not None:
        assert type(pg).__name__ == "ProcessGroup", type(pg)  # torch's, holding both backends
        cuda = pg._get_backend(torch.device("cuda"))
        assert other in type(cuda).__name__.lower(), type(cuda)
    toroid_pg = cpu._group()
    before = toroid_pg.stats["allreduce"]
    # Random data per rank against the sum computed here from every rank's seed.
    n = 100_003
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    expect = sum(torch.randn(n, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(size))
    dist.all_reduce(x)
    torch.testing.assert_close(x, expect, rtol=1e-12, atol=1e-12)
    y = torch.arange(7, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(y, async_op=True).wait()
    assert torch.equal(y, torch.arange(7, dtype=torch.int64) * (size * (size + 1) // 2)), y
    assert toroid_pg.stats["allreduce"] == before + 2, toroid_pg.stats
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {backend} ok", flush=True)


if __name__ == "__main__":
    {"mixed": mixed}[sys.argv[1]](*sys.argv[2:])
    os._exit(0)
