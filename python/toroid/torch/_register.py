"""Registration with torch.distributed: the backend's constructor, `register`, the DDP hooks
(`bf16_wire_hook`, `fp16_wire_hook`) and `batch_isend_irecv`, installed in torch's place."""

from __future__ import annotations

import sys
import warnings
from typing import Optional

import torch.distributed as dist

from . import _native
from ._backend import _DeviceBackend
from ._group import ProcessGroupToroid, _backend_constructible
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


class _MixedBackend(_DeviceBackend):
    """toroid's backend in a group whose other devices have another backend ("cpu:toroid,
    cuda:nccl"): torch's own ProcessGroup holds it for toroid's devices and the other backend
    for the rest, so this backend owns its ProcessGroupToroid (a _DeviceBackend only refers to
    the group that holds it)."""

    def __init__(self, pg: ProcessGroupToroid, rank: int, size: int):
        super().__init__(pg, rank, size)
        self._owner = pg


def _mixed_config() -> Optional[dict]:
    """The device -> backend map when torch is creating toroid for some devices of a group and
    another backend for the others, else None. torch passes a backend's creator no device;
    its _new_process_group_helper (torch 2.4 to 2.15) holds the parsed backend string as the
    local `backend_config`, read here from the creator's callers. Not found: None, and toroid
    takes the whole group as before."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return None
        config = frame.f_locals.get("backend_config")
        if config is not None and hasattr(config, "get_device_backend_map"):
            devices = dict(config.get_device_backend_map())
            return devices if any(b != BACKEND for b in devices.values()) else None
    return None


def _create(store, rank, size, timeout=None, *args, **kwargs):
    """torch's creator for "toroid": the whole process group (a ProcessGroupToroid, which torch
    returns as the group itself), or, when the backend string gives other devices another
    backend, a c10d Backend that torch's ProcessGroup uses beside that backend."""
    pg = ProcessGroupToroid(store, rank, size, timeout)
    mixed = _mixed_config()
    if mixed is None:
        return pg
    if not _backend_constructible():
        warnings.warn(f"this torch cannot construct a Python c10d Backend: toroid takes the whole group, not only "
                      f"{[d for d, b in mixed.items() if b == BACKEND]} of {mixed}", stacklevel=2)
        return pg
    mixed_backend = _MixedBackend(pg, rank, size)
    if pg._native_comm is not None:  # (the C++ backend, over the Python one that owns the group)
        return _native.module().ToroidBackend(pg._native_comm, mixed_backend, rank, size)
    return mixed_backend


def register() -> None:
    """Registers the backend "toroid" (done on import; repeated calls do nothing). An installed
    package needs no import: torch calls this through the entry point `toroid` of the group
    `torch.distributed.backends` (pyproject.toml) the first time a group names "toroid"."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=list(DEVICES))
        # toroid records every collective itself (its flight recorder: the stall report, dump()
        # and the health query), as gloo does: torch (2.15) attaches its own recorder's hook to
        # a group whose backend is not in this set, which costs each call of the C++ backend
        # about 4 us. (A private set: where absent, nothing to do.)
        recording = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
        if isinstance(recording, set):
            recording.add(BACKEND)


_torch_batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv


def batch_isend_irecv(p2p_op_list):
    """torch.distributed.batch_isend_irecv, installed in its place on import: a batch on a
    toroid group is recorded and issued as one toroid group, its sends and receives side by
    side (ProcessGroupToroid.start_coalescing / end_coalescing) on every torch version; other groups
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
        group.drop_coalescing()  # nothing of the batch is issued (_defer checks each operation)
        raise
    group.end_coalescing()
    return works
