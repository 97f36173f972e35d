"""--engine ray on a real local Ray instance (2 worker processes): the same results as the default
engine, a worker killed mid-task, an unreadable shard."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from grpolens.analysis.recompute import recompute
from grpolens.errors import RunFormatError
from grpolens.metrics.engine import ThreadEngine
from grpolens.run import format as fmt

pytestmark = pytest.mark.slow  # a Ray instance starts once per session (~10 s here)

DERIVED = ("metrics.parquet", "is_hist.parquet", "top_tokens.parquet", "completions.parquet")


def _engine(**kw):
    from grpolens.metrics.engine_ray import RayEngine

    return RayEngine(**kw)


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(fmt.DERIVED_DIR))
    return dest


def _derived(run: Path) -> dict[str, pl.DataFrame]:
    return {name: pl.read_parquet(run / fmt.DERIVED_DIR / name) for name in DERIVED}


def test_identical_to_default_engine_including_cache(ray_local, synth_small, tmp_path):
    a, b = _copy(synth_small, tmp_path / "a"), _copy(synth_small, tmp_path / "b")
    recompute(a, engine=ThreadEngine())
    res = recompute(b, engine=_engine(shards_per_task=1), result=True)  # one task per shard: most merging
    assert res.computed_steps == list(range(6))
    da, db = _derived(a), _derived(b)
    for name in DERIVED:
        assert_frame_equal(da[name], db[name], check_exact=True)
    assert (a / "grpolens" / "metrics.jsonl").read_text() == (b / "grpolens" / "metrics.jsonl").read_text()
    # the per-step cache written by the Ray engine serves the next run: nothing is recomputed
    again = recompute(b, engine=_engine(), result=True)
    assert again.computed_steps == [] and again.reused_steps == list(range(6))
    assert_frame_equal(again.metrics, res.metrics, check_exact=True)


def test_other_profiles_and_sweep_identical(ray_local, synth_small):
    from grpolens.analysis.sweep import sweep

    for profile in ("verl", "trl"):
        a = recompute(synth_small, profile=profile, write=False, incremental=False, engine=ThreadEngine())
        b = recompute(synth_small, profile=profile, write=False, incremental=False, engine=_engine())
        assert_frame_equal(a, b, check_exact=True)
    params = {"upper": [1.5, 3.0], "veto_lower": [None, 1e-4]}
    assert_frame_equal(sweep(synth_small, params, engine=ThreadEngine()), sweep(synth_small, params, engine=_engine()),
                       check_exact=True)


class KillOnce:
    """A visitor whose first call, on one worker, kills that worker's process (SIGKILL: no
    cleanup, as when a node dies); the marker file makes Ray's retry succeed."""

    name = "kill_once"

    def __init__(self, marker: str):
        self.marker = marker

    def shard(self, batch, shard):
        if shard.step == 2 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return os.getpid()

    def combine(self, step, pieces):
        return pieces


def test_worker_killed_mid_task_is_retried(ray_local, synth_small, tmp_path):
    marker = tmp_path / "killed"
    pids: dict[int, list[int]] = {}
    ref = recompute(synth_small, write=False, incremental=False, engine=ThreadEngine())
    got = recompute(synth_small, write=False, engine=_engine(), extra_visitors=[KillOnce(str(marker))],
                    on_step=lambda s, pieces: pids.__setitem__(s, pieces["kill_once"]))
    killed = int(marker.read_text())
    assert killed != os.getpid() and killed not in pids[2]  # a worker died; step 2 ran again on another
    assert_frame_equal(ref, got, check_exact=True)


def test_unreadable_shard_names_it_and_writes_nothing(ray_local, synth_small, tmp_path):
    run = _copy(synth_small, tmp_path / "bad")
    bad = fmt.list_shards(run, fmt.TOKENS, steps=[4])[1].path
    bad.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(RunFormatError) as e:
        recompute(run, engine=_engine())
    assert e.value.path == str(bad) and "unreadable or truncated Parquet file" in e.value.message
    assert not (run / fmt.DERIVED_DIR / "metrics.parquet").exists()


def test_cli_engine_ray(ray_local, synth_small, tmp_path, capsys):
    from grpolens.cli import main

    run = _copy(synth_small, tmp_path / "cli")
    main(["recompute", str(run), "--engine", "ray", "-q"])
    assert_frame_equal(pl.read_parquet(run / "grpolens" / "metrics.parquet"),
                       recompute(run, write=False, incremental=False), check_exact=True)
    bad = fmt.list_shards(run, fmt.TOKENS, steps=[1])[0].path
    bad.write_bytes(b"garbage")
    with pytest.raises(SystemExit) as e:
        main(["check", str(run), "--engine", "ray", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and str(bad) in err[0]


LOCAL_START = r'''
import json, os, sys
import ray
from grpolens.analysis.recompute import recompute
from grpolens.metrics.engine_ray import RayEngine

class WorkerEnv:
    """Reports the PYTHONPATH a worker was started with, and prints a line there."""
    name = "worker_env"
    def shard(self, batch, shard):
        print("a line a worker printed")
        return os.environ.get("PYTHONPATH")
    def combine(self, step, pieces):
        return pieces

paths = set()
recompute(sys.argv[1], write=False, incremental=False, engine=RayEngine(), extra_visitors=[WorkerEnv()],
          on_step=lambda s, pieces: paths.update(pieces["worker_env"]))
print(json.dumps({"paths": sorted(paths), "initialized_after": ray.is_initialized()}))
'''


def test_a_local_instance_the_engine_starts_gives_workers_this_checkout_and_stops(synth_small):
    """Without ``--ray-address`` the engine starts a local instance of its own (a fresh process
    here: the other tests share one started by a fixture): its workers import grpolens from the
    checkout the driver imports it from, ahead of the user's PYTHONPATH; neither Ray's start-up
    messages nor the workers' output reach the user; and the instance stops with the command."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": "/no/such/dir", "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run([sys.executable, "-c", LOCAL_START, str(synth_small)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"paths": [f"{root}{os.pathsep}/no/such/dir"], "initialized_after": False}
    assert "a line a worker printed" not in r.stdout + r.stderr
    assert "Started a local Ray instance" not in r.stderr
