"""One rank of test_stats.py: 5 all-reduces of 1024 float32 (4 KiB, size class 12) and one
broadcast of 100 float64 (800 bytes, size class 10), then Comm.stats() checked exactly against
what this script issued (counted from a baseline taken after set-up)."""

import os

import numpy as np

import toroid

RANK = int(os.environ["TOROID_RANK"])


def row(stats, kind, size_class):
    rows = [s for s in stats if s["kind"] == kind and s["size_class"] == size_class]
    assert len(rows) <= 1, f"several {kind} rows of class {size_class} with one algorithm each? {rows}"
    return rows[0] if rows else None


with toroid.Comm.from_env() as comm:
    # A second communicator of the same ranks, for the end: the revoke below leaves it alone.
    sync = comm.split(0, RANK)
    before = comm.stats()
    assert row(before, "all_reduce", 12) is None and row(before, "broadcast", 10) is None, before
    for it in range(5):
        a = np.arange(1024, dtype=np.float32) + RANK + it
        comm.all_reduce(a)
        assert a[7] == 2 * (7 + it) + 1, a[:8]
    b = np.arange(100, dtype=np.float64) if RANK == 0 else np.zeros(100)
    comm.broadcast(b, root=0)
    assert b[99] == 99.0
    after = comm.stats()

    ar = row(after, "all_reduce", 12)
    assert ar is not None, after
    assert (ar["count"], ar["bytes"]) == (5, 20480), ar
    assert 0 < ar["min_ns"] <= ar["max_ns"], ar
    assert 5 * ar["min_ns"] <= ar["total_ns"] <= 5 * ar["max_ns"], ar
    assert len(ar["hist"]) == 32 and sum(ar["hist"]) == 5, ar
    assert ar["algorithm"] in toroid._lib.ALGORITHM_NAMES.values(), ar
    bc = row(after, "broadcast", 10)
    assert bc is not None and (bc["count"], bc["bytes"]) == (1, 800), bc
    assert sum(s["count"] for s in after) == sum(s["count"] for s in before) + 6, (before, after)
    assert len(after) == len(before) + 2, (before, after)

    # The health document: every rank alive, this rank's completed count as counted here.
    h = comm.health(grace=2.0)  # generous: a loaded machine can delay a live rank's answer
    assert h["size"] == comm.size and len(h["ranks"]) == comm.size, h
    assert all(r["state"] == "alive" for r in h["ranks"]), h
    mine = h["ranks"][RANK]
    assert mine["completed"] == sum(s["count"] for s in after), (mine, after)
    text = comm.health(format="prometheus", grace=2.0)
    assert f'rank="{RANK}",state="alive"}} 1' in text, text
    try:
        comm.health(format="xml")
        raise AssertionError("format xml accepted")
    except ValueError:
        pass
    # Revoke: rank 0 revokes; every rank's next all-reduce fails as aborted (rank 0 sent nothing
    # for it), and every rank then sees the communicator revoked. (No collective between the
    # queries and the revoke: a rank still inside one when rank 0 revokes would fail it. The
    # control plane answers after the revoke, so the others' queries still see every rank.)
    assert not comm.is_revoked()
    if RANK == 0:
        comm.revoke()
        comm.revoke()  # idempotent
    try:
        comm.all_reduce(np.ones(8, dtype=np.float32))
        raise AssertionError("an all-reduce after the revoke succeeded")
    except toroid.AbortedError as e:
        assert "rank 0 revoked the communicator" in str(e), e
    assert comm.is_revoked()
    sync.barrier()  # every rank's control plane up until all have asked
    sync.destroy()
    print(f"rank {RANK}: stats passed", flush=True)
