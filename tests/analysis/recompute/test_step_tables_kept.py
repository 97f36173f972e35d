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


def test_a_steps_range_keeps_the_other_steps_rows_of_the_tables(tmp_path):
    # --steps 0:3 wrote tables of steps 0..3 while the cache kept every step's row: the next whole
    # recompute reused all 20 steps and its completions.parquet held 4 of them. The range's tables
    # now keep the rows of the other steps they held, as the cache keeps their rows of metrics
    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "tiny", run, ignore=shutil.ignore_patterns("grpolens"))
    full = grpolens.recompute(run, result=True)
    want = _tables(run / "grpolens")
    part = grpolens.recompute(run, steps="0:3", result=True)
    assert part.computed_steps == [] and part.metrics["step"].to_list() == [0, 1, 2, 3]
    assert _same(_tables(run / "grpolens"), want)
    (run / "grpolens" / "top_tokens.parquet").unlink()  # a table gone: the range's steps computed, the rest not kept
    part = grpolens.recompute(run, steps="0:3", result=True)
    assert part.computed_steps == [0, 1, 2, 3]
    assert sorted(_tables(run / "grpolens")["completions.parquet"]["step"].unique()) == [0, 1, 2, 3]
    again = grpolens.recompute(run, result=True)
    assert again.reused_steps == [0, 1, 2, 3] and again.computed_steps == full.computed_steps[4:]
    assert _same(_tables(run / "grpolens"), want)
    assert again.metrics.equals(full.metrics)
