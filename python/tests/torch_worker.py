"""One rank of the torch tests (started by test_torch.py through launch.py): every collective
of the "toroid" backend against torch's own gloo backend on the same random tensors, and a
small model trained with DistributedDataParallel on both."""

import datetime
import os
import random
import sys
import time

import torch
import torch.distributed as dist

import toroid
import toroid.torch  # noqa: F401 - registers the backend

SCENARIO = sys.argv[1]
checks = []


def close(a, b, what, rtol=1e-5, atol=1e-6):
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{what}[{i}]", rtol, atol)
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.is_floating_point() or a.is_complex():
        ok = torch.allclose(a.to(torch.complex128 if a.is_complex() else torch.float64),
                            b.to(torch.complex128 if b.is_complex() else torch.float64), rtol=rtol, atol=atol)
    else:
        ok = torch.equal(a, b)
    if not ok:
        raise AssertionError(f"{what}: toroid and gloo differ\n toroid {a.flatten()[:8]}\n gloo   {b.flatten()[:8]}")
    checks.append(what)


def rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        if dtype in (torch.float16, torch.bfloat16):  # small integers: exact in 16 bits
            return torch.randint(-8, 9, shape, generator=g).to(dtype)
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def both(fn, *tensors):
    """Runs fn(group, *copies) on the toroid group (the default) and on gloo; returns both copies."""
    a = [t.clone() for t in tensors]
    b = [t.clone() for t in tensors]
    fn(None, *a)
    fn(GLOO, *b)
    return a, b


def compare(rank, size):
    seed = 100 * rank
    # all_reduce: types x ops, blocking and async; AVG against gloo's SUM / size.
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
    for dtype in [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.uint8]:
        for op in ops:
            x = rand((1000,), dtype, seed := seed + 1)
            if op == dist.ReduceOp.PRODUCT and dtype.is_floating_point:
                x = x.abs().clamp(0.5, 1.5) if dtype in (torch.float32, torch.float64) else x.sign() + (x == 0)
            a, b = both(lambda g, t: dist.all_reduce(t, op=op, group=g), x)
            close(a[0], b[0], f"all_reduce {dtype} {op}")
            w = dist.all_reduce(a[0], op=op, async_op=True)
            fut = w.get_future()
            w.wait()
            assert fut.wait()[0] is a[0] or torch.equal(fut.wait()[0], a[0])
            dist.all_reduce(b[0], op=op, group=GLOO)
            close(a[0], b[0], f"all_reduce twice, async {dtype} {op}")
    x = rand((777,), torch.float32, seed := seed + 1)
    a = x.clone()
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    b = x.clone()
    dist.all_reduce(b, group=GLOO)
    close(a, b / size, "all_reduce AVG")
    x = rand((300,), torch.complex64, seed := seed + 1)
    a, b = both(lambda g, t: dist.all_reduce(t, group=g), x)
    close(a[0], b[0], "all_reduce complex64")
    nc = rand((40, 30), torch.float32, seed := seed + 1).t()  # not contiguous
    a, b = both(lambda g, t: dist.all_reduce(t, group=g), nc)
    close(a[0], b[0], "all_reduce non-contiguous")

    for root in range(size):
        for dtype in [torch.float32, torch.int64]:
            x = rand((513,), dtype, seed := seed + 1)
            a, b = both(lambda g, t: dist.broadcast(t, root, group=g), x)
            close(a[0], b[0], f"broadcast root {root} {dtype}")
            a, b = both(lambda g, t: dist.reduce(t, root, op=dist.ReduceOp.MAX, group=g), x)
            if rank == root:
                close(a[0], b[0], f"reduce root {root} {dtype}")
            w = dist.broadcast(a[0], root, async_op=True)
            w.wait()
            dist.broadcast(b[0], root, group=GLOO)
            close(a[0], b[0], f"async broadcast root {root}")

    for dtype in [torch.float32, torch.int32, torch.bfloat16]:
        x = rand((5, 7), dtype, seed := seed + 1)
        outs_a = [torch.empty_like(x) for _ in range(size)]
        outs_b = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(outs_a, x)
        dist.all_gather(outs_b, x, group=GLOO)
        close(outs_a, outs_b, f"all_gather {dtype}")
        ta = torch.empty((size * 5, 7), dtype=dtype)
        tb = torch.empty((size * 5, 7), dtype=dtype)
        w = dist.all_gather_into_tensor(ta, x, async_op=True)
        w.wait()
        dist.all_gather_into_tensor(tb, x, group=GLOO)
        close(ta, tb, f"all_gather_into_tensor {dtype}")

    for dtype in [torch.float32, torch.int64]:
        ins = [rand((6, 3), dtype, seed := seed + 1) for _ in range(size)]
        oa, ob = torch.empty((6, 3), dtype=dtype), torch.empty((6, 3), dtype=dtype)
        dist.reduce_scatter(oa, [t.clone() for t in ins])
        # gloo's reduce_scatter and reduce_scatter_tensor: compare with them where gloo has them,
        # else with gloo's all_reduce sliced.
        full = torch.cat(ins)
        try:
            dist.reduce_scatter(ob, [t.clone() for t in ins], group=GLOO)
        except (RuntimeError, ValueError):
            ref = full.clone()
            dist.all_reduce(ref, group=GLOO)
            ob = ref[rank * 6:(rank + 1) * 6]
        close(oa, ob, f"reduce_scatter {dtype}")
        ta, tb = torch.empty((6, 3), dtype=dtype), torch.empty((6, 3), dtype=dtype)
        w = dist.reduce_scatter_tensor(ta, full.clone(), op=dist.ReduceOp.MAX, async_op=True)
        w.wait()
        try:
            dist.reduce_scatter_tensor(tb, full.clone(), op=dist.ReduceOp.MAX, group=GLOO)
        except (RuntimeError, ValueError):
            ref = full.clone()
            dist.all_reduce(ref, op=dist.ReduceOp.MAX, group=GLOO)
            tb = ref[rank * 6:(rank + 1) * 6]
        close(ta, tb, f"reduce_scatter_tensor {dtype}")

    # all_to_all_single: equal splits, then uneven (rank r sends r+j+1 rows to rank j).
    x = rand((size * 4, 3), torch.float32, seed := seed + 1)
    oa, ob = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(oa, x)
    dist.all_to_all_single(ob, x, group=GLOO)
    close(oa, ob, "all_to_all_single")
    in_splits = [rank + j + 1 for j in range(size)]
    out_splits = [j + rank + 1 for j in range(size)]
    x = rand((sum(in_splits), 3), torch.int64, seed := seed + 1)
    oa, ob = torch.empty((sum(out_splits), 3), dtype=torch.int64), torch.empty((sum(out_splits), 3), dtype=torch.int64)
    w = dist.all_to_all_single(oa, x, out_splits, in_splits, async_op=True)
    w.wait()
    dist.all_to_all_single(ob, x, out_splits, in_splits, group=GLOO)
    close(oa, ob, "all_to_all_single uneven")

    # send/recv around the ring (even ranks send first).
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    mine = rand((1000,), torch.float64, 7000 + rank)
    got_a, got_b = torch.empty(1000, dtype=torch.float64), torch.empty(1000, dtype=torch.float64)
    for g, got in ((None, got_a), (GLOO, got_b)):
        if rank % 2 == 0:
            dist.send(mine, nxt, group=g)
            dist.recv(got, prv, group=g)
        else:
            dist.recv(got, prv, group=g)
            dist.send(mine, nxt, group=g)
    close(got_a, got_b, "send/recv")
    close(got_a, rand((1000,), torch.float64, 7000 + prv), "send/recv value")
    req = dist.isend(mine, nxt) if rank % 2 == 0 else dist.irecv(got_a, prv)
    req.wait()
    req = dist.irecv(got_a, prv) if rank % 2 == 0 else dist.isend(mine, nxt)
    req.wait()
    close(got_a, got_b, "isend/irecv")

    dist.barrier()
    w = dist.barrier(async_op=True)
    w.wait()
    assert w.is_completed()

    # Errors carry toroid's message; the group stays usable.
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG)
        raise AssertionError("AVG on int32 succeeded")
    except toroid.UnsupportedError as e:
        assert "avg is defined for floating types only" in str(e), e
    try:
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BXOR)
        raise AssertionError("BXOR succeeded")
    except ValueError as e:
        assert "toroid does not support" in str(e), e
    x = torch.ones(3)
    dist.all_reduce(x)
    close(x, torch.full((3,), float(size)), "usable after errors")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(10, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def ddp(rank, size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    pg = dist.distributed_c10d._get_default_group()
    before = pg.stats["allreduce"]
    for name, group in (("toroid", dist.group.WORLD), ("gloo", GLOO)):
        torch.manual_seed(0)  # the same initial model on every rank and backend
        model = Net()
        # Small buckets: several all-reduces per step, overlapping the backward pass.
        net = DDP(model, process_group=group, bucket_cap_mb=0.01)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
        for _ in range(6):
            x = torch.randn(32, 10, generator=g)
            y = torch.randn(32, 4, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
        results[name] = [p.detach().clone() for p in model.parameters()]
    # DDP's gradient buckets went through toroid's async all-reduce: several per step.
    # (one bucket in the first step, then DDP rebuilds them: 2 per step with these sizes)
    assert pg.stats["allreduce"] - before >= 1 + 2 * 5, pg.stats
    torch.manual_seed(0)
    initial = [p.detach() for p in Net().parameters()]
    assert any(not torch.allclose(a, b) for a, b in zip(results["toroid"], initial)), "the model did not train"
    close(results["toroid"], results["gloo"], "DDP parameters toroid vs gloo", rtol=1e-4, atol=1e-6)
    # Every rank holds the same parameters (what DDP guarantees).
    flat = torch.cat([p.flatten() for p in results["toroid"]])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat, group=GLOO)
    for r in range(size):
        close(gathered[r], flat, f"DDP parameters of rank {r}")


def obj(seed):
    """A picklable object of a size that depends on the seed (for the *_object collectives)."""
    g = random.Random(seed)
    return {"seed": seed, "values": [g.random() for _ in range(g.randrange(1, 200))],
            "name": "x" * g.randrange(0, 5000), "nested": (seed, [seed] * (seed % 7))}


def entry_points(rank, size):
    """torch.distributed functions that pick the group's backend by device, on toroid against
    gloo and against references computed here from every rank's seed."""
    pg = dist.distributed_c10d._get_default_group()
    assert torch.device("cpu") in pg._device_types
    assert isinstance(pg._get_backend(torch.device("cpu")), toroid.torch._CpuBackend)

    def ran(name, before):
        assert pg.stats[name] > before[name], f"{name} did not run on toroid: {dict(pg.stats)}"

    # all_gather_coalesced: several inputs of different shapes, per dtype.
    for dtype in [torch.float32, torch.int64]:
        shapes = [(5,), (3, 4), (1,), (257,)]

        def inputs(r):
            return [rand(sh, dtype, 500 + 10 * r + i) for i, sh in enumerate(shapes)]

        # outs[r][i] receives rank r's input i
        outs = {g: [[torch.empty(sh, dtype=dtype) for sh in shapes] for _ in range(size)] for g in ("toroid", "gloo")}
        before = pg.stats.copy()
        dist.all_gather_coalesced(outs["toroid"], inputs(rank))
        ran("allgather_coalesced", before)
        dist.all_gather_coalesced(outs["gloo"], inputs(rank), group=GLOO)
        close(outs["toroid"], outs["gloo"], f"all_gather_coalesced {dtype}")
        close(outs["toroid"], [inputs(r) for r in range(size)], f"all_gather_coalesced {dtype} reference")

    # all_reduce_coalesced: several tensors, SUM and MAX.
    for op, fold in ((dist.ReduceOp.SUM, torch.add), (dist.ReduceOp.MAX, torch.maximum)):
        shapes = [(7,), (2, 9), (1000,)]

        def inputs(r):
            return [rand(sh, torch.float64, 700 + 10 * r + i) for i, sh in enumerate(shapes)]

        a, b = inputs(rank), inputs(rank)
        before = pg.stats.copy()
        dist.all_reduce_coalesced(a, op=op)
        ran("allreduce_coalesced", before)
        dist.all_reduce_coalesced(b, op=op, group=GLOO)
        close(a, b, f"all_reduce_coalesced {op}", rtol=1e-12, atol=1e-12)
        want = inputs(0)
        for r in range(1, size):
            want = [fold(w, x) for w, x in zip(want, inputs(r))]
        close(a, want, f"all_reduce_coalesced {op} reference", rtol=1e-12, atol=1e-12)

    # batch_isend_irecv: every rank sends 8 MB to every other rank and receives as much, all
    # sends first (a cycle of sends: it deadlocks unless the backend orders the batch).
    def message(src, dst):
        return rand((1 << 21) + 7 * src + dst, torch.float32, 9000 + 100 * src + dst)

    peers = [p for p in range(size) if p != rank]
    got = {}
    for name, group in (("toroid", None), ("gloo", GLOO)):
        bufs = {p: torch.empty_like(message(p, rank)) for p in peers}
        ops = [dist.P2POp(dist.isend, message(rank, p), p, group=group) for p in peers]
        ops += [dist.P2POp(dist.irecv, bufs[p], p, group=group) for p in peers]
        before = pg.stats.copy()
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if name == "toroid":
            ran("coalesced", before)
        got[name] = bufs
    for p in peers:
        close(got["toroid"][p], got["gloo"][p], f"batch_isend_irecv from {p}")
        close(got["toroid"][p], message(p, rank), f"batch_isend_irecv from {p} reference")

    # monitored_barrier: the last rank comes 1 s late; nobody leaves before it arrives.
    for name, group in (("toroid", None), ("gloo", GLOO)):
        for wait_all in (False, True):
            if rank == size - 1:
                time.sleep(1.0)
            before = pg.stats.copy()
            t = time.monotonic()
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=60), wait_all_ranks=wait_all)
            dt = time.monotonic() - t
            if name == "toroid":
                ran("monitored_barrier", before)
            if rank != size - 1:
                assert dt >= 0.9, f"{name} monitored_barrier returned after {dt:.2f} s, before the last rank came"
            checks.append(f"monitored_barrier {name}")

    # The *_object collectives, every root.
    for root in range(size):
        lists = {}
        for name, group in (("toroid", None), ("gloo", GLOO)):
            items = [obj(100 * root + i) for i in range(3)] if rank == root else [None] * 3
            dist.broadcast_object_list(items, src=root, group=group)
            lists[name] = items
        assert lists["toroid"] == lists["gloo"] == [obj(100 * root + i) for i in range(3)], f"broadcast_object_list root {root}"
        checks.append(f"broadcast_object_list root {root}")

        for name, group in (("toroid", None), ("gloo", GLOO)):
            out = [None] * size if rank == root else None
            dist.gather_object(obj(1000 + rank), out, dst=root, group=group)
            lists[name] = out
        if rank == root:
            assert lists["toroid"] == lists["gloo"] == [obj(1000 + r) for r in range(size)], f"gather_object root {root}"
        else:
            assert lists["toroid"] is None
        checks.append(f"gather_object root {root}")

        for name, group in (("toroid", None), ("gloo", GLOO)):
            out = [None]
            dist.scatter_object_list(out, [obj(2000 + r) for r in range(size)] if rank == root else None, src=root, group=group)
            lists[name] = out
        assert lists["toroid"] == lists["gloo"] == [obj(2000 + rank)], f"scatter_object_list root {root}"
        checks.append(f"scatter_object_list root {root}")

    lists = {}
    for name, group in (("toroid", None), ("gloo", GLOO)):
        out = [None] * size
        dist.all_gather_object(out, obj(3000 + rank), group=group)
        lists[name] = out
    assert lists["toroid"] == lists["gloo"] == [obj(3000 + r) for r in range(size)], "all_gather_object"
    checks.append("all_gather_object")

    # new_group over subsets: even ranks and odd ranks (sizes 1 and 1, or 2 and 1).
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
    subs = {"toroid": [dist.new_group(evens), dist.new_group(odds)],
            "gloo": [dist.new_group(evens, backend="gloo"), dist.new_group(odds, backend="gloo")]}
    members = evens if rank % 2 == 0 else odds
    mine = {name: subs[name][rank % 2] for name in subs}
    assert dist.get_backend(mine["toroid"]) == "toroid"
    assert isinstance(mine["toroid"], toroid.torch.ProcessGroupToroid) and mine["toroid"].comm.size == len(members)
    assert isinstance(mine["toroid"]._get_backend(torch.device("cpu")), toroid.torch._CpuBackend)
    results = {}
    for name, g in mine.items():
        x = rand((333,), torch.float64, 4000 + rank)
        dist.all_reduce(x, group=g)
        outs = [[torch.empty(5, dtype=torch.int64), torch.empty(2, dtype=torch.int64)] for _ in members]
        dist.all_gather_coalesced(outs, [rand((5,), torch.int64, 5000 + rank), rand((2,), torch.int64, 5500 + rank)], group=g)
        items = [obj(6000 + members[-1])] if rank == members[-1] else [None]
        dist.broadcast_object_list(items, src=members[-1], group=g)
        results[name] = (x, outs, items)
    close(results["toroid"][0], results["gloo"][0], "subgroup all_reduce", rtol=1e-12, atol=1e-12)
    close(results["toroid"][0], sum(rand((333,), torch.float64, 4000 + r) for r in members), "subgroup all_reduce reference",
          rtol=1e-12, atol=1e-12)
    close(results["toroid"][1], results["gloo"][1], "subgroup all_gather_coalesced")
    close(results["toroid"][1], [[rand((5,), torch.int64, 5000 + r), rand((2,), torch.int64, 5500 + r)] for r in members],
          "subgroup all_gather_coalesced reference")
    assert results["toroid"][2] == results["gloo"][2] == [obj(6000 + members[-1])], "subgroup broadcast_object_list"
    checks.append("subgroup broadcast_object_list")


def wait_timeout(rank, size):
    """Work.wait(timeout) on an all-reduce that the last rank joins late: it raises "timed out"
    after about the timeout, like gloo's, and the operation still completes afterwards."""
    signal = dist.new_group(backend="gloo")  # tells the late rank to join
    late = size - 1
    want = sum(rand((1000,), torch.float64, 8000 + r) for r in range(size))
    for name, group in (("toroid", None), ("gloo", GLOO)):
        x = rand((1000,), torch.float64, 8000 + rank)
        if rank != late:
            w = dist.all_reduce(x, group=group, async_op=True)
            fut = w.get_future()
            t = time.monotonic()
            try:
                w.wait(timeout=datetime.timedelta(seconds=1))
                raise AssertionError(f"{name}: wait(1 s) returned though rank {late} had not joined")
            except RuntimeError as e:
                dt = time.monotonic() - t
                assert "timed out" in str(e).lower(), f"{name}: {e!r}"
                assert 0.95 <= dt <= 4.0, f"{name}: wait(1 s) raised after {dt:.2f} s"
            assert not w.is_completed() and (name == "gloo" or not fut.done()), name
            dist.barrier(group=signal)
            w.wait()
            assert w.is_completed(), name
            if name == "toroid":
                assert fut.done() and fut.wait()[0] is x
        else:
            dist.barrier(group=signal)
            dist.all_reduce(x, group=group)
        close(x, want, f"{name} all_reduce completed after a timed-out wait", rtol=1e-12, atol=1e-12)

    # A timeout that does not pass: wait returns.
    x = rand((1000,), torch.float64, 8000 + rank)
    w = dist.all_reduce(x, async_op=True)
    assert w.wait(timeout=datetime.timedelta(seconds=60))
    close(x, want, "all_reduce waited with a timeout", rtol=1e-12, atol=1e-12)

    # monitored_barrier that a rank never enters: the others fail in about its timeout (toroid
    # aborts that group; it is a group of its own here).
    sub = dist.new_group(backend="toroid")
    if rank != late:
        t = time.monotonic()
        try:
            dist.monitored_barrier(group=sub, timeout=datetime.timedelta(seconds=1))
            raise AssertionError(f"monitored_barrier passed though rank {late} never entered")
        except toroid.ToroidError as e:
            dt = time.monotonic() - t
            assert isinstance(e, (toroid.TimeoutError, toroid.AbortedError, toroid.RemoteError)), repr(e)
            assert dt <= 5.0, f"monitored_barrier(1 s) failed after {dt:.2f} s"
        checks.append("monitored_barrier timeout")
    dist.barrier(group=signal)


if __name__ == "__main__":
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("toroid", init_method="env://", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    assert isinstance(dist.distributed_c10d._get_default_group(), toroid.torch.ProcessGroupToroid)
    assert dist.get_backend() == "toroid"
    GLOO = dist.new_group(backend="gloo")
    {"compare": compare, "ddp": ddp, "entry_points": entry_points, "wait_timeout": wait_timeout}[SCENARIO](rank, size)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {SCENARIO} passed ({len(checks)} comparisons with gloo)")
