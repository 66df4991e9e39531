#!/usr/bin/env python3
"""The torch backend on CUDA tensors, on a machine with a GPU: 2 processes on GPU 0
(torch.multiprocessing), backend "toroid". Run by `scripts/gpu-check.sh --run DIR` after the
Rust and C checks, or by hand: `TOROID_LIBRARY=.../libtoroid.so python3 gpu_torch_check.py`.

(a) all_reduce (SUM, MAX, AVG) and broadcast (root 0 and 1) of random CUDA tensors of float32,
    float16, bfloat16, float64, int32 and int64, of 1, 4099 and 3,000,000 elements (the last
    is several 4 MiB staging chunks), on the stream path (checked through the group's counters),
    against a reference computed here on the CPU from every rank's inputs (each rank makes
    every rank's inputs from the same seeds), every element. Exact for integers, for MAX and for
    broadcast. Floats (SUM, AVG): |result - reference| <= 2 eps(dtype) * sum_r |x_r| (/ size for
    AVG) per element, the reference in float64: a 2-rank result is the sum rounded once to its
    type (AVG: and scaled by 1/2), and the bound leaves a factor 2 for the reference's own
    rounding in float64. Also: a tensor written on a side stream behind a long kernel is
    reduced after that write (the call is ordered on torch's current stream); async_op works
    (wait, is_completed, the future's value); a non-contiguous tensor takes the staged path
    and leaves the elements between its own untouched; a call mixing CPU and CUDA tensors
    raises ValueError.
(b) all_gather_into_tensor (stream path) of float32, bfloat16 and int64, exact, out of place
    and in place (FSDP's form), also with its input written on a side stream and with
    async_op; reduce_scatter_tensor (stream path) SUM, MAX, AVG of float32, bfloat16, float64
    and int32, exact for MAX and integers, floats within the bound of (a).
(c) reduce (stream path) SUM and MAX to either root of float32, bfloat16 and int64, of 1, 4099
    and 3,000,000 elements, floats within the bound of (a), a non-root's tensor untouched;
    all_to_all_single with equal splits (stream path), out of place and in place, exact; and
    the collectives staged through host memory, exact: all_to_all_single with uneven splits,
    all_gather into a list, all_to_all of lists, gather and scatter from either root, send
    and recv each way, isend/irecv both ways at once (4099 elements), batch_isend_irecv
    (1,000,000), barrier.
(d) DDP(device_ids=[0]) over "toroid": a small MLP trained 5 steps on each rank's own batches
    ends with bit-identical parameters on both ranks, within 1e-5 (max |difference| per
    parameter tensor over its max |value|) of a reference trained here without DDP on the
    gradients of both ranks' batches averaged by hand, and its gradient all-reduces took the
    stream path.

Prints one PASS or FAIL line per check and rank, then a summary line; exits 1 on any failure,
0 with "SKIPPED: ..." when torch or a CUDA device is missing.

`--cpu-dry-run` runs the same checks on CPU tensors, without the ones that need a GPU (side
streams, the path taken, the mixed call): it checks this script (inputs, references, bounds,
the DDP reference) on a machine without a GPU, and nothing of the CUDA path.
"""

from __future__ import annotations

import copy
import datetime
import os
import pathlib
import socket
import sys
import time
import traceback

# Run from a checkout (python/tests/) or from a gpu-check bundle (DIR/python/tests/): the
# toroid package is two levels up (unless the tests run against the installed package).
if os.environ.get("TOROID_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

SIZE = 2
DRY = "--cpu-dry-run" in sys.argv
DEVICE = "cpu" if DRY else "cuda:0"
TIMEOUT_S = 240  # the whole check; each collective is bounded by the group's 60 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Checks:
    def __init__(self, rank: int):
        self.rank = rank
        self.passed = 0
        self.failed: list[str] = []

    def run(self, name: str, fn) -> None:
        try:
            detail = fn()
            self.passed += 1
            print(f"[rank {self.rank}] PASS {name}{': ' + detail if detail else ''}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported, counted, the next check runs
            self.failed.append(name)
            print(f"[rank {self.rank}] FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()


def rank_inputs(torch, r: int, dtype, n: int, seed: int):
    """Rank r's input (on the CPU), the same on every rank that asks."""
    g = torch.Generator().manual_seed(seed * 1000 + r)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-(2 ** 30), 2 ** 30, (n,), generator=g, dtype=torch.int64).to(dtype)


def assert_close_to(torch, got, ref64, scale64, dtype, what: str, factor: float) -> str:
    """got (CPU, dtype) against the float64 reference: |got - ref| <= factor eps scale."""
    bound = 2 * torch.finfo(dtype).eps * scale64 * factor + torch.finfo(dtype).tiny
    err = (got.to(torch.float64) - ref64).abs()
    bad = (err > bound).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} elements off, first [{i}]: {got[i].item()} vs reference "
                             f"{ref64[i].item()} (bound {bound[i].item():.3g})")
    return f"max error {float(err.max()) if err.numel() else 0:.3g}"


def assert_equal(torch, got, ref, what: str) -> None:
    if got.dtype != ref.dtype or got.shape != ref.shape:
        raise AssertionError(f"{what}: {got.dtype}{tuple(got.shape)} vs {ref.dtype}{tuple(ref.shape)}")
    if not torch.equal(got, ref):
        bad = (got != ref).nonzero()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} elements differ, first [{i}]: {got[i].item()} vs {ref[i].item()}")


def assert_reduced(torch, got, xs, name: str, dtype, what: str) -> str:
    """got (CPU, dtype) against the reduction `name` ("sum", "max" or "avg") of every rank's
    input xs: exact for MAX and for integers; floats within the bound of (a)."""
    if name == "max":
        ref = xs[0]
        for x in xs[1:]:
            ref = torch.maximum(ref, x)
        assert_equal(torch, got, ref, what)
        return "exact"
    ref64 = sum(x.to(torch.float64) for x in xs)
    if not dtype.is_floating_point:
        assert_equal(torch, got, ref64.to(dtype), what)
        return "exact"
    scale = sum(x.to(torch.float64).abs() for x in xs)
    if name == "avg":
        return assert_close_to(torch, got, ref64 / SIZE, scale, dtype, what, 1 / SIZE)
    return assert_close_to(torch, got, ref64, scale, dtype, what, 1)


def expect_path(pg, key: str, before: int) -> None:
    """The call took the path `key` counts (the group's counters); not checked in a dry run."""
    if not DRY and pg.stats[key] != before + 1:
        raise AssertionError(f"did not take the path {key}: {dict(pg.stats)}")


def check_all_reduce_and_broadcast(torch, dist, pg, rank: int, c: Checks) -> None:
    dev = torch.device(DEVICE)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64]
    seed = 0
    for dtype in dtypes:
        for n in [1, 4099, 3_000_000]:
            for name, op in ops.items():
                if name == "avg" and not dtype.is_floating_point:
                    continue  # toroid has AVG on floats only (checked to raise below)
                seed += 1

                def one(dtype=dtype, n=n, name=name, op=op, seed=seed):
                    xs = [rank_inputs(torch, r, dtype, n, seed) for r in range(SIZE)]
                    t = xs[rank].to(dev, copy=True)
                    before = pg.stats["allreduce:stream"]
                    dist.all_reduce(t, op=op)
                    expect_path(pg, "allreduce:stream", before)
                    return assert_reduced(torch, t.cpu(), xs, name, dtype, f"all_reduce {name}")

                c.run(f"all_reduce {name} {str(dtype)[6:]} n={n}", one)
            for root in range(SIZE):
                seed += 1

                def bcast(dtype=dtype, n=n, root=root, seed=seed):
                    xs = [rank_inputs(torch, r, dtype, n, seed) for r in range(SIZE)]
                    t = xs[rank].to(dev, copy=True)
                    before = pg.stats["broadcast:stream"]
                    dist.broadcast(t, src=root)
                    expect_path(pg, "broadcast:stream", before)
                    assert_equal(torch, t.cpu(), xs[root], "broadcast")
                    return "exact"

                c.run(f"broadcast root={root} {str(dtype)[6:]} n={n}", bcast)

    def side_stream():
        # The input is written on a side stream behind a ~0.1 s kernel; the all-reduce issued on
        # that stream must read it after the write (a call that ignored the stream would read
        # the zeros first).
        n = 1 << 20
        xs = [rank_inputs(torch, r, torch.float32, n, 9001) for r in range(SIZE)]
        src = xs[rank].to(dev, copy=True)
        t = torch.zeros(n, device=dev)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)
            t.copy_(src)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        s.synchronize()
        ref = torch.maximum(xs[0], xs[1])
        assert_equal(torch, t.cpu(), ref, "all_reduce on a side stream")
        return "exact"

    if not DRY:
        c.run("all_reduce ordered on the current (side) stream", side_stream)

    def async_op():
        xs = [rank_inputs(torch, r, torch.int64, 4099, 9002) for r in range(SIZE)]
        t = xs[rank].to(dev, copy=True)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        if not w.is_completed():
            raise AssertionError("is_completed() is False after wait()")
        value = w.get_future().wait()[0]
        if value.device != dev:
            raise AssertionError(f"the future holds a tensor on {value.device}")
        ref = xs[0] + xs[1]
        assert_equal(torch, value.cpu(), ref, "future's value")
        assert_equal(torch, t.cpu(), ref, "async all_reduce")
        return "exact"

    c.run("all_reduce async_op (wait, is_completed, future)", async_op)

    def non_contiguous():
        xs = [rank_inputs(torch, r, torch.int64, 2 * 3001, 9003).view(3001, 2) for r in range(SIZE)]
        base = xs[rank].to(dev, copy=True)
        before = pg.stats["allreduce:staged"]
        dist.all_reduce(base[:, 0])
        expect_path(pg, "allreduce:staged", before)
        got = base.cpu()
        assert_equal(torch, got[:, 0].contiguous(), (xs[0][:, 0] + xs[1][:, 0]).contiguous(), "reduced column")
        assert_equal(torch, got[:, 1].contiguous(), xs[rank][:, 1].contiguous(), "untouched column")
        return "exact"

    c.run("all_reduce of a non-contiguous tensor (staged)", non_contiguous)

    def avg_int_refused():
        t = torch.ones(8, dtype=torch.int64, device=dev)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
        except Exception as e:  # noqa: BLE001 - the CPU path's refusal, whatever its type
            if "avg" not in str(e).lower():
                raise AssertionError(f"refused, but not for AVG: {e}") from e
            return f"{type(e).__name__}"
        raise AssertionError("AVG on int64 was accepted")

    c.run("all_reduce AVG on int64 refused", avg_int_refused)

    def mixed():
        try:
            pg.allreduce([torch.ones(4), torch.ones(4, device=dev)])
        except ValueError as e:
            return str(e)
        raise AssertionError("a call mixing CPU and CUDA tensors was accepted")

    if not DRY:
        c.run("mixed CPU/CUDA call refused", mixed)


def check_all_gather(torch, dist, pg, rank: int, c: Checks) -> None:
    dev = torch.device(DEVICE)
    seed = 5000
    for dtype in [torch.float32, torch.bfloat16, torch.int64]:
        for n in [1, 4099, 1_000_000]:
            seed += 1

            def one(dtype=dtype, n=n, seed=seed):
                xs = [rank_inputs(torch, r, dtype, n, seed) for r in range(SIZE)]
                out = torch.full((SIZE * n,), 7, dtype=dtype, device=dev)
                before = pg.stats["all_gather_single:stream"]  # (_allgather_base is all_gather_single)
                dist.all_gather_into_tensor(out, xs[rank].to(dev, copy=True))
                expect_path(pg, "all_gather_single:stream", before)
                assert_equal(torch, out.cpu(), torch.cat(xs), "all_gather_into_tensor")
                # In place, as FSDP calls it: the input is this rank's piece of the output.
                out = torch.full((SIZE * n,), 7, dtype=dtype, device=dev)
                piece = out.narrow(0, rank * n, n)
                piece.copy_(xs[rank].to(dev))
                dist.all_gather_into_tensor(out, piece)
                assert_equal(torch, out.cpu(), torch.cat(xs), "all_gather_into_tensor in place")
                return "exact, out of place and in place"

            c.run(f"all_gather_into_tensor {str(dtype)[6:]} n={n}", one)

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
    for dtype in [torch.float32, torch.bfloat16, torch.float64, torch.int32]:
        for n in [1, 4099, 1_000_000]:
            for name, op in ops.items():
                if name == "avg" and not dtype.is_floating_point:
                    continue
                seed += 1

                def rs(dtype=dtype, n=n, name=name, op=op, seed=seed):
                    xs = [rank_inputs(torch, r, dtype, SIZE * n, seed) for r in range(SIZE)]
                    out = torch.full((n,), 7, dtype=dtype, device=dev)
                    before = pg.stats["reduce_scatter_single:stream"]
                    dist.reduce_scatter_tensor(out, xs[rank].to(dev, copy=True), op=op)
                    expect_path(pg, "reduce_scatter_single:stream", before)
                    got = out.cpu()
                    mine = [x[rank * n:(rank + 1) * n] for x in xs]
                    if name == "max":
                        ref = mine[0]
                        for x in mine[1:]:
                            ref = torch.maximum(ref, x)
                        assert_equal(torch, got, ref, "reduce_scatter_tensor max")
                        return "exact"
                    if not dtype.is_floating_point:
                        ref = mine[0].to(torch.int64)
                        for x in mine[1:]:
                            ref = ref + x.to(torch.int64)
                        assert_equal(torch, got, ref.to(dtype), "reduce_scatter_tensor sum")  # (wraps alike)
                        return "exact"
                    ref64 = sum(x.to(torch.float64) for x in mine)
                    scale = sum(x.to(torch.float64).abs() for x in mine)
                    if name == "avg":
                        ref64, scale = ref64 / SIZE, scale / SIZE
                    return assert_close_to(torch, got, ref64, scale, dtype, f"reduce_scatter_tensor {name}", 2.0)

                c.run(f"reduce_scatter_tensor {name} {str(dtype)[6:]} n={n}", rs)

    def side_stream_async():
        n = 1 << 20
        xs = [rank_inputs(torch, r, torch.float32, n, 9100) for r in range(SIZE)]
        src = xs[rank].to(dev, copy=True)
        inp = torch.zeros(n, device=dev)
        out = torch.zeros(SIZE * n, device=dev)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)
            inp.copy_(src)
            w = dist.all_gather_into_tensor(out, inp, async_op=True)
        w.wait()
        if not w.is_completed():
            raise AssertionError("is_completed() is False after wait()")
        s.synchronize()
        assert_equal(torch, out.cpu(), torch.cat(xs), "all_gather_into_tensor on a side stream, async")
        return "exact"

    if not DRY:
        c.run("all_gather_into_tensor on a side stream, async_op", side_stream_async)


def check_others(torch, dist, pg, rank: int, c: Checks) -> None:
    dev = torch.device(DEVICE)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    seed = 8000
    for dtype in [torch.float32, torch.bfloat16, torch.int64]:
        for n in [1, 4099, 3_000_000]:
            for name, op in ops.items():
                for root in range(SIZE):
                    seed += 1

                    def red(dtype=dtype, n=n, name=name, op=op, root=root, seed=seed):
                        xs = [rank_inputs(torch, r, dtype, n, seed) for r in range(SIZE)]
                        t = xs[rank].to(dev, copy=True)
                        before = pg.stats["reduce:stream"]
                        dist.reduce(t, dst=root, op=op)
                        expect_path(pg, "reduce:stream", before)
                        got = t.cpu()
                        if rank != root:
                            assert_equal(torch, got, xs[rank], "reduce: a non-root's tensor")
                            return "not the root: its tensor untouched"
                        return assert_reduced(torch, got, xs, name, dtype, f"reduce {name}")

                    c.run(f"reduce {name} dst={root} {str(dtype)[6:]} n={n}", red)
        for n in [1, 4099, 1_000_000]:
            seed += 1

            def a2a(dtype=dtype, n=n, seed=seed):
                xs = [rank_inputs(torch, r, dtype, SIZE * n, seed) for r in range(SIZE)]
                ref = torch.cat([xs[j][rank * n:(rank + 1) * n] for j in range(SIZE)])
                out = torch.full((SIZE * n,), 7, dtype=dtype, device=dev)
                before = pg.stats["all_to_all_single:stream"]
                dist.all_to_all_single(out, xs[rank].to(dev, copy=True))
                expect_path(pg, "all_to_all_single:stream", before)
                assert_equal(torch, out.cpu(), ref, "all_to_all_single")
                t = xs[rank].to(dev, copy=True)
                before = pg.stats["all_to_all_single:stream"]
                dist.all_to_all_single(t, t)
                expect_path(pg, "all_to_all_single:stream", before)
                assert_equal(torch, t.cpu(), ref, "all_to_all_single in place")
                return "exact, out of place and in place"

            c.run(f"all_to_all_single {str(dtype)[6:]} {n} per rank", a2a)

    # The collectives the backend stages through host memory on CUDA tensors (.cpu(), the CPU
    # path, .copy_() back on the caller's stream), each checked against its reference.
    n = 4099

    def xs_for(seed, numel=n):
        return [rank_inputs(torch, r, torch.float32, numel, seed) for r in range(SIZE)]

    def staged(key: str, before: int):
        if not DRY and pg.stats[key] <= before:
            raise AssertionError(f"did not take the path {key}: {dict(pg.stats)}")

    def uneven():
        # Rank r sends rows(r, j) rows of 3 elements to rank j.
        rows = lambda r, j: 1 + r + 2 * j  # noqa: E731
        xs = [rank_inputs(torch, r, torch.float32, 3 * sum(rows(r, j) for j in range(SIZE)), 9300).reshape(-1, 3)
              for r in range(SIZE)]
        def block(r, j):
            at = sum(rows(r, k) for k in range(j))
            return xs[r][at:at + rows(r, j)]
        ref = torch.cat([block(j, rank) for j in range(SIZE)])
        out = torch.full_like(ref, 7, device=dev)
        before = pg.stats["all_to_all_single:staged"]
        dist.all_to_all_single(out, xs[rank].to(dev, copy=True),
                               output_split_sizes=[rows(j, rank) for j in range(SIZE)],
                               input_split_sizes=[rows(rank, j) for j in range(SIZE)])
        staged("all_to_all_single:staged", before)
        assert_equal(torch, out.cpu().reshape(-1), ref.reshape(-1), "all_to_all_single, uneven splits")
        return "exact"

    def all_gather_list():
        xs = xs_for(9301)
        outs = [torch.full((n,), 7.0, device=dev) for _ in range(SIZE)]
        before = pg.stats["allgather:staged"]
        dist.all_gather(outs, xs[rank].to(dev, copy=True))
        staged("allgather:staged", before)
        for r in range(SIZE):
            assert_equal(torch, outs[r].cpu(), xs[r], f"all_gather piece {r}")
        return "exact"

    def all_to_all_list():
        xs = [xs_for(9310 + j) for j in range(SIZE)]  # xs[j][r]: what rank r sends to rank j
        outs = [torch.full((n,), 7.0, device=dev) for _ in range(SIZE)]
        before = pg.stats["alltoall:staged"]
        dist.all_to_all(outs, [xs[j][rank].to(dev, copy=True) for j in range(SIZE)])
        staged("alltoall:staged", before)
        for r in range(SIZE):
            assert_equal(torch, outs[r].cpu(), xs[rank][r], f"all_to_all from rank {r}")
        return "exact"

    def gather_scatter():
        before = (pg.stats["gather:staged"], pg.stats["scatter:staged"])
        for root in range(SIZE):
            xs = xs_for(9320 + root)
            outs = [torch.full((n,), 7.0, device=dev) for _ in range(SIZE)] if rank == root else None
            dist.gather(xs[rank].to(dev, copy=True), gather_list=outs, dst=root)
            if rank == root:
                for r in range(SIZE):
                    assert_equal(torch, outs[r].cpu(), xs[r], f"gather to {root}, piece {r}")
            pieces = xs_for(9330 + root)
            out = torch.full((n,), 7.0, device=dev)
            dist.scatter(out, [p.to(dev, copy=True) for p in pieces] if rank == root else None, src=root)
            assert_equal(torch, out.cpu(), pieces[rank], f"scatter from {root}")
        staged("gather:staged", before[0])
        staged("scatter:staged", before[1])
        return "exact, both roots"

    def send_recv():
        before = pg.stats["send:staged"]
        peer = 1 - rank
        xs = xs_for(9340, 1_000_000)
        # Blocking, one way then the other.
        for sender in range(SIZE):
            if rank == sender:
                dist.send(xs[rank].to(dev, copy=True), dst=peer)
            else:
                got = torch.full((1_000_000,), 7.0, device=dev)
                dist.recv(got, src=peer)
                assert_equal(torch, got.cpu(), xs[peer], f"recv from {peer}")
        # Both ways at once: isend before irecv on both ranks (a small message: one group's
        # operations run in issue order, so two large sends to each other would both block;
        # docs/C_AND_PYTHON.md), and a large one as one batch, which orders them.
        small = xs_for(9341)
        got = torch.full((n,), 7.0, device=dev)
        s = dist.isend(small[rank].to(dev, copy=True), dst=peer)
        r = dist.irecv(got, src=peer)
        s.wait()
        r.wait()
        assert_equal(torch, got.cpu(), small[peer], "irecv while isend")
        got = torch.full((1_000_000,), 7.0, device=dev)
        ops = [dist.P2POp(dist.isend, xs[rank].to(dev, copy=True), peer), dist.P2POp(dist.irecv, got, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert_equal(torch, got.cpu(), xs[peer], "batch_isend_irecv")
        staged("send:staged", before)
        return "exact: send/recv each way, isend/irecv both ways at once, batch_isend_irecv"

    def barrier():
        dist.barrier()
        return None

    for name, fn in [("all_to_all_single, uneven splits (staged)", uneven),
                     ("all_gather into a list (staged)", all_gather_list),
                     ("all_to_all of lists (staged)", all_to_all_list),
                     ("gather and scatter (staged)", gather_scatter),
                     ("send, recv, isend/irecv, batch_isend_irecv (staged)", send_recv),
                     ("barrier", barrier)]:
        c.run(name, fn)


def check_ddp(torch, dist, pg, rank: int, c: Checks) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device(DEVICE)

    def ddp():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(dev)
        ref = copy.deepcopy(model)
        before = pg.stats["allreduce:stream"]
        net = DDP(model) if DRY else DDP(model, device_ids=[0])
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        loss_fn = torch.nn.functional.mse_loss
        for step in range(5):
            batches = []
            for r in range(SIZE):
                g = torch.Generator().manual_seed(100 * step + r)
                batches.append((torch.randn(32, 16, generator=g).to(dev, copy=True), torch.randn(32, 4, generator=g).to(dev, copy=True)))
            x, y = batches[rank]
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
            # The reference: each rank's gradient computed here, averaged by hand.
            grads = []
            for xr, yr in batches:
                ref.zero_grad()
                loss_fn(ref(xr), yr).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            for i, p in enumerate(ref.parameters()):
                p.grad = sum(gr[i] for gr in grads) / SIZE
            ref_opt.step()
        ran = pg.stats["allreduce:stream"] - before
        if ran < 5 and not DRY:
            raise AssertionError(f"DDP's gradient all-reduces did not take the stream path ({ran}): {dict(pg.stats)}")
        worst = 0.0
        for (name, p), q in zip(net.module.named_parameters(), ref.parameters()):
            a, b = p.detach().cpu(), q.detach().cpu()
            rel = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            worst = max(worst, rel)
            if rel > 1e-5:
                raise AssertionError(f"{name}: {rel:.3g} relative from the hand-averaged reference")
        # Bit-identical on both ranks: gathered on the CPU (the backend's tested CPU path).
        flat = torch.cat([p.detach().cpu().flatten() for p in net.module.parameters()])
        every = [torch.empty_like(flat) for _ in range(SIZE)]
        dist.all_gather(every, flat)
        if not all(torch.equal(e, every[0]) for e in every):
            raise AssertionError("parameters differ between the ranks")
        return f"{ran} stream all-reduces, max relative difference from the reference {worst:.3g}"

    c.run("DDP(device_ids=[0]) 5 steps: identical on both ranks, equal to the hand-averaged reference", ddp)


def rank_main(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    import toroid
    import toroid.torch  # noqa: F401 - registers the backend

    if not DRY:
        torch.cuda.set_device(0)
    if rank == 0:
        where = "CPU dry run" if DRY else torch.cuda.get_device_name(0)
        print(f"toroid {toroid.version()} ({pathlib.Path(toroid.__file__).parent}, {toroid.library_path()}); "
              f"torch {torch.__version__}; {where}", flush=True)
    dist.init_process_group("toroid", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    c = Checks(rank)
    check_all_reduce_and_broadcast(torch, dist, pg, rank, c)
    check_all_gather(torch, dist, pg, rank, c)
    check_others(torch, dist, pg, rank, c)
    check_ddp(torch, dist, pg, rank, c)
    dist.destroy_process_group()
    print(f"[rank {rank}] {c.passed} passed, {len(c.failed)} failed", flush=True)
    if c.failed:
        raise SystemExit(1)


def main() -> int:
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        print(f"SKIPPED: torch is not importable ({e})")
        return 0
    if not torch.cuda.is_available() and not DRY:
        print("SKIPPED: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.spawn(rank_main, args=(free_port(),), nprocs=SIZE, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                print(f"FAIL: gpu_torch_check did not finish within {TIMEOUT_S} s")
                return 1
    except Exception as e:  # noqa: BLE001 - a rank failed (its FAIL lines are above)
        print(f"FAIL: gpu_torch_check: {type(e).__name__}: {e}")
        return 1
    print(f"PASS: gpu_torch_check ({SIZE} processes {'on the CPU, dry run' if DRY else 'on one GPU'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
