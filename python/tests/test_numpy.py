"""toroid.Comm on numpy arrays across real processes (2 and 3 ranks)."""

import pathlib

import pytest

from launch import assert_all_passed, run_ranks

WORKER = pathlib.Path(__file__).with_name("np_worker.py")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("scenario", ["collectives", "async", "errors", "with_store", "dump", "shrink", "grow", "group", "wire"])
def test_numpy(scenario, n):
    assert_all_passed(run_ranks(n, WORKER, scenario, timeout=180), f"{scenario} passed")
