"""Recompute on worker processes (grpolens.analysis.step_workers): the same outputs as one process.

Every test forces the workers on small runs (the thresholds to 0) and, unless it says otherwise,
puts every step through the worker processes: the parent's own per-step function is replaced by
one that fails, so a test passes only if the worker processes computed the steps.
"""

import json
import shutil

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from polars.testing import assert_frame_equal

import grpolens.analysis.recompute as recompute_module
from grpolens.adapters.synth import synth_run
from grpolens.analysis import step_workers
from grpolens.analysis.recompute import recompute
from tests.refdata import random_calls, write_run

OUTPUTS = ("metrics.parquet", "completions.parquet", "top_tokens.parquet", "is_hist.parquet")


@pytest.fixture
def forced(monkeypatch):
    """Workers for any run, however small."""
    monkeypatch.setattr(step_workers, "MIN_STEPS_PER_WORKER", 0)
    monkeypatch.setattr(step_workers, "MIN_BYTES_PER_WORKER", 0)


@pytest.fixture
def here(forced, monkeypatch):
    """The steps computed in this process; and with workers, none is: every step goes through
    the worker processes (``workers=3``: two of them)."""
    done = []
    real = recompute_module.StepWork.one_step

    def counted(self, step, *args, **kwargs):
        done.append(step)
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(recompute_module.StepWork, "one_step", counted)
    monkeypatch.setattr(step_workers, "COMPUTE_HERE", False)
    return done


def _both(run, tmp_path, here, **kwargs):
    """The outputs of one process (workers=1) and of two worker processes (workers=3)."""
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"out{workers}"
        res = recompute(run, out=out, incremental=False, result=True, workers=workers, **kwargs)
        outs.append((res, out))
    assert not here, f"steps {here} computed in this process, not by the workers"
    return outs


def _assert_same(outs):
    (a, da), (b, db) = outs
    assert_frame_equal(a.metrics, b.metrics)
    assert a.computed_steps == b.computed_steps and a.notes == b.notes
    for name in OUTPUTS:
        if (da / name).exists() or (db / name).exists():
            assert_frame_equal(pl.read_parquet(da / name), pl.read_parquet(db / name))
    assert (da / "metrics.jsonl").read_bytes() == (db / "metrics.jsonl").read_bytes()
    assert not list(da.parent.rglob(".spill-*")), "the spill folder is removed"


def test_synthetic_run_every_output_equal(tmp_path, here):
    run = synth_run(tmp_path / "run", steps=6, ranks=2, micro_batches=2, groups=3, generations=4, max_len=24, seed=3)
    outs = _both(run, tmp_path, here)
    _assert_same(outs)
    assert outs[0][0].metrics.height == 6
    assert pl.read_parquet(outs[1][1] / "completions.parquet").height == 6 * 2 * 3 * 4


def _ragged_run(path, rng):
    """Steps 0-4 with tokens; samples at steps 0, 2 and 5 only (5: samples without token shards)."""
    calls = random_calls(rng, steps=(0, 1, 2, 3, 4), ranks=2, micro_batches=2, batch=4, max_len=9)
    samples = {}
    for step in (0, 2, 5):
        own = [(c.rank, int(s)) for c in calls if c.step == step for s in c.sample_ids] or [(0, 500), (1, 501)]
        ids, ranks = [s for _, s in own], [r for r, _ in own]
        samples[step] = pa.table({"step": pa.array([step] * len(ids), pa.int64()), "rank": pa.array(ranks, pa.int32()),
                                  "sample_id": pa.array(ids, pa.int64()),
                                  "group_id": pa.array([i // 4 for i in ids], pa.int64()),
                                  "completion_len": pa.array([5] * len(ids), pa.int32()),
                                  "truncated": pa.array([i % 3 == 0 for i in ids], pa.bool_()),
                                  "reward": pa.array(rng.normal(size=len(ids)), pa.float64())})
    return write_run(path, calls, config={"rollout_is": {"level": "token", "mode": "truncate", "threshold": 2.0}},
                     samples=samples)


def test_samples_at_some_steps_and_a_step_without_tokens(tmp_path, here):
    run = _ragged_run(tmp_path / "run", np.random.default_rng(11))
    outs = _both(run, tmp_path, here)
    _assert_same(outs)
    assert outs[1][0].metrics["step"].to_list() == [0, 1, 2, 3, 4, 5]
    assert 5 in pl.read_parquet(outs[1][1] / "completions.parquet")["step"].to_list()
    for d in ("out1", "out3"):
        shutil.rmtree(tmp_path / d)
    only = _both(run, tmp_path, here, only=["kl,rewards,diversity"])  # some families: no spill, no other outputs
    assert_frame_equal(only[0][0].metrics, only[1][0].metrics)
    assert only[1][0].metrics.width > 3


def test_trl_profile_and_a_step_range(tmp_path, here):
    run = synth_run(tmp_path / "run", steps=7, ranks=2, groups=2, generations=4, max_len=16, seed=5)
    m = json.loads((run / "grpolens.json").read_text())
    m["trainer"] = {"name": "trl", "version": "1.16.0"}
    m["config"] = {**m["config"], "trl_args": {"logging_steps": 3}}
    (run / "grpolens.json").write_text(json.dumps(m))
    outs = _both(run, tmp_path, here, profile="trl")
    _assert_same(outs)
    assert outs[0][0].metrics.height < 7  # TRL's windows: one row per log
    for d in ("out1", "out3"):
        shutil.rmtree(tmp_path / d)
    ranged = _both(run, tmp_path, here, steps="2:5")
    _assert_same(ranged)
    assert ranged[1][0].metrics["step"].to_list() == [2, 3, 4, 5]


def test_incremental_rerun_after_a_new_step(tmp_path, forced):
    rng = np.random.default_rng(4)
    run = write_run(tmp_path / "run", random_calls(rng, steps=(0, 1, 2, 3)))
    first = recompute(run, result=True, workers=2)
    assert first.computed_steps == [0, 1, 2, 3]
    write_run(run, random_calls(rng, steps=(4, 5)))
    grown = recompute(run, result=True, workers=2)
    assert grown.computed_steps == [4, 5] and grown.reused_steps == [0, 1, 2, 3]
    written = {n: pl.read_parquet(run / "grpolens" / n) for n in OUTPUTS if (run / "grpolens" / n).exists()}
    full = recompute(run, out=tmp_path / "full", incremental=False, workers=1)
    assert_frame_equal(grown.metrics, full)
    for name, df in written.items():
        assert_frame_equal(df, pl.read_parquet(tmp_path / "full" / name))


def test_a_metric_the_workers_do_not_know_computes_here(tmp_path, here, monkeypatch):
    """A metric registered in this process at run time (no plugin) is unknown to the worker
    processes: they decline and this process computes every step."""
    from grpolens.metrics.registry import REGISTRY

    some = next(m for m in REGISTRY.values() if m.name == "entropy")
    monkeypatch.setitem(REGISTRY, "entropy_again", type(some)(**{**vars(some), "name": "entropy_again"}))
    rng = np.random.default_rng(2)
    run = write_run(tmp_path / "run", random_calls(rng, steps=(0, 1, 2, 3)))
    df = recompute(run, write=False, workers=3)
    assert df["entropy_again"].to_list() == df["entropy"].to_list()
    assert sorted(here) == [0, 1, 2, 3]  # the workers declined


def _corrupt(run, step):
    path = next((run / "tokens").glob(f"step={step:08d}/*.parquet"))
    path.write_bytes(b"PAR1 not parquet" + path.read_bytes()[40:])
    return path


@pytest.mark.parametrize("workers", ["1", "3"])
def test_a_corrupt_shard_in_a_worker_is_the_one_line_error(tmp_path, forced, monkeypatch, capsys, workers):
    from grpolens.cli import main

    rng = np.random.default_rng(9)
    run = write_run(tmp_path / "run", random_calls(rng, steps=(0, 1, 2, 3, 4, 5)))
    recompute(run, workers=1)
    before = {p.name: p.read_bytes() for p in (run / "grpolens").iterdir() if p.is_file()}
    bad = _corrupt(run, 4)
    monkeypatch.setattr(step_workers, "COMPUTE_HERE", False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["recompute", str(run), "--full", "--quiet", "--workers", workers])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("error: ") and str(bad) in err.replace("\n", "") and "Traceback" not in err
    assert not list(run.rglob(".spill-*")), "no spill folder left"
    after = {p.name: p.read_bytes() for p in (run / "grpolens").iterdir() if p.is_file()}
    assert after == before, "outputs untouched"


def test_the_worker_count(monkeypatch):
    monkeypatch.setenv("GRPOLENS_WORKERS", "3")
    assert step_workers.count(None, 100, 1 << 40) == 3
    assert step_workers.count(1, 100, 1 << 40) == 1
    assert step_workers.count(4, 5, 1 << 40) == 2  # at least MIN_STEPS_PER_WORKER steps each
    assert step_workers.count(4, 100, 3 * step_workers.MIN_BYTES_PER_WORKER) == 3
    assert step_workers.count(4, 100, 0) == 1
    monkeypatch.setenv("GRPOLENS_WORKERS", "0")
    with pytest.raises(step_workers.UserError, match="GRPOLENS_WORKERS"):
        step_workers.count(None, 100, 1 << 40)


def _ended_worker(*messages) -> step_workers._Worker:
    """A worker whose process has ended after sending ``messages`` down its pipe."""
    import subprocess
    import sys
    from multiprocessing import Pipe

    mine, theirs = Pipe()
    for m in messages:
        theirs.send(m)
    theirs.close()
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    return step_workers._Worker(proc, mine)


def test_a_worker_that_ended_after_its_error_is_raised_as_that_error():
    # the race behind a silent exit 1: the worker sends its error and ends, and this process,
    # dispatching before reading, meets a broken pipe; the error waiting in the pipe is the answer
    from grpolens.errors import RunFormatError

    err = RunFormatError("/x/step=00000004/rank=0000.parquet", "not a Parquet file")
    w = _ended_worker(("done", 3, {}, None, {}), ("error", RunFormatError, err.args, dict(vars(err)), "trace"))
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        w.conn.send(5)  # what dispatching the next step meets
    got = w.last_word()
    assert isinstance(got, RunFormatError) and str(got) == str(err)


def test_a_worker_that_ended_without_a_word_is_named_with_its_exit_code():
    got = _ended_worker(("ready",)).last_word()
    assert isinstance(got, RuntimeError) and "exit code 3" in str(got)
