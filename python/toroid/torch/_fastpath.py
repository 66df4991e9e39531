"""The torch backend's C path: torch's blocking dist.all_reduce and dist.broadcast of one dense
CPU tensor, checked and made by toroid._fastcall (see _fast_path), in front of the group's
Python methods (_collectives.py)."""

from __future__ import annotations

import datetime
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import _lib
from .._lib import ReduceOp
from ._collectives import _ALLREDUCE_OPTIONS, _DONE, _NO_TIMEOUT, _STRIDED
from ._errors import _torch_error
from ._types import _BITWISE, _OPS, _TYPES

# toroid._fastcall's answer for a call it did not make (the general path takes it).
_NOT_TAKEN_CODE = -1


def _bind_torch_fastcall() -> bool:
    """Hands toroid._fastcall the torch objects its torch_all_reduce and torch_broadcast compare
    with (see _fast_path); False where the extension is absent or older than those functions."""
    try:
        from .. import _fastcall
    except ImportError:
        return False
    ops = _op_numbers()
    if not hasattr(_fastcall, "torch_broadcast") or ops is None:
        return False
    _fastcall.bind_torch(torch.Tensor, _ALLREDUCE_OPTIONS, dist.BroadcastOptions, datetime.timedelta, _NO_TIMEOUT,
                         _STRIDED, {t: int(d) for t, d in _TYPES.items()}, ops)
    return True


def _op_numbers() -> Optional[dict]:
    """{number of torch's RedOpType: toroid's op} for the operators the C path takes, which it
    finds by the hash of the options' reduceOp: torch's ReduceOp hashes as that number (torch
    2.15's does). None where this torch's does not, for any operator: then the C path is off."""
    numbers = {}
    for torch_op, op in _OPS:
        opts = _ALLREDUCE_OPTIONS()
        opts.reduceOp = torch_op
        number = int(torch_op)
        if hash(opts.reduceOp) != number or not 0 <= number < 16 or not opts.reduceOp == torch_op:
            return None
        numbers[number] = int(op)
    for name, _ in _BITWISE:  # (and none of the others hashes as one of them)
        opts = _ALLREDUCE_OPTIONS()
        opts.reduceOp = getattr(dist.ReduceOp, name)
        if hash(opts.reduceOp) in numbers:
            return None
    return numbers


_TORCH_FASTCALL = _bind_torch_fastcall()


def _fast_path(name: str, general: Callable) -> Callable:
    """ProcessGroupToroid.allreduce or .broadcast (`name`): torch's dist.all_reduce (SUM,
    PRODUCT, MIN, MAX, AVG) or dist.broadcast of one dense contiguous CPU tensor, blocking or
    async without a timeout of its own, checked and made in C by toroid._fastcall's
    torch_all_reduce or torch_broadcast (in Python the checks cost a 4 KiB call about as much as
    the collective, issue 36): the same toroid call as the Python method makes, blocking, or
    queued with its work wrapped as the Python path wraps it (a ToroidWork over the binding's
    Work, which keeps the tensor alive until it has run). Every other call, and every call where the
    extension is absent (or TOROID_PYTHON_FASTCALL=0), is `general`'s: the method as
    _Collectives defines it, with _torch_errors around it. Errors are raised as _torch_errors
    raises them; stats count the calls made in C under `name` and, as the path they took,
    "<name>:fastcall"."""
    if not _TORCH_FASTCALL:
        return general
    from .. import _fastcall

    key, function = f"{name}:fastcall", {"allreduce": "toroid_all_reduce", "broadcast": "toroid_broadcast"}[name]
    call = {"allreduce": _fastcall.torch_all_reduce, "broadcast": _fastcall.torch_broadcast}[name]

    def fast(self, tensors, opts=None):
        if _lib.FAST is not None:  # (None until the library is bound, or with TOROID_PYTHON_FASTCALL=0)
            code = call(self, tensors, opts)
            if code != _NOT_TAKEN_CODE:
                stats = self.stats  # (made: done, or failed; counted as every path counts a call)
                stats[key] += 1
                if type(code) is tuple:  # async: (result, work)
                    try:
                        work = self._comm._issued(function, code, (tensors[0],), None)
                    except _lib.ToroidError as e:
                        stats[name] += 1
                        raise _torch_error(e, name, self.rank(), self._timeout_s) from e
                    self._comm._prune()
                    return self._work([work], tensors, None, name)  # (which counts it under `name`)
                stats[name] += 1
                if code == 0:
                    return _DONE
                try:
                    _lib.check(function, code, self._comm._handle)
                except _lib.ToroidError as e:
                    raise _torch_error(e, name, self.rank(), self._timeout_s) from e
        return general(self, tensors, opts)

    fast.__name__, fast.__doc__ = name, general.__doc__
    return fast
