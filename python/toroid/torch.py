"""The torch.distributed backend "toroid".

    import torch.distributed as dist
    import toroid.torch                         # registers the backend
    dist.init_process_group("toroid")           # env:// (torchrun) or any init_method

`ProcessGroupToroid` is a Python subclass of torch's c10d `Backend` (as ProcessGroupGloo is),
registered for the "cpu" and "cuda" devices: torch wraps it in a ProcessGroup, so every
torch.distributed entry point that picks a backend by device (all_gather_coalesced, batch_isend_irecv,
monitored_barrier, the *_object collectives, ...) finds it. It bootstraps through the store
torch hands to every backend (toroid_comm_init_with_store with ctypes callbacks: no port of its
own) and runs every collective as a toroid async call; the returned Work completes its torch
Future when toroid's work completes, so DistributedDataParallel overlaps gradient all-reduce
with backward. Work.wait(timeout) honours its timeout.

Supported: all_reduce (SUM, PRODUCT, MIN, MAX, AVG; complex SUM/AVG as pairs of reals),
broadcast, reduce, all_gather, all_gather_into_tensor, all_gather_coalesced, reduce_scatter,
reduce_scatter_tensor, all_to_all_single (uneven splits too), all_to_all, gather, scatter
(gather by all-gather, scatter by broadcast), barrier (with its timeout), monitored_barrier
(gloo's, through the store: names the ranks that did not arrive), send/recv (tags are ignored:
messages between two ranks match in issue order), recv from any source, batch_isend_irecv
(ordered so that it cannot deadlock, on every torch version: see batch_isend_irecv), the
coalesced forms, all_reduce of sparse COO tensors
(SUM, as gloo); CPU tensors of int8, uint8, int32, int64, uint32, uint64, float16, bfloat16,
float32, float64; BAND/BOR/BXOR in all_reduce on integer and bool tensors (all-gather and a
local fold). Not supported: PREMUL_SUM (gloo has it neither). The group's timeout
(init_process_group's `timeout`) bounds set-up and every operation; a failure raises torch.distributed.DistBackendError (a RuntimeError, as gloo's
are) whose text starts with gloo's wording ("Timed out waiting Nms for ...") and ends with
toroid's detail (which rank, which operation, where it stood).

CUDA tensors (checked on a GPU by python/tests/gpu_torch_check.py, run by scripts/gpu-check.sh;
it passed on an NVIDIA H200 and an H100 with torch 2.11):

- all_reduce, all_reduce_coalesced (and so DDP's default gradient all-reduce) and broadcast of
  contiguous CUDA tensors of float32, float16, bfloat16, float64, int32 or int64 (ops SUM,
  PRODUCT, MIN, MAX, AVG; AVG on floats), and all_gather_into_tensor and reduce_scatter_tensor
  of such tensors (FSDP's collectives), run on device memory: one call of
  toroid_{all_reduce,broadcast,all_gather,reduce_scatter}_stream per tensor, ordered on
  torch.cuda.current_stream(t.device), the stream ProcessGroupNCCL uses; between the ranks of
  one host through CUDA IPC with the reductions on the GPU, otherwise staged in the library
  through pinned host memory. The call reads the tensor after the work already queued on that
  stream. On the IPC path it is asynchronous for the host: it returns once the collective is
  queued (it runs on toroid's own stream), so DDP's gradient all-reduces overlap its backward
  pass; the work completes when the collective has, and wait() blocks the host until then
  (torch's stream is not made to wait: read the result after wait(), as torch requires). The
  staged path completes before returning. Failures of the collective are the work's (wait() raises them, as
  for CPU tensors); argument errors are raised at once. `stream_path` is the rule that picks
  this path.
- reduce of such tensors and all_to_all_single with equal splits run on device memory too
  (toroid_reduce_stream, toroid_all_to_all_stream on the current stream), blocking: the library
  pipelines them through pinned host memory on either path.
- Every other case is staged through host memory: each CUDA argument is copied with `.cpu()`
  (on the current stream, waiting for it), the CPU path runs on the copies, and when it has
  completed the outputs are copied back with `.copy_()` on the stream that was current when the
  call was issued, the host waiting for those copies before the work completes. That is every
  other collective (all_gather and reduce_scatter of tensor lists, all_to_all of lists or
  uneven splits, gather, scatter, send/recv, the coalesced forms, the bitwise and sparse all-reduces, the wire
  hooks) and all_reduce/broadcast of other types, non-contiguous or empty tensors, AVG on
  integers, and float32/float64 all-reduces with a compressed wire type. Simple, not fast: two
  copies through pageable memory and a host synchronisation per call. send/recv stay here
  because toroid_send_stream blocks the host until its data is out (for more than a ring
  holds, until the peer receives), so isend before irecv on both ranks would not reach the
  receive.
- A call mixing CUDA and CPU tensors is a ValueError. Object collectives and barrier stay on the
  CPU (torch picks "cpu" when a group has it).

Like every toroid call, operations of one process group run in issue order on one queue: a
send waits for its receiver, so pair sends and receives so that no cycle of ranks all sends
first with large messages (for example even ranks send first, odd ranks receive first), or use
batch_isend_irecv, which orders them itself.
"""

from __future__ import annotations

import collections
import datetime
import inspect
import os
import queue
import threading
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch.futures import Future

from . import _lib
from ._lib import DataType, ReduceOp
from .comm import Comm

try:  # (a Python subclass of c10d's Backend needs its constructor bound, as in torch 2.15)
    _C10dBackend(0, 1)
    _BACKEND_CONSTRUCTIBLE = True
except TypeError:
    _BACKEND_CONSTRUCTIBLE = False

BACKEND = "toroid"
# The devices the backend is registered for. "cpu" first: torch prefixes the store of a group
# with the first, and picks "cpu" for object collectives and barrier when it is among them.
DEVICES = ("cpu", "cuda")

_TYPES = {
    torch.int8: DataType.INT8,
    torch.uint8: DataType.UINT8,
    torch.int32: DataType.INT32,
    torch.int64: DataType.INT64,
    torch.float16: DataType.FLOAT16,
    torch.bfloat16: DataType.BFLOAT16,
    torch.float32: DataType.FLOAT32,
    torch.float64: DataType.FLOAT64,
}
for _name, _dt in (("uint32", DataType.UINT32), ("uint64", DataType.UINT64)):
    if hasattr(torch, _name):
        _TYPES[getattr(torch, _name)] = _dt

_OPS = [
    (dist.ReduceOp.SUM, ReduceOp.SUM),
    (dist.ReduceOp.PRODUCT, ReduceOp.PROD),
    (dist.ReduceOp.MIN, ReduceOp.MIN),
    (dist.ReduceOp.MAX, ReduceOp.MAX),
    (dist.ReduceOp.AVG, ReduceOp.AVG),
]


# Bitwise reductions: computed by all-gather and a local fold (see _bitwise_allreduce).
_BITWISE = [("BAND", torch.bitwise_and), ("BOR", torch.bitwise_or), ("BXOR", torch.bitwise_xor)]


def _op(torch_op) -> ReduceOp:
    for t, o in _OPS:
        if torch_op == t:
            return o
    raise ValueError(f"toroid does not support the reduction {torch_op} here (it has SUM, PRODUCT, MIN, MAX, AVG; "
                     "BAND, BOR and BXOR in all_reduce only)")


def _stream_op(torch_op) -> Optional[ReduceOp]:
    """toroid's op for a call on CUDA tensors; None for those only the CPU path runs or refuses
    (BAND/BOR/BXOR, PREMUL_SUM), whose call is then staged."""
    try:
        return _op(torch_op)
    except ValueError:
        return None


def _flat(t: torch.Tensor, op: Optional[ReduceOp] = None) -> torch.Tensor:
    """The tensor as toroid sees it: on CPU, of a toroid type; complex as pairs of reals. (CUDA
    tensors never get here: they take the stream path or are staged into CPU copies first.)"""
    if t.device.type != "cpu":
        raise ValueError(f"the toroid backend works on CPU and CUDA tensors, not {t.device}")
    if t.is_complex():
        if op not in (None, ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"toroid reduces complex tensors with SUM or AVG only, not {op.name}")
        t = torch.view_as_real(t)
    if t.dtype not in _TYPES:
        raise ValueError(f"the toroid backend has no element type for {t.dtype}")
    return t


def _dtype(t: torch.Tensor) -> DataType:
    return _TYPES[t.dtype]


# ---- CUDA tensors ------------------------------------------------------------------------------
# all_reduce, broadcast, all_gather_into_tensor and reduce_scatter_tensor of CUDA tensors run on
# device memory through the C entry points toroid_*_stream (Comm.*_stream_ptr), ordered on
# torch's current stream of the tensor's device (as ProcessGroupNCCL orders on it), and so do
# reduce and all_to_all_single with equal splits (blocking). Everything else is staged: copied
# to CPU tensors, run by the CPU path, copied back (see _staged). Every rank must pass tensors
# of the same device, type and layout: the stream path and the staged path run different host
# collectives.

# The element types and ops of the stream path: the types src/gpu's tests run on the device.
_STREAM_TYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64})
_STREAM_OPS = frozenset({ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG})


def stream_path(dtype: torch.dtype, op: Optional[ReduceOp], contiguous: bool, numel: int,
                wire: Optional[DataType] = None) -> bool:
    """Whether a strided CUDA tensor of `dtype`, `numel` elements, contiguous or not, is
    all-reduced or reduced with `op` (None: broadcast, or moved by an all-gather or all-to-all)
    by the stream entry points (True) or staged through host memory (False). Every rank must
    decide alike for a collective, so this depends only on what every rank must pass equally
    (the same type, layout and size; a rank that passes another layout than its peers may fail
    with a mismatch error or at its deadline, as a mismatched CPU call does).

    Staged: another element type (the stream path is kept to the types tested on the device);
    a non-contiguous tensor (the entry points take one flat range); an empty one (the stream
    path moves nothing and issues no collective, the CPU path does); AVG on an integer type
    (toroid refuses it: staging gives the CPU path's error); a float32/float64 all-reduce with a
    compressed `wire` type (only the host collective compresses)."""
    if dtype not in _STREAM_TYPES or not contiguous or numel == 0:
        return False
    if op is None:
        return True
    if op not in _STREAM_OPS or (op == ReduceOp.AVG and not dtype.is_floating_point):
        return False
    return wire is None or dtype not in (torch.float32, torch.float64)


def _tensors_in(value) -> list:
    """The tensors of an argument: a tensor, or (nested) lists and tuples of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _device_type(tensors) -> str:
    """"cuda" when the call's tensors are CUDA tensors, else "cpu" (other devices are refused
    later by the CPU path). A call mixing CUDA and other tensors is refused: the stream path
    takes device memory only, and staging a mix would hide a caller's mistake."""
    kinds = {t.device.type for t in tensors}
    if "cuda" in kinds and len(kinds) > 1:
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"the toroid backend takes the tensors of one call on one kind of device, got {devices}")
    return "cuda" if "cuda" in kinds else "cpu"


def _cuda_devices(value) -> list:
    """The CUDA devices of the tensors in `value` (a torch Future holding them must name them)."""
    return sorted({t.device for t in _tensors_in(value) if t.device.type == "cuda"}, key=lambda d: d.index or 0)


class _Staging:
    """The CUDA tensors of one staged call and their CPU copies.

    A CUDA argument is copied with `.cpu()`, which runs on the current stream of its device
    and returns once the copy is done, so work the caller queued before the call is in it.
    When the operation completes, each output's copy is written back with `.copy_()` on the
    stream that was current when the call was issued (the completion thread's own current
    stream is another), and the host waits for those copies: a completed work's outputs are in
    device memory, whichever stream reads them next."""

    def __init__(self):
        self._originals: dict = {}  # id(CPU copy) -> the CUDA tensor
        self._back: list = []  # (CUDA output, its CPU copy, the stream to copy back on)
        self._keep: list = []  # every copy, so that no id is reused while mapped

    def stage(self, value, output: bool):
        """`value` with each CUDA tensor replaced by a CPU copy (lists and tuples kept)."""
        if isinstance(value, torch.Tensor):
            if value.device.type != "cuda":
                return value
            copy = value.cpu()
            self._originals[id(copy)] = value
            self._keep.append(copy)
            if output:
                self._back.append((value, copy, torch.cuda.current_stream(value.device)))
            return copy
        if isinstance(value, (list, tuple)):
            return type(value)(self.stage(v, output) for v in value)
        return value

    def original(self, value):
        """`value` (a result made of the CPU copies) with the caller's CUDA tensors again."""
        if isinstance(value, torch.Tensor):
            return self._originals.get(id(value), value)
        if isinstance(value, (list, tuple)):
            return type(value)(self.original(v) for v in value)
        return value

    def copy_back(self) -> None:
        done = []
        for dst, src, stream in self._back:
            with torch.cuda.stream(stream):
                dst.copy_(src)
                event = torch.cuda.Event()
                event.record(stream)
                done.append(event)
        for event in done:
            event.synchronize()


def _staged(outputs=(), inputs=()):
    """Decorates a CPU implementation: a call with CUDA tensors in the arguments named in
    `outputs` (written, copied back) and `inputs` (only read) runs on CPU copies of them (see
    _Staging); a call without any runs unchanged; a mix of devices is a ValueError."""

    def decorate(method):
        signature = inspect.signature(method)

        def wrapper(self, *args, **kwargs):
            # CPU tensors only (the common call): straight through, without binding the
            # arguments by name.
            if not any(t.device.type == "cuda" for t in _tensors_in([*args, *kwargs.values()])):
                return method(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            names = [n for n in (*outputs, *inputs) if n in bound.arguments]
            if _device_type([t for n in names for t in _tensors_in(bound.arguments[n])]) != "cuda":
                return method(self, *args, **kwargs)
            staging = _Staging()
            for n in names:
                bound.arguments[n] = staging.stage(bound.arguments[n], n in outputs)
            self.stats[f"{method.__name__.strip('_').removesuffix('_host')}:staged"] += 1
            # _work / _defer attach the staging to the work this call makes (before it is queued,
            # so the completion thread cannot complete it without the copies back).
            self._staging.current = staging
            try:
                return method(*bound.args, **bound.kwargs)
            finally:
                self._staging.current = None

        wrapper.__name__ = method.__name__
        wrapper.__doc__ = method.__doc__
        return wrapper

    return decorate


class _Finished:
    """A toroid call that has already run (a stream call that completed before returning, or
    the failure that stopped issuing the others) as a work of a ToroidWork: wait() raises its
    failure, if any."""

    _any_source = False

    def __init__(self, error: Optional[BaseException] = None):
        self._error = error

    def wait(self, timeout=None) -> None:
        if self._error is not None:
            raise self._error


def _is_store_timeout(e: BaseException) -> bool:
    """Whether a torch store's exception is its timeout (the key is still missing), as opposed
    to a failure of the store. torch raises DistStoreError "wait timeout after 500ms, keys: ..."
    (TCPStore) or "Wait timeout" (HashStore; FileStore as a plain RuntimeError); a lost or dead
    server is a DistNetworkError ("Broken pipe", "Failed to recv, got 0 bytes", "Socket
    Timeout"), which is never a missing key."""
    network = getattr(dist, "DistNetworkError", None)
    if network is not None and isinstance(e, network):
        return False
    if not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return "timeout" in text or "timed out" in text


class TorchStore:
    """A torch.distributed Store as toroid's caller-supplied store (Comm.with_store): get
    returns None only when torch's store times out; any other failure is raised (and fails
    the communicator's set-up with that exception)."""

    def __init__(self, store: dist.Store):
        self.store = store

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout: float) -> Optional[bytes]:
        if timeout <= 0:
            if not self.store.check([key]):
                return None
        else:
            try:
                self.store.wait([key], datetime.timedelta(seconds=timeout))
            except RuntimeError as e:
                if _is_store_timeout(e):
                    return None  # still missing at the deadline
                raise
        return bytes(self.store.get(key))


class _Output:
    """An output tensor, or a contiguous stand-in copied back when the operation is done."""

    def __init__(self, t: torch.Tensor, op: Optional[ReduceOp] = None):
        self.target = t
        self.buf = _flat(t if t.is_contiguous() else t.contiguous(), op)

    def copy_back(self) -> None:
        if not self.target.is_contiguous():
            src = torch.view_as_complex(self.buf) if self.target.is_complex() else self.buf
            self.target.copy_(src)


def _seconds(timeout) -> Optional[float]:
    """A Work.wait timeout in seconds; None for none: None, or <= 0 (torch passes
    timedelta(0), its kNoTimeout, when the caller gave none)."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return s if s > 0 else None


def _opt_timeout(opts) -> Optional[float]:
    """A per-call timeout from torch's options (seconds), or None when unset."""
    return _seconds(getattr(opts, "timeout", None)) if opts is not None else None


_BACKEND_ERROR = getattr(dist, "DistBackendError", RuntimeError)


def _torch_error(e: BaseException, name: str, rank: int, timeout_s: Optional[float]) -> BaseException:
    """A toroid failure as torch reports a backend's: DistBackendError (a RuntimeError, the type
    gloo's failures also are) with gloo's wording first and toroid's detail after it. Refusals
    of the request itself, which leave the group usable (argument errors, a ValueError;
    toroid.UnsupportedError, e.g. AVG on integers), and anything not from toroid pass through
    unchanged."""
    if not isinstance(e, _lib.ToroidError) or isinstance(e, (ValueError, _lib.UnsupportedError)):
        return e
    if isinstance(e, _lib.TimeoutError):
        ms = f"{timeout_s * 1000:.0f}ms" if timeout_s else "the timeout"
        text = f"[Rank {rank}]: Timed out waiting {ms} for {name} to complete. toroid: {e}"
    elif isinstance(e, _lib.RemoteError):
        text = f"[Rank {rank}]: {name} failed: a peer failed (connection closed by peer, or it aborted). toroid: {e}"
    elif isinstance(e, _lib.AbortedError):
        text = f"[Rank {rank}]: {name} failed: the group was aborted (an earlier operation failed, or abort was called). toroid: {e}"
    else:
        text = f"[Rank {rank}]: {name} failed. toroid: {e}"
    err = _BACKEND_ERROR(text)
    err.__cause__ = e
    return err


def _torch_errors(method):
    """Raises toroid's errors from issuing an operation as torch's (see _torch_error)."""

    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except _lib.ToroidError as e:
            raise _torch_error(e, method.__name__, self.rank(), self._timeout_s) from e

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


class ToroidWork(dist.Work):
    """A torch Work over toroid async works: wait() blocks until they are done, get_future()
    completes when they are (set by the group's completion thread, or by wait()).

    `staging` (a call on CUDA tensors run on CPU copies) maps the result back to the caller's
    tensors and copies the outputs back once `finish` has run. A result holding CUDA tensors
    gets a future that names their devices (torch refuses CUDA tensors in a CPU-only future)."""

    def __init__(self, pg: "ProcessGroupToroid", works: list, result: Any, finish: Optional[Callable[[], None]], name: str,
                 timeout: Optional[float] = None, staging: Optional[_Staging] = None):
        super().__init__()
        if staging is not None:
            result = staging.original(result)
        self._copy_back = staging.copy_back if staging is not None else None
        self._pg = pg
        self._timeout_s = timeout if timeout is not None else pg._timeout_s
        self._source: Optional[int] = None  # the sender, for a receive from any source
        self._works = works
        self._result = result
        self._finish = finish
        self._name = name
        devices = _cuda_devices(result)
        self._future = Future(devices=devices) if devices else Future()
        self._lock = threading.Lock()
        self._done = False
        self._completed = threading.Event()  # set once done and the future is completed
        self._settler: Optional[int] = None  # the thread that completes the future
        self._deferred = False  # a send/recv of a coalescing block, not issued yet
        self._exception: Optional[BaseException] = None

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
            self._works = []
            self._settler = threading.get_ident()
        # The future's callbacks run here, outside the lock (they may wait on other works).
        if self._exception is not None:
            self._future.set_exception(self._exception)
        else:
            self._future.set_result(self._result)
        self._completed.set()

    def _settled(self, seconds: Optional[float]) -> bool:
        """Waits until the future is completed too (a callback of that future, running on the
        completing thread, does not wait for itself)."""
        if self._settler == threading.get_ident():
            return True
        return self._completed.wait(seconds)

    def wait(self, timeout=None) -> bool:
        """Waits for completion (the future too); raises the operation's error. With a timeout
        (seconds or a timedelta; torch's timedelta(0) means none), raises RuntimeError
        "Operation timed out!" (what gloo's collectives raise) once it passes; the operation
        stays queued, like gloo's, and a later wait() can still complete it."""
        if self._deferred:
            raise RuntimeError(f"toroid {self._name}: waited on inside a coalescing block; "
                               "its operation is issued when the block ends")
        seconds = _seconds(timeout)
        if seconds is None:
            self._complete()
            self._settled(None)
        elif not self._settled(seconds):  # the group's completion thread completes it
            raise RuntimeError(f"Operation timed out! toroid {self._name} did not complete within {seconds:g} s "
                               "(Work.wait timeout; the operation is still pending)")
        if self._exception is not None:
            raise self._exception
        return True

    def get_future(self) -> Future:
        return self._future

    def is_completed(self) -> bool:
        return self._completed.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._exception is None

    def exception(self):
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


class ProcessGroupToroid(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on a toroid communicator."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: Optional[datetime.timedelta] = None,
                 comm: Optional[Comm] = None, wire_dtype: Optional[str] = None):
        """A group of `size` ranks meeting through `store`, or over `comm` when given (a split
        of a parent's communicator; `store` then serves monitored_barrier only). `wire_dtype`
        ("bf16" or "f16"): every float32/float64 all-reduce of the group travels in that type
        (see `set_wire_dtype`)."""
        super().__init__(rank, size)
        self._wire: Optional[DataType] = None
        self.set_wire_dtype(wire_dtype)
        self._timeout_s = timeout.total_seconds() if timeout else None
        self._store = store  # (monitored_barrier meets through it)
        self._monitored = 0  # monitored barriers so far (every rank counts the same)
        self._comm = comm if comm is not None else Comm.with_store(rank, size, TorchStore(store), timeout=self._timeout_s)
        self.stats: collections.Counter = collections.Counter()  # operations issued, by name
        self._coalesced: Optional[list] = None  # send/recv recorded in a coalescing block
        self._staging = threading.local()  # .current: the staging of the CUDA call being issued
        self._queue: "queue.Queue[Optional[ToroidWork]]" = queue.Queue()
        self._thread = threading.Thread(target=self._completer, name=f"toroid-pg-r{rank}", daemon=True)
        self._thread.start()
        # The group's backend for each device it takes, for the entry points that look one up by
        # the device of their tensors (one object for both: torch keeps one backend per type).
        # torch before Python-constructible c10d Backends (2.11 says "No constructor defined")
        # gets none: its ProcessGroup calls this Python group's methods directly.
        if _BACKEND_CONSTRUCTIBLE:
            kind = dist.Backend.backend_type_map.get(BACKEND, dist.ProcessGroup.BackendType.CUSTOM)
            backend = _DeviceBackend(self, rank, size)
            for device in DEVICES:
                self._register_backend(torch.device(device), kind, backend)
            self._set_default_backend(kind)

    # The completion thread: toroid runs a group's operations in issue order, so completing the
    # works in FIFO order is what they finish in.
    def _completer(self) -> None:
        while True:
            w = self._queue.get()
            if w is None:
                return
            w._complete()

    def _work(self, works: list, result: Any, finish: Optional[Callable[[], None]] = None, name: str = "",
              timeout: Optional[float] = None) -> ToroidWork:
        w = ToroidWork(self, works, result, finish, name, timeout, self._take_staging())
        self.stats[name] += 1
        self._queue.put(w)
        return w

    def _take_staging(self) -> Optional[_Staging]:
        """The staging of the CUDA call being issued on this thread (see _staged), once."""
        staging, self._staging.current = getattr(self._staging, "current", None), None
        return staging

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"ProcessGroupToroid(rank={self.rank()}, size={self.size()})"

    @property
    def comm(self) -> Comm:
        """The toroid communicator."""
        return self._comm

    def set_wire_dtype(self, wire: Optional[str]) -> None:
        """Compressed all-reduce for the whole group: "bf16" or "f16" makes every float32 and
        float64 all-reduce (allreduce, allreduce_coalesced) travel in that type, reductions in
        the tensor's own type, the same result on every rank (error bound: docs/ARCHITECTURE.md,
        compressed all-reduce); None: as TOROID_WIRE_DTYPE says (uncompressed when unset). The
        process-group option; `bf16_wire_hook` does the same for DDP's gradients only. Every
        rank must set the same."""
        w = None if wire is None else DataType.of(wire)
        if w not in (None, DataType.BFLOAT16, DataType.FLOAT16):
            raise ValueError(f"wire_dtype must be 'bf16', 'f16' or None, not {wire!r}")
        self._wire = w

    def _wire_for(self, t: torch.Tensor, wire: Optional[DataType] = None) -> Optional[DataType]:
        wire = wire if wire is not None else self._wire
        return wire if t.dtype in (torch.float32, torch.float64) else None

    @_staged(outputs=("tensor",))
    def allreduce_wire(self, tensor: torch.Tensor, wire="bf16", op=dist.ReduceOp.AVG) -> "ToroidWork":
        """One all-reduce of `tensor` in place whose bytes travel as `wire` ("bf16" or "f16";
        float32/float64 tensors, others reduced as usual): what the DDP hooks call. A CUDA
        tensor is staged through host memory (the stream path does not compress)."""
        w = DataType.of(wire)
        if w not in (DataType.BFLOAT16, DataType.FLOAT16):
            raise ValueError(f"wire must be 'bf16' or 'f16', not {wire!r}")
        rop = _op(op)
        o = _Output(tensor, rop)
        p = o.buf.data_ptr()
        work = self._comm.all_reduce_ptr(p, p, o.buf.numel(), _dtype(o.buf), rop, True, (o.buf,),
                                         wire=self._wire_for(o.buf, w))
        return self._work([work], [tensor], o.copy_back, "allreduce_wire")

    # ---- collectives -----------------------------------------------------------------------

    def _on_stream(self, tensors, op: Optional[ReduceOp], wire: Optional[DataType] = None) -> bool:
        """Whether a call on these CUDA tensors takes the stream path (see stream_path; `wire`:
        the all-reduce's compression): all of them do, or the whole call is staged (one path per
        call keeps its work simple)."""
        return all(t.layout == torch.strided and stream_path(t.dtype, op, t.is_contiguous(), t.numel(), wire)
                   for t in tensors)

    def _stream_work(self, tensors, name: str, call: Callable[[torch.Tensor, int], Any],
                     timeout: Optional[float] = None) -> ToroidWork:
        """Runs `call(tensor, stream)` for each CUDA tensor on the current stream of its device:
        one stream call per tensor, each returning its toroid Work (an asynchronous call on the
        IPC path: toroid_*_stream_async, queued, the host free) or None (it completed before
        returning: the staged path, and the blocking reduce and all-to-all). The returned work
        completes when all of them have. A refusal of the request (a toroid
        InvalidArgumentError, UnsupportedError or InvalidUsageError) is raised here, as the CPU
        path raises them when issuing; a failure of the collective itself (a peer, a deadline)
        is the work's, raised by wait() and set on its future, as for an async CPU call."""
        works: list = []
        for t in tensors:
            try:
                w = call(t, torch.cuda.current_stream(t.device).cuda_stream)
            except (_lib.InvalidArgumentError, _lib.UnsupportedError, _lib.InvalidUsageError):
                raise
            except _lib.ToroidError as e:
                works.append(_Finished(e))  # the communicator is aborted: the others would fail alike
                break
            works.append(w if w is not None else _Finished())
        self.stats[f"{name}:stream"] += 1
        return self._work(works, tensors, None, name, timeout)

    def allreduce(self, tensors, opts=None):
        """In place, per tensor. CUDA tensors: on the stream path when stream_path allows it for
        every one (toroid_all_reduce_stream on torch's current stream), else staged."""
        torch_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if _device_type(tensors) == "cuda":
            op = _stream_op(torch_op)
            if op is not None and self._on_stream(tensors, op, self._wire):
                def call(t, stream):
                    p = t.data_ptr()
                    return self._comm.all_reduce_stream_ptr(p, p, t.numel(), _dtype(t), op, stream, True, (t,))

                return self._stream_work(tensors, "allreduce", call, _opt_timeout(opts))
        return self._allreduce_host(tensors, opts)

    @_staged(outputs=("tensors",))
    def _allreduce_host(self, tensors, opts=None):
        if any(t.layout != torch.strided for t in tensors):
            return self._sparse_allreduce(tensors, opts)
        torch_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for name, fold in _BITWISE:
            if torch_op == getattr(dist.ReduceOp, name):
                return self._bitwise_allreduce(tensors, name, fold, opts)
        op = _op(torch_op)
        works, outs = [], []
        for t in tensors:
            o = _Output(t, op)
            p = o.buf.data_ptr()
            works.append(self._comm.all_reduce_ptr(p, p, o.buf.numel(), _dtype(o.buf), op, True, (o.buf,),
                                                   wire=self._wire_for(o.buf)))
            outs.append(o)
        return self._work(works, tensors, lambda: [o.copy_back() for o in outs], "allreduce", _opt_timeout(opts))

    def _bitwise_allreduce(self, tensors, name: str, fold, opts):
        """BAND / BOR / BXOR (integer and bool tensors, as gloo): toroid's reductions are
        arithmetic, so every rank's tensor is all-gathered and folded here. That moves n times
        the bytes of a ring all-reduce; these reductions are used on flags and masks."""
        works, finishers = [], []
        for t in tensors:
            if t.is_floating_point() or t.is_complex():
                raise ValueError(f"the toroid backend computes {name} on integer and bool tensors only, not {t.dtype}")
            src = t.contiguous()
            src = src.view(torch.uint8) if src.dtype == torch.bool else src
            _flat(src)  # (checks the device and type)
            gathered = torch.empty((self.size(),) + tuple(src.shape), dtype=src.dtype)
            w, _ = self._gather_into(gathered, src)
            works.append(w)

            def finish(t=t, gathered=gathered):
                out = gathered[0].clone()
                for r in range(1, self.size()):
                    out = fold(out, gathered[r])
                t.copy_(out.view(torch.bool) if t.dtype == torch.bool else out)

            finishers.append(finish)
        return self._work(works, tensors, lambda: [f() for f in finishers], f"allreduce_{name.lower()}",
                          _opt_timeout(opts))

    def _sparse_allreduce(self, tensors, opts):
        """Sum of sparse COO tensors as gloo computes it: every rank's (coalesced) indices and
        values are all-gathered (padded to the largest count), concatenated and coalesced, and
        the input is replaced by the result. Runs before this call returns."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"the toroid backend reduces sparse tensors with SUM only (as gloo), not {op}")
        for t in tensors:
            if t.layout != torch.sparse_coo:
                raise ValueError(f"the toroid backend all-reduces dense and sparse COO tensors, not {t.layout}")
            if t.device.type != "cpu":
                raise ValueError(f"the toroid backend works on CPU tensors, not {t.device}")
        n = self.size()
        for t in tensors:
            c = t.coalesce()
            indices, values = c.indices().contiguous(), c.values().contiguous()
            nnz = torch.tensor([indices.shape[1]], dtype=torch.int64)
            counts = torch.empty(n, dtype=torch.int64)
            self._comm.all_gather_ptr(nnz.data_ptr(), counts.data_ptr(), 1, DataType.INT64)
            width = int(counts.max().item())
            pad_i = torch.zeros((indices.shape[0], width), dtype=torch.int64)
            pad_i[:, :indices.shape[1]] = indices
            pad_v = torch.zeros((width,) + tuple(values.shape[1:]), dtype=values.dtype)
            pad_v[:values.shape[0]] = values
            all_i = torch.empty((n,) + tuple(pad_i.shape), dtype=torch.int64)
            self._comm.all_gather_ptr(pad_i.data_ptr(), all_i.data_ptr(), pad_i.numel(), DataType.INT64)
            fv = _flat(pad_v)
            all_v = torch.empty((n,) + tuple(fv.shape), dtype=fv.dtype)
            self._comm.all_gather_ptr(fv.data_ptr(), all_v.data_ptr(), fv.numel(), _dtype(fv))
            if values.is_complex():
                all_v = torch.view_as_complex(all_v)
            k = [int(x) for x in counts]
            idx = torch.cat([all_i[r][:, :k[r]] for r in range(n)], dim=1)
            val = torch.cat([all_v[r][:k[r]] for r in range(n)], dim=0)
            t.copy_(torch.sparse_coo_tensor(idx, val, t.shape).coalesce())
        return self._work([], tensors, None, "allreduce_sparse")

    def allreduce_coalesced(self, tensors, opts=None):
        """One all-reduce per tensor, in place (a contiguous stand-in for a non-contiguous one),
        recorded as one toroid group and queued by its asynchronous end: toroid packs the small
        ones into one all-reduce itself (NCCL's ncclGroupStart/End), and a large one travels
        alone, without the copy into and out of one concatenation of everything. CUDA tensors
        of one type, each on the stream path: one stream call each (they cannot be recorded in
        a group); otherwise the whole call is staged."""
        if tensors and _device_type(tensors) == "cuda":
            op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
            if len({t.dtype for t in tensors}) == 1 and self._on_stream(tensors, op, self._wire):
                def call(t, stream):
                    p = t.data_ptr()
                    return self._comm.all_reduce_stream_ptr(p, p, t.numel(), _dtype(t), op, stream, True, (t,))

                return self._stream_work(tensors, "allreduce_coalesced", call)
        return self._allreduce_coalesced_host(tensors, opts)

    @_staged(outputs=("tensors",))
    def _allreduce_coalesced_host(self, tensors, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if not tensors:
            return self._work([], tensors)
        outs = [_Output(t, op) for t in tensors]  # (checks every device and type first)
        dtypes = {o.buf.dtype for o in outs}
        if len(dtypes) > 1:  # as gloo: the calls are one coalesced operation of one type
            raise ValueError(f"allreduce_coalesced: tensors must all have the same type, got {sorted(map(str, dtypes))}")
        self._comm.group_start()
        try:
            for o in outs:
                p = o.buf.data_ptr()
                self._comm.all_reduce_ptr(p, p, o.buf.numel(), _dtype(o.buf), op, False, (o.buf,),
                                          wire=self._wire_for(o.buf))
        finally:
            # Also after a refused call: the calls recorded so far are queued on every rank alike.
            work = self._comm.group_end(async_op=True)
        works = [work] if work is not None else []
        return self._work(works, tensors, lambda: [o.copy_back() for o in outs], "allreduce_coalesced")

    def broadcast(self, tensors, opts=None):
        """In place from the root, per tensor. CUDA tensors: on the stream path when
        stream_path allows it for every one (toroid_broadcast_stream), else staged."""
        if _device_type(tensors) == "cuda" and self._on_stream(tensors, None):
            root = opts.rootRank if opts is not None else 0

            def call(t, stream):
                p = t.data_ptr()
                return self._comm.broadcast_stream_ptr(p, p, t.numel(), _dtype(t), root, stream, True, (t,))

            return self._stream_work(tensors, "broadcast", call)
        return self._broadcast_host(tensors, opts)

    @_staged(outputs=("tensors",))
    def _broadcast_host(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        works, outs = [], []
        for t in tensors:
            o = _Output(t)
            p = o.buf.data_ptr()
            works.append(self._comm.broadcast_ptr(p, p, o.buf.numel(), _dtype(o.buf), root, True, (o.buf,)))
            outs.append(o)
        return self._work(works, tensors, lambda: [o.copy_back() for o in outs], "broadcast")

    def reduce(self, tensors, opts=None):
        """In place at the root, per tensor (the others' tensors are left as they were). CUDA
        tensors: on the stream path when stream_path allows it for every one
        (toroid_reduce_stream on torch's current stream: blocking, pipelined through pinned host
        memory), else staged."""
        if _device_type(tensors) == "cuda":
            op = _stream_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
            root = opts.rootRank if opts is not None else 0
            if op is not None and self._on_stream(tensors, op):
                def call(t, stream):
                    p = t.data_ptr()
                    return self._comm.reduce_stream_ptr(p, p, t.numel(), _dtype(t), op, root, stream)

                return self._stream_work(tensors, "reduce", call, _opt_timeout(opts))
        return self._reduce_host(tensors, opts)

    @_staged(outputs=("tensors",))
    def _reduce_host(self, tensors, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        root = opts.rootRank if opts is not None else 0
        works, outs = [], []
        for t in tensors:
            o = _Output(t, op)
            p = o.buf.data_ptr()
            works.append(self._comm.reduce_ptr(p, p, o.buf.numel(), _dtype(o.buf), op, root, True, (o.buf,)))
            outs.append(o)
        return self._work(works, tensors, lambda: [o.copy_back() for o in outs], "reduce")

    def _gather_into(self, output: torch.Tensor, input: torch.Tensor):
        """all_gather of `input` into the flat `output` (size x numel) as a toroid work."""
        src = _flat(input.contiguous())
        o = _Output(output)
        if o.buf.numel() != src.numel() * self.size():
            raise ValueError(f"all_gather output has {o.buf.numel()} elements, expected {src.numel() * self.size()}")
        if o.buf.dtype != src.dtype:
            raise ValueError(f"all_gather output is {output.dtype} but input is {input.dtype}")
        w = self._comm.all_gather_ptr(src.data_ptr(), o.buf.data_ptr(), src.numel(), _dtype(src), True, (src, o.buf))
        return w, o

    def _allgather_lists(self, output_lists, input_tensors, name: str):
        """all_gather of each input into its list of size outputs (one toroid all-gather each)."""
        if len(output_lists) != len(input_tensors):
            raise ValueError(f"{name}: {len(output_lists)} output lists for {len(input_tensors)} inputs")
        works, finishers = [], []
        for outs, inp in zip(output_lists, input_tensors):
            if len(outs) != self.size():
                raise ValueError(f"{name} needs {self.size()} output tensors per input, got {len(outs)}")
            tmp = torch.empty((self.size(),) + tuple(inp.shape), dtype=inp.dtype)
            w, o = self._gather_into(tmp, inp)
            works.append(w)

            def finish(outs=outs, tmp=tmp):
                for r, out in enumerate(outs):
                    out.copy_(tmp[r].view_as(out))

            finishers.append(finish)
        return self._work(works, output_lists, lambda: [f() for f in finishers], name)

    @_staged(outputs=("output_tensors",), inputs=("input_tensors",))
    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._allgather_lists(output_tensors, input_tensors, "allgather")

    @_staged(outputs=("output_lists",), inputs=("input_tensors",))
    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """output_lists[r][i] receives rank r's input i (gloo's layout: one list per rank)."""
        if len(output_lists) != self.size():
            raise ValueError(f"allgather_coalesced needs {self.size()} output lists (one per rank), got {len(output_lists)}")
        if any(len(outs) != len(input_tensors) for outs in output_lists):
            raise ValueError(f"allgather_coalesced: every output list needs {len(input_tensors)} tensors (one per input)")
        per_input = [[outs[i] for outs in output_lists] for i in range(len(input_tensors))]
        return self._allgather_lists(per_input, input_tensors, "allgather_coalesced")

    def _pair_on_stream(self, output, input, op: Optional[ReduceOp], out_per_in: int) -> bool:
        """Whether an all-gather (op None; output = size x input) or a reduce-scatter (input =
        size x output) of CUDA tensors takes the stream path: one dtype and device, both
        contiguous, the sizes right, and stream_path allowing the type and op. Otherwise staged
        (where the CPU path also reports wrong sizes and types)."""
        small = input if op is None else output
        return (isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor)
                and output.layout == input.layout == torch.strided
                and output.dtype == input.dtype and output.device == input.device
                and output.is_contiguous() and input.is_contiguous()
                and (output if op is None else input).numel() == out_per_in * small.numel()
                and stream_path(small.dtype, op, True, small.numel()))

    def all_gather_single(self, output, input, opts=None):
        """all_gather_into_tensor. CUDA tensors: on the stream path (toroid_all_gather_stream on
        torch's current stream; CUDA IPC inside a host) when _pair_on_stream allows, else
        staged."""
        if _device_type([output, input]) == "cuda" and self._pair_on_stream(output, input, None, self.size()):
            def call(t, stream):
                return self._comm.all_gather_stream_ptr(input.data_ptr(), output.data_ptr(), input.numel(),
                                                        _dtype(input), stream, True, (input, output))

            return self._stream_work([output], "all_gather_single", call, _opt_timeout(opts))
        return self._all_gather_single_host(output, input, opts)

    @_staged(outputs=("output",), inputs=("input",))
    def _all_gather_single_host(self, output, input, opts=None):
        w, o = self._gather_into(output, input)
        return self._work([w], output, o.copy_back, "all_gather_single")

    _allgather_base = all_gather_single

    @_staged(outputs=("outputs",), inputs=("inputs",))
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        pairs = [self._gather_into(o, i) for o, i in zip(outputs, inputs)]
        return self._work([w for w, _ in pairs], outputs, lambda: [o.copy_back() for _, o in pairs], "all_gather_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _scatter_from(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp):
        """reduce_scatter of the flat `input` (size x numel) into `output` as a toroid work."""
        src = _flat(input.contiguous(), op)
        o = _Output(output, op)
        if src.numel() != o.buf.numel() * self.size():
            raise ValueError(f"reduce_scatter input has {src.numel()} elements, expected {o.buf.numel() * self.size()}")
        if o.buf.dtype != src.dtype:
            raise ValueError(f"reduce_scatter output is {output.dtype} but input is {input.dtype}")
        p = o.buf.data_ptr()
        w = self._comm.reduce_scatter_ptr(src.data_ptr(), p, o.buf.numel(), _dtype(src), op, True, (src, o.buf))
        return w, o

    @_staged(outputs=("output_tensors",), inputs=("input_tensors",))
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        pairs = []
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self.size():
                raise ValueError(f"reduce_scatter needs {self.size()} input tensors, got {len(ins)}")
            flat = torch.cat([_flat(x, op).reshape(-1) for x in ins])
            pairs.append(self._scatter_from(out, flat, op))
        return self._work([w for w, _ in pairs], output_tensors, lambda: [o.copy_back() for _, o in pairs], "reduce_scatter")

    def reduce_scatter_single(self, output, input, opts=None):
        """reduce_scatter_tensor. CUDA tensors: on the stream path (toroid_reduce_scatter_stream
        on torch's current stream; CUDA IPC inside a host) when _pair_on_stream allows, else
        staged."""
        if _device_type([output, input]) == "cuda":
            op = _stream_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
            if op is not None and self._pair_on_stream(output, input, op, self.size()):
                def call(t, stream):
                    return self._comm.reduce_scatter_stream_ptr(input.data_ptr(), output.data_ptr(), output.numel(),
                                                                _dtype(output), op, stream, True, (input, output))

                return self._stream_work([output], "reduce_scatter_single", call, _opt_timeout(opts))
        return self._reduce_scatter_single_host(output, input, opts)

    @_staged(outputs=("output",), inputs=("input",))
    def _reduce_scatter_single_host(self, output, input, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        w, o = self._scatter_from(output, input, op)
        return self._work([w], output, o.copy_back, "reduce_scatter_single")

    _reduce_scatter_base = reduce_scatter_single

    @_staged(outputs=("outputs",), inputs=("inputs",))
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        pairs = [self._scatter_from(o, i, op) for o, i in zip(outputs, inputs)]
        return self._work([w for w, _ in pairs], outputs, lambda: [o.copy_back() for _, o in pairs], "reduce_scatter_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _all_to_all_v(self, send_blocks: list, recv_counts: list, dtype: torch.dtype):
        """All-to-all of blocks of any sizes: padded to the largest block of any rank (one small
        all-reduce finds it), exchanged as equal blocks. Returns (work, padded output, M)."""
        n = self.size()
        local = max([b.numel() for b in send_blocks] + list(recv_counts) + [0])
        m = torch.tensor([local], dtype=torch.int64)
        self._comm.all_reduce_ptr(m.data_ptr(), m.data_ptr(), 1, DataType.INT64, ReduceOp.MAX)
        width = int(m.item())
        send = torch.zeros(n * width, dtype=dtype)
        for j, b in enumerate(send_blocks):
            send[j * width:j * width + b.numel()] = b
        recv = torch.empty(n * width, dtype=dtype)
        w = self._comm.all_to_all_ptr(send.data_ptr(), recv.data_ptr(), width, _dtype(send), True, (send, recv))
        return w, recv, width

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """all_to_all_single. CUDA tensors with equal splits: on the stream path
        (toroid_all_to_all_stream on torch's current stream: blocking, pipelined through pinned
        host memory) when _pair_on_stream allows and the size divides the input, else staged
        (uneven splits always: the padded exchange of _all_to_all_v runs on the CPU)."""
        if (_device_type([output, input]) == "cuda" and not output_split_sizes and not input_split_sizes
                and self._pair_on_stream(output, input, None, 1) and input.numel() % self.size() == 0):
            def call(t, stream):
                return self._comm.all_to_all_stream_ptr(input.data_ptr(), output.data_ptr(), input.numel() // self.size(),
                                                        _dtype(input), stream)

            return self._stream_work([output], "all_to_all_single", call, _opt_timeout(opts))
        return self._all_to_all_single_host(output, input, output_split_sizes, input_split_sizes, opts)

    @_staged(outputs=("output",), inputs=("input",))
    def _all_to_all_single_host(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()
        src = _flat(input.contiguous())
        if not output_split_sizes and not input_split_sizes:
            o = _Output(output)
            if src.numel() % n or o.buf.numel() != src.numel():
                raise ValueError("all_to_all_single with equal splits needs equal inputs and outputs divisible by the size")
            w = self._comm.all_to_all_ptr(src.data_ptr(), o.buf.data_ptr(), src.numel() // n, _dtype(src), True, (src, o.buf))
            return self._work([w], output, o.copy_back, "all_to_all_single")
        # Uneven splits are counted in rows of dim 0.
        row = src[0].numel() if src.dim() > 0 and src.shape[0] else 1
        ins = list(input_split_sizes) or [input.shape[0] // n] * n
        outs = list(output_split_sizes) or [output.shape[0] // n] * n
        flat_in = src.reshape(-1)
        blocks, at = [], 0
        for s in ins:
            blocks.append(flat_in[at:at + s * row])
            at += s * row
        w, recv, width = self._all_to_all_v(blocks, [s * row for s in outs], src.dtype)
        o = _Output(output)

        def finish():
            flat_out, at = o.buf.reshape(-1), 0
            for j, s in enumerate(outs):
                flat_out[at:at + s * row] = recv[j * width:j * width + s * row]
                at += s * row
            o.copy_back()

        return self._work([w], output, finish, "all_to_all_single")

    alltoall_base = all_to_all_single

    @_staged(outputs=("output_tensors",), inputs=("input_tensors",))
    def alltoall(self, output_tensors, input_tensors, opts=None):
        blocks = [_flat(t.contiguous()).reshape(-1) for t in input_tensors]
        w, recv, width = self._all_to_all_v(blocks, [t.numel() for t in output_tensors], blocks[0].dtype)

        def finish():
            for j, out in enumerate(output_tensors):
                o = _flat(out)  # a view: writing it writes `out`
                o.copy_(recv[j * width:j * width + o.numel()].view_as(o))

        return self._work([w], output_tensors, finish, "alltoall")

    @_staged(outputs=("output_tensors",), inputs=("input_tensors",))
    def gather(self, output_tensors, input_tensors, opts=None):
        """Gather by all-gather (every rank receives; the root keeps it)."""
        root = opts.rootRank if opts is not None else 0
        inp = input_tensors[0]
        tmp = torch.empty((self.size(),) + tuple(inp.shape), dtype=inp.dtype)
        w, _ = self._gather_into(tmp, inp)

        def finish():
            if self.rank() == root:
                for r, out in enumerate(output_tensors[0]):
                    out.copy_(tmp[r])

        return self._work([w], output_tensors, finish, "gather")

    @_staged(outputs=("output_tensors",), inputs=("input_tensors",))
    def scatter(self, output_tensors, input_tensors, opts=None):
        """Scatter by broadcast of the root's pieces (every rank receives all, keeps its own)."""
        root = opts.rootRank if opts is not None else 0
        out = output_tensors[0]
        buf = torch.empty((self.size(),) + tuple(out.shape), dtype=out.dtype)
        if self.rank() == root:
            for r, piece in enumerate(input_tensors[0]):
                buf[r].copy_(piece)
        flat = _flat(buf)
        p = flat.data_ptr()
        w = self._comm.broadcast_ptr(p, p, flat.numel(), _dtype(flat), root, True, (flat,))
        return self._work([w], output_tensors, lambda: out.copy_(buf[self.rank()]), "scatter")

    def barrier(self, opts=None):
        return self._work([self._comm.barrier(async_op=True)], None, None, "barrier", _opt_timeout(opts))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False) -> None:
        """gloo's monitored barrier, through the group's store (it leaves the toroid
        communicator untouched, so the group stays usable after a failure): every rank but 0
        checks in, rank 0 waits for each within `timeout` (a timedelta or seconds; None: the
        group's) and raises "[Rank 0]: Rank(s) ... failed to pass monitoredBarrier in N ms",
        naming every missing rank with wait_all_ranks, else the first. Rank 0 then releases the
        others, or tells them it failed so that they raise at once (gloo's wording) instead of
        at their own timeout."""
        if timeout is None:
            seconds = self._timeout_s or 1800.0
        else:
            seconds = max(0.0, timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout))
        ms = int(seconds * 1000)
        me, n = self.rank(), self.size()
        self._monitored += 1
        self.stats["monitored_barrier"] += 1
        key = f"toroid/monitored_barrier/{self._monitored}"
        store = self._store
        if me != 0:
            store.set(f"{key}/in/{me}", b"1")
            lost = (f"Rank {me} successfully reached monitoredBarrier, but received errors while waiting for send/recv "
                    f"from rank 0. Please check rank 0 logs for faulty rank.")
            try:
                # Rank 0 answers within its timeout; the group's bounds the wait for a lost rank 0.
                store.wait([f"{key}/out"], datetime.timedelta(seconds=max(seconds, self._timeout_s or seconds)))
                verdict = bytes(store.get(f"{key}/out"))
            except RuntimeError as e:
                raise _BACKEND_ERROR(f"{lost}\n Original exception: \n{e}") from e
            if verdict != b"ok":
                raise _BACKEND_ERROR(f"{lost}\n Rank 0 reported: {verdict.decode(errors='replace')}")
            return
        start = datetime.datetime.now()
        missing, passed = [], []
        for r in range(1, n):
            left = seconds - (datetime.datetime.now() - start).total_seconds()
            if left <= 0 and not wait_all_ranks and not store.check([f"{key}/in/{r}"]):
                elapsed = int((datetime.datetime.now() - start).total_seconds() * 1000)
                done = (f" Successfully processed ranks: {', '.join(map(str, passed))}" if passed
                        else " No ranks successfully processed in monitoredBarrier.")
                self._fail_monitored(key, f"Rank 0 timed out in monitoredBarrier after {elapsed} ms.{done}")
            try:
                if left > 0:
                    store.wait([f"{key}/in/{r}"], datetime.timedelta(seconds=left))
                elif not store.check([f"{key}/in/{r}"]):
                    raise RuntimeError("wait timeout")
                passed.append(r)
            except RuntimeError as e:
                if not _is_store_timeout(e):
                    raise
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            which = f"Ranks {', '.join(map(str, missing))}" if wait_all_ranks else f"Rank {missing[0]}"
            self._fail_monitored(key, f"[Rank 0]: {which} failed to pass monitoredBarrier in {ms} ms")
        store.set(f"{key}/out", b"ok")
        for r in range(1, n):  # the check-ins are read: drop them (the verdict stays, small)
            try:
                store.delete_key(f"{key}/in/{r}")
            except Exception:  # noqa: BLE001 - a store without delete keeps them
                pass

    def _fail_monitored(self, key: str, error: str) -> None:
        self._store.set(f"{key}/out", error.encode())
        raise _BACKEND_ERROR(error)

    def _send(self, tensors, dst: int) -> list:
        works = []
        for t in tensors:
            src = _flat(t.contiguous())
            works.append(self._comm.send_ptr(src.data_ptr(), src.numel(), _dtype(src), dst, True, (src,)))
        return works

    def _recv(self, tensors, src: int):
        works, outs = [], []
        for t in tensors:
            o = _Output(t)
            works.append(self._comm.recv_ptr(o.buf.data_ptr(), o.buf.numel(), _dtype(o.buf), src, True, (o.buf,)))
            outs.append(o)
        return works, lambda: [o.copy_back() for o in outs]

    @_staged(inputs=("tensors",))
    def send(self, tensors, dstRank, tag=0):
        if self._coalesced is not None:
            return self._defer("send", tensors, dstRank)
        return self._work(self._send(tensors, dstRank), tensors, None, "send")

    @_staged(outputs=("tensors",))
    def recv(self, tensors, srcRank, tag=0):
        if self._coalesced is not None:
            return self._defer("recv", tensors, srcRank)
        works, finish = self._recv(tensors, srcRank)
        return self._work(works, tensors, finish, "recv")

    @_staged(outputs=("tensors",))
    def recv_anysource(self, tensors, tag=0):
        """Receive from whichever rank sends first; the work's _source_rank() names it (what
        dist.recv(src=None) returns). One tensor (as gloo)."""
        if len(tensors) != 1:
            raise ValueError(f"recv from any source takes one tensor, got {len(tensors)}")
        if self._coalesced is not None:
            raise ValueError("the toroid backend cannot receive from any source inside a coalescing block "
                             "(batch_isend_irecv needs a source for every irecv)")
        o = _Output(tensors[0])
        w = self._comm.recv_any_ptr(o.buf.data_ptr(), o.buf.numel(), _dtype(o.buf), True, (o.buf,))
        return self._work([w], tensors, o.copy_back, "recv_anysource")

    # ---- coalescing (batch_isend_irecv) ----------------------------------------------------
    # Between start_coalescing and end_coalescing (torch's _coalescing_manager, which
    # batch_isend_irecv uses when supports_coalescing is true), send and recv are recorded and
    # issued at the end in an order every rank agrees on, so that a batch never deadlocks on
    # toroid's one-operation-at-a-time queue (a send waits for its receiver): by peer pair
    # (lower rank, higher rank) ascending, within a pair first the lower rank's messages to the
    # higher, then the other way, each direction in issue order. At any moment the smallest
    # pair left has both its ranks at it, so the batch always progresses. Collectives called
    # inside a block are issued at once, not deferred.

    def start_coalescing(self, device=None) -> None:  # (device: from ProcessGroup._start_coalescing)
        if self._coalesced is not None:
            raise RuntimeError("toroid: start_coalescing inside a coalescing block")
        self._coalesced = []

    def _defer(self, kind: str, tensors, peer: int) -> ToroidWork:
        # Checked now, so that an operation the batch cannot issue fails it while it is being
        # recorded, before any of it is issued (an issued send would pair with a later batch's
        # receive).
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"toroid {kind}: peer {peer} is not another rank of this group of {self.size()}")
        for t in tensors:
            _flat(t)  # a device or element type toroid cannot move raises here
        w = ToroidWork(self, [], tensors, None, kind, staging=self._take_staging())
        w._deferred = True
        self._coalesced.append((kind, list(tensors), peer, w))
        return w

    def end_coalescing(self, device=None):
        ops, self._coalesced = self._coalesced, None
        if ops is None:
            raise RuntimeError("toroid: end_coalescing without start_coalescing")
        if not ops:
            return None
        me = self.rank()

        def order(item):
            i, (kind, _, peer, _) = item
            lo, hi = min(me, peer), max(me, peer)
            return (lo, hi, 0 if (kind == "send") == (me == lo) else 1, i)

        issued = []
        try:
            for _, (kind, tensors, peer, w) in sorted(enumerate(ops), key=order):
                if kind == "send":
                    works, finish = self._send(tensors, peer), None
                else:
                    works, finish = self._recv(tensors, peer)
                w._works, w._finish, w._deferred = works, finish, False
                issued.append(w)
        finally:
            for _, _, _, w in ops:  # (queued even if a later op failed to issue: they complete)
                if w in issued:
                    self.stats[w._name] += 1
                    self._queue.put(w)
                else:
                    w._deferred = False
                    w._exception = RuntimeError(f"toroid {w._name}: not issued (an earlier operation of its batch failed)")
                    w._done = True
                    w._future.set_exception(w._exception)
                    w._completed.set()

        def finish():
            for w in issued:
                w._complete()
                if w._exception is not None:
                    raise w._exception

        return self._work([], [t for _, _, _, w in ops for t in w._result], finish, "coalesced")

    # ---- splitting (torch.distributed.split_group) ----------------------------------------

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """One rank's part of torch's split_group: every rank of this group calls it with the
        split it belongs to (`ranks`, group ranks; a rank in none passes a split without it).
        The toroid communicator is split (ranks of one split share the color min(ranks), and
        keep their order in `ranks`); the child meets through a prefix of this group's store.
        Returns None on a rank outside `ranks`. The child's operations are bounded by `timeout`
        (default: this group's)."""
        me = self.rank()
        member = me in ranks
        sub = self._comm.split(min(ranks) if member else None, ranks.index(me) if member else 0)
        if sub is None:
            return None
        timeout = timeout if timeout is not None else (
            datetime.timedelta(seconds=self._timeout_s) if self._timeout_s else None)
        store = dist.PrefixStore(f"toroid/split/{group_name or min(ranks)}/", self._store)
        child = ProcessGroupToroid(store, sub.rank, sub.size, timeout, comm=sub)
        if group_name is not None:
            child._set_group_name(group_name)
        if group_desc is not None:
            child._set_group_desc(group_desc)
        return child

    # ---- life cycle --------------------------------------------------------------------------

    def abort(self) -> None:
        self._comm.abort()

    def shutdown(self) -> None:
        """Waits for queued operations, then releases the communicator."""
        if self._thread.is_alive():
            self._queue.put(None)
            if threading.current_thread() is not self._thread:  # (may run from its last work)
                self._thread.join()
        try:
            self._comm.destroy()
        except _lib.ToroidError as e:
            # Each failed operation already failed its own work; say so once more, do not raise
            # from a teardown.
            warnings.warn(f"toroid: {e}", RuntimeWarning, stacklevel=2)

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


# Every operation raises toroid's failures as torch's (DistBackendError with gloo's wording).
for _name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "allgather_coalesced",
              "all_gather_single", "_allgather_base", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
              "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter_single_coalesced",
              "reduce_scatter_tensor_coalesced", "all_to_all_single", "alltoall_base", "alltoall", "gather", "scatter",
              "barrier", "send", "recv", "recv_anysource", "end_coalescing"):
    setattr(ProcessGroupToroid, _name, _torch_errors(getattr(ProcessGroupToroid, _name)))


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


def _forward(name: str):
    def method(self, *args):
        return getattr(self._group(), name)(*args)

    method.__name__ = name
    return method


for _name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single",
              "allgather_coalesced", "all_gather_single_coalesced", "gather", "scatter", "reduce_scatter",
              "reduce_scatter_single", "reduce_scatter_single_coalesced", "all_to_all_single", "alltoall", "send",
              "recv", "recv_anysource", "barrier", "start_coalescing", "end_coalescing"):
    setattr(_DeviceBackend, _name, _forward(_name))

_CpuBackend = _DeviceBackend  # (its name before it was registered for "cuda" too)


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


def nvrtc_from_torch() -> Optional[str]:
    """The libnvrtc.so.13 of torch's CUDA wheels (nvidia/cu13/lib or nvidia/cuda_nvrtc/lib), if
    installed: the NVRTC that matches torch's CUDA, which the driver supports."""
    try:
        import nvidia  # (a namespace package of torch's CUDA wheels)
    except ImportError:
        return None
    for p in getattr(nvidia, "__path__", []):
        for d in ("cu13", "cuda_nvrtc"):
            f = os.path.join(p, d, "lib", "libnvrtc.so.13")
            if os.path.exists(f):
                return f
    return None


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


dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv

register()
# The GPU kernels of collectives on CUDA tensors (CUDA IPC between the ranks of a host) compile
# with NVRTC: torch's own unless the user named one.
if "TOROID_NVRTC_PATH" not in os.environ and (_nvrtc := nvrtc_from_torch()) is not None:
    os.environ["TOROID_NVRTC_PATH"] = _nvrtc

__all__ = ["BACKEND", "DEVICES", "ProcessGroupToroid", "ToroidWork", "TorchStore", "batch_isend_irecv", "bf16_wire_hook", "fp16_wire_hook", "register", "stream_path"]
_ = _lib  # the ctypes layer, for users who want toroid.torch._lib
