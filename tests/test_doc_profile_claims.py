"""What the docs say a profile does not reproduce is what the reference tests record.

A profile judged by its trainer's own code (its ``reference`` names ``tests/reference``) has a test
module ``tests/reference/test_<profile>_reference.py`` whose ``GAPS`` are the configurations it does
not reproduce, each an ``xfail(strict=True)`` with the reason (no ``GAPS`` and no xfail: none): when a gap is fixed its marker fails
and goes. So a sentence or table row of the docs that names such a profile and says something is
not reproduced, approximate or exact only under a condition must name one of those gaps; with no
gaps, it is false. (The tests themselves are slow: they build the trainers' venvs. This check reads
the modules' source, fast, and the counts the docs quote are checked by the reference tests.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"docs/cli.md", "docs/metrics.md"}
PAGES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
         if str(p.relative_to(ROOT)) not in GENERATED]
#: words that restrict what a profile reproduces
RESTRICTS = re.compile(r"not reproduced?|isn't reproduced|doesn't reproduce|approximate|exact only|only exact|"
                       r"not exact|inexact|exact at|yes at", re.I)


def reference_profiles() -> dict[str, Path]:
    from grpolens.metrics.registry import PROFILES, load_families

    load_families()
    return {name: ROOT / "tests" / "reference" / f"test_{name}_reference.py"
            for name, prof in PROFILES.items() if "tests/reference" in (prof.reference or "")}


def recorded(module: Path) -> tuple[list[str], dict]:
    """The configuration names (``Case("name", ...)``) and the ``GAPS`` of a reference test module."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    cases = [n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Case"
             and n.args and isinstance(n.args[0], ast.Constant)]
    gaps = next((ast.literal_eval(n.value) for n in ast.walk(tree)
                 if isinstance(n, ast.AnnAssign | ast.Assign) and "GAPS" in ast.unparse(n).split("=", 1)[0]), None)
    if gaps is None:  # no GAPS table: then no xfail marker either, every configuration is reproduced
        assert "xfail" not in module.read_text(encoding="utf-8"), f"{module.name} marks xfails outside a GAPS table"
        gaps = {}
    return cases, gaps


def claims(text: str) -> list[str]:
    """The page's table rows and prose sentences, code blocks left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    rows = [ln for ln in text.splitlines() if ln.lstrip().startswith("|")]
    prose = re.sub(r"\s+", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("|")))
    return rows + re.split(r"(?<=[.!?])\s+(?=[A-Z`*(\[])", prose)


def restrictions(profile: str, gaps: dict) -> list[str]:
    """Each claim in the docs that restricts what PROFILE reproduces and names none of its gaps."""
    named = re.compile(rf"(?<![\w-]){re.escape(profile)}(?![\w-])", re.I)
    gap_words = {str(k) for key in gaps for k in (key if isinstance(key, tuple) else (key,))} | set(gaps.values())
    out = []
    for page in PAGES:
        for claim in claims(page.read_text(encoding="utf-8")):
            if (named.search(claim) and RESTRICTS.search(claim) and "xfail" not in claim
                    and not any(w in claim for w in gap_words)):
                out.append(f"{page.relative_to(ROOT)}: …{claim.strip()[:300]}…")
    return out


def test_profiles_judged_by_their_trainers_code_have_a_reference_module():
    profiles = reference_profiles()
    assert profiles, "no profile names tests/reference any more"
    missing = [str(m.relative_to(ROOT)) for m in profiles.values() if not m.exists()]
    assert not missing, f"profiles name tests/reference, but these modules are missing: {missing}"


@pytest.mark.parametrize("profile", sorted(reference_profiles()))
def test_what_the_docs_say_is_not_reproduced_is_a_recorded_gap(profile):
    cases, gaps = recorded(reference_profiles()[profile])
    assert cases, f"no Case(...) found in the {profile} reference module"
    wrong = restrictions(profile, gaps)
    assert not wrong, (f"the {profile} reference tests record {len(gaps)} gap(s) {sorted(gaps) or ''} over "
                       f"{len(cases)} configurations, but the docs restrict what the profile reproduces:\n"
                       + "\n".join(wrong))


def test_the_check_sees_a_restriction():
    page = "| `twinkle` | … | yes at temperature 1 (Twinkle's ×T rescale is not reproduced) |\n\nThe verl profile is exact."
    rows = claims(page)
    assert any(RESTRICTS.search(r) for r in rows if "twinkle" in r)
    assert not any(RESTRICTS.search(r) for r in rows if "verl" in r)
