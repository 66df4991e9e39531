"""The torch.distributed backend "toroid" against gloo, across real processes (2 and 3)."""

import pathlib

import pytest

from launch import assert_all_passed, run_ranks

pytest.importorskip  # torch is required here: a missing torch fails these tests, never skips
import torch  # noqa: E402,F401

WORKER = pathlib.Path(__file__).with_name("torch_worker.py")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("scenario", ["compare", "ddp", "fsdp", "wire", "entry_points", "wait_timeout", "conformance", "errors",
                                      "peer_death", "shrink", "compare/no-device-backend", "ddp/no-device-backend",
                                      "entry_points/python-backend"])
def test_torch_backend(scenario, n):
    assert_all_passed(run_ranks(n, WORKER, scenario, timeout=300), f"{scenario} passed")
