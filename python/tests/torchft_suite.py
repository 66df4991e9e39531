"""torchft's own tests that build its ProcessGroupGloo, run on gloo and on toroid
(toroid.torchft.ProcessGroupToroid), with the installed torchft (checked with 0.2.0).

    python3 python/tests/torchft_suite.py --compare                       # both backends, compared
    python3 python/tests/torchft_suite.py --backend toroid [--part integ] [-k REGEX]

The tests are torchft's test methods, their bodies unchanged. On toroid, the name
ProcessGroupGloo in torchft's test module is ProcessGroupToroid for the duration of each test
(mock.patch.object), so the same bodies build, configure and use toroid groups:

part "pg", torchft/process_group_test.py:
- ProcessGroupTest.test_gloo_apis (cpu: every collective of a 1-rank group, then DDP on it; its
  cuda case skips without CUDA), test_gloo_timeout (set-up of a 2-rank group with one rank,
  10 ms timeout), test_functional_collectives (register() and a functional all_reduce);
- NormalGlooMultiPgTest.test_collective[...] and test_collective_with_resiliency[...] (3 ranks as
  threads of this process, one reconfigurable group each; the resiliency case reconfigures,
  shuts the last rank's group down and checks that the others' collective fails): on toroid a
  subclass whose BACKEND is "toroid" and whose _create_pg builds ProcessGroupToroid with gloo's
  timeout (1 s). The line of a passed resiliency case says what its survivors raised
  (torchft's pattern also accepts its own "no error": the collective passed without the
  dead rank, which a broadcast from rank 0 or a send/recv between ranks 0 and 1 may).
- On toroid only, as extras (not compared: torchft skips them on gloo, whose group refuses
  them): the same two methods for alltoall_base and reduce_scatter_tensor_coalesced.
  (reduce_scatter is left out: torchft's check returns at once on CPU tensors.)

part "integ": checkpointing/pg_transport_test.py test_pg_transport_gloo (a checkpoint sent over
the group's send/recv to 2 and 1 receivers, then a receive that times out) and
manager_integ_test.py's ManagerIntegTest cases that build ProcessGroupGloo: test_ddp_healthy,
test_ddp_recovery[async_quorum, sync_quorum], test_ddp_recovery_multi_rank,
test_ddp_skip_init_sync, test_manager_allreduce (torchft's Manager, a lighthouse, 2 replica
groups as threads, a replica failing by an injected exception and recovering from the other).
(test_quorum_timeout builds a gloo group too, but never configures it: left out.)

A test counts as passed on a backend only if it ran on it: its groups are of that class, or it
built one while it ran. Prints one line per test (PASS / SKIP / FAIL / ERROR, seconds) and a
summary line per run; --compare runs everything on both backends (a gloo process that crashes
before its summary runs again, up to twice), prints a "compare:" line, and exits 1 when a test that passes on gloo does not pass on toroid (or no gloo test passed), 0
otherwise; 3 when torchft or its test modules cannot be imported (`parameterized`, a test
dependency of torchft, is needed too).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time
import unittest
from datetime import timedelta
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parent
if os.environ.get("TOROID_TEST_INSTALLED") != "1":  # else the installed package (conftest.py)
    sys.path.insert(0, str(HERE.parent))  # the toroid package of this checkout

NO_TORCHFT = 3
SINGLE = ("test_gloo_apis", "test_gloo_timeout", "test_functional_collectives")
MULTI = ("test_collective",)  # test_collective_<i>_<name> and test_collective_with_resiliency_<i>_<name>
EXTRAS = ("alltoall_base", "reduce_scatter_tensor_coalesced")
# torchft's other tests whose bodies build a ProcessGroupGloo (the name patched as above):
# checkpoint transfer over the group, and torchft's Manager + DDP integration tests (2 replica
# groups as threads, a lighthouse, failures injected by raising in a replica, which restarts).
PG_TRANSPORT = ("test_pg_transport_gloo",)
MANAGER = ("test_ddp_healthy", "test_ddp_recovery", "test_ddp_skip_init_sync", "test_manager_allreduce")
NOT = ("torchcomms",)  # (torchft's tests of its torchcomms group, not of a gloo one)


def _display(cls_name: str, method: str) -> str:
    """`ProcessGroupTest.test_gloo_apis[cpu]`: parameterized's method names without their index
    (the index of a collective varies between runs: torchft lists them from a set)."""
    m = re.match(r"^(test_\w+?)_\d+_(.+)$", method)
    return f"{cls_name}.{m.group(1)}[{m.group(2)}]" if m else f"{cls_name}.{method}"


def _patched(base: type, module, backend: str) -> type:
    """torchft's test case `base` whose tests see ProcessGroupToroid under the name
    ProcessGroupGloo of their module (`module`) when `backend` is toroid."""

    class Case(base):
        def setUp(self) -> None:
            super().setUp()
            if backend == "toroid":
                from toroid.torchft import ProcessGroupToroid

                patch = mock.patch.object(module, "ProcessGroupGloo", ProcessGroupToroid)
                patch.start()
                self.addCleanup(patch.stop)

    Case.__name__ = Case.__qualname__ = base.__name__
    return Case


def _multi_pg(backend: str, pgt) -> type:
    class NormalGlooMultiPgTest(pgt.NormalGlooMultiPgTest):
        BACKEND = backend

        def assertRaisesRegex(self, expected, regex, *args, **kwargs):
            # What the survivors of a resiliency test raised (torchft's pattern also accepts its
            # own "no error", raised when the collective passed without the dead rank): kept
            # for the report, the assertion itself unchanged.
            ctx = super().assertRaisesRegex(expected, regex, *args, **kwargs)
            raised = self.raised

            class Recording:
                def __enter__(self):
                    return ctx.__enter__()

                def __exit__(self, *exc):
                    if exc[1] is not None:
                        raised.append(str(exc[1]).splitlines()[0][:160])
                    return ctx.__exit__(*exc)

            return Recording()

        def setUp(self) -> None:
            super().setUp()
            self.raised = []

        @classmethod
        def _create_pg(cls, name: str):
            if name == "toroid":
                from toroid.torchft import ProcessGroupToroid

                return ProcessGroupToroid(timeout=timedelta(seconds=1))  # as torchft's gloo case
            return super()._create_pg(name)

    # The extras: torchft's parameterized methods for collectives its gloo case skips.
    if backend == "toroid":
        for i, coll in enumerate(EXTRAS):
            def parallel(self, coll=coll):
                self._run_parallel(coll, device="cpu")

            def resilient(self, coll=coll):
                self._run_with_resiliency(coll, device="cpu")

            for base, fn in (("test_extra_collective", parallel), ("test_extra_collective_with_resiliency", resilient)):
                setattr(NormalGlooMultiPgTest, f"{base}_{i}_{coll}", fn)
    return NormalGlooMultiPgTest


def _cases(backend: str, part: str) -> list:
    """torchft's tests of one part: "pg" (process_group_test.py) or "integ" (pg_transport_test.py,
    manager_integ_test.py; they init the default process group, which process_group_test.py's
    test_functional_collectives leaves initialised, and bind fixed ports, 19530 and up)."""
    if part == "pg":
        import torchft.process_group_test as pgt

        classes = ((_patched(pgt.ProcessGroupTest, pgt, backend), SINGLE),
                   (_multi_pg(backend, pgt), MULTI + ("test_extra",)))
    else:
        import torchft.checkpointing.pg_transport_test as ptt
        import torchft.manager_integ_test as mit

        classes = ((_patched(ptt.PGTransportTest, ptt, backend), PG_TRANSPORT),
                   (_patched(mit.ManagerIntegTest, mit, backend), MANAGER))
    loader = unittest.TestLoader()
    cases = []
    for cls, prefixes in classes:
        names = [n for n in loader.getTestCaseNames(cls) if n.startswith(prefixes) and not any(x in n for x in NOT)]
        # The resiliency tests leave the shared groups broken (each reconfigures first): after
        # every test that uses them as they are.
        for name in sorted(names, key=lambda n: ("resiliency" in n, n)):
            cases.append(cls(name))
    return cases


class _Result(unittest.TestResult):
    """Prints a line per test. A test counts as passed only if it ran on the backend named:
    torchft's multi-rank cases hold groups of that class, and every other case built (or tried
    to build, for the set-up timeout) at least one group of it while it ran."""

    def __init__(self, backend: str, group_class: type, built: list):
        super().__init__()
        self.backend = backend
        self.outcomes: dict[str, str] = {}
        self._start = 0.0
        self._group_class = group_class
        self._built = built  # [groups built so far]
        self._built_at_start = 0

    def startTest(self, test):
        super().startTest(test)
        self._start = time.monotonic()
        self._built_at_start = self._built[0]

    def _backend_check(self, test) -> str:
        pool = getattr(type(test), "pg_pool", None)
        if pool is not None:
            wrong = [type(pg).__name__ for pg in pool if type(pg) is not self._group_class]
            return f"its groups are {wrong}, not {self._group_class.__name__}" if wrong else ""
        if self._built[0] == self._built_at_start:
            return f"it built no {self._group_class.__name__}"
        return ""

    def _record(self, test, outcome: str, detail: str = "") -> None:
        name = _display(type(test).__name__, test._testMethodName)
        self.outcomes[name] = outcome
        extra = "  (toroid only)" if "extra_collective" in name else ""
        print(f"{self.backend:6} {outcome:5} {time.monotonic() - self._start:6.2f}s {name}{extra}", flush=True)
        if detail:
            print("       " + detail.rstrip().replace("\n", "\n       "), flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        wrong = self._backend_check(test)
        if wrong:
            self._record(test, "FAIL", f"passed, but did not run on {self.backend}: {wrong}")
            return
        raised = getattr(test, "raised", None)
        self._record(test, "PASS", "survivors raised: " + " | ".join(sorted(set(raised))) if raised else "")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "SKIP", f"skipped: {reason}")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "FAIL", self.failures[-1][1][-3000:])

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "ERROR", self.errors[-1][1][-3000:])


def run(backend: str, part: str, pattern: str | None) -> int:
    try:
        import torchft  # noqa: F401
        import torchft.process_group_test  # noqa: F401 (needs `parameterized`, a test dependency of torchft)
    except ImportError as e:
        print(f"SKIP torchft's tests: cannot import them ({e})", flush=True)
        return NO_TORCHFT
    cases = [c for c in _cases(backend, part)
             if pattern is None or re.search(pattern, _display(type(c).__name__, c._testMethodName))]
    suite = unittest.TestSuite(cases)  # (one class after the other: setUpClass/tearDownClass run once each)
    if backend == "toroid":
        from toroid.torchft import ProcessGroupToroid as group_class
    else:
        from torchft.process_group import ProcessGroupGloo as group_class
    built = [0]
    create = group_class._create_pg

    def counting(self, *args, **kwargs):
        built[0] += 1
        return create(self, *args, **kwargs)

    group_class._create_pg = counting
    result = _Result(backend, group_class, built)
    start = time.monotonic()
    suite.run(result)
    counts = {k: sum(1 for v in result.outcomes.values() if v == k) for k in ("PASS", "SKIP", "FAIL", "ERROR")}
    extra = sum(1 for n, v in result.outcomes.items() if "extra_collective" in n and v == "PASS")
    print(f"{backend} ({part}): {counts['PASS']} passed, {counts['FAIL'] + counts['ERROR']} failed, "
          f"{counts['SKIP']} skipped"
          + (f" ({extra} of the passed are toroid-only extras)" if backend == "toroid" else "")
          + f" in {time.monotonic() - start:.1f}s", flush=True)
    return 0


def _parse(out: str, backend: str) -> dict[str, str]:
    outcomes = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == backend and parts[1] in ("PASS", "SKIP", "FAIL", "ERROR"):
            outcomes[parts[3]] = parts[1]
    return outcomes


def compare(pattern: str | None, timeout: float) -> int:
    """Both backends, each in processes of its own; then every test that passed on gloo must
    pass on toroid. process_group_test.py's part runs on both backends at once (most of it is
    waiting: gloo's resiliency tests wait for their 30 s timeout twice); the integration part
    runs on one backend after the other (torchft's tests bind fixed ports)."""
    base = [sys.executable, __file__] + (["-k", pattern] if pattern else [])

    def start(backend: str, part: str) -> subprocess.Popen:
        return subprocess.Popen(base + ["--backend", backend, "--part", part], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def finish(p: subprocess.Popen, what: str) -> str:
        try:
            return p.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            return p.communicate()[0] + f"\n{what}: TIMED OUT after {timeout:.0f}s\n"

    def ended(out: str, backend: str, part: str) -> bool:  # (its summary line is there)
        return any(line.startswith(f"{backend} ({part}): ") for line in out.splitlines())

    def gloo_again(out: str, rc: int, part: str) -> tuple[str, int]:
        """torch's gloo crashes now and then in torchft's resiliency cases (a run of the "pg" part
        died after 3 tests, in a clean-clone CI run): a gloo process that ends before its summary
        runs again, up to twice, and says so. (A toroid process that does is not run again: what
        it did not pass counts as lost.)"""
        for _ in range(2):
            if ended(out, "gloo", part) or rc == NO_TORCHFT:
                break
            print(f"gloo {part}: ended (exit status {rc}) before its summary; run again:\n{out[-2000:]}", flush=True)
            p = start("gloo", part)
            out, rc = finish(p, f"gloo {part}"), p.returncode
        return out, rc

    runs: list[tuple[str, str, str, int]] = []  # (backend, part, output, exit status)
    started = {b: start(b, "pg") for b in ("gloo", "toroid")}
    for b, p in started.items():
        out, rc = finish(p, f"{b} pg"), p.returncode
        runs.append((b, "pg", *(gloo_again(out, rc, "pg") if b == "gloo" else (out, rc))))
    for b in ("gloo", "toroid"):
        p = start(b, "integ")
        out, rc = finish(p, f"{b} integ"), p.returncode
        runs.append((b, "integ", *(gloo_again(out, rc, "integ") if b == "gloo" else (out, rc))))
    for b, part, out, _ in runs:
        print(f"==== {b}, {part} ====\n{out}", flush=True)
    if any(rc == NO_TORCHFT for *_, rc in runs):
        return NO_TORCHFT
    gloo: dict[str, str] = {}
    toroid: dict[str, str] = {}
    for b, _, out, _ in runs:
        (gloo if b == "gloo" else toroid).update(_parse(out, b))
    passed_gloo = sorted(n for n, v in gloo.items() if v == "PASS")
    lost = [n for n in passed_gloo if toroid.get(n) != "PASS"]
    extras = [n for n in toroid if "extra_collective" in n]

    def count(d: dict, v: str, names=None) -> int:
        return sum(1 for n, x in d.items() if x == v and (names is None or n in names))

    print(f"compare: gloo {len(passed_gloo)} passed, {count(gloo, 'FAIL') + count(gloo, 'ERROR')} failed, "
          f"{count(gloo, 'SKIP')} skipped; toroid {count(toroid, 'PASS')} passed "
          f"({len(passed_gloo) - len(lost)} of gloo's {len(passed_gloo)}, and {count(toroid, 'PASS', extras)} of "
          f"{len(extras)} toroid-only extras), {count(toroid, 'FAIL') + count(toroid, 'ERROR')} failed, "
          f"{count(toroid, 'SKIP')} skipped", flush=True)
    for n in lost:
        print(f"compare: passes on gloo, not on toroid ({toroid.get(n, 'not run')}): {n}", flush=True)
    print(f"counts: gloo_passed={len(passed_gloo)} gloo_failed={count(gloo, 'FAIL') + count(gloo, 'ERROR')} "
          f"toroid_passed={count(toroid, 'PASS')} toroid_failed={count(toroid, 'FAIL') + count(toroid, 'ERROR')} "
          f"lost={len(lost)}", flush=True)
    if not passed_gloo:
        print("compare: no test passed on gloo: nothing was compared", flush=True)
        return 1
    return 1 if lost else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("gloo", "toroid"))
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--part", choices=("pg", "integ"), default="pg",
                    help="with --backend: process_group_test.py (pg) or the integration tests (integ)")
    ap.add_argument("-k", dest="pattern", help="a regular expression the test names must match")
    ap.add_argument("--timeout", type=float, default=300.0, help="--compare: seconds per run of one part")
    a = ap.parse_args()
    if a.compare:
        return compare(a.pattern, a.timeout)
    if a.backend is None:
        ap.error("--backend or --compare")
    return run(a.backend, a.part, a.pattern)


if __name__ == "__main__":
    sys.exit(main())
