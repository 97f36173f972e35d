"""Numbers and claims in the docs that are not timings are checked against the code that makes them.

(Timings are written by the benchmark scripts, which print the command beside each figure.)
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_TINY = ROOT / "sample_runs" / "trl-tiny"
PAGES_QUOTING_PARITY = [ROOT / "README.md", ROOT / "docs" / "integrations" / "trl.md"]


def test_parity_count_of_the_bundled_run_is_the_one_the_docs_quote(tmp_path):
    run = tmp_path / "trl-tiny"
    shutil.copytree(TRL_TINY, run)
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "parity", str(run)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    measured = re.findall(r"(\d+/\d+) logged values reproduced", r.stdout + r.stderr)
    assert measured, r.stdout
    for page in PAGES_QUOTING_PARITY:
        quoted = set(re.findall(r"(\d+/\d+) logged values reproduced", page.read_text(encoding="utf-8")))
        assert quoted == {measured[-1]}, f"{page.relative_to(ROOT)} quotes {sorted(quoted)}; parity says {measured[-1]}"


def test_tests_the_docs_call_slow_are_marked_slow():
    claims = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        for path in re.findall(r"`(tests/[\w/]+\.py)`\s*\(marked `slow`\)", text):
            claims.append((page.relative_to(ROOT), path))
    wrong = [f"{page}: {path}" for page, path in claims
             if "mark.slow" not in (ROOT / path).read_text(encoding="utf-8")]
    assert not wrong, f"the docs call these tests slow, but they are not marked slow: {wrong}"


def test_step_count_of_the_bundled_run_is_the_one_the_docs_quote():
    steps = len(list((TRL_TINY / "tokens").glob("step=*")))
    quoted = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        # "sample_runs/trl-tiny (real TRL training, 24 steps", "... bundled run (24 steps recorded ..."
        for m in re.finditer(r"trl-tiny[^.;]{0,80}?\b(\d+) steps (?:of real TRL|recorded)|trl-tiny`? \(real TRL "
                             r"training, (\d+) steps|bundled run \((\d+) steps recorded", text):
            quoted.append((page.relative_to(ROOT), int(next(g for g in m.groups() if g))))
    assert len(quoted) >= 3, quoted  # README, check.md and the TRL page say it
    assert all(n == steps for _, n in quoted), f"sample_runs/trl-tiny has {steps} steps; the docs say {quoted}"
