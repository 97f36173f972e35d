"""Every metric, profile and visitor registered once for the whole session, as the commands do
before they use the registry (modules that read ``REGISTRY`` or ``PROFILES`` directly rely on it).

The ``cli`` fixture: ``grpolens ARGS`` run in this process, through the command line's own entry point.

And a guard: a test writes under ``tmp_path``, never into the checkout. An export once left MLflow's
``./mlruns`` in the repository root and it was committed; the session now fails when the root gained
an entry."""

import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from grpolens.plugins import load_plugins

load_plugins()

_ROOT = Path(__file__).resolve().parents[1]
_ROOT_BEFORE: set[str] = set()
_ARTIFACTS = "test-artifacts"


def _root_entries() -> set[str]:
    # dot-entries are tools' caches (.pytest_cache, .ruff_cache); *.egg-info is pip's, from the install;
    # test-artifacts/ is the one place tests write on purpose (the browser tests' screenshots, for people
    # to look at; git-ignored). mutmut runs the tests in its mutants/ copy, where it writes its own state.
    if _ROOT.name == "mutants":
        return set()
    return {p.name for p in _ROOT.iterdir()
            if not p.name.startswith(".") and not p.name.endswith(".egg-info") and p.name != _ARTIFACTS}


def pytest_sessionstart(session):
    _ROOT_BEFORE.update(_root_entries())


def pytest_sessionfinish(session, exitstatus):
    new = sorted(_root_entries() - _ROOT_BEFORE)
    if new:
        sys.stderr.write(f"\nthe tests wrote into the repository root {_ROOT}: {', '.join(new)} "
                         "(write under tmp_path)\n")
        session.exitstatus = 1


class CliResult(NamedTuple):
    """What ``grpolens ARGS`` did: its exit code and what it printed (unpacks as ``code, out, err``)."""

    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys):
    """``cli(*args)``: ``grpolens ARGS`` in this process (``grpolens.cli.main``, so a user error is
    its one line and exit code, as a user sees it), each argument ``str()``-ed; returns a
    :class:`CliResult` with what it printed from the call on."""
    from grpolens.cli import main

    def run(*args) -> CliResult:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code or 0
        cap = capsys.readouterr()
        return CliResult(code, cap.out, cap.err)

    return run
