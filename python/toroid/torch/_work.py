"""`ToroidWork`: the torch Work of a toroid operation (its future, wait with a timeout, the
copy back of staged and non-contiguous outputs), completed in issue order by the group's
completion thread, or on the caller's thread when nothing remains to do but wait (see
ToroidWork._lazy)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.futures import Future

from ._errors import _seconds, _torch_error
from ._staging import _Staging
from ._types import _cuda_devices

if TYPE_CHECKING:  # (imported at run time it would be a cycle: _group imports this module)
    from ._group import ProcessGroupToroid


class _Finished:
    """A toroid call that has already run on the host (a stream call that returned having
    completed or having enqueued its collective on the caller's stream, or the failure that
    stopped issuing the others) as a work of a ToroidWork: wait() raises its failure, if any.
    With `event` (recorded on the caller's stream right after a stream call, and handed to the
    ToroidWork with its device), the ToroidWork's wait() makes the current stream of that device
    wait for it (on the waiting thread, every wait), and test() is whether the device has run it: ProcessGroupNCCL's rules, so a
    result read on another stream after wait() is the collective's even where the library only
    enqueued it (the stream-ordered path)."""

    _any_source = False

    def __init__(self, error: Optional[BaseException] = None, event=None):
        self._error = error
        self.event = event

    def wait(self, timeout=None) -> None:
        if self._error is not None:
            raise self._error

    def test(self) -> bool:
        return self._event is None or self._event.query()


class ToroidWork(dist.Work):
    """A torch Work over toroid async works: wait() blocks until they are done, get_future()
    completes when they are (set by the group's completion thread, or by wait()).

    `staging` (a call on CUDA tensors run on CPU copies) maps the result back to the caller's
    tensors and copies the outputs back once `finish` has run. A result holding CUDA tensors
    gets a future that names their devices (torch refuses CUDA tensors in a CPU-only future)."""

    # The state every work starts in, as class attributes: an instance sets only what differs
    # (each attribute set on a torch Work costs ~0.1 us, and an async 4 KiB all-reduce through
    # torch makes one work per call).
    _copy_back: Optional[Callable[[], None]] = None
    _source: Optional[int] = None  # the sender, for a receive from any source
    # Stream calls' events: wait() makes the waiter's current stream wait for each (only CUDA
    # stream calls have any).
    _events: tuple = ()
    # The future and the event a waiter sleeps on are made when first asked for: a blocking
    # call needs neither, and each costs microseconds.
    _future: Optional[Future] = None
    _done = False
    _is_settled = False  # done, and the future (if made by then) completed
    _settled_event: Optional[threading.Event] = None  # set once settled
    _settler: Optional[int] = None  # the thread that completes the future
    _deferred = False  # a send/recv of a coalescing block, not issued yet
    _exception: Optional[BaseException] = None
    _queued = False

    def __init__(self, pg: "ProcessGroupToroid", works: list, result: Any, finish: Optional[Callable[[], None]], name: str,
                 timeout: Optional[float] = None, staging: Optional[_Staging] = None, events: tuple = ()):
        super().__init__()
        if staging is not None:
            result = staging.original(result)
            self._copy_back = staging.copy_back
        if events:
            self._events = events
        self._pg = pg
        self._timeout_s = timeout if timeout is not None else pg._timeout_s
        self._works = works
        self._result = result
        self._finish = finish
        self._name = name
        self._lock = threading.Lock()
        # A work with nothing to do once its toroid works are done (no copy back, no finishing
        # step: an in-place CPU all-reduce, broadcast, barrier ...) goes to the completion
        # thread only when something needs its completion without a wait: get_future(), or a
        # wait with a timeout. A plain wait() (every blocking torch call) then completes it on
        # the caller's thread, where toroid runs the operation itself if its worker has not
        # started it: no hand-over to two other threads and back, which cost a blocking 4 KiB
        # all-reduce most of its time. is_completed() tests the toroid works.
        self._lazy = finish is None and staging is None

    def _complete(self) -> None:
        """Waits for the toroid works, runs the copy-backs, completes the future (once)."""
        with self._lock:
            if self._done:
                return
            try:
                for w in self._works:
                    got = w.wait(self._timeout_s)
                    if getattr(w, "_any_source", False):
                        self._source = got
                if self._finish is not None:
                    self._finish()
                if self._copy_back is not None:
                    self._copy_back()
            except BaseException as e:  # noqa: BLE001 - handed to the future and to wait()
                self._exception = _torch_error(e, self._name, self._pg.rank(), self._timeout_s)
            self._done = True
            works, self._works = self._works, ()
            self._settler = threading.get_ident()
            future = self._future  # (one made later is completed by get_future)
            if future is None:  # (nothing to run outside the lock: settled now)
                self._is_settled = True
                event = self._settled_event
        del works  # (the toroid works are freed here, outside the lock)
        if future is not None:
            # The future's callbacks run here, outside the lock (they may wait on other works).
            self._settle_future(future)
            with self._lock:
                self._is_settled = True
                event = self._settled_event
        if event is not None:
            event.set()

    def _settle_future(self, future: Future) -> None:
        if self._exception is not None:
            future.set_exception(self._exception)
        else:
            future.set_result(self._result)

    def _fail_unissued(self, error: BaseException) -> None:
        """Completes a work whose operation was never issued with `error`."""
        self._deferred = False
        self._exception = error
        self._done = True
        self._is_settled = True

    def _queue_slot(self) -> bool:
        """Under self._lock: whether the caller is the one to hand the work to the group's
        completion thread (once, and not once it is done)."""
        if self._queued or self._done:
            return False
        self._queued = True
        return True

    def _enqueue(self) -> None:
        """Hands the work to the group's completion thread (once)."""
        with self._lock:
            go = self._queue_slot()
        if go:
            self._pg._queue.put(self)

    def _settled(self, seconds: Optional[float]) -> bool:
        """Waits until the future is completed too (a callback of that future, running on the
        completing thread, does not wait for itself)."""
        if self._settler == threading.get_ident():
            return True
        with self._lock:
            if self._is_settled:
                return True
            if self._settled_event is None:
                self._settled_event = threading.Event()
            event = self._settled_event
        return event.wait(seconds)

    def wait(self, timeout=None) -> bool:
        """Waits for completion (the future too); raises the operation's error. With a timeout
        (seconds or a timedelta; torch's timedelta(0) means none), raises RuntimeError
        "Operation timed out!" (what gloo's collectives raise) once it passes; the operation
        stays queued, like gloo's, and a later wait() can still complete it."""
        if self._deferred:
            raise RuntimeError(f"toroid {self._name}: waited on inside a coalescing block; "
                               "its operation is issued when the block ends")
        seconds = _seconds(timeout) if timeout is not None else None
        if seconds is None:
            self._complete()
            if not self._is_settled:  # (a future's callbacks may still be running elsewhere)
                self._settled(None)
        else:
            self._enqueue()  # the completion thread completes it
            if not self._settled(seconds):
                raise RuntimeError(f"Operation timed out! toroid {self._name} did not complete within "
                                   f"{seconds:g} s (Work.wait timeout; the operation is still pending)")
        if self._exception is not None:
            raise self._exception
        for event, device in self._events:
            with torch.cuda.device(device):
                event.wait(torch.cuda.current_stream(device))
        return True

    def get_future(self) -> Future:
        with self._lock:
            made = self._future is None
            if made:
                devices = _cuda_devices(self._result)
                self._future = Future(devices=devices) if devices else Future()
            late = made and self._done  # _complete has passed the point where it completes it
            future = self._future
            enqueue = not late and self._queue_slot()  # (_enqueue's, under the lock held here)
        if late:
            self._settle_future(future)
        elif enqueue:
            self._pg._queue.put(self)
        return future

    def is_completed(self) -> bool:
        """Whether the operation has run, its outputs in place. The completing thread marks it
        so before it completes the future (as gloo's work does), so a caller woken by the future
        finds it completed, while the future's callbacks may still be running."""
        if not self._done and not self._queued and not self._deferred:
            works = self._works
            if all(w.test() for w in works):
                self._complete()  # (done: it does not block)
        return self._done

    def is_success(self) -> bool:
        return self.is_completed() and self._exception is None

    def exception(self):
        self.is_completed()
        return self._exception

    def result(self):
        return self._result

    def _source_rank(self) -> int:
        """The sender of a finished receive from any source (what dist.recv returns)."""
        if self._source is None:
            raise RuntimeError(f"toroid {self._name}: no source rank (not a finished receive from any source)")
        return self._source

    def __repr__(self) -> str:
        return f"ToroidWork({self._name}, done={self._done})"
