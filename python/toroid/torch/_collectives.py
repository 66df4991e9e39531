"""ProcessGroupToroid's collectives (all-reduce ... scatter), as a mixin of the group class in
`_group.py`: each maps torch's arguments onto one or more toroid calls, on the CUDA stream path
or staged."""

from __future__ import annotations

from .. import _lib
import datetime
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .._lib import DataType, ReduceOp
from ._errors import _opt_timeout
from ._staging import _staged
from ._types import _BITWISE, _TYPES, _Output, _dense_type, _device_type, _dtype, _flat, _op, _reduce_opts, _stream_op, stream_path
from ._work import ToroidWork, _Finished


def _waits_at_once(opts) -> bool:
    """Whether torch waits on this call's work as soon as it is returned: its blocking
    collectives (dist.all_reduce, broadcast, barrier without async_op) set asyncOp = False in the
    options and call wait() at once (torch 2.15's distributed_c10d). Such a call can run as a
    blocking toroid call, unless it has a timeout of its own (a blocking call is bounded by the
    group's). Every call's path: torch's options hold a timedelta, compared as it is."""
    if opts is None or getattr(opts, "asyncOp", True):
        return False
    timeout = getattr(opts, "timeout", None)
    return timeout <= _NO_TIMEOUT if type(timeout) is datetime.timedelta else _opt_timeout(opts) is None


# (torch's unset timeout is timedelta(milliseconds=-1); timedelta(0) is its "none")
_NO_TIMEOUT = datetime.timedelta(0)
# A blocking call's fast path returns this: torch's blocking functions take a None work as done
# ("the backend has sync'ed": `elif work is not None: work.wait()`), and a completed Work
# object costs a small call more than a microsecond to create.
_DONE = None
# _allreduce_dense's answer for a call it does not take.
_NOT_TAKEN = object()
_ALLREDUCE_OPTIONS = dist.AllreduceOptions
_STRIDED = torch.strided
_SUM = dist.ReduceOp.SUM
class _Collectives:
    """The collectives of ProcessGroupToroid (a mixin: `self` is the group; see _group.py)."""

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
        returning: the staged path, and the blocking reduce and all-to-all; or it is enqueued on
        the stream: the stream-ordered path, TOROID_CUDA_ORDERED=1, where wait() makes the
        current stream wait for it and nothing blocks the host). The returned work
        completes when all of them have. A refusal of the request (a toroid
        InvalidArgumentError, UnsupportedError or InvalidUsageError) is raised here, as the CPU
        path raises them when issuing; a failure of the collective itself (a peer, a deadline)
        is the work's, raised by wait() and set on its future, as for an async CPU call."""
        works: list = []
        events: list = []
        for t in tensors:
            stream = torch.cuda.current_stream(t.device)
            try:
                w = call(t, stream.cuda_stream)
            except (_lib.InvalidArgumentError, _lib.UnsupportedError, _lib.InvalidUsageError):
                raise
            except _lib.ToroidError as e:
                works.append(_Finished(e))  # the communicator is aborted: the others would fail alike
                break
            if w is None:
                # Completed, or enqueued on `stream` (the stream-ordered path): wait() makes the
                # then-current stream wait for it, as ProcessGroupNCCL's work does.
                event = torch.cuda.Event()
                event.record(stream)
                w = _Finished(event=event)
                events.append((event, t.device))
            works.append(w)
        self.stats[f"{name}:stream"] += 1
        return self._work(works, tensors, None, name, timeout, tuple(events))

    def allreduce(self, tensors, opts=None):
        """In place, per tensor. CUDA tensors: on the stream path when stream_path allows it for
        every one (toroid_all_reduce_stream on torch's current stream), else staged. `opts`:
        AllreduceOptions, or a bare ReduceOp (as torch's ProcessGroup.allreduce takes)."""
        if type(opts) is _ALLREDUCE_OPTIONS and len(tensors) == 1 and self._wire is None and _waits_at_once(opts):
            # torch's blocking dist.all_reduce of one tensor: its most common call, checked in
            # the fewest steps (each costs a 4 KiB call a few percent of its time).
            t = tensors[0]
            dtype = _TYPES.get(t.dtype) if t.is_cpu and t.layout is _STRIDED and t.is_contiguous() else None
            torch_op = opts.reduceOp
            op = ReduceOp.SUM if torch_op == _SUM else _stream_op(torch_op)
            if dtype is not None and op is not None:
                return self._all_reduce_now(t, dtype, op)
        opts = _reduce_opts(opts)
        torch_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if len(tensors) == 1 and self._wire is None:
            fast = self._allreduce_dense(tensors[0], torch_op, opts)
            if fast is not _NOT_TAKEN:
                return fast
        if _device_type(tensors) == "cuda":
            op = _stream_op(torch_op)
            if op is not None and self._on_stream(tensors, op, self._wire):
                def call(t, stream):
                    p = t.data_ptr()
                    return self._comm.all_reduce_stream_ptr(p, p, t.numel(), _dtype(t), op, stream, True, (t,))

                return self._stream_work(tensors, "allreduce", call, _opt_timeout(opts))
        return self._allreduce_host(tensors, opts)

    def _all_reduce_now(self, t: torch.Tensor, dtype: DataType, op: ReduceOp) -> Any:
        """A blocking in-place all-reduce of one dense contiguous CPU tensor: torch's blocking
        calls, which accept None for a work. It runs on this thread when the group is idle (else
        behind its queued work, running that too), without an async call's hand-over to toroid's
        worker thread, whose wake-up alone costs a small all-reduce most of its time on a small
        host."""
        p = t.data_ptr()
        self._comm.all_reduce_ptr(p, p, t.numel(), dtype, op, False)
        self.stats["allreduce"] += 1
        return _DONE

    def _allreduce_dense(self, t: torch.Tensor, torch_op, opts) -> Any:
        """The common async call, straight to toroid: one dense contiguous CPU tensor of a
        toroid element type, reduced with SUM, PRODUCT, MIN, MAX or AVG, uncompressed. What
        _allreduce_host does for it, without its general steps (staging, stand-ins, several
        tensors). Returns the call's work, or _NOT_TAKEN for any other call, which takes the
        general path. (torch's blocking call took allreduce's first branch.)"""
        dtype = _dense_type(t)
        op = _stream_op(torch_op) if dtype is not None else None
        if op is None:
            return _NOT_TAKEN  # complex, bool, another type; BAND/BOR/BXOR, PREMUL_SUM
        if _waits_at_once(opts):
            # A blocking call torch did not make with its own options type: as allreduce's first
            # branch.
            return self._all_reduce_now(t, dtype, op)
        p = t.data_ptr()
        work = self._comm.all_reduce_ptr(p, p, t.numel(), dtype, op, True, (t,))
        return self._work([work], [t], None, "allreduce", _opt_timeout(opts))

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
        return self._work(works, tensors, _Output.copy_backs(outs), "allreduce", _opt_timeout(opts))

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
        a group); otherwise the whole call is staged. `opts`: AllreduceCoalescedOptions, or a bare
        ReduceOp."""
        opts = _reduce_opts(opts, dist.AllreduceCoalescedOptions)
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
        return self._work(works, tensors, _Output.copy_backs(outs), "allreduce_coalesced")

    def broadcast(self, tensors, opts=None):
        """In place from the root, per tensor. CUDA tensors: on the stream path when
        stream_path allows it for every one (toroid_broadcast_stream), else staged."""
        if len(tensors) == 1 and _waits_at_once(opts):
            t = tensors[0]
            dtype = _dense_type(t)
            if dtype is not None:
                # torch's blocking dist.broadcast: a blocking toroid call (see _allreduce_dense).
                p = t.data_ptr()
                self._comm.broadcast_ptr(p, p, t.numel(), dtype, opts.rootRank, False)
                self.stats["broadcast"] += 1
                return _DONE
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
        return self._work(works, tensors, _Output.copy_backs(outs), "broadcast")

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
        return self._work(works, tensors, _Output.copy_backs(outs), "reduce")

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

    def _allgather_lists(self, output_lists, input_tensors, name: str, result):
        """all_gather of each input into its list of size outputs (one toroid all-gather each);
        `result`: the work's result and its future's value."""
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
        return self._work(works, result, lambda: [f() for f in finishers], name)

    @_staged(outputs=("output_tensors",), inputs=("input_tensors",))
    def allgather(self, output_tensors, input_tensors, opts=None):
        # (the result, and a future's value, as gloo's: one input's outputs, else every list)
        result = output_tensors[0] if len(output_tensors) == 1 else output_tensors
        return self._allgather_lists(output_tensors, input_tensors, "allgather", result)

    @_staged(outputs=("output_lists",), inputs=("input_tensors",))
    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """output_lists[r][i] receives rank r's input i (gloo's layout: one list per rank)."""
        if len(output_lists) != self.size():
            raise ValueError(f"allgather_coalesced needs {self.size()} output lists (one per rank), got {len(output_lists)}")
        if any(len(outs) != len(input_tensors) for outs in output_lists):
            raise ValueError(f"allgather_coalesced: every output list needs {len(input_tensors)} tensors (one per input)")
        per_input = [[outs[i] for outs in output_lists] for i in range(len(input_tensors))]
        return self._allgather_lists(per_input, input_tensors, "allgather_coalesced", output_lists)

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
        return self._work([w], [output], _Output.copy_backs([o]), "all_gather_single")

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
        return self._work([w], [output], _Output.copy_backs([o]), "reduce_scatter_single")

    _reduce_scatter_base = reduce_scatter_single

    @_staged(outputs=("outputs",), inputs=("inputs",))
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        pairs = [self._scatter_from(o, i, op) for o, i in zip(outputs, inputs)]
        return self._work([w for w, _ in pairs], outputs, lambda: [o.copy_back() for _, o in pairs], "reduce_scatter_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """all_to_all_single. CUDA tensors with equal splits: on the stream path
        (toroid_all_to_all_stream on torch's current stream: blocking, pipelined through pinned
        host memory) when _pair_on_stream allows and the size divides the input, else staged
        (uneven splits always: toroid_all_to_all_v runs on the CPU)."""
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
            return self._work([w], [output], _Output.copy_backs([o]), "all_to_all_single")
        # Uneven splits are counted in rows of dim 0; the blocks lie packed in both tensors.
        row = src[0].numel() if src.dim() > 0 and src.shape[0] else 1
        ins = list(input_split_sizes) or [input.shape[0] // n] * n
        outs = list(output_split_sizes) or [output.shape[0] // n] * n
        if len(ins) != n or len(outs) != n or sum(ins) * row != src.numel():
            raise ValueError(f"all_to_all_single: input splits {ins} (rows of {row}) do not cover the input "
                             f"of {src.numel()} elements in {n} blocks")
        o = _Output(output)
        if o.buf.data_ptr() == src.data_ptr() and src.numel():  # (all_to_all_v is out of place)
            src = src.clone()
        w = self._comm.all_to_all_v_ptr(src.data_ptr(), [s * row for s in ins], o.buf.data_ptr(),
                                        [s * row for s in outs], _dtype(src), True, (src, o.buf))
        return self._work([w], [output], _Output.copy_backs([o]), "all_to_all_single")

    alltoall_base = all_to_all_single

    @_staged(outputs=("output_tensors",), inputs=("input_tensors",))
    def alltoall(self, output_tensors, input_tensors, opts=None):
        blocks = [_flat(t.contiguous()).reshape(-1) for t in input_tensors]
        send = torch.cat(blocks)
        recv = torch.empty(sum(t.numel() for t in output_tensors), dtype=send.dtype)
        w = self._comm.all_to_all_v_ptr(send.data_ptr(), [b.numel() for b in blocks], recv.data_ptr(),
                                        [t.numel() for t in output_tensors], _dtype(send), True, (send, recv))

        def finish():
            at = 0
            for out in output_tensors:
                o = _flat(out)  # a view: writing it writes `out`
                o.copy_(recv[at:at + o.numel()].view_as(o))
                at += o.numel()

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
                for r, out in enumerate(output_tensors[0]):  # (any shape of the input's size, as all_gather)
                    out.copy_(tmp[r].view_as(out))

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
