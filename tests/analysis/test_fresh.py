"""A re-run of ``grpolens recompute RUN`` with nothing new (grpolens/analysis/fresh.py): answered
from the written outputs without importing the engine, and never when anything it depends on
changed -- the run's files, the request, the outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from grpolens.adapters.synth import synth_run
from grpolens.analysis import fresh
from grpolens.run import format as fmt
from grpolens.run.tree import DERIVED_DIR, tree_digest

ROOT = Path(__file__).resolve().parents[2]

#: run the CLI, then say whether the engine was imported (it must not be on a fresh re-run)
PROBE = ("import sys; from grpolens.cli import main; sys.argv = ['grpolens', *sys.argv[1:]]\n"
         "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
         "print('ENGINE' if 'grpolens.metrics.engine' in sys.modules else 'NO-ENGINE', file=sys.stderr)")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return p


def _engine_used(*args: str) -> bool:
    return _cli(*args).stderr.strip().splitlines()[-1] == "ENGINE"


@pytest.fixture
def run(tmp_path):
    return synth_run(tmp_path / "run", steps=3, ranks=1, groups=2, generations=3, max_len=16, seed=1)


def test_the_derived_folder_name_matches_the_run_format():
    assert DERIVED_DIR == fmt.DERIVED_DIR


@pytest.mark.slow  # recomputes through the CLI in fresh processes
def test_a_rerun_with_nothing_new_does_not_import_the_engine_and_shows_the_same_table(run):
    first = _cli("recompute", str(run))
    assert "ENGINE" in first.stderr.splitlines()[-1]
    written = pl.read_parquet(run / "grpolens" / "metrics.parquet")
    again = _cli("recompute", str(run))
    assert again.stderr.strip().splitlines()[-1] == "NO-ENGINE"
    assert again.stdout == first.stdout  # the same summary table, key metrics and all
    assert "0 step(s) computed, 3 reused from cache" in again.stderr
    assert not _engine_used("recompute", str(run), "--quiet")
    assert_frame_equal(pl.read_parquet(run / "grpolens" / "metrics.parquet"), written)


@pytest.mark.slow  # recomputes through the CLI in fresh processes
def test_a_new_step_a_rewritten_shard_or_touched_outputs_take_the_ordinary_path(run, tmp_path):
    _cli("recompute", str(run), "--quiet")
    # a step added by a writer (here: moved in from a longer copy of the same run)
    longer = synth_run(tmp_path / "longer", steps=4, ranks=1, groups=2, generations=3, max_len=16, seed=1)
    for table in fmt.TABLES:
        (longer / table / "step=00000003").rename(run / table / "step=00000003")
    for marker in (longer / fmt.COMPLETE_DIR).glob("step=00000003.*"):
        marker.rename(run / fmt.COMPLETE_DIR / marker.name)
    assert _engine_used("recompute", str(run), "--quiet")
    assert pl.read_parquet(run / "grpolens" / "metrics.parquet")["step"].to_list() == [0, 1, 2, 3]
    assert not _engine_used("recompute", str(run), "--quiet")
    # outputs removed by someone else
    (run / "grpolens" / "completions.parquet").unlink()
    assert _engine_used("recompute", str(run), "--quiet")
    assert (run / "grpolens" / "completions.parquet").is_file()
    # a shard rewritten (by rename, as writers do): the run's tree changed
    shard = next((run / "tokens" / "step=00000001").glob("*.parquet"))
    copy = shard.with_name("copy.tmp")
    copy.write_bytes(shard.read_bytes())
    copy.replace(shard)
    assert _engine_used("recompute", str(run), "--quiet")


@pytest.mark.slow  # recomputes through the CLI in fresh processes
def test_another_request_is_never_answered_by_a_stamp(run, tmp_path):
    _cli("recompute", str(run), "--quiet")
    for args in (["--steps", "1:2"], ["--profile", "trl"], ["--out", str(tmp_path / "elsewhere")],
                 ["--set", "epsilon=0.3"], ["--full"]):
        assert _engine_used("recompute", str(run), "--quiet", *args), args


@pytest.mark.slow  # recomputes through the CLI in fresh processes
def test_the_stamp_is_of_the_run_as_it_was_read(run):
    _cli("recompute", str(run), "--quiet")
    state = json.loads(fresh.state_path(run, "grpolens").read_text())
    assert state["fresh"]["tree"] == tree_digest(run)
    assert state["fresh"]["code"] == fresh.code_fingerprint()
    assert state["fresh"]["reused"] == [0, 1, 2]


def test_tree_digest_sees_names_sizes_times_and_inodes_but_not_the_derived_folder(run):
    before = tree_digest(run)
    (run / DERIVED_DIR).mkdir(exist_ok=True)
    (run / DERIVED_DIR / "anything").write_text("x")
    assert tree_digest(run) == before
    shard = next((run / "samples" / "step=00000000").glob("*.parquet"))
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert tree_digest(run) != before
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert tree_digest(run) == before
    (run / "stray.txt").write_text("")
    assert tree_digest(run) != before


@pytest.mark.slow  # recomputes through the CLI in fresh processes
def test_a_damaged_state_is_not_fresh(run):
    _cli("recompute", str(run), "--quiet")
    fresh.state_path(run, "grpolens").write_text("{not json")
    assert fresh.fresh_outputs(run, None, "grpolens", None, False) is None
    assert _engine_used("recompute", str(run), "--quiet")
    assert fresh.fresh_outputs(run, None, "grpolens", None, False) is not None
