"""Grouped sends and receives against the same calls one by one, through toroid's numpy binding:
every rank sends one message to each neighbour and receives one from each, as one group
(`with comm.group():`, the batch side by side) and as blocking calls ordered so that they
cannot deadlock (even ranks send first; an even number of ranks). Median of 30 calls after 5 warm-ups, two alternating
rounds per size, the better round; rank 0 prints one line per size.

    cargo build --release && TOROID_LIBRARY=target/release/libtoroid.so PYTHONPATH=python \\
        target/release/toroid-run -n 4 python scripts/p2p-group-bench.py
"""
import time

import numpy as np
import toroid

comm = toroid.Comm.from_env()
R, N = comm.rank, comm.size
nxt, prv = (R + 1) % N, (R - 1) % N
for nbytes in (4 << 10, 64 << 10, 1 << 20, 16 << 20):
    n = nbytes // 4
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    x, y = np.zeros(n, np.float32), np.zeros(n, np.float32)

    def grouped():
        with comm.group():
            comm.send(a, nxt)
            comm.send(b, prv)
            comm.recv(x, prv)
            comm.recv(y, nxt)

    def ordered():
        if R % 2 == 0:
            comm.send(a, nxt), comm.recv(x, prv), comm.send(b, prv), comm.recv(y, nxt)
        else:
            comm.recv(x, prv), comm.send(a, nxt), comm.recv(y, nxt), comm.send(b, prv)

    best = {}
    for name, f in (("grouped", grouped), ("ordered", ordered)) * 2:
        for _ in range(5):
            f()
        comm.barrier()
        times = []
        for _ in range(30):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        best[name] = min(best.get(name, float("inf")), float(np.median(times)) * 1e6)
    if R == 0:
        g, o = best["grouped"], best["ordered"]
        print(f"{N} ranks {nbytes:>9} B: grouped {g:9.1f} us, one by one {o:9.1f} us, {o / g:.2f}x", flush=True)
