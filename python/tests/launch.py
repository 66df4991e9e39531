"""Starts N rank processes of a worker script and collects their results (bounded in time).

Each rank gets TOROID_RANK/TOROID_WORLD_SIZE/TOROID_STORE_ADDR (toroid's launcher variables) and
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torch's env:// variables), with fresh free ports."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

PYTHON_DIR = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def child_env() -> dict:
    """This process's environment for a child process: with the checkout's package first on its
    PYTHONPATH, unless the tests run against the installed package (TOROID_TEST_INSTALLED=1,
    conftest.py)."""
    env = dict(os.environ)
    if env.get("TOROID_TEST_INSTALLED") != "1":
        env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_ranks(n: int, script: str, *args: str, timeout: float = 240, env: dict | None = None) -> list[RankResult]:
    """Runs `python script args...` as n ranks; kills every rank when one fails or at the timeout."""
    port, master_port = free_port(), free_port()
    base = child_env()
    base.update(
        TOROID_WORLD_SIZE=str(n),
        TOROID_STORE_ADDR=f"127.0.0.1:{port}",
        WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        OMP_NUM_THREADS="1",
    )
    base.update(env or {})
    with tempfile.TemporaryDirectory(prefix="toroid-pytest-") as tmp:
        procs, files = [], []
        for r in range(n):
            e = dict(base, TOROID_RANK=str(r), RANK=str(r), LOCAL_RANK=str(r), TOROID_TEST_TMP=tmp)
            out = open(os.path.join(tmp, f"out{r}"), "w+")
            err = open(os.path.join(tmp, f"err{r}"), "w+")
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    env=e,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now  # one rank failed: give the others a moment, then stop them
            if now > deadline or (failed_at is not None and now > failed_at + 5):
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        results = []
        for r, (p, (out, err)) in enumerate(zip(procs, files)):
            rc = p.wait()
            out.seek(0)
            err.seek(0)
            results.append(RankResult(r, rc, out.read(), err.read()))
            out.close()
            err.close()
        return results


def assert_all_passed(results: list[RankResult], marker: str) -> None:
    bad = [r for r in results if r.returncode != 0 or marker not in r.stdout]
    if bad:
        text = "\n".join(
            f"--- rank {r.rank} (exit {r.returncode})\n{r.stdout}\n{r.stderr[-6000:]}" for r in results
        )
        raise AssertionError(f"{len(bad)} of {len(results)} ranks failed:\n{text}")
