"""A Work.wait(timeout) that passes its timeout on a toroid.torchft.ProcessGroupToroid aborts the
group, whichever path made the work (the C++ backend's or the Python one's).

Two ranks as threads of this process (as torchft's checkpoint-transport test runs them), each
configured at once on one TCPStore. First a send/recv of random data, checked element by element;
then rank 1 waits 50 ms for a recv that rank 0 never sends: the wait raises "timed out", the
group reports errored(), and rank 1's next send fails at once (a pending recv would otherwise hold
it up until its timeout: toroid runs a group's operations in issue order). Prints one JSON line:
what each rank saw, and whether the works came from the Python path (toroid.torch.ToroidWork)."""

import json
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from toroid.torch import ToroidWork
from toroid.torchft import ProcessGroupToroid

TIMEOUT = timedelta(seconds=5)


def main() -> int:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}/timeout-test"
    expected = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    out = {}
    barrier = threading.Barrier(2, timeout=30)

    def run(rank: int) -> None:
        pg = ProcessGroupToroid(timeout=TIMEOUT)
        pg.configure(addr, "replica", rank, 2)
        seen = out.setdefault(rank, {})
        if rank == 0:
            work = pg.send([expected.clone()], 1, 0)
            work.wait(TIMEOUT)
        else:
            got = torch.zeros(1000)
            work = pg.recv([got], 0, 0)
            work.wait(TIMEOUT)
            seen["exact"] = bool(torch.equal(got, expected))
        seen["python_path"] = isinstance(getattr(work, "_work", work), ToroidWork)
        barrier.wait()
        if rank == 1:
            try:
                pg.recv([torch.zeros(1, dtype=torch.int64)], 0, 1).wait(timedelta(milliseconds=50))
                seen["recv"] = "completed"
            except RuntimeError as e:
                seen["recv"] = str(e)
            seen["errored"] = repr(pg.errored())
            start = time.monotonic()
            try:
                pg.send([torch.ones(3)], 0, 2).wait(TIMEOUT)
                seen["send"] = "completed"
            except RuntimeError as e:
                seen["send"] = str(e)
            seen["send_seconds"] = time.monotonic() - start
        barrier.wait()
        pg.shutdown()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
