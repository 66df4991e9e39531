"""`Comm`'s calls on raw addresses: host memory (`*_ptr`, blocking or async) and CUDA device
memory ordered on a stream (`*_stream_ptr`), as a mixin of `Comm` (comm.py)."""

from __future__ import annotations

import ctypes
from typing import Any, Optional

from . import _lib
from ._handles import Work
from ._lib import DataType, ReduceOp, check


# The C extension's codes (see _lib.FAST), by member and by the names DataType.of and
# ReduceOp.of read at once; other spellings take the general path.
_FAST_TYPES = {**{m.name.lower(): int(m) for m in DataType}, **{m: int(m) for m in DataType}}
_FAST_OPS = {**{m.name.lower(): int(m) for m in ReduceOp}, **{m: int(m) for m in ReduceOp}}
_NOT_TAKEN = -1  # (toroid._fastcall: the call was not made)


class _PointerCalls:
    """Comm's pointer-level calls (a mixin: `self` is the Comm; see comm.py)."""

    def _issued(self, name: str, issued: tuple, refs: tuple, result: Any) -> Work:
        """The Work of an async call `name` just made (`issued`: its result code and work
        address; the C extension's answer, or Comm._call's), raising its error; kept until
        done."""
        code, work = issued
        check(name + "_async", code, self._handle)
        w = Work(self, work, refs, result, name + "_async")
        self._keep(w)
        return w

    def all_reduce_ptr(self, send: int, recv: int, count: int, dtype, op="sum", async_op=False, _refs=(), _result=None,
                       wire=None):
        fast = _lib.FAST  # (the C extension, where built: the call without ctypes)
        if fast is not None and wire is None and not self._group_depth and type(send) is int:
            t, o = _FAST_TYPES.get(dtype), _FAST_OPS.get(op)  # (a member or a name: no parse)
            if t is not None and o is not None and type(recv) is int:
                if not async_op:
                    code = fast.all_reduce_addr(self._live(), send, recv, count, t, o)
                    if code != _NOT_TAKEN:
                        if code:
                            check("toroid_all_reduce", code, self._handle)
                        return _result
                elif _lib.FAST_ASYNC is not None:
                    self._prune()
                    issued = fast.all_reduce_addr_async(self._live(), send, recv, count, t, o)
                    if issued != _NOT_TAKEN:
                        return self._issued("toroid_all_reduce", issued, _refs, _result)
        args = (send, recv, count, DataType.of(dtype), ReduceOp.of(op))
        if wire is not None:
            return self._call("toroid_all_reduce_wire", args + (DataType.of(wire),), async_op, _refs, _result)
        return self._call("toroid_all_reduce", args, async_op, _refs, _result)

    def reduce_scatter_ptr(self, send: int, recv: int, recvcount: int, dtype, op="sum", async_op=False, _refs=(), _result=None):
        args = (send, recv, recvcount, DataType.of(dtype), ReduceOp.of(op))
        return self._call("toroid_reduce_scatter", args, async_op, _refs, _result)

    def all_gather_ptr(self, send: int, recv: int, sendcount: int, dtype, async_op=False, _refs=(), _result=None):
        args = (send, recv, sendcount, DataType.of(dtype))
        return self._call("toroid_all_gather", args, async_op, _refs, _result)

    def broadcast_ptr(self, send: int, recv: int, count: int, dtype, root: int, async_op=False, _refs=(), _result=None):
        fast = _lib.FAST  # (as in all_reduce_ptr)
        if fast is not None and not async_op and not self._group_depth and type(send) is int and type(recv) is int:
            t = _FAST_TYPES.get(dtype)
            if t is not None and type(root) is int:
                code = fast.broadcast_addr(self._live(), send, recv, count, t, root)
                if code != _NOT_TAKEN:
                    if code:
                        check("toroid_broadcast", code, self._handle)
                    return _result
        args = (send, recv, count, DataType.of(dtype), root)
        return self._call("toroid_broadcast", args, async_op, _refs, _result)

    def reduce_ptr(self, send: int, recv: int, count: int, dtype, op="sum", root=0, async_op=False, _refs=(), _result=None):
        args = (send, recv, count, DataType.of(dtype), ReduceOp.of(op), root)
        return self._call("toroid_reduce", args, async_op, _refs, _result)

    def all_to_all_ptr(self, send: int, recv: int, count_per_rank: int, dtype, async_op=False, _refs=(), _result=None):
        args = (send, recv, count_per_rank, DataType.of(dtype))
        return self._call("toroid_all_to_all", args, async_op, _refs, _result)

    def all_to_all_v_ptr(self, send: int, send_counts, recv: int, recv_counts, dtype, async_op=False, _refs=(),
                         _result=None):
        """All-to-all with blocks of any size (toroid_all_to_all_v): `send_counts[j]` elements
        of `send`, after the blocks for the ranks below j, go to rank j; `recv_counts[j]` from
        rank j land in `recv` after the blocks from the ranks below j (`size` counts each)."""
        counts = []
        for what, c in (("send_counts", send_counts), ("recv_counts", recv_counts)):
            c = [int(x) for x in c]
            if len(c) != self.size or any(x < 0 for x in c):
                raise ValueError(f"all_to_all_v: {what} must be {self.size} counts of at least 0, got {c}")
            counts.append((ctypes.c_size_t * len(c))(*c))
        args = (send, counts[0], recv, counts[1], DataType.of(dtype))
        return self._call("toroid_all_to_all_v", args, async_op, _refs, _result)

    def send_ptr(self, buf: int, count: int, dtype, peer: int, async_op=False, _refs=(), _result=None):
        return self._call("toroid_send", (buf, count, DataType.of(dtype), peer), async_op, _refs, _result)

    def recv_ptr(self, buf: int, count: int, dtype, peer: int, async_op=False, _refs=(), _result=None):
        return self._call("toroid_recv", (buf, count, DataType.of(dtype), peer), async_op, _refs, _result)

    def recv_any_ptr(self, buf: int, count: int, dtype, async_op=False, _refs=()):
        """Receives from whichever rank sends first. Blocking: returns that rank; async: a Work
        whose wait() returns it (and whose source() gives it once done)."""
        handle = self._live()
        f = _lib.lib()
        args = (buf, count, DataType.of(dtype))
        if not async_op:
            src = ctypes.c_int(-1)
            check("toroid_recv_any", f.toroid_recv_any(handle, *args, ctypes.byref(src)), handle)
            return src.value
        self._prune()
        work = ctypes.c_void_p()
        check("toroid_recv_any_async", f.toroid_recv_any_async(handle, *args, ctypes.byref(work)), handle)
        w = Work(self, work.value, _refs, None, "toroid_recv_any_async", any_source=True)
        self._keep(w)
        return w

    # Device memory (CUDA) on a stream: toroid_{all_reduce,broadcast,all_gather,reduce_scatter}_stream.

    def _stream_call(self, name: str, args: tuple, async_op: bool = False, refs: tuple = ()) -> Optional["Work"]:
        if self._group_depth:
            # The stream entry points run at once, not recorded: inside a group they would run
            # before the calls recorded ahead of them, so refuse instead of reordering.
            raise _lib.InvalidUsageError(name, _lib.Result.INVALID_USAGE, "not allowed inside a group",
                                         "the stream collectives cannot be recorded in a group")
        handle = self._live()
        if not async_op:
            check(name, getattr(_lib.lib(), name)(handle, *args), handle)
            return None
        self._prune()
        work = ctypes.c_void_p()
        check(name + "_async", getattr(_lib.lib(), name + "_async")(handle, *args, ctypes.byref(work)), handle)
        if work.value is None:
            return None  # completed before returning (the staged path)
        w = Work(self, work.value, refs, None, name + "_async")
        self._keep(w)
        return w

    def all_reduce_stream_ptr(self, send: int, recv: int, count: int, dtype, op="sum", stream: int = 0,
                              async_op: bool = False, _refs: tuple = ()) -> Optional["Work"]:
        """All-reduces `count` elements of `dtype` from device memory `send` into device memory
        `recv` (the same address: in place) with `op` (toroid_all_reduce_stream).

        `stream` is a cudaStream_t/CUstream of the buffers' device as an int (torch:
        ``torch.cuda.current_stream(dev).cuda_stream``; 0: the legacy default stream). The
        call reads `send` after the work already queued on `stream`. Blocking (the default), it
        returns when the result is in `recv`. With `async_op=True`
        (toroid_all_reduce_stream_async) it returns once the collective is queued, with a Work
        that completes when it has (None when it completed before returning: the staged path);
        `stream` is not made to wait for it: read the result after the Work's wait(). The
        buffers (kept alive through `_refs`) must stay valid and untouched until then. Every rank calls it with the same count, type and op.

        Without CUDA (no driver, or a library built without the `cuda` feature)
        toroid.UnsupportedError; host memory on a machine with CUDA, or buffers of two devices,
        toroid.InvalidArgumentError; inside ``comm.group()`` toroid.InvalidUsageError (these
        calls cannot be recorded)."""
        return self._stream_call("toroid_all_reduce_stream",
                                 (send, recv, count, DataType.of(dtype), ReduceOp.of(op), stream or None), async_op, _refs)

    def broadcast_stream_ptr(self, send: int, recv: int, count: int, dtype, root: int, stream: int = 0,
                             async_op: bool = False, _refs: tuple = ()) -> Optional["Work"]:
        """Broadcasts `count` elements of `dtype` from device memory `send` at `root` into device
        memory `recv` at every rank (the same address: in place; `send` is read at the root
        only), ordered on `stream`, blocking or not, as `all_reduce_stream_ptr`, with its errors
        (toroid_broadcast_stream)."""
        return self._stream_call("toroid_broadcast_stream", (send, recv, count, DataType.of(dtype), root, stream or None),
                                 async_op, _refs)

    def all_gather_stream_ptr(self, send: int, recv: int, sendcount: int, dtype, stream: int = 0,
                              async_op: bool = False, _refs: tuple = ()) -> Optional["Work"]:
        """Gathers every rank's `sendcount` elements of `dtype` at device memory `send` into every
        rank's device memory `recv` (size x sendcount elements, rank r's at r x sendcount; in
        place when `send` is `recv`'s piece of this rank), ordered on `stream`, blocking or not,
        as `all_reduce_stream_ptr`, with its errors (toroid_all_gather_stream)."""
        return self._stream_call("toroid_all_gather_stream", (send, recv, sendcount, DataType.of(dtype), stream or None),
                                 async_op, _refs)

    def reduce_scatter_stream_ptr(self, send: int, recv: int, recvcount: int, dtype, op="sum",
                                  stream: int = 0, async_op: bool = False, _refs: tuple = ()) -> Optional["Work"]:
        """Reduces every rank's device memory `send` (size x recvcount elements) with `op`; rank r
        receives piece r in device memory `recv` (recvcount elements; in place when `recv` is
        `send`'s piece of this rank or `send`), ordered on `stream`, blocking or not, as
        `all_reduce_stream_ptr`, with its errors (toroid_reduce_scatter_stream)."""
        return self._stream_call("toroid_reduce_scatter_stream",
                                 (send, recv, recvcount, DataType.of(dtype), ReduceOp.of(op), stream or None),
                                 async_op, _refs)

    def reduce_stream_ptr(self, send: int, recv: int, count: int, dtype, op="sum", root: int = 0,
                          stream: int = 0) -> None:
        """Reduces `count` elements of `dtype` of every rank's device memory `send` with `op` into
        device memory `recv` at `root` (written there only; other ranks may pass 0; in place at
        the root when `send` is `recv`), ordered on `stream` and blocking, as
        `all_reduce_stream_ptr`, with its errors (toroid_reduce_stream; staged through pinned
        host memory)."""
        self._stream_call("toroid_reduce_stream",
                          (send, recv or None, count, DataType.of(dtype), ReduceOp.of(op), root, stream or None),
                          False, ())

    def all_to_all_stream_ptr(self, send: int, recv: int, count_per_rank: int, dtype, stream: int = 0) -> None:
        """Block j (count_per_rank elements of `dtype`) of device memory `send` goes to rank j,
        arriving as its block `rank` of device memory `recv` (both size x count_per_rank; in
        place when they are the same), ordered on `stream` and blocking, as
        `all_reduce_stream_ptr`, with its errors (toroid_all_to_all_stream; staged)."""
        self._stream_call("toroid_all_to_all_stream",
                          (send, recv, count_per_rank, DataType.of(dtype), stream or None), False, ())

    def send_stream_ptr(self, buf: int, count: int, dtype, peer: int, stream: int = 0) -> None:
        """Sends `count` elements of `dtype` of device memory `buf` to `peer`, which calls
        `recv_stream_ptr` with the same count, ordered on `stream` and blocking, with the errors
        of `all_reduce_stream_ptr` (toroid_send_stream; staged)."""
        self._stream_call("toroid_send_stream", (buf, count, DataType.of(dtype), peer, stream or None), False, ())

    def recv_stream_ptr(self, buf: int, count: int, dtype, peer: int, stream: int = 0) -> None:
        """Receives `count` elements of `dtype` from `peer` into device memory `buf`, ordered on
        `stream` and blocking (the data is there when it returns), with the errors of
        `all_reduce_stream_ptr` (toroid_recv_stream; staged)."""
        self._stream_call("toroid_recv_stream", (buf, count, DataType.of(dtype), peer, stream or None), False, ())
