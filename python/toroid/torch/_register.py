"""Registration with torch.distributed: the backend's constructor, `register`, the DDP hooks
(`bf16_wire_hook`, `fp16_wire_hook`) and `batch_isend_irecv`, installed in torch's place."""

from __future__ import annotations


import torch.distributed as dist

from ._group import ProcessGroupToroid
from ._types import BACKEND, DEVICES


def _wire_hook(wire: str):
    def hook(process_group, bucket):  # (no annotation: DDP accepts only Future[Tensor] or none)
        group = process_group if process_group is not None else dist.group.WORLD
        if not isinstance(group, ProcessGroupToroid):
            raise TypeError(f"{wire}_wire_hook needs a toroid process group, not {type(group).__name__}")
        return group.allreduce_wire(bucket.buffer(), wire, dist.ReduceOp.AVG).get_future().then(lambda f: f.value()[0])

    hook.__name__ = f"{wire}_wire_hook"
    hook.__doc__ = f"""DDP communication hook: each gradient bucket is averaged by one all-reduce whose
    bytes travel in {wire} (half of float32's), accumulated in float32, the same on every rank.
    torch's own bf16_compress_hook casts the bucket and reduces in bf16; here only the
    transfer is narrow. Use: ddp.register_comm_hook(None, toroid.torch.{wire}_wire_hook) (or a
    toroid process group as the state)."""
    return hook


bf16_wire_hook = _wire_hook("bf16")
fp16_wire_hook = _wire_hook("f16")


def _create(store, rank, size, timeout=None, *args, **kwargs) -> ProcessGroupToroid:
    return ProcessGroupToroid(store, rank, size, timeout)


def register() -> None:
    """Registers the backend "toroid" (done on import; repeated calls do nothing)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=list(DEVICES))


_torch_batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv


def batch_isend_irecv(p2p_op_list):
    """torch.distributed.batch_isend_irecv, installed in its place on import: a batch on a
    toroid group is recorded and issued in the order that cannot deadlock
    (ProcessGroupToroid.start_coalescing / end_coalescing) on every torch version; other groups
    go to torch's own. (torch 2.11's own coalesces only when the group's type is exactly
    ProcessGroup, so for a toroid group it issued the sends one by one, and two ranks sending
    more than a ring holds to each other deadlocked; newer versions coalesce for subclasses.)
    Returns one work per operation, each complete once its operation is."""
    group = getattr(p2p_op_list[0], "group", None) if p2p_op_list else None
    if group is None and p2p_op_list and dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, ProcessGroupToroid):
        return _torch_batch_isend_irecv(p2p_op_list)
    dist.distributed_c10d._check_p2p_op_list(p2p_op_list)  # one group, P2POps of isend/irecv
    group.start_coalescing()
    try:
        works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in p2p_op_list]
    except BaseException:
        group._coalesced = None  # nothing of the batch was issued (_defer checks each operation)
        raise
    group.end_coalescing()
    return works
