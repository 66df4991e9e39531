"""The installed package as a torch user meets it: torch finds the backend with no toroid import
(its entry point), under torchrun, `python -m torch.distributed.run` and mp.spawn, as the CPU half
of a mixed backend string, and toroid-run is a command. These need the package installed
(scripts/test-package.sh runs the suite so, with TOROID_TEST_INSTALLED=1); from a checkout they
are skipped and say why."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from launch import assert_all_passed, run_ranks

pytestmark = pytest.mark.skipif(os.environ.get("TOROID_TEST_INSTALLED") != "1",
                                reason="needs the installed package: scripts/test-package.sh runs these")
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
WORKER = pathlib.Path(__file__).with_name("install_worker.py")


def _imports_toroid(script: pathlib.Path) -> bool:
    return any(line.lstrip().startswith(("import toroid", "from toroid")) for line in script.read_text().splitlines())


def _run(cmd: list[str], cwd, timeout: float = 240) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{p.stdout}\n{p.stderr[-6000:]}"
    return p


def _launcher(how: str) -> list[str]:
    if how == "torchrun":
        torchrun = shutil.which("torchrun")
        assert torchrun, "no torchrun on PATH"
        return [torchrun]
    return [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.parametrize("how", ["torchrun", "python -m torch.distributed.run"])
def test_ddp_example_trains_with_no_toroid_import(tmp_path, how):
    example = EXAMPLES / "ddp.py"
    assert not _imports_toroid(example)
    p = _run([*_launcher(how), "--standalone", "--nproc-per-node", "2", str(example)], tmp_path)
    for rank in (0, 1):
        assert f"rank {rank} step 4: loss" in p.stdout, p.stdout
        assert f"rank {rank}: parameters equal on every rank: True" in p.stdout, p.stdout


def test_mp_spawn_example(tmp_path):
    example = EXAMPLES / "spawn.py"
    assert not _imports_toroid(example)
    p = _run([sys.executable, str(example), "3"], tmp_path)
    for rank in range(3):
        assert f"rank {rank} of 3: all_reduce 6 on toroid" in p.stdout, p.stdout


@pytest.mark.parametrize("backend", ["cpu:toroid,cuda:gloo", "cpu:toroid"])
def test_toroid_as_the_cpu_backend_of_a_mixed_group(backend):
    # cuda:gloo stands for cuda:nccl, which cannot be created without a GPU: the group is built
    # the same way (torch's ProcessGroup, toroid's backend for "cpu", the other for "cuda").
    assert_all_passed(run_ranks(3, str(WORKER), "mixed", backend, timeout=120), f"{backend} ok")


def test_toroid_run_is_a_command_of_the_environment(tmp_path):
    exe = shutil.which("toroid-run")
    assert exe and pathlib.Path(exe).parent == pathlib.Path(sys.executable).parent, exe
    code = ("import numpy as np, toroid; c = toroid.Comm.from_env(); x = np.arange(5, dtype=np.float32) + c.rank; "
            "c.all_reduce(x); print('sum', c.rank, x.tolist())")
    p = _run([exe, "-n", "3", "--", sys.executable, "-c", code], tmp_path, timeout=120)
    for rank in range(3):
        assert f"sum {rank} [3.0, 6.0, 9.0, 12.0, 15.0]" in p.stdout, p.stdout


def test_the_package_loads_its_own_library_and_toroid_library_overrides_it(tmp_path):
    code = "import toroid; print(toroid.library_path()); print(toroid.version())"
    own = _run([sys.executable, "-c", code], tmp_path).stdout.split()
    import toroid

    package = pathlib.Path(toroid.__file__).parent
    assert own[0] == str(package / "libtoroid.so"), own
    copy = tmp_path / "libtoroid-copy.so"
    shutil.copy(own[0], copy)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, TOROID_LIBRARY=str(copy)))
    assert p.returncode == 0 and p.stdout.split() == [str(copy), own[1]], p
