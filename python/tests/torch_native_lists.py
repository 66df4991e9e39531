"""torch's list-form all_gather, reduce and the coalesced collectives (all_reduce_coalesced and
torch's _coalescing_manager of all_reduce, all_gather_into_tensor and reduce_scatter_tensor)
through toroid's C++ backend (toroid/torch/_native.cpp), part of torch_worker.py's
entry_points scenario: every result against a reference computed from every rank's seed, each
call counted by the path it took ("<name>:native" in the group's stats). Where the group has no
C++ backend ("/python-backend") nothing is counted and the results are still checked."""

import torch
import torch.distributed as dist

MODES = ("block", "wait", "future")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8,
          torch.int8)


def counter(built):
    """`counted(name, taken, call)`: makes the call and checks that the default group's C++
    backend made it once under `name` when `taken` (and `built`), else never."""
    pg = dist.distributed_c10d._get_default_group()

    def counted(name, taken, call):
        key = f"{name}:native"
        before = pg.stats[key]
        out = call()
        went = pg.stats[key] - before
        want = 1 if taken and built else 0
        assert went == want, f"{name}: the C++ path ran {went} times, want {want}"
        return out

    return counted


def check(rank, size, built, rand, close):
    """Runs every case; `built`: the group has the C++ backend; `rand(shape, dtype, seed)` and
    `close(got, want, what, rtol, atol)` are torch_worker's."""
    counted = counter(built)

    def finish(work, mode):
        if mode == "wait":
            work.wait()
        elif mode == "future":
            return work.get_future().wait()
        return None

    all_gather(rank, size, counted, finish, rand, close)
    gather_scatter(rank, size, counted, finish, rand, close)
    reduce(rank, size, counted, finish, rand, close)
    coalesced(rank, size, counted, rand, close)


def all_gather(rank, size, counted, finish, rand, close):
    """dist.all_gather: rank r's input in output r, for outputs of any shape of the input's element
    count and any strides (copied out of one staging buffer after the gather)."""
    shapes = ((1,), (1000,), (33, 17), (0,))
    for i, (dtype, shape) in enumerate((d, sh) for d in DTYPES for sh in shapes):
        mode = MODES[i % 3]
        x = rand(shape, dtype, 6000 + 100 * i + rank)
        outs = [torch.full(shape, 7, dtype=dtype) for _ in range(size)]
        work = counted("allgather", True, lambda: dist.all_gather(outs, x, async_op=mode != "block"))
        value = finish(work, mode)
        if mode == "future":  # (gloo's: the one input's list of outputs)
            assert len(value) == size and all(v is o for v, o in zip(value, outs)), "the future's value is not the outputs"
        close(outs, [rand(shape, dtype, 6000 + 100 * i + r) for r in range(size)],
              f"native all_gather {dtype} {shape} {mode}")
    # Outputs of other shapes and strides (a transposed one), the input among them (in place).
    x = rand((12,), torch.float32, 6900 + rank)
    outs = [torch.empty(12) if r % 3 == 0 else torch.empty(3, 4) if r % 3 == 1 else torch.empty(4, 3).t()
            for r in range(size)]
    outs[rank] = x
    work = counted("allgather", True, lambda: dist.all_gather(outs, x, async_op=True))
    work.wait()
    close([o.reshape(-1) for o in outs], [rand((12,), torch.float32, 6900 + r) for r in range(size)],
          "native all_gather into outputs of any shape")
    # Not taken: a non-contiguous input (the Python path, the same result).
    x = rand((5, 4), torch.int64, 6950 + rank).t()
    outs = [torch.empty(4, 5, dtype=torch.int64) for _ in range(size)]
    counted("allgather", False, lambda: dist.all_gather(outs, x))
    close(outs, [rand((5, 4), torch.int64, 6950 + r).t() for r in range(size)], "all_gather of a non-contiguous input")
    # all_gather_object rides on it (a size, then the pickles).
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "tail": "x" * (rank * 100)})
    assert objs == [{"rank": r, "tail": "x" * (r * 100)} for r in range(size)], objs


def gather_scatter(rank, size, counted, finish, rand, close):
    """dist.gather: the root's list receives every rank's input (the others pass none);
    dist.scatter: each rank's output receives the root's piece for it. Every type, a few shapes
    (empty included), every root, blocking, wait() and the future; gather's outputs and
    scatter's pieces of other shapes and strides."""
    for i, dtype in enumerate(DTYPES):
        mode, root, shape = MODES[i % 3], i % size, ((7,), (0,), (5, 3))[i % 3]
        x = rand(shape, dtype, 9000 + 100 * i + rank)
        outs = [torch.full(shape, 3, dtype=dtype) for _ in range(size)] if rank == root else None
        work = counted("gather", True, lambda: dist.gather(x, outs, dst=root, async_op=mode != "block"))
        finish(work, mode)
        if rank == root:
            close(outs, [rand(shape, dtype, 9000 + 100 * i + r) for r in range(size)],
                  f"native gather {dtype} {shape} to {root} {mode}")
        pieces = [rand(shape, dtype, 9500 + 100 * i + r) for r in range(size)] if rank == root else None
        out = torch.full(shape, 3, dtype=dtype)
        work = counted("scatter", True, lambda: dist.scatter(out, pieces, src=root, async_op=mode != "block"))
        finish(work, mode)
        close(out, rand(shape, dtype, 9500 + 100 * i + rank), f"native scatter {dtype} {shape} from {root} {mode}")
    # Outputs and pieces of other shapes and strides (transposed ones).
    root = size - 1
    x = rand((12,), torch.float64, 9900 + rank)
    outs = [torch.empty(4, 3, dtype=torch.float64).t() for _ in range(size)] if rank == root else None
    counted("gather", True, lambda: dist.gather(x, outs, dst=root))
    if rank == root:
        close([o.reshape(-1) for o in outs], [rand((12,), torch.float64, 9900 + r) for r in range(size)],
              "native gather into transposed outputs")
    pieces = [rand((3, 4), torch.float64, 9950 + r).t() for r in range(size)] if rank == root else None
    out = torch.empty(4, 3, dtype=torch.float64)
    counted("scatter", True, lambda: dist.scatter(out, pieces, src=root))
    close(out, rand((3, 4), torch.float64, 9950 + rank).t(), "native scatter of transposed pieces")
    # Not taken: a non-contiguous input to gather, a non-contiguous output of scatter (the Python
    # path, the same results).
    x = rand((3, 4), torch.int32, 9970 + rank).t()
    outs = [torch.empty(4, 3, dtype=torch.int32) for _ in range(size)] if rank == 0 else None
    counted("gather", False, lambda: dist.gather(x, outs, dst=0))
    if rank == 0:
        close(outs, [rand((3, 4), torch.int32, 9970 + r).t() for r in range(size)], "gather of a non-contiguous input")
    pieces = [rand((2, 5), torch.int32, 9980 + r) for r in range(size)] if rank == 0 else None
    out = torch.empty(5, 2, dtype=torch.int32).t()
    counted("scatter", False, lambda: dist.scatter(out, pieces, src=0))
    close(out, rand((2, 5), torch.int32, 9980 + rank), "scatter into a non-contiguous output")


def reduce(rank, size, counted, finish, rand, close):
    """dist.reduce: the root's tensor becomes the reduction of every rank's; the others' are only
    read (toroid_reduce, in place at the root)."""
    folds = {dist.ReduceOp.SUM: lambda xs: sum(xs[1:], xs[0].clone()),
             dist.ReduceOp.MAX: lambda xs: torch.stack(xs).max(0).values,
             dist.ReduceOp.MIN: lambda xs: torch.stack(xs).min(0).values,
             dist.ReduceOp.PRODUCT: lambda xs: torch.stack(xs).prod(0).to(xs[0].dtype)}
    cases = [(d, (257,), dist.ReduceOp.SUM) for d in DTYPES]
    cases += [(torch.float32, (33, 5), dist.ReduceOp.MAX), (torch.int64, (1,), dist.ReduceOp.MIN),
              (torch.int32, (64,), dist.ReduceOp.PRODUCT), (torch.float64, (0,), dist.ReduceOp.SUM)]
    for i, (dtype, shape, op) in enumerate(cases):
        mode, root = MODES[i % 3], i % size

        def make(r, i=i, dtype=dtype, shape=shape, op=op):
            if op == dist.ReduceOp.PRODUCT:
                return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(7000 + 100 * i + r)).to(dtype)
            return rand(shape, dtype, 7000 + 100 * i + r)

        x = make(rank)
        work = counted("reduce", True, lambda: dist.reduce(x, root, op=op, async_op=mode != "block"))
        finish(work, mode)
        want = folds[op]([make(r) for r in range(size)]).to(dtype) if rank == root else make(rank)
        close(x, want, f"native reduce {dtype} {shape} {op} to {root} {mode}",
              rtol=1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5, atol=1e-5)
    # Not taken: a non-contiguous tensor (the Python path, the same result at the root).
    x = rand((6, 4), torch.float32, 7900 + rank).t()
    counted("reduce", False, lambda: dist.reduce(x, size - 1))
    if rank == size - 1:
        close(x, sum(rand((6, 4), torch.float32, 7900 + r) for r in range(size)).t(), "reduce of a non-contiguous tensor")


def coalesced(rank, size, counted, rand, close):
    """all_reduce_coalesced and torch's _coalescing_manager: one toroid group per call (its small
    all-reduces packed into one), blocking or async, tensors of any sizes."""
    shapes = ((5,), (3, 4), (1,), (4097,), (0,))
    for i, (dtype, async_op) in enumerate(((torch.float32, False), (torch.int64, True), (torch.bfloat16, True))):
        def inputs(r, i=i, dtype=dtype):
            return [rand(sh, dtype, 8000 + 100 * i + 10 * r + j) for j, sh in enumerate(shapes)]

        ts = inputs(rank)
        work = counted("allreduce_coalesced", True, lambda: dist.all_reduce_coalesced(ts, async_op=async_op))
        if async_op:
            work.wait()
        close(ts, [sum(xs[1:], xs[0].clone()) for xs in zip(*[inputs(r) for r in range(size)])],
              f"native all_reduce_coalesced {dtype} {'async' if async_op else 'block'}")
    # Not taken: a non-contiguous tensor among them (the Python path, the same result).
    ts = [rand((3,), torch.float64, 8400 + rank), rand((4, 3), torch.float64, 8410 + rank).t()]
    counted("allreduce_coalesced", False, lambda: dist.all_reduce_coalesced(ts))
    close(ts, [sum(rand((3,), torch.float64, 8400 + r) for r in range(size)),
               sum(rand((4, 3), torch.float64, 8410 + r) for r in range(size)).t()],
          "all_reduce_coalesced with a non-contiguous tensor")
    # _coalescing_manager (each block one coalesced call, counted when the block ends):
    # all_reduce (MAX), all_gather_into_tensor, reduce_scatter_tensor.
    def block(calls, async_op):
        with dist._coalescing_manager(async_ops=async_op) as cm:
            calls()
        if async_op:
            cm.wait()

    ts = [rand(sh, torch.float32, 8500 + 10 * rank + j) for j, sh in enumerate(shapes)]
    counted("allreduce_coalesced", True,
            lambda: block(lambda: [dist.all_reduce(t, op=dist.ReduceOp.MAX) for t in ts], True))
    want = [torch.stack(xs).max(0).values for xs in
            zip(*[[rand(sh, torch.float32, 8500 + 10 * r + j) for j, sh in enumerate(shapes)] for r in range(size)])]
    close(ts, want, "coalescing manager all_reduce MAX")
    for async_op in (False, True):
        ins = [rand(sh, torch.float64, 8600 + 10 * rank + j) for j, sh in enumerate(shapes)]
        outs = [torch.empty((size * sh[0],) + sh[1:], dtype=torch.float64) for sh in shapes]
        counted("all_gather_coalesced", True,
                lambda: block(lambda: [dist.all_gather_into_tensor(o, x) for o, x in zip(outs, ins)], async_op))
        close(outs, [torch.cat([rand(sh, torch.float64, 8600 + 10 * r + j) for r in range(size)])
                     for j, sh in enumerate(shapes)], f"coalescing manager all_gather_into_tensor async={async_op}")
        ins = [rand((size * sh[0],) + sh[1:], torch.float32, 8700 + 10 * rank + j) for j, sh in enumerate(shapes)]
        outs = [torch.empty(sh) for sh in shapes]
        counted("reduce_scatter_coalesced", True,
                lambda: block(lambda: [dist.reduce_scatter_tensor(o, x) for o, x in zip(outs, ins)], async_op))
        close(outs, [sum(rand((size * sh[0],) + sh[1:], torch.float32, 8700 + 10 * r + j)
                         for r in range(size))[rank * sh[0]:(rank + 1) * sh[0]] for j, sh in enumerate(shapes)],
              f"coalescing manager reduce_scatter_tensor async={async_op}")
    # Not taken: a non-contiguous output among the pairs (the Python path, the same result).
    ins = [rand((4,), torch.float32, 8800 + rank), rand((6,), torch.float32, 8810 + rank)]
    outs = [torch.empty(size * 4), torch.empty(6, size).t()]
    counted("all_gather_coalesced", False,
            lambda: block(lambda: [dist.all_gather_into_tensor(o, x) for o, x in zip(outs, ins)], False))
    close([o.reshape(-1) for o in outs],
          [torch.cat([rand((k,), torch.float32, 8800 + 10 * j + r) for r in range(size)]) for j, k in enumerate((4, 6))],
          "coalescing manager all_gather_into_tensor into a non-contiguous output")
