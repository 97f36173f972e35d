"""A fast first pass over the mutants that ``mutmut run`` generated, in long-lived processes.

mutmut runs every mutant in a process of its own: it imports grpolens and collects the test files
again for each one, which on this code base costs more than the tests themselves. Its generated
tree does not need that: every mutated function is a trampoline that picks the original or a
mutant when it is *called*, from ``MUTANT_UNDER_TEST``. This script imports once per few
functions, collects each function's tests once, and runs them clean, once per mutant, and clean
again in the same pytest session (module fixtures are built once).

What the speed costs, and how it is paid back:

- **Import-time code** (metric factories run when a module is imported) and **fixtures** (built
  once, by the original code) are never re-run with a mutant on, so their mutants survive here
  whatever the tests do. **State a mutant leaves behind** (a cache, a
  mutated module global) could fail the next mutant's tests. So every function's tests are run
  clean before and after its mutants; if the clean run fails after, the function's verdicts are
  dropped and a fresh process takes over. ``functools.lru_cache`` caches of the package are
  cleared between mutants.
- **Survivors are not verdicts.** Run them again with ``mutmut run`` (a process each, every test
  of the selection), as docs/mutation-testing.md says. A *kill* here is one: a test failed with
  the mutant on and passed with it off, both sides of it in the same process.

Verdicts go into mutmut's own files (``mutants/**/*.py.meta``, with mutmut's exit codes), so
``mutmut results`` and ``mutmut show`` read them. Only mutants not yet checked are run, so an
interrupted pass resumes where it stopped.

Usage, from the project root, after ``mutmut run`` has generated ``mutants/`` and its stats::

    python tools/mutation_fast_pass.py                      # every unchecked mutant
    python tools/mutation_fast_pass.py "grpolens.check.*"   # those whose name matches a pattern
    python tools/mutation_fast_pass.py --jobs 2 --max-test-seconds 0.5
"""
from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path.cwd()
MUTANTS = ROOT / "mutants"
STATS = MUTANTS / "mutmut-stats.json"
# mutmut's exit codes (mutmut.stats.status_by_exit_code): 1 killed, 0 survived, 33 no tests, 36 timeout.
KILLED, SURVIVED, NO_TESTS, TIMEOUT = 1, 0, 33, 36
CLEAN_RUN_FACTOR = 10  # the first clean run's time limit, in units of the per-mutant one
POLLUTED = 3  # a child's exit status: state was left behind, start a fresh process
# Functions whose mutants left state behind: left to `mutmut run`, a process per mutant.
SKIPPED = MUTANTS / "fast-pass-skipped.txt"


def function_of(mutant: str) -> str:
    """``grpolens.m.x_f__mutmut_3`` -> ``grpolens.m.x_f``, the key of mutmut's test mapping."""
    return mutant.rpartition("__mutmut_")[0]


def unchecked(patterns: list[str], redo_survivors: bool) -> dict[Path, dict[str, list[str]]]:
    """Per .meta file, per function, the mutants to run."""
    todo: dict[Path, dict[str, list[str]]] = {}
    for meta in sorted(MUTANTS.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in codes.items():
            if patterns and not any(fnmatch.fnmatch(name, p) for p in patterns):
                continue
            if code is None or (redo_survivors and code == SURVIVED):
                todo.setdefault(meta, defaultdict(list))[function_of(name)].append(name)
    return todo


def record(meta: Path, verdicts: dict[str, int], durations: dict[str, float]) -> None:
    data = json.loads(meta.read_text())
    data["exit_code_by_key"].update(verdicts)
    data.setdefault("durations_by_key", {}).update(durations)
    tmp = meta.with_suffix(".meta.tmp")
    tmp.write_text(json.dumps(data, indent=4))
    os.replace(tmp, meta)


# ---------------------------------------------------------------- the child: one source file


class _Timeout(BaseException):
    """Raised by the alarm inside a test; pytest reports it as that test's failure."""


def _alarm(signum, frame):  # noqa: ARG001
    raise _Timeout()


def _quiet_pytest(args: list[str], plugins: list | None = None) -> int:
    """``pytest.main`` with the process's stdout/stderr sent to /dev/null (fd level: tests print)."""
    import pytest

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        return int(pytest.main(args, plugins=plugins or []))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _clear_caches() -> None:
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("grpolens"):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, functools._lru_cache_wrapper):
                obj.cache_clear()


def _fast_switch() -> None:
    """The generated trampolines read ``os.environ`` on every call of every mutated function, a
    third of the run's time: read the variable once per test run instead."""
    import mutmut.mutation.trampoline as trampoline

    current = {"name": ""}
    trampoline.get_mutant_under_test = lambda: current["name"]
    return current


class _MutantLoop:
    """A pytest plugin that runs one function's tests once clean, once per mutant, and once clean
    again, in one session: the tests are collected once and module fixtures are built once.

    The price: a fixture is built by the original code, so a mutant that only a fixture would have
    run survives here (the survivors are run again by mutmut, see the module docstring)."""

    def __init__(self, mutants: list[str], current: dict, timeout: float):
        self.mutants, self.current, self.timeout = mutants, current, timeout
        self.clean = self.after = None
        self.verdicts: dict[str, int] = {}
        self.durations: dict[str, float] = {}

    def _run_all(self, session, mutant: str) -> int:
        from _pytest.runner import runtestprotocol

        os.environ["MUTANT_UNDER_TEST"] = mutant  # for subprocesses a test starts
        self.current["name"] = mutant
        _clear_caches()
        items = session.items
        for i, item in enumerate(items):
            # the next item is the first one again after the last, so module fixtures stay up
            reports = runtestprotocol(item, nextitem=items[(i + 1) % len(items)], log=False)
            if any(r.failed for r in reports):
                # the next run starts again at the first item: tear everything down (the item
                # was torn down towards the next one, whose module and parametrized fixtures the
                # first item's setup would otherwise find still up)
                session._setupstate.teardown_exact(None)
                return KILLED
        return SURVIVED

    def _timed(self, session, mutant: str, timeout: float | None = None) -> tuple[int, float]:
        timeout = timeout or self.timeout
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            code = self._run_all(session, mutant)
        except _Timeout:
            code = TIMEOUT
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        dt = time.perf_counter() - t0
        return (TIMEOUT if dt >= timeout and code == SURVIVED else code), dt

    def pytest_runtestloop(self, session):
        if not session.items:
            return True
        # The first run builds the session and module fixtures (the verl reference fixture runs
        # verl over every configuration: about a minute), which the mutants' runs then share.
        self.clean, _ = self._timed(session, "", timeout=self.timeout * CLEAN_RUN_FACTOR)
        if self.clean == SURVIVED:
            for m in self.mutants:
                self.verdicts[m], self.durations[m] = self._timed(session, m)
            self.after, _ = self._timed(session, "")
        session._setupstate.teardown_exact(None)
        return True


def run_chunk(chunk: list[tuple[Path, str, list[str]]], tests_of: dict[str, list[str]], timeout: float) -> int:
    """Run the mutants of a few functions in this process; the verdicts of each go to its .meta."""
    os.chdir(MUTANTS)
    sys.path.insert(0, str(MUTANTS))
    signal.signal(signal.SIGALRM, _alarm)
    current = _fast_switch()
    # --tb=no: a kill is a failed test, and formatting its traceback parses every source file in it
    # (mutmut's generated modules hold every mutant: tens of thousands of lines), which cost more
    # than the tests themselves
    base = ["--rootdir=.", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--no-header", "--tb=no"]

    for meta, function, mutants in chunk:
        tests = tests_of.get(function, [])
        if not tests:
            record(meta, {m: NO_TESTS for m in mutants}, {})
            continue
        loop = _MutantLoop(mutants, current, timeout)
        _quiet_pytest(base + tests, plugins=[loop])
        if loop.clean != SURVIVED:
            why = "time out" if loop.clean == TIMEOUT else "fail"
            print(f"  {function}: its tests {why} without a mutant; left unchecked", flush=True)
            continue
        if loop.after != SURVIVED:
            print(f"  {function}: a mutant left state behind; left to `mutmut run`", flush=True)
            with SKIPPED.open("a") as f:
                f.write(function + "\n")
            return POLLUTED
        record(meta, loop.verdicts, loop.durations)
        killed = sum(v == KILLED for v in loop.verdicts.values())
        print(f"  {function}: {killed}/{len(mutants)} killed, {len(tests)} tests, "
              f"{sum(loop.durations.values()):.1f} s", flush=True)
    return 0


# ---------------------------------------------------------------- the parent


# Test files that pin a module although their names do not say so (by default a test file pins
# the module whose name it carries: tests/metrics/test_kl.py -> grpolens.metrics.kl).
HOME_TESTS = {
    # the two rollout_is packages (functional/ and metrics/): their modules' names do not say so
    **{m: ("test_rollout_is", "test_rollout_is_profiles", "test_merge")
       for m in ("weights", "per_token", "summary", "inputs", "producers", "visitors", "catalogue")},
    "offset": ("test_rollout_is_offset",),
    "verl_actor": ("test_verl_reference",),
    "twinkle": ("test_twinkle_reference",),
    **{m: ("test_validator", "test_keys", "test_joins", "test_layout", "test_samples", "test_validate_refusals")
       for m in ("validate", "validator", "checks", "footer")},  # tests/run/validate/
    "partials": ("test_merge", "test_boundaries", "test_rollout_is", "test_rollout_is_profiles"),
    "reduce": ("test_boundaries", "test_kl", "test_clip", "test_loss"),
}


def is_home(function: str, test: str) -> bool:
    module = function.split(".")[-2]
    stem = test.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    return stem.startswith(f"test_{module}") or stem in HOME_TESTS.get(module, ()) or (
        function.startswith("grpolens.check.") and (stem.startswith("test_check_") or "tests/check/" in test))


def test_mapping(max_test_seconds: float | None, budget: float | None) -> dict[str, list[str]]:
    """Function -> its tests: those of its own test file first, then the cheapest (a kill comes
    sooner); tests slower than ``max_test_seconds`` left out, and no more than ``budget`` seconds
    of recorded duration in all, if asked."""
    stats = json.loads(STATS.read_text())
    dur = stats["duration_by_test"]
    out = {}
    for function, tests in stats["tests_by_mangled_function_name"].items():
        keep = [t for t in tests if t in dur and (max_test_seconds is None or dur[t] <= max_test_seconds)]
        keep.sort(key=lambda t: (not is_home(function, t), dur[t]))
        if budget is not None:
            total, capped = 0.0, []
            for t in keep:
                if capped and total + dur[t] > budget:
                    continue
                capped.append(t)
                total += dur[t]
            keep = capped
        out[function] = keep
    return out


def work_list(todo: dict[Path, dict[str, list[str]]], patterns: list[str]) -> list[tuple[Path, str, list[str]]]:
    """Every function's mutants, taking one function from each source file in turn, so that
    every module has verdicts early; files matching an earlier pattern come first in each turn."""
    def rank(meta: Path) -> int:
        first = next(iter(todo[meta].values()))[0]
        return min((i for i, p in enumerate(patterns) if fnmatch.fnmatch(first, p)), default=0)

    skipped = set(SKIPPED.read_text().split()) if SKIPPED.exists() else set()
    per_file = [[(meta, f, ms) for f, ms in todo[meta].items() if f not in skipped] for meta in sorted(todo, key=rank)]
    out = []
    while any(per_file):
        for items in per_file:
            if items:
                out.append(items.pop(0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("patterns", nargs="*", help="fnmatch patterns on mutant names (default: all); "
                    "the modules of earlier patterns are served first")
    ap.add_argument("--jobs", type=int, default=1, help="processes at once (default 1)")
    ap.add_argument("--functions-per-process", type=int, default=6,
                    help="functions a process runs before a fresh one takes over (default 6)")
    ap.add_argument("--max-test-seconds", type=float, default=None,
                    help="leave out tests whose recorded duration is longer (first pass on the fast tests)")
    ap.add_argument("--budget", type=float, default=None,
                    help="at most this many seconds of tests (recorded durations) per mutant, its own test file first")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant before it counts as a timeout")
    ap.add_argument("--redo-survivors", action="store_true", help="run survivors again too")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not STATS.exists():
        sys.exit(f"{STATS} not found: run `mutmut run` first (it generates the mutants and maps the tests)")
    tests_of = test_mapping(args.max_test_seconds, args.budget)

    if args.child:
        chunk = [(Path(m), f, ms) for m, f, ms in json.loads(Path(args.child).read_text())]
        return run_chunk(chunk, tests_of, args.timeout)

    todo = unchecked(args.patterns, args.redo_survivors)
    work = work_list(todo, args.patterns)
    total = sum(len(ms) for _, _, ms in work)
    print(f"{total} mutants of {len(work)} functions in {len(todo)} files", flush=True)
    n = args.functions_per_process
    queue = [work[i:i + n] for i in range(0, len(work), n)]
    running: dict[subprocess.Popen, Path] = {}
    env = {k: v for k, v in os.environ.items() if k != "MUTANT_UNDER_TEST"}
    t0, done, started = time.time(), 0, 0
    while queue or running:
        while queue and len(running) < args.jobs:
            chunk = queue.pop(0)
            # numbered in the order started: a requeued chunk (see POLLUTED) makes the queue's length repeat
            started += 1
            spec = MUTANTS / f"fast-pass-chunk-{os.getpid()}-{started}.json"
            spec.write_text(json.dumps([[str(m), f, ms] for m, f, ms in chunk]))
            cmd = [sys.executable, __file__, "--child", str(spec), "--timeout", str(args.timeout)]
            if args.max_test_seconds is not None:
                cmd += ["--max-test-seconds", str(args.max_test_seconds)]
            if args.budget is not None:
                cmd += ["--budget", str(args.budget)]
            running[subprocess.Popen(cmd, env=env)] = spec
        time.sleep(0.5)
        for proc, spec in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[proc]
            chunk = json.loads(spec.read_text())
            spec.unlink()
            if code == POLLUTED:
                # a fresh process goes on with the functions still unchecked (not the skipped one)
                left = [(Path(m), f, ms) for m, f, ms in chunk]
                codes = {k: v for m in {c[0] for c in left} for k, v in
                         json.loads(Path(m).read_text())["exit_code_by_key"].items()}
                skipped = set(SKIPPED.read_text().split()) if SKIPPED.exists() else set()
                left = [c for c in left if c[1] not in skipped and any(codes.get(x) is None for x in c[2])]
                if left:
                    queue.insert(0, left)
            elif code != 0:
                print(f"a process stopped with exit {code}; its functions stay unchecked", flush=True)
            done += sum(len(ms) for _, _, ms in chunk)
            print(f"[{time.time() - t0:6.0f} s] {done}/{total} mutants", flush=True)
    print(f"done in {time.time() - t0:.0f} s; `mutmut results` lists the survivors", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
