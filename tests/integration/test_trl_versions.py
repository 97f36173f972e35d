"""The trl profile's per-release rules, judged by runs that older TRL releases trained themselves.

``tests/data/trl-<version>/<case>/`` were recorded by ``make_trl_version_runs.py`` with that
release's own GRPOTrainer (on this suite's torch and transformers), through the integration: a
two-process torchrun run with clipping and logging windows (``window_ddp``) and GRPOConfig's
defaults (``defaults``, logging_steps=10). Reading them needs no TRL.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from grpolens.analysis import parity

DATA = Path(__file__).resolve().parents[1] / "data"
RUNS = sorted(p for p in DATA.glob("trl-*/*") if (p / "grpolens.json").is_file())


def _version(run: Path) -> str:
    return json.loads((run / "grpolens.json").read_text())["trainer"]["version"]


def test_old_releases_are_there():
    assert {_version(r) for r in RUNS} >= {"0.29.0", "1.8.0"}


@pytest.mark.parametrize("run", RUNS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_logged_value_reproduced(run):
    rows = parity.compare(run, profile="trl")
    bad = [r for r in rows if r.status != "ok"]
    assert rows and not bad, parity.summary(rows)
    if run.name == "window_ddp":
        assert json.loads((run / "grpolens.json").read_text())["world_size"] == 2
        assert {"clip_ratio/low_min", "clip_ratio/high_max", "kl", "loss"} <= {r.key for r in rows}


@pytest.mark.parametrize("run", [r for r in RUNS if r.name == "window_ddp" and r.parent.name < "trl-1.9"],
                         ids=lambda p: p.parent.name)
def test_the_release_rule_is_what_matches(run, tmp_path):
    """Read as if TRL 1.16 had written it, the same run no longer matches: per-rank means and
    rank-level low_min/high_max are what reproduce these releases."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    manifest = json.loads((copy / "grpolens.json").read_text())
    manifest["trainer"]["version"] = "1.16.0"
    (copy / "grpolens.json").write_text(json.dumps(manifest))
    bad = {r.key for r in parity.compare(copy, profile="trl") if r.status != "ok"}
    assert {"clip_ratio/low_min", "clip_ratio/high_max", "entropy"} <= bad
