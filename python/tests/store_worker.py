"""toroid.torch.TorchStore (torch's store as toroid's caller-supplied store) on a live and on a
dead TCPStore server (started by test_torch_store.py through launch.py, as one process with
TOROID_TIMEOUT set). A missing key is a timeout, reported as missing; a dead server is an error
that reaches the caller of Comm.with_store as torch's own exception, fast."""

import datetime
import os
import select
import subprocess
import sys
import threading
import time

import torch.distributed as dist

import toroid
from toroid.torch import TorchStore

SCENARIO = sys.argv[1]
TIMEOUT = float(os.environ["TOROID_TIMEOUT"])


def serve(start_timeout: float = 60.0):
    """A TCPStore server in a child process; returns (process, port)."""
    code = (
        "import sys, time, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', 0, 2, True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    ready, _, _ = select.select([p.stdout], [], [], start_timeout)
    if not ready:
        p.kill()
        p.wait()
        raise AssertionError("the store server did not start")
    return p, int(p.stdout.readline())


def timed(f):
    t = time.monotonic()
    try:
        return f(), None, time.monotonic() - t
    except Exception as e:  # noqa: BLE001 - returned to the checks
        return None, e, time.monotonic() - t


def client(port):
    return dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))


def missing(server, port):
    store = TorchStore(client(port))
    value = os.urandom(300)
    store.set("present", value)
    assert store.get("present", 0) == value
    assert store.get("present", 2.0) == value
    # A missing key: None at once without waiting, None after the timeout when waiting.
    got, err, dt = timed(lambda: store.get("absent", 0))
    assert got is None and err is None and dt < 1.0, (got, err, dt)
    got, err, dt = timed(lambda: store.get("absent", 0.5))
    assert got is None and err is None and 0.45 <= dt < 3.0, (got, err, dt)
    # A key written while get waits for it.
    late = os.urandom(50)
    writer = threading.Timer(0.3, lambda: client(port).set("late", late))
    writer.start()
    got, err, dt = timed(lambda: store.get("late", 10.0))
    writer.join()
    assert got == late and err is None and dt < 5.0, (got, err, dt)
    # Through toroid: the peer (rank 0) never comes, so its key stays missing: toroid's timeout.
    got, err, dt = timed(lambda: toroid.Comm.with_store(1, 2, TorchStore(client(port))))
    assert isinstance(err, toroid.TimeoutError), repr(err)
    assert TIMEOUT * 0.9 <= dt < TIMEOUT + 10, dt


def dead(server, port):
    store = TorchStore(client(port))
    for_toroid = TorchStore(client(port))  # connected before the server dies
    store.set("present", b"x")
    assert store.get("present", 1.0) == b"x"
    server.kill()
    server.wait()
    time.sleep(0.2)
    for wait in (0, 5.0):
        got, err, dt = timed(lambda: store.get("present", wait))
        assert isinstance(err, dist.DistNetworkError), f"get({wait}) on a dead store gave {got!r} / {err!r}"
        assert dt < 3.0, dt
    # Through toroid: the store's own error, at once (not toroid's "missing key" timeout).
    got, err, dt = timed(lambda: toroid.Comm.with_store(1, 2, for_toroid))
    assert isinstance(err, dist.DistNetworkError) and not isinstance(err, toroid.ToroidError), repr(err)
    assert isinstance(err.__context__, toroid.ToroidError), repr(err.__context__)
    assert dt < TIMEOUT / 2, f"{dt:.1f} s: the dead store was waited on like a slow one"


if __name__ == "__main__":
    server, port = serve()
    try:
        {"missing": missing, "dead": dead}[SCENARIO](server, port)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
    print(f"{SCENARIO} passed")
