"""`python -m toroid.bench` as a user runs it: a subprocess that starts its own ranks, prints the
table and writes --json. With TOROID_TEST_INSTALLED=1 the toroid package must come from the
installation, so the checkout's python/ directory is not put on the PYTHONPATH."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from launch import child_env

from toroid import bench


def _run(tmp_path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # cwd: a directory without the package, so that only PYTHONPATH (or the installation) finds it
    return subprocess.run([sys.executable, "-m", "toroid.bench", *args], env=child_env(), cwd=tmp_path,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def test_bench_compares_both_backends(tmp_path):
    out = tmp_path / "rows.json"
    p = _run(tmp_path, "--sizes", "4K,1M", "--iters", "6", "--rounds", "2", "--timeout", "180", "--json", str(out))
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and doc["backends"] == ["gloo", "toroid"] and doc["dtype"] == "float32"
    assert [r["bytes"] for r in doc["rows"]] == [4096, 1 << 20]
    for r in doc["rows"]:
        assert r["count"] == r["bytes"] // 4 and r["iters"] == 6
        for b in ("gloo", "toroid"):
            assert r[f"{b}_p50_us"] > 0 and r[f"{b}_busbw_gbps"] > 0, r
        assert r["speedup"] == pytest.approx(r["gloo_p50_us"] / r["toroid_p50_us"])
    # The printed table has the same rows, every column a number.
    table = [line.split() for line in p.stdout.splitlines() if not line.startswith("#")]
    assert [int(t[0]) for t in table] == [4096, 1 << 20], p.stdout
    assert all(re.fullmatch(r"[\d.]+x?", c) for t in table for c in t), p.stdout


def test_bench_one_backend(tmp_path):
    # (async calls through their futures: the result is checked as for blocking ones)
    out = tmp_path / "rows.json"
    p = _run(tmp_path, "--backends", "toroid", "--sizes", "64K", "--iters", "2", "--rounds", "1",
             "--dtype", "bfloat16", "--call", "future", "--timeout", "180", "--json", str(out))
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    doc = json.loads(out.read_text())
    assert doc["call"] == "future" and "async, then get_future().wait()" in p.stdout, p.stdout
    (row,) = doc["rows"]
    assert row["count"] == 32 << 10 and row["toroid_p50_us"] > 0
    assert "gloo_p50_us" not in row and "speedup" not in row


def test_bench_numpy_backend(tmp_path):
    # toroid's own binding on the toroid group's communicator, beside torch's path, 3 ranks, its
    # results checked as the others' are; the table gets its two columns.
    out = tmp_path / "rows.json"
    p = _run(tmp_path, "--ranks", "3", "--backends", "toroid,numpy", "--sizes", "4K,64K", "--iters", "4",
             "--rounds", "2", "--call", "wait", "--dtype", "float64", "--timeout", "180", "--json", str(out))
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    doc = json.loads(out.read_text())
    assert doc["backends"] == ["toroid", "numpy"] and "numpy us" in p.stdout, p.stdout
    for r in doc["rows"]:
        assert r["numpy_p50_us"] > 0 and r["numpy_busbw_gbps"] > 0 and r["toroid_p50_us"] > 0, r
        assert "speedup" not in r
    table = [line.split() for line in p.stdout.splitlines() if not line.startswith("#")]
    assert [len(t) for t in table] == [10, 10], p.stdout  # (gloo's and the speed-up columns are "-")


@pytest.mark.parametrize("op,call", [("all_gather", "blocking"), ("reduce_scatter", "wait")])
def test_bench_fsdp_collectives(tmp_path, op, call):
    # 3 ranks: 4 KiB is rounded down to whole pieces (4092 bytes); both backends' results are
    # checked by every rank against its own reference, so a wrong gather or scatter fails the run.
    out = tmp_path / "rows.json"
    p = _run(tmp_path, "--op", op, "--call", call, "--ranks", "3", "--sizes", "4K,96K", "--iters", "4", "--rounds",
             "2", "--dtype", "int32", "--timeout", "180", "--json", str(out))
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    doc = json.loads(out.read_text())
    assert doc["collective"] == op and doc["ranks"] == 3
    assert [r["bytes"] for r in doc["rows"]] == [4092, 96 << 10]
    for r in doc["rows"]:
        assert r["gloo_p50_us"] > 0 and r["toroid_p50_us"] > 0
        assert r["toroid_busbw_gbps"] == pytest.approx(r["bytes"] / (r["toroid_p50_us"] * 1e3) * 2 / 3)
    assert ("all_gather_into_tensor" if op == "all_gather" else "reduce_scatter_tensor") in p.stdout, p.stdout


def test_bench_timeout_stops_the_ranks(tmp_path):
    # 0.2 s is less than any rank needs to import torch: the run must end at its deadline, say
    # so, and fail, without waiting for the ranks.
    p = _run(tmp_path, "--sizes", "4K", "--timeout", "0.2", timeout=60)
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "timed out after 0.2 s" in p.stderr and "stopped rank(s) 0, 1" in p.stderr, p.stderr


def test_sizes_and_arguments():
    assert [bench.parse_size(s) for s in ("4096", "4K", "64M", "1G", "2KiB")] == [4096, 4096, 64 << 20, 1 << 30, 2048]
    args = bench.parser().parse_args([])
    assert bench.sizes_of(args) == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    assert bench.sizes_of(bench.parser().parse_args(["-b", "1K", "-e", "8K", "-f", "2"])) == [1024, 2048, 4096, 8192]
    for bad in (["--sizes", "4X"], ["--sizes", "0"]):
        with pytest.raises(SystemExit):
            bench.parser().parse_args(bad)
    for bad in (["--backends", "nccl"], ["--dtype", "float32", "--sizes", "6"], ["--op", "all_gather", "--sizes", "4"],
                ["--op", "reduce_scatter", "--call", "future"], ["--backends", "numpy", "--op", "all_gather"],
                ["--backends", "numpy", "--call", "future"], ["--backends", "numpy", "--dtype", "bfloat16"]):
        with pytest.raises(SystemExit):
            bench.main(bad)
