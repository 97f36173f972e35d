"""The per-step cache is the run's, shared by every ``--out``; a cached step's rows of the step tables
(completions, top tokens, IS histograms) come from the files in the output folder. A recompute into
a folder whose step tables are not the ones the cache's state wrote (another --out, a table removed
or replaced) computes the steps again instead of writing tables without them (it wrote an empty
completions.parquet and no top_tokens.parquet)."""

import shutil
from pathlib import Path

import polars as pl

import grpolens

ROOT = Path(__file__).resolve().parents[3]
TABLES = ("completions.parquet", "top_tokens.parquet", "is_hist.parquet")


def _tables(out: Path) -> dict[str, pl.DataFrame]:
    return {t: pl.read_parquet(out / t) for t in TABLES if (out / t).is_file()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[t].equals(b[t]) for t in a)


def test_a_recompute_into_another_folder_computes_the_steps_its_tables_lack(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "tiny", run, ignore=shutil.ignore_patterns("grpolens"))
    elsewhere = tmp_path / "elsewhere"
    first = grpolens.recompute(run, out=elsewhere, result=True)
    want = _tables(elsewhere)
    assert "completions.parquet" in want and want["completions.parquet"].height > 0
    # the run's own folder has no tables yet: every step computed, not taken from the cache
    own = grpolens.recompute(run, result=True)
    assert own.reused_steps == [] and own.computed_steps == first.computed_steps
    assert _same(_tables(run / "grpolens"), want)
    assert own.metrics.equals(first.metrics)
    # nothing changed: the rows are reused, and the tables stay whole
    again = grpolens.recompute(run, result=True, incremental=True)
    assert again.computed_steps == []
    assert _same(_tables(run / "grpolens"), want)
    # a table removed: computed again
    (run / "grpolens" / "completions.parquet").unlink()
    (run / "grpolens" / "metrics.parquet").unlink()  # (else the outputs' stamp is gone and nothing is re-read)
    rerun = grpolens.recompute(run, result=True)
    assert rerun.reused_steps == []
    assert _same(_tables(run / "grpolens"), want)
