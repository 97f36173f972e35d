"""Copies of the bundled sample runs as git has them, without what a recompute wrote into them.

A run's derived folder (``RUN/grpolens/``: cache, outputs) is ignored by git except the TRL log
files a sample run ships (.gitignore's ``!sample_runs/*/grpolens/...`` lines). A test copying a
sample run with ``shutil.copytree`` alone also copies whatever an earlier command left in the
checkout (a cache from ``recompute sample_runs/trl-tiny``), and then tests that checkout, not the
code: a fresh clone passes where a developer's tree fails, or the other way round.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_RUNS = ROOT / "sample_runs"
#: the files of a sample run's derived folder that git tracks (.gitignore's exceptions)
SHIPPED = frozenset({"trl_log.jsonl", "trl_state.json"})


def _derived(folder: str, names: list[str]) -> set[str]:
    if Path(folder).name == "grpolens" and Path(folder).parent.parent == SAMPLE_RUNS:
        return {n for n in names if n not in SHIPPED}
    return {n for n in names if n == "__pycache__"}


def copy_sample_run(name: str, dest: Path) -> Path:
    """``sample_runs/<name>`` copied to ``dest`` as git has it; returns ``dest``."""
    return Path(shutil.copytree(SAMPLE_RUNS / name, dest, ignore=_derived))


def copy_sample_runs(dest: Path) -> Path:
    """The whole ``sample_runs`` folder copied to ``dest`` as git has it; returns ``dest``."""
    return Path(shutil.copytree(SAMPLE_RUNS, dest, ignore=_derived))
