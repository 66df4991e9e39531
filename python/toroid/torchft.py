"""torchft on toroid: `ProcessGroupToroid`, a reconfigurable process group for torchft's Manager
in place of torchft's `ProcessGroupGloo`.

    from datetime import timedelta
    from torchft import Manager
    from toroid.torchft import ProcessGroupToroid

    pg = ProcessGroupToroid(timeout=timedelta(seconds=10))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=..., state_dict=...)

torchft (meta-pytorch/torchft; checked with 0.2.0) reconfigures its process group on every quorum
change: `configure(store_addr, replica_id, rank, world_size, ...)` with a fresh store prefix
("host:port/torchft/<quorum>/<group rank>"). Each configure aborts the previous group (never
blocking: toroid_comm_abort; its completion thread and communicator are released on a thread of
their own) and builds a new toroid group of the torch backend (toroid.torch.ProcessGroupToroid,
the one torch.distributed's "toroid" backend creates) on torchft's store client, as torchft's
ProcessGroupGloo builds a gloo one. The timeout (the constructor's, or `set_timeout`'s for the
next configure) bounds the set-up and every operation of the group, as gloo's does.

Differences from torchft's gloo group:

- reduce_scatter, reduce_scatter_tensor_coalesced and alltoall_base work (gloo's raise).
- `Work.wait(timeout)` past its timeout aborts the group (as torchft's NCCL group does on a
  timeout): toroid runs a group's operations one at a time in issue order, so an operation left
  pending (a receive whose sender never comes) would hold up every later one, sends included,
  where gloo's send and receive are independent. Later operations fail at once, saying so, and
  `errored()` reports it until the next configure.
- `errored()` reports an abort of the current group (as torchft's NCCL group does) and a revoke
  of its communicator by any rank (`revoke()`).
- `shutdown()` releases the communicator, so that peers' pending operations fail at once
  ("Connection closed by peer") instead of waiting for their timeout.

Importing this module needs torchft; `import toroid` and `import toroid.torch` do not.
"""

from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Generator, Optional

import torch.distributed as dist
from torch.distributed import Store

from torchft.process_group import ProcessGroupWrapper

from . import _lib
from .torch import ProcessGroupToroid as _ToroidGroup
from .torch._errors import _BACKEND_ERROR, _seconds

__all__ = ["ProcessGroupToroid"]

BACKEND_NAME = "torchft-toroid"


def _release(group: _ToroidGroup) -> None:
    """Waits for the group's completion thread (its operations fail at once after an abort),
    then destroys its communicator; failures of a released group are already its works'."""
    try:
        group.shutdown()
    except Exception:  # noqa: BLE001 - a teardown on a thread of its own: nothing to raise to
        pass


class _Work(dist.Work):
    """A work of the current toroid group as ProcessGroupToroid hands it out: the group's own
    ToroidWork, except that a wait(timeout) that passes its timeout aborts the group (see the
    module's notes) before raising."""

    def __init__(self, owner: "ProcessGroupToroid", group: _ToroidGroup, work: dist.Work):
        super().__init__()
        self._owner = owner
        self._group = group
        self._work = work  # a ToroidWork, or a work of the C++ backend (torch's Work type)

    def wait(self, timeout=None) -> bool:
        seconds = _seconds(timeout)
        try:
            # (a C++ backend's work takes a timedelta, or nothing for no timeout)
            return self._work.wait() if seconds is None else self._work.wait(timedelta(seconds=seconds))
        except RuntimeError as e:
            if seconds is None or self._work.is_completed():
                raise  # the operation's own failure
            # (the C++ backend's works name their operation only in their message)
            named = re.search(r"toroid (\w+) did not complete", str(e))
            name = getattr(self._work, "_name", None) or (named.group(1) if named else "operation")
            what = f"{name} did not complete within {seconds:g} s"
            self._owner._wait_timed_out(self._group, what)
            raise RuntimeError(f"Operation timed out! toroid {what} (Work.wait timeout); the toroid process group "
                               "is aborted: the pending operation held up every later one") from e

    def get_future(self):
        return self._work.get_future()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def result(self):
        return self._work.result()

    def _source_rank(self) -> int:
        return self._work._source_rank()


class ProcessGroupToroid(ProcessGroupWrapper):
    """A reconfigurable toroid process group for torchft (in place of torchft's ProcessGroupGloo).

    Args:
        timeout: bounds the set-up of each configured group and every operation on it (as
            torchft's ProcessGroupGloo passes its timeout to gloo).
        wire_dtype: "bf16" or "f16": every float32/float64 all-reduce travels in that type
            (toroid.torch.ProcessGroupToroid.set_wire_dtype); None (default): uncompressed
            unless TOROID_WIRE_DTYPE says otherwise. Every replica must use the same.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60), wire_dtype: Optional[str] = None) -> None:
        super().__init__(timeout=timeout)
        self._wire_dtype = wire_dtype
        self._errored: Optional[Exception] = None
        self._timed_out: Optional[str] = None  # why the current group was aborted by a wait
        self._lock = threading.Lock()  # guards taking self._pg away (abort from a timer thread)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _create_pg(self, store: Store, rank: int, world_size: int) -> dist.ProcessGroup:
        self._errored = None
        self._timed_out = None
        seconds = self._timeout.total_seconds()
        try:
            pg = _ToroidGroup(store, rank, world_size, self._timeout, wire_dtype=self._wire_dtype)
        except _lib.TimeoutError as e:
            # gloo's wording (its store wait says "timeout after 10ms"), toroid's detail after it.
            raise _BACKEND_ERROR(f"[Rank {rank}]: toroid set-up of a group of {world_size}: timeout after "
                                 f"{seconds * 1000:.0f}ms. toroid: {e}") from e
        except _lib.ToroidError as e:
            raise _BACKEND_ERROR(f"[Rank {rank}]: toroid set-up of a group of {world_size} failed. toroid: {e}") from e
        return pg

    def _wrap_work(self, work, opts):
        # Every work of a toroid group: a ToroidWork of the Python path or one of the C++
        # backend (which took most calls, send and recv among them, and returns torch's Work).
        pg = self._pg
        if isinstance(work, dist.Work) and isinstance(pg, _ToroidGroup):
            return _Work(self, pg, work)
        return work

    @contextmanager
    def _run_context(self) -> Generator[None, None, None]:
        try:
            yield
        except RuntimeError as e:
            why = self._timed_out
            if why is None:
                raise
            raise _BACKEND_ERROR(f"{e} [the toroid process group was aborted when a wait timed out: {why}]") from e

    def _wait_timed_out(self, group: _ToroidGroup, why: str) -> None:
        if self._pg is not group:
            return  # a group configured away since
        self._timed_out = why
        self._errored = RuntimeError(f"aborted: a wait on the toroid process group timed out ({why})")
        try:
            group.abort()
        except _lib.ToroidError:
            pass

    def _take(self) -> Optional[dist.ProcessGroup]:
        with self._lock:
            pg, self._pg = self._pg, None
        return pg

    def abort(self, errored: bool = True) -> None:
        """Fails the current group's pending and later operations at once and drops it; never
        blocks (the communicator is released on a thread of its own). With `errored`,
        `errored()` then reports "aborted" until the next configure (as torchft's NCCL group)."""
        if errored:
            self._errored = RuntimeError("aborted: the toroid process group was aborted")
        pg = self._take()
        if pg is None:
            return
        if errored:  # as torchft's wrapper: an abort for an error goes to its errors logger
            self.errors_logger.info("", extra={"job_id": os.environ.get("JOB_ID", "unknown"),
                                               "replica_id": self._replica_id, "rank": self._rank,
                                               "quorum_id": self._quorum_id, "error": "process_group_abort"})
        try:
            pg.abort()
        except _lib.ToroidError:
            pass  # already destroyed
        threading.Thread(target=_release, args=(pg,), name="toroid-torchft-release", daemon=True).start()

    def shutdown(self) -> None:
        """Releases the current group: waits for its queued operations (each bounded by the
        timeout), then destroys its communicator, so that peers' pending operations fail at once."""
        pg = self._take()
        if pg is not None:
            _release(pg)

    def errored(self) -> Optional[Exception]:
        """RuntimeError("aborted ...") after `abort()` or a wait that timed out (until the next
        configure), or once any rank has revoked the current communicator (`revoke()`); None
        otherwise. Failed operations report their errors through their works, as on gloo."""
        if self._errored is not None:
            return self._errored
        pg = self._pg
        if isinstance(pg, _ToroidGroup):
            try:
                if pg.comm.is_revoked():
                    return RuntimeError("aborted: the toroid communicator was revoked")
            except _lib.ToroidError:
                pass
        return None

    def revoke(self) -> None:
        """Revokes the current communicator (toroid_comm_revoke): pending and later operations
        fail on every rank, and `errored()` reports it on each. Never blocks."""
        pg = self._pg
        if isinstance(pg, _ToroidGroup):
            pg.comm.revoke()

    @property
    def toroid_group(self) -> Optional[_ToroidGroup]:
        """The current toroid.torch.ProcessGroupToroid (None before configure, after abort or
        shutdown): its `comm` gives health(), dump(); its `stats` counts the operations."""
        pg = self._pg
        return pg if isinstance(pg, _ToroidGroup) else None

    def __repr__(self) -> str:
        return f"ProcessGroupToroid(pg={self._pg})"
