"""One rank of the numpy tests (started by test_numpy.py through launch.py).

Every rank generates every rank's input from a seed, so it computes the expected result itself."""

import collections
import os
import pathlib
import sys
import time

import numpy as np

import toroid

SCENARIO = sys.argv[1]
RANK = int(os.environ["TOROID_RANK"])
SIZE = int(os.environ["TOROID_WORLD_SIZE"])
checks = 0


def data(test: int, rank: int, n: int, dtype, op="sum"):
    rng = np.random.default_rng(1000 * test + rank)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        if op == "prod":
            return rng.uniform(0.5, 1.5, n).astype(dt)
        if dt == np.float16:
            return rng.integers(-8, 9, n).astype(dt)  # exact sums
        return rng.uniform(-1, 1, n).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)


def reference(inputs, op):
    with np.errstate(over="ignore"):
        acc = inputs[0].copy()
        for x in inputs[1:]:
            if op in ("sum", "avg"):
                acc = acc + x
            elif op == "prod":
                acc = acc * x
            elif op == "min":
                acc = np.minimum(acc, x)
            else:
                acc = np.maximum(acc, x)
        if op == "avg":
            acc = acc / len(inputs)
        return acc.astype(inputs[0].dtype)


def same(got, want, what):
    global checks
    checks += got.size
    if got.dtype.kind == "f":
        tol = {np.float16: 0.07, np.float32: 1e-5 * SIZE, np.float64: 1e-12 * SIZE}[got.dtype.type]
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    else:
        ok = np.array_equal(got, want)
    if not ok:
        bad = np.flatnonzero(got != want)[:5]
        raise AssertionError(f"{what}: elements {bad} are {got.flat[bad]}, expected {want.flat[bad]}")


def collectives(comm: toroid.Comm):
    t = 0
    for dtype in ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"]:
        for op in ["sum", "prod", "min", "max", "avg"]:
            if op == "avg" and np.dtype(dtype).kind != "f":
                continue
            for n in [0, 1, 7, 4099]:
                t += 1
                xs = [data(t, r, n, dtype, op) for r in range(SIZE)]
                mine = xs[RANK].copy()
                if t % 2:
                    out = comm.all_reduce(mine, np.empty_like(mine), op=op)
                    same(mine, xs[RANK], "all_reduce input untouched")
                else:
                    out = comm.all_reduce(mine, op=op)
                    assert out is mine
                same(out, reference(xs, op), f"all_reduce {dtype} {op} n={n}")
    # reduce_scatter / all_gather / all_to_all / broadcast / reduce
    for dtype in ["int32", "float64"]:
        for n in [0, 5, 4099]:
            t += 1
            xs = [data(t, r, n * SIZE, dtype) for r in range(SIZE)]
            want = reference(xs, "sum")[RANK * n:(RANK + 1) * n]
            same(comm.reduce_scatter(xs[RANK].copy()), want, "reduce_scatter")
            xs = [data(t, r, n, dtype) for r in range(SIZE)]
            same(comm.all_gather(xs[RANK]), np.stack(xs), "all_gather")
            xs = [data(t, r, n * SIZE, dtype) for r in range(SIZE)]
            want = np.concatenate([xs[j][RANK * n:(RANK + 1) * n] for j in range(SIZE)])
            same(comm.all_to_all(xs[RANK]), want, "all_to_all")
            # all_to_all_v: rank i sends rank j counts(i, j) elements (0 to n), async every
            # other time; every block checked against the sender's data.
            def counts(i, j, t=t, n=n):
                return (i * 5 + j * 3 + t + i * j) % (n + 1)

            xs = [data(t, r, sum(counts(r, j) for j in range(SIZE)), dtype) for r in range(SIZE)]
            want = np.concatenate([xs[j][sum(counts(j, k) for k in range(RANK)):][:counts(j, RANK)] for j in range(SIZE)])
            got = np.full(len(want), 7, dtype=dtype)
            w = comm.all_to_all_v(xs[RANK], [counts(RANK, j) for j in range(SIZE)], got,
                                  [counts(j, RANK) for j in range(SIZE)], async_op=bool(t % 2))
            same(w.wait() if t % 2 else w, want, f"all_to_all_v {dtype} up to {n}")
            for root in range(SIZE):
                buf = data(t, RANK, n, dtype)
                same(comm.broadcast(buf, root), data(t, root, n, dtype), f"broadcast root {root}")
                xs = [data(t + 1, r, n, dtype) for r in range(SIZE)]
                got = comm.reduce(xs[RANK].copy(), op="max", root=root)
                if RANK == root:
                    same(got, reference(xs, "max"), "reduce")
                else:
                    assert got is None
    # send/recv around a ring
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    mine, got = data(99, RANK, 100_003, "float32"), np.empty(100_003, np.float32)
    if RANK % 2 == 0:
        comm.send(mine, nxt)
        comm.recv(got, prv)
    else:
        comm.recv(got, prv)
        comm.send(mine, nxt)
    same(got, data(99, prv, 100_003, "float32"), "send/recv")
    comm.barrier()
    # receive from any source: the last rank collects everyone's message, blocking then async
    if SIZE > 1:
        last = SIZE - 1
        for round_ in range(2):
            if RANK == last:
                senders = []
                for _ in range(SIZE - 1):
                    got = np.empty(5_003, np.int64)
                    src = comm.recv_any(got) if round_ == 0 else comm.recv_any(got, async_op=True).wait()
                    same(got, data(98 + round_, src, 5_003, "int64"), f"recv_any from {src}")
                    senders.append(src)
                assert sorted(senders) == list(range(SIZE - 1)), senders
            else:
                comm.send(data(98 + round_, RANK, 5_003, "int64"), last)
            comm.barrier()  # (a sender's next round must not overtake this one)


def async_and_pointers(comm: toroid.Comm):
    n = 10_001
    xs = [data(500, r, n, "float32") for r in range(SIZE)]
    a = xs[RANK].copy()
    works = [
        comm.all_reduce(a, op="sum", async_op=True),
        comm.all_gather(xs[RANK], async_op=True),
        comm.barrier(async_op=True),
    ]
    # The async work owns references: dropping our names does not free the arrays early.
    results = [w.wait() for w in works]
    same(results[0], reference(xs, "sum"), "async all_reduce")
    same(results[1], np.stack(xs), "async all_gather")
    assert results[2] is None
    w = comm.all_reduce(np.full(3, RANK, np.int64), op="max", async_op=True)
    deadline = time.time() + 60
    while not w.test():
        assert time.time() < deadline
        time.sleep(0.001)
    same(w.wait(), np.full(3, SIZE - 1, np.int64), "async test/wait")
    # bfloat16 through the pointer API: the upper halves of float32 values (small integers:
    # exact sums).
    vals = [np.arange(64, dtype=np.float32) % 7 + r for r in range(SIZE)]
    bf = (vals[RANK].view(np.uint32) >> 16).astype(np.uint16)
    comm.all_reduce_ptr(bf.ctypes.data, bf.ctypes.data, bf.size, "bfloat16", "sum")
    got = (bf.astype(np.uint32) << 16).view(np.float32)
    same(got, reference(vals, "sum"), "bfloat16 all_reduce_ptr")
    # split: even and odd ranks
    sub = comm.split(RANK % 2, key=RANK)
    members = [r for r in range(SIZE) if r % 2 == RANK % 2]
    assert sub.size == len(members) and sub.rank == members.index(RANK)
    same(sub.all_reduce(np.array([RANK], np.int32)), np.array([sum(members)], np.int32), "split")
    sub.destroy()
    none = comm.split(toroid.SPLIT_NOCOLOR if RANK == 0 else 1)
    assert (none is None) == (RANK == 0)
    if none is not None:
        none.destroy()


def dump(comm: toroid.Comm):
    """The stall report of a healthy job: nobody blamed, a row per rank."""
    comm.all_reduce(np.ones(4, np.float32))
    d = comm.dump()
    # Idle everywhere, or (a rank that finished its own dump may already be in the barrier that
    # follows) "no rank is missing": either way nobody is blamed.
    line = d.splitlines()[0]
    assert line.startswith("stall report: no "), d
    assert not any(w in line for w in ("never entered", "died", "not answering", "disagree")), d
    for r in range(SIZE):
        assert f"\n{r} " in d, d


def errors(comm: toroid.Comm):
    try:
        comm.all_reduce(np.zeros(4, np.int32), op="avg")
        raise AssertionError("avg on int32 succeeded")
    except toroid.UnsupportedError as e:
        assert e.code == toroid.Result.UNSUPPORTED and "avg" in e.detail and "TOROID_DEBUG" in str(e)
    try:
        comm.broadcast(np.zeros(4, np.float32), root=SIZE + 3)
        raise AssertionError("bad root accepted")
    except toroid.InvalidArgumentError as e:
        assert f"root {SIZE + 3}" in e.detail, e.detail
        assert isinstance(e, ValueError)
    try:
        comm.all_reduce_ptr(0, 0, 10, "float32")
        raise AssertionError("NULL buffers accepted")
    except toroid.InvalidArgumentError as e:
        assert "NULL" in str(e)
    assert "NULL" in comm.last_error
    # Still usable after argument errors.
    same(comm.all_reduce(np.ones(2, np.float64)), np.full(2, float(SIZE)), "usable after errors")
    # A forked child (a DataLoader or multiprocessing worker) cannot use the communicator: its
    # calls fail with InvalidUsageError naming fork, and dropping it there must not disturb the
    # parent's links (the parent's next collective below still runs).
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            comm.barrier()
        except toroid.InvalidUsageError as e:
            code = 0 if "fork" in e.detail else 4
        except BaseException:
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"forked child exited with {status:#x}"
    same(comm.all_reduce(np.ones(3, np.int32)), np.full(3, SIZE, np.int32), "usable after a fork")
    sub = comm.split(0, RANK)
    sub.destroy()
    try:
        sub.barrier()
        raise AssertionError("destroyed communicator used")
    except toroid.InvalidUsageError:
        pass


def fastcall(comm: toroid.Comm):
    """toroid._fastcall, the C extension the blocking all_reduce and broadcast take where it is
    built (toroid._lib.FAST): the same results and the same errors as the ctypes path, and what
    it cannot take left to that path. Prints whether it is bound (test_numpy.py reads that)."""
    from toroid import _lib

    fast = _lib.FAST
    print(f"rank {RANK}: fastcall {'bound' if fast is not None else 'not built'}", flush=True)
    if fast is None:
        return
    t = 500
    for dtype in ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"]:
        for op in ["sum", "prod", "min", "max", "avg", toroid.ReduceOp.MAX]:
            if op == "avg" and np.dtype(dtype).kind != "f":
                continue
            for n in [0, 1, 7, 1024, 100_003]:
                t += 1
                name = op.name.lower() if isinstance(op, toroid.ReduceOp) else op
                xs = [data(t, r, n, dtype, name) for r in range(SIZE)]
                want = reference(xs, name)
                got = {}
                for path in ("fast", "ctypes"):
                    _lib.FAST = fast if path == "fast" else None
                    try:
                        mine = xs[RANK].copy()
                        if t % 2:
                            got[path] = comm.all_reduce(mine, np.empty_like(mine), op=op)
                            same(mine, xs[RANK], f"{path} all_reduce input untouched")
                        else:
                            got[path] = comm.all_reduce(mine, op=op)
                            assert got[path] is mine
                    finally:
                        _lib.FAST = fast
                    same(got[path], want, f"{path} all_reduce {dtype} {name} n={n}")
                assert got["fast"].tobytes() == got["ctypes"].tobytes(), f"fast and ctypes differ: {dtype} {name} n={n}"
                if n and name == "sum":
                    for root in range(SIZE):
                        buf = data(t, RANK, n, dtype)
                        same(comm.broadcast(buf, root), data(t, root, n, dtype), f"fast broadcast root {root}")
    # The pointer-level calls (the torch backend's blocking all-reduce and broadcast), both paths.
    for path in ("fast", "ctypes"):
        _lib.FAST = fast if path == "fast" else None
        try:
            for n in [1, 4099]:
                t += 1
                xs = [data(t, r, n, "float64") for r in range(SIZE)]
                mine, out = xs[RANK].copy(), np.zeros(n, np.float64)
                comm.all_reduce_ptr(mine.ctypes.data, out.ctypes.data, n, "float64", toroid.ReduceOp.SUM)
                same(out, reference(xs, "sum"), f"{path} all_reduce_ptr n={n}")
                same(mine, xs[RANK], f"{path} all_reduce_ptr input untouched")
                for root in range(SIZE):
                    buf = data(t, RANK, n, "int32")
                    comm.broadcast_ptr(buf.ctypes.data, buf.ctypes.data, n, toroid.DataType.INT32, root)
                    same(buf, data(t, root, n, "int32"), f"{path} broadcast_ptr root {root}")
        finally:
            _lib.FAST = fast
    # The async calls (all_reduce_addr_async, and every Work's work_wait and work_free), both
    # paths; on the fast one, counted through a stand-in that forwards to the extension.
    fast_async = _lib.FAST_ASYNC
    assert fast_async is fast, "the extension is bound but its async calls are not"

    class Counting:
        calls = collections.Counter()

        def __getattr__(self, name):
            f = getattr(fast, name)

            def counted(*args):
                Counting.calls[name] += 1
                return f(*args)

            return counted

    for path in ("fast", "ctypes"):
        _lib.FAST = _lib.FAST_ASYNC = Counting() if path == "fast" else None
        try:
            for n in [1, 4099]:
                t += 1
                xs = [data(t, r, n, "float32") for r in range(SIZE)]
                works = [comm.all_reduce(xs[RANK].copy(), op="sum", async_op=True) for _ in range(3)]
                mine, out = xs[RANK].copy(), np.zeros(n, np.float32)
                w = comm.all_reduce_ptr(mine.ctypes.data, out.ctypes.data, n, "float32", "max", True, (mine, out), out)
                same(w.wait(), reference(xs, "max"), f"{path} async all_reduce_ptr n={n}")
                for i, x in enumerate(reversed(works)):
                    same(x.wait(), reference(xs, "sum"), f"{path} async all_reduce #{i} n={n}")
                del works, w, x  # (each Work is freed here, on its path)
            try:
                comm.all_reduce(np.zeros(4, np.int32), op="avg", async_op=True)
                raise AssertionError(f"{path}: async avg on integers accepted")
            except toroid.UnsupportedError:
                pass
        finally:
            _lib.FAST, _lib.FAST_ASYNC = fast, fast_async
    c = Counting.calls
    assert c["all_reduce_addr_async"] == 9 and c["work_wait"] == 8 and c["work_free"] == 8, dict(c)
    # What the extension leaves to the general path raises there, as without it.
    a = np.arange(16, dtype=np.float32)
    frozen = np.ones(16, np.float32)
    frozen.flags.writeable = False
    for what, call, error in [
        ("a strided array", lambda: comm.all_reduce(a[::2]), ValueError),
        ("a read-only output", lambda: comm.all_reduce(a, frozen), ValueError),
        ("a read-only array in place", lambda: comm.all_reduce(frozen), ValueError),
        ("an output of another type", lambda: comm.all_reduce(a, np.zeros(16, np.int32)), TypeError),
        ("an output of another size", lambda: comm.all_reduce(a, np.zeros(15, np.float32)), ValueError),
        ("a list", lambda: comm.all_reduce([1.0, 2.0]), TypeError),
        ("a bool array", lambda: comm.all_reduce(np.ones(4, bool)), TypeError),
        ("a strided broadcast", lambda: comm.broadcast(a[::2], 0), ValueError),
        ("a root out of range", lambda: comm.broadcast(a, SIZE + 3), toroid.InvalidArgumentError),
        ("avg on integers", lambda: comm.all_reduce(np.zeros(4, np.int32), op="avg"), toroid.UnsupportedError),
    ]:
        try:
            call()
            raise AssertionError(f"{what} accepted")
        except error:
            pass
    # The extension itself: what it cannot take is NOT_TAKEN (-1), never a call with a size it
    # did not derive; bad arguments are Python errors; a null communicator is toroid's error.
    h = comm._live()
    f32, f64 = int(toroid.DataType.FLOAT32), int(toroid.DataType.FLOAT64)
    assert fast.all_reduce(h, a, None, 63, 0) == -1  # a type without a width
    assert fast.all_reduce(h, a, None, -1, 0) == -1
    assert fast.all_reduce(h, np.ones(3, np.float64), None, f32, 0) == -1  # 8-byte items as 4-byte ones
    assert fast.all_reduce(h, memoryview(bytes(16)).cast("f"), None, f32, 0) == -1  # read-only in place
    assert fast.all_reduce(h, np.ones(4, np.float64), np.ones(5, np.float64), f64, 0) == -1  # sizes differ
    assert fast.all_reduce(h, a[::2], None, f32, 0) == -1
    assert fast.broadcast(h, a, f32, 1 << 40) == -1  # a root beyond a C int
    assert fast.broadcast_addr(h, a.ctypes.data, a.ctypes.data, 16, f32, 1 << 40) == -1
    assert fast.all_reduce_addr(h, a.ctypes.data, a.ctypes.data, 16, 63, 0) == -1
    for bad in [(h, a, None, f32), (h, a, None, "float32", 0), ("comm", a, None, f32, 0)]:
        try:
            fast.all_reduce(*bad)
            raise AssertionError(f"all_reduce{bad[2:]} accepted")
        except TypeError:
            pass
    assert fast.all_reduce(0, a, None, f32, 0) == toroid.Result.INVALID_ARGUMENT
    # Still usable, through both paths.
    same(comm.all_reduce(np.ones(5, np.int64)), np.full(5, SIZE, np.int64), "usable after the checks")


def created_in_the_background():
    """Comm.from_env_async, polled until done (the last rank comes 300 ms late)."""
    if RANK == SIZE - 1:
        time.sleep(0.3)
    pending = toroid.Comm.from_env_async()
    start = time.monotonic()
    while not pending.done():
        assert time.monotonic() - start < 60, "creation not done within 60 s"
        time.sleep(0.002)
    comm = pending.wait()
    try:
        pending.wait()
        raise AssertionError("a second wait handed out a communicator")
    except toroid.InvalidUsageError:
        pass
    pending.release()
    return comm


def shrink(comm):
    """The last rank leaves; the others shrink without it (in the background, polled) and
    all-reduce on the survivors; then a shrink that cannot complete is aborted."""
    comm.barrier()
    if RANK == SIZE - 1:
        comm.destroy()
        return
    pending = comm.shrink_async([SIZE - 1])
    while not pending.done():
        time.sleep(0.002)
    small = pending.wait()
    survivors = list(range(SIZE - 1))
    assert (small.rank, small.size) == (RANK, SIZE - 1), (small.rank, small.size)
    x = data(50, RANK, 1000, np.int64)
    same(small.all_reduce(x.copy()), reference([data(50, r, 1000, np.int64) for r in survivors], "sum"), "after shrink")
    try:
        comm.shrink([SIZE - 1])
        raise AssertionError("a second shrink of one communicator")
    except toroid.ToroidError:
        pass
    small.destroy()
    comm.destroy()
    if RANK == 0:
        # Rank 0 of a world of 2 whose rank 1 never comes: aborted within a second.
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        p = toroid.Comm.init_async(0, 2, f"127.0.0.1:{port}", timeout=60)
        time.sleep(0.3)
        assert not p.done()
        t = time.monotonic()
        p.abort()
        took = time.monotonic() - t
        assert took < 1.0, f"abort took {took:.3f} s"
        try:
            p.wait()
            raise AssertionError("an aborted creation gave a communicator")
        except toroid.AbortedError:
            pass


def grow(comm):
    """The last rank leaves and comes back as a new member: the others shrink without it, offer
    one rank (the token goes through a file, as a framework's store would carry it) and grow in
    the background; the process that left, holding no communicator, joins with the token as
    the last rank. Everyone all-reduces on the grown communicator, checked element by element.
    A forged token (another secret) is refused; an offer is used once."""
    path = os.path.join(os.environ["TOROID_TEST_TMP"], "join-token")
    last = SIZE - 1
    comm.barrier()
    if RANK == last:
        comm.destroy()
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert time.monotonic() < deadline, "no token was offered"
            time.sleep(0.002)
        with open(path) as f:
            token = f.read()
        head, secret, addr = token.rsplit("/", 2)
        forged = f"{head}/{'0' if secret[0] != '0' else '1'}{secret[1:]}/{addr}"
        try:
            toroid.Comm.join(forged, last, timeout=20)
            raise AssertionError("a forged token joined")
        except toroid.ToroidError as e:
            assert "refused this token" in str(e), str(e)
        pending = toroid.Comm.join_async(token, last, timeout=20)
        grown = pending.wait()
    else:
        small = comm.shrink([last])
        offer = small.grow_offer(1)
        assert offer.token.startswith(f"toroid-join1/{SIZE}/"), offer.token
        if RANK == 0:
            with open(path + ".tmp", "w") as f:
                f.write(offer.token)
            os.rename(path + ".tmp", path)
        grown = small.grow_async(offer).wait()
        try:
            small.grow(offer)
            raise AssertionError("an offer was used twice")
        except toroid.InvalidUsageError:
            pass
        offer.release()
        small.destroy()
        comm.destroy()
    assert (grown.rank, grown.size) == (RANK, SIZE), (grown.rank, grown.size)
    x = data(60, RANK, 4099, np.int64)
    same(grown.all_reduce(x.copy()), reference([data(60, r, 4099, np.int64) for r in range(SIZE)], "sum"), "after grow")
    grown.destroy()


def wire(comm):
    """`all_reduce(wire=...)`: float32 and float64, bf16 and f16, sum and avg, blocking and
    async; every element within the documented bound of the exact sum (computed here in float64
    from every rank's seeded input), the rounding visible, the same bits on every rank; an
    integer wire type refused."""
    global checks
    for test, (dt, wname, op) in enumerate((dt, w, o) for dt in (np.float32, np.float64) for w in ("bf16", "f16")
                                            for o in ("sum", "avg")):
        inputs = [data(400 + test, r, 5003, dt) * (1 + r) for r in range(SIZE)]
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
        mag = np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
        u = 2.0 ** -8 if wname == "bf16" else 2.0 ** -11
        div = SIZE if op == "avg" else 1
        bound = ((2 * u + u * u) * mag + SIZE * 2.0 ** -24 * mag) / div * (1 + 1e-6)
        x = inputs[RANK].copy()
        if test % 2:
            got = comm.all_reduce(x, op=op, async_op=True, wire=wname).wait()
        else:
            got = comm.all_reduce(x, op=op, wire=wname)
        err = np.abs(got.astype(np.float64) - exact / div)
        if not (err <= bound).all():
            i = int(np.argmax(err - bound))
            raise AssertionError(f"{dt.__name__} {wname} {op}: element {i} is {got[i]}, exact {exact[i] / div}, "
                                 f"bound {bound[i]}")
        plain = comm.all_reduce(inputs[RANK].copy(), op=op, wire=dt.__name__)
        assert not np.array_equal(plain, got), f"{dt.__name__} {wname}: not rounded, so not compressed"
        every = comm.all_gather(got)
        assert all(np.array_equal(every[r], got) for r in range(SIZE)), f"{dt.__name__} {wname}: ranks differ"
        checks += got.size
    try:
        comm.all_reduce(np.ones(4, np.float32), wire="int32")
        raise AssertionError("an integer wire type was accepted")
    except toroid.InvalidArgumentError:
        pass


def group(comm):
    """80 small all-reduces of mixed types and ops with a broadcast and an all-gather between
    them, in one `with comm.group()`: every element checked; the all-reduces run packed. Then
    sends and receives in a group, and a persistent all-reduce (`all_reduce_init`) run 5 times
    on new data."""
    def all_reduces():
        return sum(c["count"] for c in comm.stats() if c["kind"] == "all_reduce")

    lens = [0 if k % 11 == 3 else int(np.random.default_rng(k).integers(1, 500)) for k in range(80)]
    kinds = [(np.float32, "sum") if k < 40 else (np.int64, "max") for k in range(80)]
    arrays = [data(100 + k, RANK, lens[k], kinds[k][0], kinds[k][1]) for k in range(80)]
    inputs = [a.copy() for a in arrays]
    b = data(300, RANK, 123, np.int32)
    g = data(301, RANK, 17, np.float64)
    before = all_reduces()
    with comm.group():
        for k in range(40):
            comm.all_reduce(arrays[k], op="sum")
        comm.broadcast(b, root=SIZE - 1)
        gathered = comm.all_gather(g)
        for k in range(40, 80):
            comm.all_reduce(arrays[k], op="max")
        assert all((arrays[k] == inputs[k]).all() for k in range(80)), "a call ran before the group ended"
    ran = all_reduces() - before
    assert SIZE == 1 or ran == 2, f"80 all-reduces ran as {ran}"
    for k in range(80):
        dt, op = kinds[k]
        same(arrays[k], reference([data(100 + k, r, lens[k], dt, op) for r in range(SIZE)], op), f"group call {k}")
    same(b, data(300, SIZE - 1, 123, np.int32), "group broadcast")
    same(gathered.reshape(-1), np.concatenate([data(301, r, 17, np.float64) for r in range(SIZE)]), "group all_gather")
    try:
        with comm.group():
            comm.all_reduce(arrays[0], async_op=True)
        raise AssertionError("an async call inside a group")
    except toroid.InvalidUsageError:
        pass
    # Sends and receives in a group run side by side: every rank sends 4 MiB to each neighbour
    # before receiving (blocking calls one by one would wait for each other), blocking and async.
    if SIZE > 1:
        nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
        for async_op in (False, True):
            out = {p: data(500 + p, RANK, 1 << 20, np.float32) for p in {nxt, prv}}
            got = {p: np.zeros(1 << 20, np.float32) for p in {nxt, prv}}
            with comm.group():
                for p in out:
                    comm.send(out[p], p)
                for p in got:
                    comm.recv(got[p], p)
                assert not any(g.any() for g in got.values()), "a receive ran before the group ended"
            if async_op:  # the same group again, queued (group_end(async_op=True))
                for g in got.values():
                    g[:] = 0
                comm.group_start()
                for p in out:
                    comm.send(out[p], p)
                for p in got:
                    comm.recv(got[p], p)
                comm.group_end(async_op=True).wait()
            for p in got:
                same(got[p], data(500 + RANK, p, 1 << 20, np.float32), f"group receive from {p} (async {async_op})")
    # A persistent all-reduce, run on new data each time, out of place.
    x = np.zeros(300, np.float32)
    y = np.zeros(300, np.float32)
    req = comm.all_reduce_init(x, y, op="sum")
    for step in range(5):
        x[:] = data(400 + step, RANK, 300, np.float32)
        assert req.run() is y
        same(y, reference([data(400 + step, r, 300, np.float32) for r in range(SIZE)], "sum"), f"persistent run {step}")
    req.free()
    try:
        req.run()
        raise AssertionError("a freed request ran")
    except toroid.InvalidUsageError:
        pass


class FileStore:
    """A caller-supplied store for Comm.with_store: one file per key."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def _file(self, key):
        return self.path / key.replace("/", "_")

    def set(self, key, value):
        tmp = self.path / f".{os.getpid()}.tmp"
        tmp.write_bytes(value)
        tmp.rename(self._file(key))

    def get(self, key, timeout):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._file(key).read_bytes()
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.002)


if __name__ == "__main__":
    if SCENARIO == "with_store":
        comm = toroid.Comm.with_store(RANK, SIZE, FileStore(os.environ["TOROID_TEST_TMP"]))
        same(comm.all_reduce(np.array([RANK + 1], np.int64), op="prod"),
             np.array([np.prod(np.arange(1, SIZE + 1))], np.int64), "with_store all_reduce")
    elif SCENARIO == "encrypted":
        # TLS on every link (the test sets TOROID_AUTH_TOKEN and no shared memory); a rank
        # without the token would be refused at set-up.
        comm = toroid.Comm.with_store(RANK, SIZE, FileStore(os.environ["TOROID_TEST_TMP"]), encrypt=True)
        collectives(comm)
    elif SCENARIO == "shrink":
        shrink(created_in_the_background())
        print(f"rank {RANK}: {SCENARIO} passed ({checks} element checks)")
        sys.exit(0)
    elif SCENARIO == "grow":
        grow(toroid.Comm.from_env())
        print(f"rank {RANK}: {SCENARIO} passed ({checks} element checks)")
        sys.exit(0)
    else:
        comm = toroid.Comm.from_env()
        {"collectives": collectives, "async": async_and_pointers, "errors": errors, "dump": dump, "group": group,
         "wire": wire, "fastcall": fastcall}[
            SCENARIO
        ](comm)
    comm.barrier()
    comm.destroy()
    print(f"rank {RANK}: {SCENARIO} passed ({checks} element checks)")
