"""Staging CUDA tensors through pinned host memory for the operations the stream path does not
take (`_Staging`, and the `_staged` decorator of ProcessGroupToroid's methods)."""

from __future__ import annotations

import inspect

import torch

from ._types import _device_type, _tensors_in


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
