"""toroid.torch.TorchStore: torch's store timeout means a missing key; any other store failure
(a dead server) is an error, raised fast by Comm.with_store (store_worker.py, one process)."""

import pathlib

import pytest

from launch import assert_all_passed, run_ranks

import torch  # noqa: F401 - torch is required here: a missing torch fails these tests, never skips

WORKER = pathlib.Path(__file__).with_name("store_worker.py")


@pytest.mark.parametrize("scenario", ["missing", "dead"])
def test_torch_store(scenario):
    results = run_ranks(1, WORKER, scenario, timeout=120, env={"TOROID_TIMEOUT": "4"})
    assert_all_passed(results, f"{scenario} passed")
