"""torchft (meta-pytorch/torchft) on toroid: toroid.torchft.ProcessGroupToroid in place of torchft's
ProcessGroupGloo.

- test_torchft_tests_gloo_vs_toroid: torchft's own tests that build its ProcessGroupGloo
  (process_group_test.py, and the Manager/DDP integration and checkpoint-transport tests), run
  unchanged on gloo and on toroid (torchft_suite.py --compare): every test that passes on gloo
  must pass on toroid, and every toroid test must pass (the toroid-only extras included).
- test_wait_timeout_aborts_the_group: a Work.wait(timeout) past its timeout aborts the group, on
  the C++ path and the Python one (torchft_timeout_worker.py).
- test_ddp_kill_restart: torchft's DDP example (two replica groups, a lighthouse in this
  process), one replica SIGKILLed mid-run and restarted: training goes on without it, the
  restarted replica heals from the live one over toroid, and both end with equal parameters.

Skipped, with the reason, when torchft cannot be imported (`pip install torchft`; the first test
also needs `parameterized`, a test dependency of torchft).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

try:
    import torchft  # noqa: F401
    from torchft._torchft import LighthouseServer
except ImportError as e:  # (torch is required: a missing torch fails, as in test_torch.py)
    pytest.skip(f"torchft is not importable ({e}): pip install torchft", allow_module_level=True)

import torch  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
SUITE = HERE / "torchft_suite.py"
WORKER = HERE / "torchft_ddp_worker.py"
# More arguments for the workers, by hand: "--backend gloo" runs test_ddp_kill_restart on torchft's
# ProcessGroupGloo (the checks that are about toroid are then left out), "--torchft-ddp-as-is"
# with torchft's DistributedDataParallel as it is (see the worker: its hook kills the survivor).
WORKER_ARGS = os.environ.get("TOROID_TORCHFT_WORKER_ARGS", "").split()
ON_TOROID = "gloo" not in WORKER_ARGS


def _env() -> dict:
    env = dict(os.environ)
    if env.get("TOROID_TEST_INSTALLED") != "1":
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_torchft_tests_gloo_vs_toroid():
    t = time.monotonic()
    out = subprocess.run([sys.executable, str(SUITE), "--compare"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=900, check=False, env=_env())
    print(out.stdout)
    if out.returncode == 3:
        reason = next((line for line in out.stdout.splitlines() if line.startswith("SKIP")), "torchft's tests")
        pytest.skip(reason)
    summary = [line for line in out.stdout.splitlines() if line.startswith("compare:")]
    assert summary, f"no summary from the runner:\n{out.stdout[-4000:]}"
    print(f"{summary[0]} ({time.monotonic() - t:.0f} s)")
    assert out.returncode == 0, "\n".join(summary)
    # The suite really ran (gloo passes 26 with torchft 0.2.0 on a CPU machine), and nothing failed
    # on toroid, the toroid-only extras included.
    line = next(line for line in out.stdout.splitlines() if line.startswith("counts: "))
    counts = {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
    assert counts["gloo_passed"] >= 20, summary[0]
    assert counts["toroid_failed"] == 0 and counts["lost"] == 0, summary[0]


def _lines(out: pathlib.Path, pattern: str) -> list:
    rows = []
    for f in sorted(out.glob(pattern)):
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut by SIGKILL
                pass
    return rows


def _wait(what: str, cond, seconds: float, procs: list):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        for p in procs:
            if p.poll() not in (None, -signal.SIGKILL):
                raise AssertionError(f"a worker exited ({p.returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {seconds:.0f} s waiting for {what}")


@pytest.mark.parametrize("native", ["as_set", "0"])
def test_wait_timeout_aborts_the_group(native):
    """A wait that times out aborts the group on either path (torchft_timeout_worker.py): the
    C++ backend's works were once left unwrapped, so a timed-out recv held up the next send
    until its own timeout (torchft's PGTransportTest failed when a rank's group was native)."""
    env = _env()
    if native == "0":
        env["TOROID_TORCH_NATIVE"] = "0"
    python_path = env.get("TOROID_TORCH_NATIVE") == "0"
    r = subprocess.run([sys.executable, str(HERE / "torchft_timeout_worker.py")], capture_output=True,
                       text=True, timeout=120, check=False, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["1"]["exact"], seen
    # (both ranks' groups on one path: groups made at once on two threads wait for the C++
    # backend's first load instead of taking the Python path while it loads)
    assert [seen[r]["python_path"] for r in ("0", "1")] == [python_path] * 2, seen
    assert seen["1"]["recv"].startswith("Operation timed out! toroid recv did not complete within 0.05 s"), seen
    assert seen["1"]["errored"].startswith("RuntimeError('aborted: a wait on the toroid process group timed out"), seen
    assert "aborted" in seen["1"]["send"], seen
    assert seen["1"]["send_seconds"] < 2.0, seen  # (not the 5 s timeout)


@pytest.mark.parametrize("kill", ["external", "in_allreduce"])
def test_ddp_kill_restart(tmp_path, kill):
    """Two replica groups of torchft_ddp_worker.py under a lighthouse in this process. Replica 1
    is SIGKILLed once both have trained together for 5 steps: by this test at whatever point of
    its step it is ("external"), or by itself inside the gradient hook of a step both replicas
    are in, before its all-reduce, so that replica 0's all-reduce of that step fails on toroid
    ("in_allreduce"). Replica 0 must go on alone; replica 1 is restarted, must heal from
    replica 0 (over toroid: torchft's PGTransport) and train with it; both then stop at an
    agreed step, and their parameters and optimizer states must be equal."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1500)
    procs: list = []
    logs: list = []

    def start(rid: int, *extra: str) -> subprocess.Popen:
        f = open(tmp_path / f"worker{rid}.{len(procs)}.out", "w")
        logs.append(f)
        args = [sys.executable, str(WORKER), "--replica-id", str(rid), "--lighthouse", lighthouse.address(),
                "--out", str(tmp_path), *extra] + WORKER_ARGS
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=_env())
        procs.append(p)
        return p

    def rows(rid: int, pid: int) -> list:
        """The steps a worker process logged (not its final "done" line)."""
        return [r for r in _lines(tmp_path, f"replica{rid}.{pid}.jsonl") if "step" in r]

    def together(rid: int, pid: int, n: int):
        """n committed steps of this process with both replicas in the quorum, or None."""
        both = [r for r in rows(rid, pid) if r.get("participants") == 2 and not r.get("errored")]
        return both if len(both) >= n else None

    t0 = time.monotonic()
    try:
        a = start(0)
        if kill == "external":
            b = start(1)
            _wait("both replicas training together", lambda: together(1, b.pid, 5) and together(0, a.pid, 5), 120,
                  [a, b])
            b.send_signal(signal.SIGKILL)
        else:
            b = start(1, "--sigkill-at-step", "5")
            b.wait(120)
        assert b.wait(10) == -signal.SIGKILL, b.returncode
        t_kill = time.monotonic()
        killed_at = max((r["step"] for r in rows(1, b.pid)), default=0)
        # The survivor goes on alone: steps committed by a quorum of one, past the kill.
        alone = _wait("replica 0 committing steps alone",
                      lambda: [r for r in rows(0, a.pid) if r.get("participants") == 1 and r["step"] > killed_at][3:],
                      60, [a])
        t_alone = time.monotonic()
        c = start(1)
        back = _wait("the restarted replica 1 training with replica 0", lambda: together(1, c.pid, 5), 120, [a, c])
        t_back = time.monotonic()
        last = max(r["step"] for r in rows(0, a.pid) + rows(1, c.pid))
        stop_at = last + 10
        (tmp_path / "stop_at").write_text(str(stop_at))
        for p in (a, c):
            assert p.wait(120) == 0, f"worker {p.args} exited with {p.returncode}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        lighthouse.shutdown()
    elapsed = time.monotonic() - t0

    finals = [torch.load(tmp_path / f"replica{rid}.final.pt") for rid in (0, 1)]
    first_c = rows(1, c.pid)[0]
    failed = [r for r in rows(0, a.pid) if r.get("errored")]
    ops = rows(0, a.pid)[-1]["toroid_ops"]
    print(f"\n{kill}: replica 1 killed after step {killed_at}; replica 0's failed steps: "
          f"{[(r['step'], r['errored'][:90]) for r in failed]}; replica 0 alone from step {alone[0]['step']} "
          f"({t_alone - t_kill:.1f} s after the kill); the restarted replica's first step {first_c['step']} "
          f"(healing: {first_c['healing']}), with replica 0 from step {back[0]['step']} "
          f"({t_back - t_alone:.1f} s after its restart); stop at {stop_at}; "
          f"toroid operations of replica 0's last group: {ops}; {elapsed:.0f} s in all")
    # Both finished at the agreed step, on toroid groups, the restarted replica having healed
    # from the live one (it started past step 0) ...
    assert [f["step"] for f in finals] == [stop_at, stop_at]
    if ON_TOROID:
        assert {r["group"] for r in rows(0, a.pid) + rows(1, c.pid)} <= {"ProcessGroupToroid", "_NativeGroup", None}
        assert ops.get("allreduce", 0) > 0 and ops.get("send", 0) > 0, ops  # (the checkpoint went over toroid)
    assert first_c["step"] > killed_at and first_c["healing"], first_c
    if kill == "in_allreduce":  # replica 0's all-reduce failed, saying why
        assert failed and "Connection closed by peer" in failed[0]["errored"], failed
    # ... and their parameters and optimizer states are equal: each replica started from its own
    # weights and drew its own batches, so only torchft's synchronisation over toroid makes them so.
    for name, p0 in finals[0]["model"].items():
        p1 = finals[1]["model"][name]
        assert torch.equal(p0, p1), f"{name}: replicas differ by {(p0 - p1).abs().max().item():.3g}"
    torch.testing.assert_close(finals[0]["optim"], finals[1]["optim"], rtol=0, atol=0)
