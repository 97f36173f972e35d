"""``grpolens sidecars`` and ``grpolens completions``: files written, views rendered on ordinary,
empty, missing, large and hostile inputs, errors as one line with exit code 2."""

import json
import os
import subprocess
import sys

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

import grpolens
from grpolens.run import format as fmt
from grpolens.analysis import sidecars
from tests.refdata import random_calls, write_run

HOSTILE = "\x1b[31mred\x1b[0m [bold]b[/bold] <script>alert(1)</script> \u202eevil"


def _samples(step, ids, ranks, rng, texts=True, text=None):
    n = len(ids)
    cols = {"step": pa.array([step] * n, pa.int64()), "rank": pa.array(ranks, pa.int32()),
            "sample_id": pa.array(ids, pa.int64()), "group_id": pa.array([i // 4 for i in ids], pa.int64()),
            "completion_len": pa.array(rng.integers(1, 50, n), pa.int32()), "truncated": pa.array(rng.random(n) < 0.3),
            "reward": pa.array(rng.normal(size=n), pa.float64()), "advantage": pa.array(rng.normal(size=n), pa.float32())}
    if texts:
        cols["prompt"] = pa.array([f"[red]prompt {i // 4}[/red]" for i in ids], pa.string())
        cols["completion"] = pa.array([text or (HOSTILE if i % 3 == 0 else None if i % 3 == 1 else f"plain {i}") for i in ids],
                                      pa.string())
    return pa.table(cols)


@pytest.fixture
def run(tmp_path):
    rng = np.random.default_rng(1)
    calls = random_calls(rng, steps=(0, 1, 2), ranks=2, micro_batches=1, batch=4)
    samples = {}
    for step in (0, 1, 2):
        own = [(c.rank, int(s)) for c in calls if c.step == step for s in c.sample_ids]
        samples[step] = _samples(step, [s for _, s in own], [r for r, _ in own], rng)
    samples[3] = _samples(3, [], [], rng)  # a step whose samples shard has no rows
    return write_run(tmp_path / "run", calls, samples=samples)


def test_sidecars_command_writes_each_step(run, cli):
    rc, _, err = cli("sidecars", run, "--quiet")
    assert rc == 0, err
    d = run / "grpolens" / "rich_completions"
    assert sorted(p.name for p in d.iterdir()) == [f"rich_completions_step_{s:06d}.json" for s in (0, 1, 2)]
    table = pl.read_parquet(run / "grpolens" / "completions.parquet")
    for s in (0, 1, 2):
        raw = (d / f"rich_completions_step_{s:06d}.json").read_bytes()
        assert raw == sidecars.sidecar_bytes(table.filter(pl.col("step") == s))
        data = json.loads(raw, parse_constant=lambda c: pytest.fail(f"strict JSON holds {c}"))
        assert len(data["data"]) == 8 and {r[0] for r in data["data"]} == {s}  # both ranks' completions
    rc, _, err = cli("sidecars", run, "--steps", "1:1", "--nan-literals", "--key", "mine", "--quiet")
    assert rc == 0, err
    raw = (d / "mine_step_000001.json").read_bytes()
    assert b"NaN" in raw and not (d / "mine_step_000000.json").exists()  # q_mass is NaN for plain GRPO
    assert sidecars.read_sidecar(d / "mine_step_000001.json").equals(
        table.filter(pl.col("step") == 1).select(sidecars.REFERENCE_COLUMNS))


def test_sidecars_fill_steps_missing_from_the_table(run, cli):
    grpolens.recompute(run)
    path = run / "grpolens" / "completions.parquet"
    full = pl.read_parquet(path)
    path.unlink()  # the recompute cache now keeps every step, but the table is gone
    rc, _, err = cli("sidecars", run, "--quiet")
    assert rc == 0, err
    assert pl.read_parquet(path).equals(full)
    assert len(list((run / "grpolens" / "rich_completions").iterdir())) == 3


@pytest.mark.parametrize("args, needle", [
    (("--key", "a/b"), "--key"),
    (("--key", " "), "--key"),
    (("--steps", "50:60"), "no step with samples in 50:60"),
    (("--steps", "x"), "--steps"),
])
def test_sidecars_bad_input(run, cli, args, needle):
    rc, _, err = cli("sidecars", run, "--quiet", *args)
    assert rc == 2 and needle in err and "Traceback" not in err


def test_commands_on_a_missing_run(tmp_path):
    for args in (("sidecars", tmp_path / "nope"), ("completions", tmp_path / "nope", "--step", "1")):
        r = subprocess.run([sys.executable, "-m", "grpolens.cli", *map(str, args)], capture_output=True, text=True)
        assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("sort", ["group", "reward", "kl", "mismatch", "entropy", "length"])
def test_completions_view_is_safe_with_hostile_text(run, cli, monkeypatch, sort):
    monkeypatch.setenv("COLUMNS", "400")  # room for the whole completion
    rc, out, err = cli("completions", run, "--step", "1", "--sort", sort, "--chars", "200")
    assert rc == 0, err
    assert "\x1b" not in out and "\u202e" not in out  # escapes and bidi overrides are shown, not sent
    assert "\\x1b[31mred\\x1b[0m [bold]b[/bold] <script>alert(1)</script> \\u202eevil" in out
    assert "step 1: 8 of 8 completion(s)" in out and "computed from the shards" in out


def test_completions_group_limit_and_sources(run, cli):
    grpolens.recompute(run)
    table = pl.read_parquet(run / "grpolens" / "completions.parquet").filter(pl.col("step") == 2)
    gid = table["group_id"][0]
    rc, out, _ = cli("completions", run, "--step", "2", "--group", gid)
    assert rc == 0 and f"of {(table['group_id'] == gid).sum()} completion(s) (8 at the step)" in out
    assert "[red]prompt" in out and "completions.parquet" in out  # prompt shown literally; fresh table used
    rc, out, _ = cli("completions", run, "--step", "2", "--group", "1")  # no such group_id: a prompt_index
    assert rc == 0 and "showing prompt_index 1" in out
    rc, out, _ = cli("completions", run, "--step", "2", "--limit", "3", "--sort", "reward")
    assert "step 2: 3 of 8" in out and "5 more; --limit 0 shows all" in out
    # a shard newer than the table: the step is computed again, same rows
    shard = fmt.list_shards(run, fmt.TOKENS, [2])[0].path
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, (run / "grpolens" / "completions.parquet").stat().st_mtime_ns + 10**9))
    assert sidecars.fresh_rows(run, 2) is None and sidecars.build_steps(run, [2]).equals(table)
    rc, out, _ = cli("completions", run, "--step", "2")
    assert rc == 0 and "computed from the shards" in out


def test_completions_empty_and_bad_input(run, cli):
    rc, out, err = cli("completions", run, "--step", "3")
    assert rc == 0 and "step 3: 0 of 0" in out and "no completions" in out, err
    for args, needle in ((("--step", "9"), "no samples for step 9"), (("--step", "1", "--sort", "x"), "--sort"),
                         (("--step", "1", "--group", "12345"), "--group"), (("--step", "3", "--sort", "kl"), "--sort kl"),
                         (("--step", "1", "--limit", "-1"), "--limit")):
        rc, _, err = cli("completions", run, *args)
        assert rc == 2 and needle in err and "Traceback" not in err, (args, err)


def test_completions_large_step_and_long_text(tmp_path, cli):
    rng = np.random.default_rng(2)
    n = 3000
    long = "word " * 4000
    run = write_run(tmp_path / "big", [], samples={5: _samples(5, list(range(n)), [i % 8 for i in range(n)], rng, text=long)})
    rc, out, err = cli("completions", run, "--step", "5", "--sort", "length", "--chars", "40")
    assert rc == 0, err
    assert f"step 5: 50 of {n}" in out and f"{n - 50} more" in out
    assert "word word" in out and long[:200] not in out


def test_completions_on_reference_sidecar_files(tmp_path, cli):
    d = tmp_path / "maxent_out" / "rich_completions"
    d.mkdir(parents=True)
    cols = list(sidecars.REFERENCE_COLUMNS)
    (d / "rich_completions_step_000007.json").write_text(
        '{"columns": %s, "data": [[7, 0, 0, 2, 2, "p", "[bold]x", 0.0, -0.7, NaN, -0.7, 0.0], '
        '[7, 0, 1, 2, 1, "p", "y", 1.0, 0.7, NaN, 0.7, 1.0]]}' % json.dumps(cols))
    rc, out, err = cli("completions", tmp_path / "maxent_out", "--step", "7", "--sort", "reward")
    assert rc == 0, err
    assert "sidecar files" in out and "[bold]x" in out and out.index(" y") < out.index("[bold]x")
    rc, _, err = cli("completions", tmp_path / "maxent_out", "--step", "8")
    assert rc == 2 and "no sidecar file for step 8" in err
    rc, _, err = cli("completions", tmp_path / "maxent_out", "--step", "7", "--sort", "kl")
    assert rc == 2 and "no kl_mean values" in err
