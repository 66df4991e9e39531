"""`Comm`: a toroid communicator over the C ABI, on numpy arrays and raw pointers."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Optional

from . import _lib
from ._arrays import _BY_DTYPE, _buffer, numpy_dtype
from ._handles import GrowOffer, Pending, Request, Store, Work, _failed_array
from ._lib import DataType, ReduceOp, check
from ._pointers import _FAST_OPS, _NOT_TAKEN, _PointerCalls

# The unfinished works a Comm holds before it tests them all (see Comm._prune).
_PRUNE_MIN = 64

try:  # numpy is optional for the pointer-level API
    import numpy as np
except ImportError:  # pragma: no cover
    np = None
_NDARRAY = np.ndarray if np is not None else None  # (no type is None: the fast paths are not taken)


class Comm(_PointerCalls):
    """A toroid communicator.

    Create it with `Comm.from_env()` (under toroid-run, torchrun, srun or mpirun),
    `Comm.init(rank, size, store_addr)` or `Comm.with_store(rank, size, store)`.

    Collectives take numpy arrays (C-contiguous, of a toroid element type); the `*_ptr` forms
    take raw addresses, element counts and a `DataType` (for bfloat16 or foreign memory).
    Every collective takes ``async_op=True`` to return a `Work` instead of blocking.
    """

    def __init__(self, handle: int):
        self._handle = handle
        self._lock = threading.Lock()
        # Unfinished async works by id: each keeps its arrays alive until done, even if the
        # caller drops it. A work leaves when it is found finished (wait, test, the prune).
        self._inflight: dict[int, Work] = {}
        self._prune_at = _PRUNE_MIN
        self._group_depth = 0
        self._group_refs: list = []
        rank, size = ctypes.c_int(), ctypes.c_int()
        check("toroid_comm_rank", _lib.lib().toroid_comm_rank(handle, ctypes.byref(rank)), handle)
        check("toroid_comm_size", _lib.lib().toroid_comm_size(handle, ctypes.byref(size)), handle)
        self.rank = rank.value
        self.size = size.value

    # ---- creation ------------------------------------------------------------------------

    @classmethod
    def from_env(cls) -> "Comm":
        """From TOROID_RANK/TOROID_WORLD_SIZE/TOROID_STORE_ADDR or torchrun/Slurm/MPI variables."""
        out = ctypes.c_void_p()
        check("toroid_comm_init_env", _lib.lib().toroid_comm_init_env(ctypes.byref(out)))
        return cls(out.value)

    @staticmethod
    def from_env_async() -> Pending:
        """`from_env` in the background: returns at once with a `Pending`."""
        out = ctypes.c_void_p()
        check("toroid_comm_init_env_async", _lib.lib().toroid_comm_init_env_async(ctypes.byref(out)))
        return Pending(out.value)

    @staticmethod
    def init_async(
        rank: int,
        size: int,
        store_addr: Optional[str] = None,
        timeout: Optional[float] = None,
        socket_ifname: Optional[str] = None,
        encrypt: Optional[bool] = None,
    ) -> Pending:
        """`init` in the background: returns at once with a `Pending`."""
        cfg = Comm._config(rank, size, store_addr, timeout, socket_ifname, encrypt)
        out = ctypes.c_void_p()
        check("toroid_comm_init_async", _lib.lib().toroid_comm_init_async(ctypes.byref(out), ctypes.byref(cfg)))
        return Pending(out.value)

    @staticmethod
    def _config(rank, size, store_addr, timeout, socket_ifname, encrypt=None) -> "_lib.Config":
        cfg = _lib.Config()
        cfg.struct_size = ctypes.sizeof(_lib.Config)
        cfg.rank, cfg.size = rank, size
        cfg.store_addr = store_addr.encode() if store_addr else None
        cfg.timeout_ms = int(timeout * 1000) if timeout else 0
        cfg.socket_ifname = socket_ifname.encode() if socket_ifname else None
        cfg.encrypt = 0 if encrypt is None else (1 if encrypt else -1)
        return cfg

    @classmethod
    def init(
        cls,
        rank: int,
        size: int,
        store_addr: Optional[str] = None,
        timeout: Optional[float] = None,
        socket_ifname: Optional[str] = None,
        encrypt: Optional[bool] = None,
    ) -> "Comm":
        """Rank 0 serves a TCP store at `store_addr` ("host:port", or "file:///dir", or
        "torch://host:port": a torch TCPStore where rank 0 publishes the port it serves on);
        None: from the environment. `timeout` in seconds (None: TOROID_TIMEOUT or 300 s). `encrypt`: TLS
        1.3 on every TCP link between ranks (needs TOROID_AUTH_TOKEN; None: TOROID_ENCRYPT)."""
        cfg = cls._config(rank, size, store_addr, timeout, socket_ifname, encrypt)
        out = ctypes.c_void_p()
        check("toroid_comm_init", _lib.lib().toroid_comm_init(ctypes.byref(out), ctypes.byref(cfg)))
        return cls(out.value)

    @classmethod
    def with_store(
        cls,
        rank: int,
        size: int,
        store: Store,
        timeout: Optional[float] = None,
        socket_ifname: Optional[str] = None,
        encrypt: Optional[bool] = None,
    ) -> "Comm":
        """Meets the other ranks through `store` (set/get, see `Store`): no port of toroid's own.
        `timeout` in seconds bounds set-up and every later call (None: TOROID_TIMEOUT or 300 s).
        `encrypt` as for `init`.

        A store that raises (rather than reporting a missing key with None) fails the set-up at
        once: the callbacks protocol has only "failed" to tell toroid, so after the first
        exception every later callback fails without touching the store, toroid gives up, and
        the store's own exception is raised here (with toroid's error as its context)."""
        errors: list[BaseException] = []

        def on_set(_ctx, key, value, length):
            if errors:
                return 1
            try:
                store.set(key.decode(), ctypes.string_at(value, length) if length else b"")
                return 0
            except BaseException as e:  # noqa: BLE001 - reported below, never into C
                errors.append(e)
                return 1

        def on_get(_ctx, key, value, cap, length, timeout_ms):
            if errors:
                return 1
            try:
                v = store.get(key.decode(), timeout_ms / 1000.0)
                if v is None:
                    return 1  # missing at the deadline
                v = bytes(v)
                ctypes.memmove(value, v, min(len(v), cap))
                length[0] = len(v)
                return 0
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return 1

        ops = _lib.StoreOps(ctypes.sizeof(_lib.StoreOps), _lib.STORE_SET(on_set), _lib.STORE_GET(on_get))
        cfg = _lib.Config()
        cfg.struct_size = ctypes.sizeof(_lib.Config)
        cfg.rank, cfg.size = rank, size
        cfg.store_addr = None
        cfg.timeout_ms = max(1, int(timeout * 1000)) if timeout else 0
        cfg.socket_ifname = socket_ifname.encode() if socket_ifname else None
        cfg.encrypt = 0 if encrypt is None else (1 if encrypt else -1)
        out = ctypes.c_void_p()
        code = _lib.lib().toroid_comm_init_with_store_config(ctypes.byref(out), ctypes.byref(cfg), ctypes.byref(ops), None)
        try:
            check("toroid_comm_init_with_store_config", code)
        except _lib.ToroidError:
            if errors:
                raise errors[0]  # the store failed: its error, not toroid's "missing key"
            raise
        return cls(out.value)

    # ---- life cycle ----------------------------------------------------------------------

    def _handle_or_none(self) -> Optional[int]:
        return self._handle

    def _live(self) -> int:
        if self._handle is None:
            raise _lib.InvalidUsageError("Comm", _lib.Result.INVALID_USAGE, "the communicator was destroyed", "")
        return self._handle

    def _forget(self, work: Work) -> None:
        with self._lock:
            self._inflight.pop(id(work), None)

    def _keep(self, work: Work) -> None:
        with self._lock:
            self._inflight[id(work)] = work

    def _prune(self) -> None:
        """Drops the finished works that nobody waited on, once their number has doubled since
        the last prune (testing every work at every call would cost each call their number)."""
        if len(self._inflight) < self._prune_at:
            return
        with self._lock:
            works = list(self._inflight.values())
        for w in works:
            w.test()
        self._prune_at = max(_PRUNE_MIN, 2 * len(self._inflight))

    def split(self, color: int, key: int = 0) -> Optional["Comm"]:
        """Ranks with the same color form a new communicator ordered by key; color < 0 (or
        None) takes part without joining one and returns None. Every rank calls it."""
        out = ctypes.c_void_p()
        color = _lib.SPLIT_NOCOLOR if color is None else color
        check("toroid_comm_split", _lib.lib().toroid_comm_split(self._live(), color, key, ctypes.byref(out)), self._handle)
        return Comm(out.value) if out.value else None

    def shrink(self, failed=()) -> "Comm":
        """A new communicator of the ranks not in `failed`, in rank order, after a failure or on
        a healthy communicator; every survivor passes the same ranks (empty: the ranks whose
        process is gone). The failed ranks do not call it. Once per communicator."""
        arr, n = _failed_array(failed)
        out = ctypes.c_void_p()
        check("toroid_comm_shrink", _lib.lib().toroid_comm_shrink(self._live(), arr, n, ctypes.byref(out)), self._handle)
        return Comm(out.value)

    def grow_offer(self, added: int) -> GrowOffer:
        """Every rank calls it to admit `added` new ranks: a collective that returns at once
        with the offer, whose `token` (the same on every rank) the new processes pass to
        `Comm.join`. Then `grow(offer)`."""
        out = ctypes.c_void_p()
        check("toroid_comm_grow_offer", _lib.lib().toroid_comm_grow_offer(self._live(), int(added), ctypes.byref(out)),
              self._handle)
        return GrowOffer(out.value)

    def grow(self, offer: GrowOffer) -> "Comm":
        """The communicator with the new ranks, once every one has joined; this rank keeps its
        rank. Uses `offer` (from `grow_offer` on this communicator) once."""
        out = ctypes.c_void_p()
        check("toroid_comm_grow", _lib.lib().toroid_comm_grow(self._live(), offer._live(), ctypes.byref(out)), self._handle)
        return Comm(out.value)

    def grow_async(self, offer: GrowOffer) -> Pending:
        """`grow` in the background: returns at once with a `Pending`."""
        out = ctypes.c_void_p()
        check("toroid_comm_grow_async", _lib.lib().toroid_comm_grow_async(self._live(), offer._live(), ctypes.byref(out)),
              self._handle)
        return Pending(out.value)

    @classmethod
    def join(cls, token: str, rank: int, timeout: Optional[float] = None,
             socket_ifname: Optional[str] = None) -> "Comm":
        """A new process joins, as `rank` (from the old size to the new one), the communicator
        the old ranks are growing with the offer whose `token` this is."""
        cfg = cls._join_config(token, rank, timeout, socket_ifname)
        out = ctypes.c_void_p()
        check("toroid_comm_join", _lib.lib().toroid_comm_join(token.encode(), ctypes.byref(cfg), ctypes.byref(out)))
        return cls(out.value)

    @classmethod
    def join_async(cls, token: str, rank: int, timeout: Optional[float] = None,
                   socket_ifname: Optional[str] = None) -> Pending:
        """`join` in the background: returns at once with a `Pending`."""
        cfg = cls._join_config(token, rank, timeout, socket_ifname)
        out = ctypes.c_void_p()
        check("toroid_comm_join_async", _lib.lib().toroid_comm_join_async(token.encode(), ctypes.byref(cfg),
                                                                          ctypes.byref(out)))
        return Pending(out.value)

    @staticmethod
    def _join_config(token: str, rank: int, timeout, socket_ifname) -> "_lib.Config":
        # The size is the token's (its second field); the C call checks the rest.
        parts = token.split("/")
        size = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0
        return Comm._config(rank, size, None, timeout, socket_ifname)

    def shrink_async(self, failed=()) -> Pending:
        """`shrink` in the background: returns at once with a `Pending`."""
        arr, n = _failed_array(failed)
        out = ctypes.c_void_p()
        check(
            "toroid_comm_shrink_async",
            _lib.lib().toroid_comm_shrink_async(self._live(), arr, n, ctypes.byref(out)),
            self._handle,
        )
        return Pending(out.value)

    def stats(self) -> list:
        """This communicator's statistics (toroid_comm_stats): one dict per (collective,
        algorithm, size class) seen, in the order first seen, with keys kind, algorithm (names),
        size_class (messages of at most 2**size_class bytes), count, bytes, moved, total_ns,
        min_ns, max_ns and hist (32 counts: hist[i] of operations under 2**i microseconds)."""
        f = _lib.lib().toroid_comm_stats
        while True:
            n = ctypes.c_size_t()
            check("toroid_comm_stats", f(self._live(), None, 0, ctypes.byref(n)), self._handle)
            cap = n.value + 4  # room for rows that a concurrent operation may add meanwhile
            rows = (_lib.Stat * cap)()
            check("toroid_comm_stats", f(self._live(), rows, cap, ctypes.byref(n)), self._handle)
            if n.value <= cap:
                break
        return [
            {
                "kind": _lib.KIND_NAMES.get(r.kind, f"kind{r.kind}"),
                "algorithm": _lib.ALGORITHM_NAMES.get(r.algorithm, f"algo{r.algorithm}"),
                "size_class": r.size_class,
                "count": r.count,
                "bytes": r.bytes,
                "moved": r.moved,
                "total_ns": r.total_ns,
                "min_ns": r.min_ns,
                "max_ns": r.max_ns,
                "hist": list(r.hist),
            }
            for r in rows[: n.value]
        ]

    def abort(self) -> None:
        """Fails pending and later operations; never blocks."""
        check("toroid_comm_abort", _lib.lib().toroid_comm_abort(self._live()), self._handle)

    def revoke(self) -> None:
        """Revokes the communicator (NCCL's ncclCommRevoke): every queued or running operation
        fails, here and on every other rank, and later ones fail at once; the handle, health(),
        dump() and shrink() keep working. Idempotent; never blocks."""
        check("toroid_comm_revoke", _lib.lib().toroid_comm_revoke(self._live()), self._handle)

    def is_revoked(self) -> bool:
        """True once revoked, here or by another rank (seen by a failed operation)."""
        flag = ctypes.c_int(0)
        check("toroid_comm_is_revoked", _lib.lib().toroid_comm_is_revoked(self._live(), ctypes.byref(flag)), self._handle)
        return bool(flag.value)

    def dump(self) -> str:
        """The stall report now, without failing anything: the conclusion line first, then one
        line per rank (last completed operation, the one it is in, whom it waits on, or dead /
        not answering). Asks every other rank, each within two seconds."""
        buf = ctypes.create_string_buffer(64 * 1024)
        check("toroid_comm_dump", _lib.lib().toroid_comm_dump(self._live(), buf, len(buf)), self._handle)
        return buf.value.decode("utf-8", "replace")

    def health(self, format: str = "json", grace: Optional[float] = None) -> Any:
        """The health of this communicator now: every rank alive, stopped or dead, the
        operation it is in and how long it has waited there, the verdict (the stall report's
        conclusion) and the stragglers (ranks ranked by how late they enter collectives).
        Asks every other rank at once, each within `grace` seconds (default 0.06); fails
        nothing. `format="json"` returns the document as a dict, `"prometheus"` the text."""
        import json

        fmts = {"json": _lib.ABI["constants"]["TOROID_HEALTH_JSON"]["value"],
                "prometheus": _lib.ABI["constants"]["TOROID_HEALTH_PROMETHEUS"]["value"]}
        if format not in fmts:
            raise ValueError(f"format {format!r}: expected 'json' or 'prometheus'")
        ms = 0 if grace is None else max(1, min(60_000, int(round(grace * 1000))))
        needed = ctypes.c_size_t(0)
        size = 64 * 1024
        for _ in range(3):
            buf = ctypes.create_string_buffer(size)
            rc = _lib.lib().toroid_comm_health(self._live(), fmts[format], ms, buf, len(buf), ctypes.byref(needed))
            if rc == 0:
                text = buf.value.decode("utf-8", "replace")
                return json.loads(text) if format == "json" else text
            if needed.value <= size:
                break
            size = needed.value + 4096  # a larger job than the buffer: ask again with room
        check("toroid_comm_health", rc, self._handle)

    def destroy(self) -> None:
        """Releases the communicator once its queued operations have finished.

        Raises the first failure of the operations still queued or running when it was called
        (the message says how many failed); the communicator is released either way."""
        handle, self._handle = self._handle, None
        if handle is not None:
            rc = _lib.lib().toroid_comm_destroy(handle)
            with self._lock:
                works, self._inflight = list(self._inflight.values()), {}
            for w in works:  # all finished now
                w._done = True
            check("toroid_comm_destroy", rc)

    close = destroy

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    @property
    def last_error(self) -> str:
        """The detail of the last failure on this communicator ('' if none)."""
        return _lib.last_error(self._handle)

    def __repr__(self) -> str:
        return f"toroid.Comm(rank={self.rank}, size={self.size})"

    # ---- the calls -----------------------------------------------------------------------

    @contextlib.contextmanager
    def group(self):
        """Runs the blocking calls issued inside the ``with`` block as one group when it ends
        (toroid_group_start / toroid_group_end): small all-reduces of one type and op packed
        into one, sends and receives side by side after the collectives. The calls return at
        once, their arrays filled when the block ends; async calls and recv_any are refused.
        Every rank must issue the same collectives in the same order. If the block raises, the
        calls recorded so far still run (the other ranks expect them) and it propagates."""
        self.group_start()
        ok = False
        try:
            yield self
            ok = True
        finally:
            self._group_end(ok, False)

    def group_start(self) -> None:
        """Opens a group (toroid_group_start), as ``with comm.group():`` does; close it with
        `group_end`. Groups nest: the outermost end runs the calls."""
        handle = self._live()
        check("toroid_group_start", _lib.lib().toroid_group_start(handle), handle)
        self._group_depth += 1

    def group_end(self, async_op: bool = False) -> Optional[Work]:
        """Closes the group opened by `group_start`. The outermost end runs the recorded calls
        (blocking), or with ``async_op=True`` queues them behind the async work already issued
        and returns a Work that completes when all have run (toroid_group_end_async; their
        arrays are kept alive until then). None when nothing was queued: blocking, a nested
        end, or an empty group."""
        return self._group_end(True, async_op)

    def _group_end(self, raise_error: bool, async_op: bool) -> Optional[Work]:
        handle = self._live()
        if self._group_depth > 0:  # (without one, toroid reports the misuse)
            self._group_depth -= 1
        refs = tuple(self._group_refs) if self._group_depth == 0 else ()
        if self._group_depth == 0:
            self._group_refs.clear()
        if not async_op:
            code = _lib.lib().toroid_group_end(handle)
            if raise_error:
                check("toroid_group_end", code, handle)
            return None
        work = ctypes.c_void_p()
        code = _lib.lib().toroid_group_end_async(handle, ctypes.byref(work))
        if raise_error:
            check("toroid_group_end_async", code, handle)
        if not work.value:
            return None
        w = Work(self, work.value, refs, None, "toroid_group_end_async")
        self._keep(w)  # keeps the arrays alive even if the caller drops it
        return w

    def _call(self, name: str, args: tuple, async_op: bool, refs: tuple, result: Any):
        handle = self._live()
        f = _lib.lib()
        if not async_op:
            check(name, getattr(f, name)(handle, *args), handle)
            if self._group_depth:
                self._group_refs.append(refs)  # read and written when the group ends
            return result
        self._prune()
        work = ctypes.c_void_p()
        return self._issued(name, (getattr(f, name + "_async")(handle, *args, ctypes.byref(work)), work.value), refs,
                            result)

    # Pointer-level collectives: addresses (int), counts in elements, DataType or its name.

    def barrier(self, async_op: bool = False):
        """Returns once every rank has entered the barrier."""
        return self._call("toroid_barrier", (), async_op, (), None)

    # numpy collectives. `recv=None` means in place where the collective allows it, or a new
    # array. The return value is the output array (or a Work whose wait() returns it).

    def all_reduce(self, send, recv=None, op="sum", async_op: bool = False, wire=None):
        """Every rank receives the reduction of every rank's `send` (in place when recv is None).
        `wire="bf16"` or `"f16"`: a float32/float64 all-reduce travels in that type (half the
        bytes, reductions in the array's own type, the same result on every rank; see
        docs/reference/c-abi.md, compressed all-reduce); None: TOROID_WIRE_DTYPE decides."""
        fast = _lib.FAST
        if fast is not None and not async_op and wire is None and not self._group_depth and type(send) is _NDARRAY:
            # The C extension's path (see _lib.FAST): the buffer checks are its own; it returns
            # NOT_TAKEN for what only the general path below handles or reports.
            t, o = _BY_DTYPE.get(send.dtype), _FAST_OPS.get(op)
            same = recv is None or recv is send or (type(recv) is _NDARRAY and recv.dtype == send.dtype)
            if t is not None and o is not None and same:
                code = fast.all_reduce(self._live(), send, recv, t, o)
                if code != _NOT_TAKEN:
                    if code:
                        check("toroid_all_reduce", code, self._handle)
                    return send if recv is None else recv
        if recv is None or recv is send:  # in place: one address
            recv = send
            src = dst = _buffer(send, True)
        else:
            self._same(send, recv)
            src, dst = _buffer(send, False), _buffer(recv, True)
        return self.all_reduce_ptr(src, dst, send.size, numpy_dtype(send), op, async_op, (send, recv), recv, wire)

    def all_reduce_init(self, send, recv=None, op="sum") -> Request:
        """A persistent all-reduce of `send` into `recv` (in place when recv is None), checked
        and its algorithm chosen once; `run()` it as often as needed (every rank as often)."""
        recv = send if recv is None else recv
        self._same(send, recv)
        out = ctypes.c_void_p()
        args = (_buffer(send, False), _buffer(recv, True), send.size, DataType.of(numpy_dtype(send)), ReduceOp.of(op))
        check("toroid_all_reduce_init", _lib.lib().toroid_all_reduce_init(self._live(), *args, ctypes.byref(out)), self._handle)
        return Request(self, out.value, (send, recv), recv)

    def reduce_scatter(self, send, recv=None, op="sum", async_op: bool = False):
        """`send` holds size equal pieces; rank r receives the reduction of everyone's piece r."""
        if send.size % self.size:
            raise ValueError(f"reduce_scatter input of {send.size} elements does not split into {self.size}")
        if recv is None:
            recv = np.empty(send.size // self.size, dtype=send.dtype)
        self._kind(send, recv)
        if recv.size * self.size != send.size:
            raise ValueError(f"reduce_scatter output has {recv.size} elements, expected {send.size // self.size}")
        return self.reduce_scatter_ptr(
            _buffer(send, False), _buffer(recv, True), recv.size, numpy_dtype(send), op, async_op, (send, recv), recv
        )

    def all_gather(self, send, recv=None, async_op: bool = False):
        """Every rank receives every rank's `send`, in rank order (a new array of shape
        (size, *send.shape) when recv is None)."""
        if recv is None:
            recv = np.empty((self.size,) + send.shape, dtype=send.dtype)
        self._kind(send, recv)
        if recv.size != send.size * self.size:
            raise ValueError(f"all_gather output has {recv.size} elements, expected {send.size * self.size}")
        return self.all_gather_ptr(
            _buffer(send, False), _buffer(recv, True), send.size, numpy_dtype(send), async_op, (send, recv), recv
        )

    def broadcast(self, buf, root: int, async_op: bool = False):
        """Root's `buf` is copied into every rank's `buf`."""
        fast = _lib.FAST
        if fast is not None and not async_op and not self._group_depth and type(buf) is _NDARRAY:
            t = _BY_DTYPE.get(buf.dtype)  # (the C extension's path, as in all_reduce)
            if t is not None and type(root) is int:
                code = fast.broadcast(self._live(), buf, t, root)
                if code != _NOT_TAKEN:
                    if code:
                        check("toroid_broadcast", code, self._handle)
                    return buf
        p = _buffer(buf, True)
        return self.broadcast_ptr(p, p, buf.size, numpy_dtype(buf), root, async_op, (buf,), buf)

    def reduce(self, send, recv=None, op="sum", root: int = 0, async_op: bool = False):
        """The root receives the reduction in `recv` (in place in `send` when recv is None);
        other ranks' arrays are only read. Returns the result at the root, None elsewhere."""
        if self.rank == root:
            recv = send if recv is None else recv
            self._same(send, recv)
            rp = _buffer(recv, True)
        else:
            rp, recv = None, None
        return self.reduce_ptr(
            _buffer(send, False), rp, send.size, numpy_dtype(send), op, root, async_op, (send, recv), recv
        )

    def all_to_all(self, send, recv=None, async_op: bool = False):
        """Block j of `send` goes to rank j, arriving as block `rank` of `recv` (equal blocks)."""
        if send.size % self.size:
            raise ValueError(f"all_to_all input of {send.size} elements does not split into {self.size}")
        recv = np.empty_like(send) if recv is None else recv
        self._same(send, recv)
        return self.all_to_all_ptr(_buffer(send, False), _buffer(recv, True), send.size // self.size,
                                   numpy_dtype(send), async_op, (send, recv), recv)

    def all_to_all_v(self, send, send_counts, recv, recv_counts, async_op: bool = False):
        """`all_to_all_v_ptr` on numpy arrays: packed blocks of any size, out of place."""
        self._kind(send, recv)
        return self.all_to_all_v_ptr(_buffer(send, False), send_counts, _buffer(recv, True), recv_counts,
                                     numpy_dtype(send), async_op, (send, recv), recv)

    def send(self, buf, peer: int, async_op: bool = False):
        """Sends `buf` to `peer` (which calls recv with an array of the same size and type)."""
        return self.send_ptr(_buffer(buf, False), buf.size, numpy_dtype(buf), peer, async_op, (buf,), None)

    def recv_any(self, buf, async_op: bool = False):
        """Receives into `buf` from whichever rank sends first; returns that rank (or a Work
        whose wait() returns it)."""
        return self.recv_any_ptr(_buffer(buf, True), buf.size, numpy_dtype(buf), async_op, (buf,))

    def recv(self, buf, peer: int, async_op: bool = False):
        """Receives into `buf` from `peer`."""
        return self.recv_ptr(_buffer(buf, True), buf.size, numpy_dtype(buf), peer, async_op, (buf,), buf)

    @staticmethod
    def _kind(a, b) -> None:
        if a.dtype != b.dtype:
            raise TypeError(f"input is {a.dtype} but output is {b.dtype}")

    @staticmethod
    def _same(a, b) -> None:
        Comm._kind(a, b)
        if a.size != b.size:
            raise ValueError(f"input has {a.size} elements but output has {b.size}")
