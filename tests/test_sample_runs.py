"""The tests' copies of the sample runs hold what git holds: the run, the TRL log files it ships,
and nothing a local command wrote into the checkout."""

from __future__ import annotations

import subprocess

from tests.sample_runs import ROOT, SAMPLE_RUNS, SHIPPED, copy_sample_run, copy_sample_runs


def test_the_shipped_files_are_the_gitignore_exceptions():
    exceptions = {line[1:].rsplit("/", 1)[1] for line in (ROOT / ".gitignore").read_text().splitlines()
                  if line.startswith("!sample_runs/")}
    assert exceptions == SHIPPED


def test_a_copy_leaves_out_what_a_recompute_left_in_the_checkout(tmp_path, monkeypatch):
    fake = tmp_path / "sample_runs"
    (fake / "trl-tiny" / "grpolens" / "cache").mkdir(parents=True)
    (fake / "trl-tiny" / "grpolens" / "cache" / "state.json").write_text("{}")
    (fake / "trl-tiny" / "grpolens" / "metrics.parquet").write_text("stale")
    (fake / "trl-tiny" / "grpolens" / "trl_log.jsonl").write_text("{}\n")
    (fake / "trl-tiny" / "tokens").mkdir()
    (fake / "trl-tiny" / "tokens" / "x.parquet").write_text("x")
    monkeypatch.setattr("tests.sample_runs.SAMPLE_RUNS", fake)
    run = copy_sample_run("trl-tiny", tmp_path / "copy")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()) == [
        "grpolens/trl_log.jsonl", "tokens/x.parquet"]
    every = copy_sample_runs(tmp_path / "all")
    assert not (every / "trl-tiny" / "grpolens" / "cache").exists()


def test_a_copy_of_a_real_sample_run_has_every_file_git_tracks():
    tracked = subprocess.run(["git", "ls-files", "trl-tiny"], cwd=SAMPLE_RUNS, capture_output=True, text=True,
                             check=True).stdout.split()
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        run = copy_sample_run("trl-tiny", Path(d) / "run")
        copied = {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}
    assert {t.split("/", 1)[1] for t in tracked} <= copied
