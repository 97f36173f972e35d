"""The versions the docs state (Python, the TRL releases the integration supports) are the ones
pyproject.toml declares and the suite runs.

(Which TRL releases were recorded and trained is checked against the docs by
``tests/test_doc_lists.py::test_trl_versions_the_docs_name_are_the_ones_recorded_and_trained``;
this file holds the declared requirements to the same facts.)
"""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def _bounds(requirement: str) -> dict[str, tuple[int, ...]]:
    """``{">=": (0, 29), "<": (1, 17)}`` for ``"trl>=0.29,<1.17"``."""
    return {op: _version(v) for op, v in re.findall(r"(>=|<=|==|<|>)\s*([\d.]+)", requirement)}


def test_python_version_the_docs_state_is_the_one_pyproject_requires():
    required = _bounds(PROJECT["requires-python"])[">="]
    stated = []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        stated += [(page.relative_to(ROOT), _version(a or b))
                   for a, b in re.findall(r"Python (?:≥|>=|version )\s*(3\.\d+)|Python (3\.\d+)\+", text)]
    assert stated, "README.md no longer says which Python it needs"
    wrong = [f"{page} says Python ≥ {'.'.join(map(str, v))}" for page, v in stated if v != required]
    assert not wrong, f"pyproject.toml requires Python >= {'.'.join(map(str, required))}: " + "; ".join(wrong)


def _trl_releases_run() -> list[tuple[int, ...]]:
    """The TRL releases the suite runs: the recorded runs under tests/data and the dev pin."""
    recorded = [_version(p.name.split("-", 1)[1]) for p in (ROOT / "tests" / "data").glob("trl-*")]
    trained = next(_version(d.split("==", 1)[1]) for d in PROJECT["optional-dependencies"]["dev"]
                   if d.startswith("trl=="))
    return sorted([*recorded, trained])


def test_trl_extra_admits_exactly_the_releases_the_docs_support():
    """The `trl` extra's range runs from the oldest release the suite runs to the newest one (its
    minor series), and docs/integrations/trl.md and the trl profile state the same range."""
    from grpolens.metrics.registry import PROFILES, load_families

    run = _trl_releases_run()
    oldest, newest = run[0][:2], run[-1][:2]
    extra = next(d for d in PROJECT["optional-dependencies"]["trl"] if d.startswith("trl"))
    bounds = _bounds(extra)
    assert bounds.get(">=", ())[:2] == oldest, f"the trl extra is {extra!r}; the suite runs TRL from {oldest}"
    assert bounds.get("<") == (newest[0], newest[1] + 1), \
        f"the trl extra is {extra!r}; the newest TRL the suite runs is {'.'.join(map(str, run[-1]))}"
    span = f"{oldest[0]}.{oldest[1]}", f"{newest[0]}.{newest[1]}"
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "integrations" / "trl.md").read_text(encoding="utf-8"))
    assert f"from {span[0]} to {span[1]}" in text, f"docs/integrations/trl.md should say from {span[0]} to {span[1]}"
    load_families()
    assert f"TRL {span[0]}–{span[1]}" in PROFILES["trl"].reference, PROFILES["trl"].reference
