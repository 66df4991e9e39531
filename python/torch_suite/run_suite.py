"""Runs torch's own distributed test suite (the one behind pytorch's test_distributed_spawn.py,
shipped in the wheel as torch.testing._internal.distributed.distributed_test) against one backend.

    python3 python/torch_suite/run_suite.py --backend gloo   [-k PATTERN] [--world-size 3]
    python3 python/torch_suite/run_suite.py --backend toroid [-k PATTERN] [--world-size 3]
    python3 python/torch_suite/run_suite.py --compare [--world-size 3]

--compare runs the suite on gloo and on toroid side by side (two child processes at once), and
fails (exit 1) when a test that passes on gloo does not pass on toroid (such tests are run once
more first, alone, to tell a flaky timing test from a real difference).

The suite decides at import time which tests a backend may run (decorators that compare the
backend's name with "gloo", "nccl", ...). With `--backend toroid` the decorators see "gloo", so
toroid is held to gloo's feature list: every test gloo is expected to pass runs on toroid too. At
run time the suite's BACKEND is "toroid", so every process group it creates is a toroid group.
A test whose body branches on the backend's name then takes the non-gloo branch; the notes in
docs/TORCH_CONFORMANCE.md say where that matters.

Every test starts WORLD_SIZE processes. By default they are forked from this one (which has
imported torch and registered toroid, and has no process group): about 1 s per test instead of
about 20 s for fresh interpreters on a 2-core machine. TOROID_SUITE_START=spawn starts fresh
interpreters as pytorch's test_distributed_spawn.py does; they import this file as their main
module, which registers the toroid backend in each of them.

Prints one line per test (PASS / SKIP / FAIL / ERROR) and the counts; exits 0 whatever the
counts are (comparing two backends is the point), 2 when the suite cannot be loaded.
"""

from __future__ import annotations

import argparse
import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = pathlib.Path(__file__).resolve().parent
if os.environ.get("TOROID_TEST_INSTALLED") != "1":  # else the installed package (conftest.py)
    sys.path.insert(0, str(HERE.parent))  # the toroid package of this checkout

RUN_AS = os.environ.get("TOROID_SUITE_BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "3")
if "TEMP_DIR" not in os.environ:
    # The suite's scratch directory: made here, removed when this process exits (forked ranks
    # leave through os._exit and do not remove it).
    _OWN_TEMP = tempfile.mkdtemp(prefix="toroid-suite-")
    os.environ["TEMP_DIR"] = _OWN_TEMP
    atexit.register(shutil.rmtree, _OWN_TEMP, ignore_errors=True)
else:
    _OWN_TEMP = None
# The decorators must see a backend the suite knows; toroid is judged by gloo's list.
os.environ["BACKEND"] = "gloo"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if RUN_AS == "toroid":
    import toroid.torch  # noqa: E402,F401  (registers the backend in this process and every child)

from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)



class _ToroidAsGloo(str):
    """The backend name the suite's test bodies see when toroid runs: its value is "toroid"
    (what init_process_group and new_group are given, what get_backend() is compared with),
    but it compares equal to "gloo" too, so that a test body that branches on the backend
    (`if BACKEND == "gloo": build the CPU model`) takes gloo's branch, as the decorators did."""

    def __eq__(self, other):
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


if RUN_AS == "toroid":
    distributed_test.BACKEND = _ToroidAsGloo("toroid")

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if os.environ.get("TOROID_SUITE_START") == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)


class _Result(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passed: list = []
        self.started = 0.0

    def startTest(self, test):
        self.started = time.monotonic()
        super().startTest(test)

    def _line(self, test, what, why=""):
        name = test.id().rsplit(".", 1)[-1]
        why = f": {why}" if why else ""
        self.stream.write(f"{what:5} {name} ({time.monotonic() - self.started:.1f} s){why}\n")
        self.stream.flush()

    def addSuccess(self, test):
        self.passed.append(test)
        self._line(test, "PASS")

    def addSkip(self, test, reason):
        self.skipped.append((test, reason))
        self._line(test, "SKIP", str(reason).splitlines()[0][:100] if reason else "")

    def addFailure(self, test, err):
        super(unittest.TextTestResult, self).addFailure(test, err)
        self._line(test, "FAIL")

    def addError(self, test, err):
        super(unittest.TextTestResult, self).addError(test, err)
        self._line(test, "ERROR")

    def addExpectedFailure(self, test, err):
        self.expectedFailures.append((test, ""))
        self._line(test, "XFAIL")

    def addUnexpectedSuccess(self, test):
        self.unexpectedSuccesses.append(test)
        self._line(test, "XPASS")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["gloo", "toroid"], default=RUN_AS)
    ap.add_argument("-k", action="append", default=[], help="run only tests whose name contains this")
    ap.add_argument("--world-size", type=int, default=int(os.environ["WORLD_SIZE"]))
    ap.add_argument("--list", action="store_true", help="list the selected tests and exit")
    ap.add_argument("--compare", action="store_true", help="run on gloo and on toroid; fail if toroid passes less")
    args = ap.parse_args()
    if args.compare:
        return compare(args)
    if args.backend != RUN_AS or str(args.world_size) != os.environ["WORLD_SIZE"]:
        # The backend and world size shape the module at import time: start again with them.
        env = dict(os.environ, TOROID_SUITE_BACKEND=args.backend, WORLD_SIZE=str(args.world_size))
        if _OWN_TEMP is not None:  # (exec skips atexit: the new process makes its own)
            shutil.rmtree(_OWN_TEMP, ignore_errors=True)
            del env["TEMP_DIR"]
        os.execve(sys.executable, [sys.executable, __file__] + sys.argv[1:], env)

    loader = unittest.TestLoader()
    names = [n for n in loader.getTestCaseNames(TestDistBackendWithSpawn)
             if not args.k or any(k in n for k in args.k)]
    if args.list:
        print("\n".join(names))
        return 0
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    print(f"torch {torch.__version__}: {len(names)} tests of distributed_test on backend {args.backend}, "
          f"WORLD_SIZE={args.world_size}", flush=True)
    runner = unittest.TextTestRunner(stream=sys.stdout, resultclass=_Result, verbosity=0)
    start = time.monotonic()
    result = runner.run(suite)
    print(f"backend {args.backend}: {len(result.passed)} passed, {len(result.skipped)} skipped, "
          f"{len(result.failures)} failed, {len(result.errors)} errors, "
          f"{len(result.expectedFailures)} expected failures, {len(result.unexpectedSuccesses)} unexpected successes "
          f"in {time.monotonic() - start:.0f} s", flush=True)
    return 0


def _start(backend: str, world_size: int, ks: list) -> tuple:
    """Starts the suite in a child process with its output in a temporary file (two run at
    once); returns the process and the file."""
    cmd = [sys.executable, __file__, "--backend", backend, "--world-size", str(world_size)]
    for k in ks:
        cmd += ["-k", k]
    out = tempfile.TemporaryFile(mode="w+")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, text=True), out


def _results(backend: str, started: tuple) -> dict:
    """Waits for a child of `_start`; returns {test: PASS|SKIP|FAIL|ERROR}."""
    proc, file = started
    proc.wait()
    with file:
        file.seek(0)
        out = file.read()
    results = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("PASS", "SKIP", "FAIL", "ERROR", "XFAIL", "XPASS"):
            results[parts[1]] = parts[0]
        if line.startswith(f"backend {backend}:"):
            print(line, flush=True)
    return results


def _run(backend: str, world_size: int, ks: list) -> dict:
    return _results(backend, _start(backend, world_size, ks))


def compare(args) -> int:
    # Side by side: each test mostly waits (its processes start, meet and join), so the two
    # runs share the cores well; a test that fails on toroid alone runs again alone below.
    gloo_run = _start("gloo", args.world_size, args.k)
    toroid_run = _start("toroid", args.world_size, args.k)
    gloo = _results("gloo", gloo_run)
    toroid = _results("toroid", toroid_run)
    behind = sorted(t for t, r in gloo.items() if r == "PASS" and toroid.get(t) != "PASS")
    if behind:
        print(f"again, alone: {' '.join(behind)}", flush=True)
        again = _run("toroid", args.world_size, behind)
        behind = [t for t in behind if again.get(t) != "PASS"]
    ahead = sorted(t for t, r in toroid.items() if r == "PASS" and gloo.get(t) != "PASS")
    print(f"world size {args.world_size}: gloo {sum(r == 'PASS' for r in gloo.values())} passed, "
          f"toroid {sum(r == 'PASS' for r in toroid.values())} passed of {len(gloo)} tests; "
          f"passing on gloo but not on toroid: {behind or 'none'}; on toroid but not on gloo: {ahead or 'none'}",
          flush=True)
    return 1 if behind or not gloo else 0


if __name__ == "__main__":
    sys.exit(main())
