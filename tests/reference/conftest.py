"""Session fixtures: the trainers' own code in venvs of their own (see ``refvenv.py``), and a
closing table of how many of each trainer's logged values grpolens reproduced per configuration."""

from __future__ import annotations

import math

import pytest

from tests.reference import refvenv

#: (trainer, configuration) -> (reproduced, logged); filled by the comparison tests
TALLY: dict[tuple[str, str], tuple[int, int]] = {}


@pytest.fixture(scope="session")
def verl_python():
    return refvenv.ensure("verl")


@pytest.fixture(scope="session")
def openrlhf_python():
    return refvenv.ensure("openrlhf")


@pytest.fixture(scope="session")
def swift_python():
    return refvenv.ensure("swift")


@pytest.fixture(scope="session")
def twinkle_python():
    return refvenv.ensure("twinkle")


def close(got: float | None, logged: float, atol: float, rtol: float) -> bool:
    """``got`` within ``atol + rtol·max(|got|, |logged|)`` of the trainer's ``logged`` value. An
    infinite value only matches itself: the relative term of an infinite ``got`` is infinite too, so
    ``inf`` would otherwise pass for any finite logged value (a mutant dividing by 0 did)."""
    if got is None:
        return False
    if not (math.isfinite(got) and math.isfinite(logged)):
        return got == logged
    return abs(got - logged) <= atol + rtol * max(abs(got), abs(logged))


def check_quoted_tally(trainer: str, expected: set[str], quote: str, page: str = "docs/profiles.md") -> None:
    """docs/profiles.md quotes each trainer's count, ``quote`` formatted with ``got``, ``total``,
    ``configs`` and ``missing`` (total - got); checked once every configuration of the module ran
    (a ``-k`` subset skips it)."""
    from pathlib import Path

    rows = {c: v for (t, c), v in TALLY.items() if t == trainer}
    if set(rows) != expected:
        pytest.skip(f"{len(rows)} of {len(expected)} {trainer} comparisons ran in this session")
    got, total = sum(v[0] for v in rows.values()), sum(v[1] for v in rows.values())
    configs = len({c.split(" [")[0] for c in rows})
    text = " ".join((Path(__file__).parents[2] / page).read_text().split())
    line = quote.format(got=got, total=total, configs=configs, missing=total - got)
    assert line in text, f"{page} should say {line!r} (the count the reference tests just measured)"


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
