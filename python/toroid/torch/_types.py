"""Tensors as toroid sees them: the backend's name and devices, torch dtypes and
reduce ops to toroid's, flat contiguous views, the choice between the CUDA stream path and
staging (`stream_path`), and `_Output`, an output tensor or its contiguous stand-in."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .._lib import DataType, ReduceOp


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


def _reduce_opts(opts, options=dist.AllreduceOptions):
    """torch's ProcessGroup.allreduce also takes a bare ReduceOp where its options go (the
    pybind overload `allreduce(tensors, op)`, which torchft's tests call): as options."""
    if isinstance(opts, dist.ReduceOp):  # (ReduceOp.SUM, a RedOpType, is one too)
        o = options()
        o.reduceOp = opts
        return o
    return opts


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


def _dense_type(t: torch.Tensor) -> Optional[DataType]:
    """toroid's type of a dense contiguous CPU tensor of a toroid element type, the tensor a
    call can hand to toroid as it is (the blocking fast paths); None for any other."""
    if not t.is_cpu or t.layout != torch.strided or not t.is_contiguous():
        return None
    return _TYPES.get(t.dtype)


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


class _Output:
    """An output tensor, or a contiguous stand-in copied back when the operation is done."""

    def stand_in(self) -> bool:
        """Whether the operation writes a stand-in that must be copied back."""
        return not self.target.is_contiguous()

    @staticmethod
    def copy_backs(outs: list[_Output]) -> Optional[Callable[[], None]]:
        """What copies every stand-in of `outs` back, or None when the operation writes the
        outputs themselves (a work with nothing left to do completes on the waiting thread:
        see ToroidWork._lazy)."""
        pending = [o for o in outs if o.stand_in()]
        if not pending:
            return None
        return lambda: [o.copy_back() for o in pending]

    def __init__(self, t: torch.Tensor, op: Optional[ReduceOp] = None):
        self.target = t
        self.buf = _flat(t if t.is_contiguous() else t.contiguous(), op)

    def copy_back(self) -> None:
        if self.stand_in():
            src = torch.view_as_complex(self.buf) if self.target.is_complex() else self.buf
            self.target.copy_(src)
