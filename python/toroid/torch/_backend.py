"""`_DeviceBackend`: the c10d Backend a ProcessGroupToroid registers for "cpu" and "cuda",
forwarding every call to the group."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torch._C._distributed_c10d import Backend as _C10dBackend

from ._types import BACKEND

if TYPE_CHECKING:  # (imported at run time it would be a cycle: _group imports this module)
    from ._group import ProcessGroupToroid


class _DeviceBackend(_C10dBackend):
    """The c10d Backend that a ProcessGroupToroid registers for its devices (DEVICES): torch's C++
    ProcessGroup looks a backend up by device for the entry points that a Python ProcessGroup
    does not override (batch_isend_irecv's coalescing, monitored_barrier, ...). Every call goes
    to the group's own method. The group itself stays what torch.distributed returns, so its
    collectives hand back ToroidWork objects directly (torch's wrapper around a Python
    backend's works forwards only wait() and get_future(): is_completed() would stay False)."""

    def __init__(self, pg: ProcessGroupToroid, rank: int, size: int):
        super().__init__(rank, size)
        self._pg = weakref.ref(pg)  # (the group holds this backend: no cycle)

    def _group(self) -> ProcessGroupToroid:
        pg = self._pg()
        if pg is None:
            raise RuntimeError("the toroid process group of this backend was destroyed")
        return pg

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def supports_coalescing(self) -> bool:
        return True  # batch_isend_irecv records its send/recv and issues them in a safe order

    @property
    def supports_splitting(self) -> bool:
        return True  # split_group splits the toroid communicator (ProcessGroupToroid.split_group)

    @property
    def supports_shrinking(self) -> bool:
        return True  # shrink_group shrinks the toroid communicator (ProcessGroupToroid.shrink)

    def shrink(self, ranks_to_exclude, shrink_flags=0, opts=None) -> "_DeviceBackend":
        """torch.distributed.shrink_group's backend call: the backend of a new group of the
        ranks not excluded (it keeps that group alive: torch wraps the backend alone in the new
        c10d ProcessGroup)."""
        child = self._group().shrink(ranks_to_exclude, shrink_flags, opts)
        if child._backend is None:
            raise RuntimeError("toroid: shrink_group needs torch's Python-constructible c10d Backend")
        backend = child._device_backend()
        if backend is child._backend:
            backend._owned = child
        else:
            backend._own(child)  # (the C++ backend: it keeps the group alive from C++)
        return backend

    def monitored_barrier(self, opts, wait_all_ranks=False) -> None:
        timeout = getattr(opts, "timeout", None)
        self._group().monitored_barrier(timeout, wait_all_ranks)

    def abort(self) -> None:
        pg = self._pg()
        if pg is not None:
            pg.abort()

    def shutdown(self) -> None:
        pg = self._pg()
        if pg is not None:
            pg.shutdown()


# The operations the C++ backend takes (_native.cpp): a group with it has torch's C++
# ProcessGroup methods under these names, and its Python methods under "_py_" + name.
NATIVE_OPS = ("allreduce", "broadcast", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "barrier",
              "send", "recv", "reduce", "allgather", "allreduce_coalesced", "all_gather_single_coalesced",
              "reduce_scatter_single_coalesced", "gather", "scatter")


def _forward(name: str):
    # (the C++ backend's operations: the group's Python methods, see NATIVE_OPS)
    target = f"_py_{name}" if name in NATIVE_OPS else name

    def method(self, *args):
        return getattr(self._group(), target)(*args)

    method.__name__ = name
    return method


for _name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single",
              "allgather_coalesced", "all_gather_single_coalesced", "gather", "scatter", "reduce_scatter",
              "reduce_scatter_single", "reduce_scatter_single_coalesced", "all_to_all_single", "alltoall", "send",
              "recv", "recv_anysource", "barrier", "start_coalescing", "end_coalescing"):
    setattr(_DeviceBackend, _name, _forward(_name))

_CpuBackend = _DeviceBackend  # (its name before it was registered for "cuda" too)
