"""Session fixtures: the trainers' own code in venvs of their own (see ``refvenv.py``), and a
closing table of how many of each trainer's logged values grpolens reproduced per configuration."""

from __future__ import annotations

import pytest

from tests.reference import refvenv

#: (trainer, configuration) -> (reproduced, logged); filled by the comparison tests
TALLY: dict[tuple[str, str], tuple[int, int]] = {}


@pytest.fixture(scope="session")
def verl_python():
    return refvenv.ensure("verl")


@pytest.fixture(scope="session")
def twinkle_python():
    return refvenv.ensure("twinkle")


def pytest_terminal_summary(terminalreporter):
    if not TALLY:
        return
    tr = terminalreporter
    tr.section("values reproduced / values the trainer's own code logged")
    for trainer in sorted({t for t, _ in TALLY}):
        rows = [(c, v) for (t, c), v in TALLY.items() if t == trainer]
        got, tot = sum(v[0] for _, v in rows), sum(v[1] for _, v in rows)
        tr.write_line(f"{trainer}: {got}/{tot}")
        for c, (g, n) in rows:
            tr.write_line(f"  {c:40s} {g}/{n}")
