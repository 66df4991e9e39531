"""The handles a `Comm` hands out: `Work` (an async call), `Request` (a persistent
all-reduce), `Pending` (a communicator being created), and the `Store` protocol a caller's
key-value store follows."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Optional, Protocol

from . import _lib
from ._lib import check

if TYPE_CHECKING:
    from .comm import Comm


class Store(Protocol):
    """What `Comm.with_store` needs from a key-value store."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float) -> Optional[bytes]:
        """The value, waiting up to `timeout` seconds (0: do not wait); None when the key is
        still missing then. Raise when the store itself fails (a lost connection, a dead
        server): that is an error, not a missing key, and Comm.with_store raises it."""
        ...


class Work:
    """An operation issued with ``async_op=True``. It keeps its buffers alive until done."""

    def __init__(self, comm: "Comm", handle: int, refs: tuple, result: Any, name: str, any_source: bool = False):
        self._comm = comm
        self._handle = handle
        self._refs = refs
        self._result = result
        self._name = name
        self._done = False
        self._any_source = any_source  # wait() returns the sender

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Waits for completion and returns the output (raises ToroidError on failure).

        `timeout` in seconds (None: the communicator's timeout). Past it the communicator is
        aborted and toroid.TimeoutError is raised, as at every toroid deadline."""
        ms = -1 if timeout is None else min(max(0, int(timeout * 1000)), 1 << 62)  # (an int64 either way)
        fast = _lib.FAST_ASYNC  # (toroid_work_wait without ctypes, where the extension is built)
        code = fast.work_wait(self._handle, ms) if fast is not None and self._handle else -1
        if code == -1:
            code = _lib.lib().toroid_work_wait(self._handle, ms)
        self._finished()
        check(f"{self._name} (wait)", code, self._comm._handle_or_none())
        return self.source() if self._any_source else self._result

    def source(self) -> int:
        """The rank a finished receive from any source took its message from."""
        src = ctypes.c_int(-1)
        check("toroid_work_source", _lib.lib().toroid_work_source(self._handle, ctypes.byref(src)))
        return src.value

    def test(self) -> bool:
        """True once the operation has finished (successfully or not). Never blocks."""
        done = ctypes.c_int(0)
        check("toroid_work_test", _lib.lib().toroid_work_test(self._handle, ctypes.byref(done)))
        if done.value:
            self._finished()
        return bool(done.value)

    def _finished(self) -> None:
        if not self._done:
            self._done = True
            self._comm._forget(self)

    def __del__(self):
        # Unfinished works are kept referenced by their communicator: this runs once finished
        # (or at interpreter exit, when freeing without cancelling is still correct).
        handle, self._handle = self._handle, None
        if handle:
            try:
                fast = _lib.FAST_ASYNC  # (without ctypes, where the extension is built)
                if fast is not None:
                    fast.work_free(handle)
                else:
                    _lib.lib().toroid_work_free(handle)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


class Request:
    """A persistent all-reduce (`Comm.all_reduce_init`): `run()` reduces its arrays as they are
    now, as often as needed; `free()` releases it (also when garbage-collected). It keeps its
    arrays alive."""

    def __init__(self, comm: "Comm", handle: int, refs: tuple, result: Any):
        self._comm = comm
        self._handle = handle  # kept after free: toroid then reports the freed handle
        self._freed = False
        self._refs = refs
        self._result = result

    def run(self) -> Any:
        """Runs the all-reduce (blocking) and returns the output array. After `free()` (or
        once the communicator is destroyed) toroid.InvalidUsageError."""
        check("toroid_request_run", _lib.lib().toroid_request_run(self._handle), self._comm._handle_or_none())
        return self._result

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            _lib.lib().toroid_request_free(self._handle)

    def __del__(self):
        try:
            self.free()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class Pending:
    """A communicator being created, shrunk, grown or joined in the background
    (`Comm.from_env_async`, `Comm.init_async`, `Comm.shrink_async`, `Comm.grow_async`,
    `Comm.join_async`): poll it with `done()`, take the communicator with
    `wait()`, give up with `abort()` (returns within about 100 ms). Released when collected."""

    def __init__(self, handle: int):
        self._handle = handle

    def _live(self) -> int:
        if self._handle is None:
            raise ValueError("pending communicator already released")
        return self._handle

    def done(self) -> bool:
        """True once the set-up has finished, successfully or not; never blocks."""
        d = ctypes.c_int()
        check("toroid_pending_test", _lib.lib().toroid_pending_test(self._live(), ctypes.byref(d)))
        return bool(d.value)

    def wait(self) -> "Comm":
        """Waits for the set-up and returns the communicator (once), or raises its error
        (AbortedError after abort())."""
        out = ctypes.c_void_p()
        check("toroid_pending_wait", _lib.lib().toroid_pending_wait(self._live(), ctypes.byref(out)))
        from .comm import Comm  # (here: comm.py imports this module)

        return Comm(out.value)

    def abort(self) -> None:
        """Stops the set-up and drops what it had made; a no-op once the communicator was taken."""
        check("toroid_pending_abort", _lib.lib().toroid_pending_abort(self._live()))

    def release(self) -> None:
        """Frees the handle, aborting the set-up if it has not finished."""
        handle, self._handle = self._handle, None
        if handle is not None:
            _lib.lib().toroid_pending_free(handle)

    def __del__(self):
        try:
            self.release()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class GrowOffer:
    """One rank's offer to grow its communicator (`Comm.grow_offer`): `token` is the text the
    new processes join with (`Comm.join`); pass the offer to `Comm.grow` once. Released when
    collected (on rank 0 that stops the grow's store if no grow took it)."""

    def __init__(self, handle: int):
        self._handle = handle
        buf = ctypes.create_string_buffer(_lib.JOIN_TOKEN_MAX)
        check("toroid_grow_offer_token", _lib.lib().toroid_grow_offer_token(handle, buf, len(buf)))
        self.token: str = buf.value.decode()

    def _live(self) -> int:
        if self._handle is None:
            raise ValueError("grow offer already released")
        return self._handle

    def release(self) -> None:
        """Frees the offer."""
        handle, self._handle = self._handle, None
        if handle is not None:
            _lib.lib().toroid_grow_offer_free(handle)

    def __del__(self):
        try:
            self.release()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _failed_array(failed) -> tuple:
    ranks = [int(r) for r in failed]
    return (ctypes.c_int * max(1, len(ranks)))(*ranks), len(ranks)
