"""The CUDA side of the torch backend, as far as it can be checked without a GPU (in this
process, one rank): which CUDA tensors take the stream path and which are staged through host
memory, the refusal of a call mixing CPU and CUDA tensors (through every entry point that takes
tensors), the registration for both devices, and the binding of the C stream entry points.
What needs a GPU is python/tests/gpu_torch_check.py, run by scripts/gpu-check.sh; its CPU dry
run (the same checks on CPU tensors: inputs, references, bounds) runs here."""

import ctypes
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import toroid
import toroid.torch as tt
from toroid import ReduceOp

STREAM_TYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64]
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]


@pytest.mark.parametrize("dtype", STREAM_TYPES)
def test_stream_path_takes_the_device_types(dtype):
    assert tt.stream_path(dtype, None, True, 10)  # broadcast
    for op in OPS:
        expected = not (op == ReduceOp.AVG and not dtype.is_floating_point)  # AVG on integers: staged
        assert tt.stream_path(dtype, op, True, 10) == expected, op
        assert tt.stream_path(dtype, op, True, 1) == expected, op


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.bool, torch.complex64, torch.int16,
                                   torch.float8_e4m3fn] + [getattr(torch, n) for n in ("uint32", "uint64") if hasattr(torch, n)])
def test_stream_path_stages_other_types(dtype):
    assert not tt.stream_path(dtype, None, True, 10)
    for op in OPS:
        assert not tt.stream_path(dtype, op, True, 10), op


@pytest.mark.parametrize("dtype", STREAM_TYPES)
def test_stream_path_stages_non_contiguous_and_empty(dtype):
    for op in [None, ReduceOp.SUM, ReduceOp.MAX]:
        assert not tt.stream_path(dtype, op, False, 10), op
        assert not tt.stream_path(dtype, op, True, 0), op


def test_stream_path_stages_compressed_float_all_reduce():
    bf16, f16 = toroid.DataType.BFLOAT16, toroid.DataType.FLOAT16
    for dtype in [torch.float32, torch.float64]:
        assert not tt.stream_path(dtype, ReduceOp.SUM, True, 10, bf16)
        assert not tt.stream_path(dtype, ReduceOp.AVG, True, 10, f16)
    # The wire type applies to float32/float64 only (as on the CPU): the others keep the path.
    for dtype in [torch.float16, torch.bfloat16, torch.int32, torch.int64]:
        assert tt.stream_path(dtype, ReduceOp.SUM, True, 10, bf16)


class _Dev:
    def __init__(self, device):
        self.device = torch.device(device)


def test_device_type_of_a_call():
    assert tt._device_type([]) == "cpu"
    assert tt._device_type([_Dev("cpu"), _Dev("cpu")]) == "cpu"
    assert tt._device_type([_Dev("cuda:0"), _Dev("cuda:1")]) == "cuda"
    assert tt._device_type([_Dev("meta")]) == "cpu"  # refused later by the CPU path, as before
    for mix in ([_Dev("cpu"), _Dev("cuda:0")], [_Dev("cuda:1"), _Dev("meta")]):
        with pytest.raises(ValueError, match="one kind of device"):
            tt._device_type(mix)


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0: enough to reach the device check of a call,
    which must refuse it next to a CPU tensor before touching either."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def fake_cuda(n):
    return torch.Tensor._make_subclass(FakeCuda, torch.zeros(n))


@pytest.fixture(scope="module")
def pg():
    group = tt.ProcessGroupToroid(dist.HashStore(), 0, 1)
    yield group
    group.shutdown()


def test_mixed_devices_are_refused_by_every_entry_point(pg):
    c = lambda: torch.ones(4)  # noqa: E731
    f = lambda: fake_cuda(4)  # noqa: E731
    reduce_opts, root_opts, band = dist.AllreduceOptions(), dist.BroadcastOptions(), dist.AllreduceOptions()
    band.reduceOp = dist.ReduceOp.BAND
    # (the group's Python methods: a FakeCuda tensor is a CUDA tensor to Python only, so through
    # the C++ backend's entry points, torch's C++ ProcessGroup methods on a group with it, it is
    # the CPU tensor it is; real CUDA tensors reach the Python methods from there)
    py = {name: getattr(pg, f"_py_{name}", getattr(pg, name)) for name in tt._backend.NATIVE_OPS}
    calls = {
        "allreduce": lambda: pg.allreduce([c(), f()], reduce_opts),
        "allreduce BAND": lambda: pg.allreduce([c().long(), f().long()], band),
        "allreduce_coalesced": lambda: py["allreduce_coalesced"]([c(), f()], dist.AllreduceCoalescedOptions()),
        "broadcast": lambda: pg.broadcast([f(), c()], root_opts),
        "reduce": lambda: py["reduce"]([c(), f()], dist.ReduceOptions()),
        "allgather": lambda: py["allgather"]([[f()]], [c()]),
        "allgather_coalesced": lambda: pg.allgather_coalesced([[c()]], [f()]),
        "all_gather_single": lambda: py["all_gather_single"](f(), c()),
        "all_gather_single_coalesced": lambda: py["all_gather_single_coalesced"]([c()], [f()]),
        "reduce_scatter": lambda: pg.reduce_scatter([f()], [[c()]]),
        "reduce_scatter_single": lambda: py["reduce_scatter_single"](c(), f()),
        "reduce_scatter_single_coalesced": lambda: py["reduce_scatter_single_coalesced"]([f()], [c()]),
        "all_to_all_single": lambda: py["all_to_all_single"](c(), f(), [], []),
        "alltoall": lambda: pg.alltoall([f()], [c()]),
        "gather": lambda: py["gather"]([[c()]], [f()]),
        "scatter": lambda: py["scatter"]([f()], [[c()]]),
        "send": lambda: pg.send([c(), f()], 0, 0),  # (torch's ProcessGroup.send: the tag is required)
        "recv": lambda: pg.recv([f(), c()], 0, 0),
        "recv_anysource": lambda: pg.recv_anysource([f(), c()]),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="one kind of device"):
            call()
            pytest.fail(f"{name}: a call mixing CPU and CUDA tensors was not refused")
    # Refused before anything was issued: the group still works.
    x = torch.arange(6.0)
    pg.allreduce([x]).wait()
    assert torch.equal(x, torch.arange(6.0))


def test_cpu_calls_take_neither_cuda_path():
    group = tt.ProcessGroupToroid(dist.HashStore(), 0, 1)
    try:
        x = torch.arange(5.0)
        group.allreduce([x]).wait()
        group.allreduce_coalesced([x, x + 1]).wait()
        group.allreduce_wire(x, "bf16", dist.ReduceOp.SUM).wait()
        group.broadcast([x]).wait()
        out = torch.empty(5)
        group._allgather_base(out, x).wait()
        assert torch.equal(out, torch.arange(5.0)) and torch.equal(x, torch.arange(5.0))
        group.reduce([x]).wait()
        out = torch.empty(5)
        group.all_to_all_single(out, x, [], []).wait()
        assert torch.equal(out, torch.arange(5.0)) and torch.equal(x, torch.arange(5.0))
        paths = [k for k in group.stats if k.endswith((":staged", ":stream"))]
        assert not paths, group.stats
        assert group.stats["allreduce"] == 1 and group.stats["allreduce_wire"] == 1, group.stats
    finally:
        group.shutdown()


def test_registered_for_cpu_and_cuda(pg):
    assert list(dist.Backend.backend_capability[tt.BACKEND]) == ["cpu", "cuda"]
    assert {d.type for d in pg._device_types} == {"cpu", "cuda"}
    assert pg._get_backend(torch.device("cuda")) is pg._get_backend(torch.device("cpu"))
    backend = pg._get_backend(torch.device("cuda"))
    if pg._native_comm is not None:  # the C++ backend (over the Python one, for what it does not take)
        assert type(backend).__name__ == "ToroidBackend" and backend._get_backend_name() == tt.BACKEND
    else:
        assert isinstance(backend, tt._DeviceBackend)
    # Object collectives and barrier stay on the CPU (torch picks "cpu" when it is registered).
    assert dist.distributed_c10d._get_object_coll_device(pg) == "cpu"


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_stream_entry_points_are_bound(pg):
    """The Comm wrappers reach the C functions: host memory is refused, as the C ABI says,
    with UNSUPPORTED where there is no CUDA driver and INVALID_ARGUMENT where there is one."""
    x = torch.zeros(4)
    p = x.data_ptr()
    expected = toroid.InvalidArgumentError if _driver_present() else toroid.UnsupportedError
    with pytest.raises(expected) as e:
        pg.comm.all_reduce_stream_ptr(p, p, 4, "float32", "sum", 0)
    assert "toroid_all_reduce_stream" in str(e.value)
    if expected is toroid.UnsupportedError:
        assert "CUDA is not available" in str(e.value)
    with pytest.raises(expected) as e:
        pg.comm.broadcast_stream_ptr(p, p, 4, "float32", 0, 0)
    assert "toroid_broadcast_stream" in str(e.value)
    for name, call in [
        ("toroid_reduce_stream", lambda: pg.comm.reduce_stream_ptr(p, p, 4, "float32", "max", 0)),
        ("toroid_all_to_all_stream", lambda: pg.comm.all_to_all_stream_ptr(p, p, 4 // pg.size(), "float32")),
        ("toroid_send_stream", lambda: pg.comm.send_stream_ptr(p, 4, "float32", (pg.rank() + 1) % pg.size())),
        ("toroid_recv_stream", lambda: pg.comm.recv_stream_ptr(p, 4, "float32", (pg.rank() + 1) % pg.size())),
    ]:
        with pytest.raises(expected) as e:
            call()
        assert name in str(e.value)
    # (On this one-rank group the peer is the rank itself: with a driver, send and receive are
    # refused for that, before their memory is looked at.)
    # A negative peer is an argument error whatever the machine.
    with pytest.raises(toroid.InvalidArgumentError, match="peer -1 is negative"):
        pg.comm.send_stream_ptr(p, 4, "float32", -1)
    # Inside a group the calls would run ahead of the ones recorded before them: refused.
    with pytest.raises(toroid.InvalidUsageError):
        with pg.comm.group():
            pg.comm.all_reduce_stream_ptr(p, p, 4, "float32", "sum", 0)
    pg.comm.all_reduce(x.numpy())  # the communicator is still usable


def test_nvrtc_is_found_in_torchs_wheels():
    # torch from PyPI (the CUDA build, as the test suite installs it) ships NVRTC 13; importing
    # the backend points the GPU kernels' compiler at it unless TOROID_NVRTC_PATH was set.
    import os

    found = tt.nvrtc_from_torch()
    assert found is not None and found.endswith("libnvrtc.so.13") and os.path.exists(found), found
    assert os.environ.get("TOROID_NVRTC_PATH"), "TOROID_NVRTC_PATH is set after importing toroid.torch"


def test_the_gpu_check_passes_its_cpu_dry_run():
    """gpu_torch_check.py --cpu-dry-run: 2 processes run every check of the GPU script that
    needs no GPU on CPU tensors, so a wrong reference or bound shows here, not first on a GPU
    machine (nothing of the CUDA path runs)."""
    script = pathlib.Path(__file__).with_name("gpu_torch_check.py")
    r = subprocess.run([sys.executable, str(script), "--cpu-dry-run"], capture_output=True, text=True, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "PASS: gpu_torch_check (2 processes on the CPU, dry run)" in r.stdout, out[-6000:]
    counts = re.findall(r"\[rank (\d)\] (\d+) passed, (\d+) failed", r.stdout)
    assert sorted(c[0] for c in counts) == ["0", "1"], out[-6000:]
    assert all(int(p) > 150 and f == "0" for _, p, f in counts), counts
