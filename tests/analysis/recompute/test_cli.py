"""The recompute command and API around the engine: options, incremental runs, bad input."""

import json
import subprocess
import sys

import numpy as np
import polars as pl
import pytest

import grpolens
from grpolens.analysis.recompute import recompute
from grpolens.run.reader import parse_overrides, parse_steps
from grpolens.errors import UserError
from tests.refdata import random_calls, write_run


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "grpolens.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.fixture
def run(tmp_path):
    rng = np.random.default_rng(7)
    return write_run(tmp_path / "run", random_calls(rng, steps=(0, 1, 2)))


def test_outputs_written_atomically_and_consistent(run):
    df = recompute(run)
    out = run / "grpolens"
    on_disk = pl.read_parquet(out / "metrics.parquet")
    assert on_disk.equals(df)
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1, 2]
    assert not [p for p in out.rglob("*.tmp")]


def test_incremental_reads_only_new_steps(run, tmp_path):
    first = recompute(run, result=True)
    assert first.computed_steps == [0, 1, 2] and first.reused_steps == []
    again = recompute(run, result=True)
    assert again.computed_steps == [] and again.reused_steps == [0, 1, 2]
    assert again.metrics.equals(first.metrics)
    # the run grows by one step: only that step is read
    rng = np.random.default_rng(8)
    write_run(run, random_calls(rng, steps=(3,)))
    grown = recompute(run, result=True)
    assert grown.computed_steps == [3] and grown.reused_steps == [0, 1, 2]
    assert grown.metrics.height == 4
    full = recompute(run, incremental=False, write=False)
    assert grown.metrics.equals(full)
    # a config change invalidates the cache
    changed = recompute(run, overrides={"epsilon": 0.1}, result=True)
    assert changed.reused_steps == []


def _outputs(run):
    d = run / "grpolens"
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(d.iterdir()) if p.is_file()}


def test_rerun_with_nothing_new_writes_nothing_and_anything_touched_is_rewritten(run):
    first = recompute(run, result=True)
    before = _outputs(run)
    assert {"metrics.parquet", "metrics.jsonl", "completions.parquet", "top_tokens.parquet"} <= set(before)
    again = recompute(run, result=True)
    assert again.computed_steps == [] and again.metrics.equals(first.metrics)
    assert _outputs(run) == before  # not even rewritten with the same bytes
    # an output removed or replaced by someone else: every output is written again, same content
    (run / "grpolens" / "metrics.parquet").unlink()
    (run / "grpolens" / "metrics.jsonl").write_text("{}\n")
    recompute(run)
    after = _outputs(run)
    assert {k: v[1] for k, v in after.items()} == {k: v[1] for k, v in before.items()}
    # another selection or destination is another output: written
    assert recompute(run, steps="1:2", result=True).metrics.height == 2
    assert pl.read_parquet(run / "grpolens" / "metrics.parquet")["step"].to_list() == [1, 2]
    recompute(run)
    assert pl.read_parquet(run / "grpolens" / "metrics.parquet")["step"].to_list() == [0, 1, 2]


def test_sample_columns_come_from_the_state_only_while_the_samples_are_unchanged(tmp_path):
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from grpolens.adapters.synth import synth_run

    run = synth_run(tmp_path / "run", steps=2, groups=2, generations=2, max_len=16)
    recompute(run)
    shard = sorted((run / "samples").rglob("*.parquet"))[0]
    t = pq.read_table(shard)
    pq.write_table(t.append_column("reward/extra", pa.array([1.0] * t.num_rows)), shard)
    df = recompute(run)
    assert "rewards/extra/mean" in df.columns
    shutil.rmtree(run / "grpolens")
    assert recompute(run).columns == df.columns


def test_steps_selection(run):
    df = recompute(run, steps="1:2", write=False)
    assert df["step"].to_list() == [1, 2]
    assert recompute(run, steps="2", write=False)["step"].to_list() == [2]
    with pytest.raises(UserError, match="no steps"):
        recompute(run, steps="10:20", write=False)


def test_option_parsing():
    assert parse_steps("3:") == (3, None)
    assert parse_steps(":4") == (None, 4)
    with pytest.raises(UserError, match="--steps"):
        parse_steps("a:b")
    with pytest.raises(UserError, match="after end"):
        parse_steps("5:2")
    assert parse_overrides(["epsilon_high=0.28", "loss_type=dapo", "rollout_is.upper=2"]) == {
        "epsilon_high": 0.28, "loss_type": "dapo", "rollout_is": {"upper": 2}}
    with pytest.raises(UserError, match="key=value"):
        parse_overrides(["epsilon"])


def test_cli_recompute_and_errors(run, tmp_path):
    r = _cli("recompute", run, "--quiet")
    assert r.returncode == 0, r.stderr
    assert (run / "grpolens" / "metrics.parquet").is_file()
    r = _cli("recompute", run, "--set", "epsilon=abc")
    assert r.returncode == 2 and "epsilon" in r.stderr and "Traceback" not in r.stderr
    r = _cli("recompute", tmp_path / "nope")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = _cli("recompute", run, "--profile", "wandb")
    assert r.returncode == 2 and "--profile" in r.stderr
    r = _cli("recompute", run, "--profile", "trl", "--quiet")
    assert r.returncode == 0 and (run / "grpolens" / "trl" / "metrics.jsonl").is_file()


def test_broken_shard_is_a_user_error_and_nothing_is_written(run):
    shard = next((run / "tokens").rglob("*.parquet"))
    shard.write_bytes(shard.read_bytes()[:50])
    r = _cli("recompute", run)
    assert r.returncode == 2
    assert str(shard.name) in r.stderr and "Traceback" not in r.stderr
    assert not (run / "grpolens" / "metrics.parquet").exists()


def test_python_api_is_lazy_and_exported():
    assert grpolens.recompute is recompute


def test_steps_run_keeps_the_cache_of_other_steps(run):
    recompute(run)
    part = recompute(run, steps="1:1", result=True)
    assert part.reused_steps == [1] and part.metrics["step"].to_list() == [1]
    again = recompute(run, result=True)
    assert again.computed_steps == [] and again.reused_steps == [0, 1, 2]


def test_cumulative_totals_include_steps_before_the_selection(tmp_path):
    from tests.refdata import random_samples, samples_run

    rng = np.random.default_rng(3)
    run = samples_run(tmp_path / "s", [random_samples(rng, s, first_id=1000 * s) for s in range(4)])
    full = recompute(run, write=False)
    part = recompute(run, steps="2:3", write=False)
    assert part["tokens/seen"].to_list() == full["tokens/seen"].to_list()[2:]


@pytest.mark.parametrize("where", ["a directory", "below a file"])
def test_an_output_the_file_system_refuses_is_one_line(run, tmp_path, where):
    """An output path the file system refuses (a directory stands where metrics.parquet goes;
    --out below a regular file) is one line naming the path and the reason, exit code 2, no
    traceback, and nothing left beside it (the output is written to a temporary file first; the run's
    own per-step cache is kept, it is valid)."""
    if where == "a directory":
        out = tmp_path / "out"
        (out / "metrics.parquet").mkdir(parents=True)
        path = out / "metrics.parquet"
        reason = "Is a directory"
    else:
        (tmp_path / "a-file").write_text("")
        out = path = tmp_path / "a-file" / "out"
        reason = "Not a directory"
    def outside_the_run():
        return sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if run not in (p, *p.parents))

    before = outside_the_run()
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "recompute", str(run), "--out", str(out), "-q"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {path}: {reason}"
    assert outside_the_run() == before
