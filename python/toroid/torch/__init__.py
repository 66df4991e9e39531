"""The torch.distributed backend "toroid".

    import torch.distributed as dist
    dist.init_process_group("toroid")           # env:// (torchrun) or any init_method

An installed package needs no import: torch imports this module through the entry point
`toroid = toroid.torch:register` (group `torch.distributed.backends`) the first time a group
names "toroid", "cpu:toroid,cuda:nccl" included. `import toroid.torch` registers it too (a
checkout on PYTHONPATH needs it).

Its all_reduce, broadcast, reduce, all_gather (list form), all_gather_into_tensor,
reduce_scatter_tensor, their coalesced forms, gather, scatter, all_to_all_single (equal or
uneven splits),
barrier, send and recv of CPU tensors run in C++ where a C++ compiler is at hand: the
group's c10d backend (_native.cpp, built on first use against the imported torch and cached;
`python -m toroid.torch` builds it ahead of time; TOROID_TORCH_NATIVE, docs/ENV.md) takes torch's
calls without Python, from torch.distributed, DDP's reducer and comm hooks, FSDP, and mixed
groups ("cpu:toroid,cuda:nccl") alike; everything else is the Python backend's.

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
  staged path completes before returning. On the stream-ordered path (TOROID_CUDA_ORDERED=1,
  one process per rank on one host: not yet run on a GPU) the collective is enqueued on the
  current stream and nothing blocks the host; wait() makes the then-current stream wait for it,
  as ProcessGroupNCCL's work does. Failures of the collective are the work's (wait() raises them, as
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

import os

import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from .. import _lib
from .._lib import DataType, ReduceOp  # noqa: F401 (names of the former single module)
from ..comm import Comm  # noqa: F401

try:  # (a Python subclass of c10d's Backend needs its constructor bound, as in torch 2.15)
    _C10dBackend(0, 1)
    _BACKEND_CONSTRUCTIBLE = True
except TypeError:
    _BACKEND_CONSTRUCTIBLE = False

# The modules by concern: _types (dtypes, ops, the stream-or-staging choice), _staging (CUDA
# tensors through host memory), _store (torch's Store for toroid), _errors (torch's exceptions
# and timeouts), _work (ToroidWork), _collectives and _group (ProcessGroupToroid), _backend (the
# per-device c10d Backend), _register (registration, DDP hooks, batch_isend_irecv), _nvrtc.
from ._backend import _CpuBackend, _DeviceBackend  # noqa: E402
from ._group import ProcessGroupToroid  # noqa: E402
from ._nvrtc import nvrtc_from_torch  # noqa: E402
from ._register import batch_isend_irecv, bf16_wire_hook, fp16_wire_hook, register  # noqa: E402
from ._store import TorchStore  # noqa: E402
from ._types import BACKEND, DEVICES, _device_type, stream_path  # noqa: E402
from ._work import ToroidWork  # noqa: E402

# On import: batch_isend_irecv in torch's place, and the backend registered.
dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv
register()
# The GPU kernels of collectives on CUDA tensors (CUDA IPC between the ranks of a host) compile
# with NVRTC: torch's own unless the user named one.
if "TOROID_NVRTC_PATH" not in os.environ and (_nvrtc := nvrtc_from_torch()) is not None:
    os.environ["TOROID_NVRTC_PATH"] = _nvrtc

__all__ = ["BACKEND", "DEVICES", "ProcessGroupToroid", "ToroidWork", "TorchStore", "batch_isend_irecv", "bf16_wire_hook", "fp16_wire_hook", "register", "stream_path"]
_ = _lib  # the ctypes layer, for users who want toroid.torch._lib
