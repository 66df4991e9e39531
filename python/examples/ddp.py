"""Trains a small model with DistributedDataParallel over the "toroid" backend.

    pip install .                                    # in the toroid checkout (once)
    torchrun --standalone --nproc-per-node 2 python/examples/ddp.py
    python -m torch.distributed.run --standalone --nproc-per-node 2 python/examples/ddp.py

There is no toroid import: torch finds the installed backend by its entry point. (From a
checkout that is not installed, add `import toroid.torch` and put python/ on PYTHONPATH.)
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("toroid")  # rank, size and store from torchrun's environment
rank = dist.get_rank()

torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts rank 0's)
model = DDP(torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(rank)  # each rank its own batch
for step in range(5):
    x, y = torch.randn(64, 10, generator=data), torch.randn(64, 1, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # gradients are averaged across ranks by toroid all-reduces
    opt.step()
    print(f"rank {rank} step {step}: loss {loss.item():.4f}")

w = model.module[0].weight.detach().clone()
dist.all_reduce(w, op=dist.ReduceOp.MAX)
print(f"rank {rank}: parameters equal on every rank: {torch.equal(w, model.module[0].weight)}")
dist.destroy_process_group()
