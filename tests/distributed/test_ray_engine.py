"""--engine ray on a real local Ray instance (2 worker processes): the same results as the default
engine, a worker killed mid-task, an unreadable shard."""

from __future__ import annotations

import functools
import os
import shutil
import signal
from dataclasses import dataclass
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


def _cwd() -> str:
    return os.getcwd()


def test_is_weights_under_a_relative_out_go_below_this_processs_directory(ray_local, synth_small, tmp_path,
                                                                         monkeypatch):
    """--engine ray --is-weights --out OUT with a relative OUT: the Ray workers write the weights, and
    their working directory is not the command's (the local instance's workers stay where it was
    started; a cluster's run elsewhere), yet the files land in OUT/is_weights/ below the command's,
    the same as the default engine's."""
    from grpolens.cli import main

    run = _copy(synth_small, tmp_path / "w")
    monkeypatch.chdir(tmp_path)
    worker_cwd = ray_local.get(ray_local.remote(_cwd).remote())
    assert Path(worker_cwd).resolve() != tmp_path.resolve()
    main(["recompute", str(run), "--is-weights", "-q", "--out", "default"])
    main(["recompute", str(run), "--engine", "ray", "--is-weights", "-q", "--out", "ray"])
    want, got = tmp_path / "default" / "is_weights", tmp_path / "ray" / "is_weights"
    names = sorted(p.relative_to(want).as_posix() for p in want.rglob("*.parquet"))
    assert names and names == sorted(p.relative_to(got).as_posix() for p in got.rglob("*.parquet"))
    for n in names:
        assert_frame_equal(pl.read_parquet(got / n), pl.read_parquet(want / n), check_exact=True)


LOCAL_START = r'''
import json, os, sys
from pathlib import Path
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

def dashboards():
    """The command lines of the running instance's dashboard processes (Linux /proc)."""
    session = ray._private.worker._global_node.get_session_dir_path()
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in args]
        if any(a.endswith("dashboard.py") for a in args) and f"--session-dir={session}" in args:
            out.append(args)
    return out

frontends = []

def run(engine):
    paths = set()
    def on_step(step, pieces):
        paths.update(pieces["worker_env"])
        frontends.extend("--disable-frontend" not in a for a in dashboards())
    recompute(sys.argv[1], write=False, incremental=False, engine=engine, extra_visitors=[WorkerEnv()],
              on_step=on_step)
    return sorted(paths)

engine = RayEngine()
got = {"paths": run(engine), "initialized_after": ray.is_initialized()}
got["dashboard_frontends"] = frontends[:] if frontends else "no dashboard process seen"
# the same engine again, with no PYTHONPATH of the user's: a second instance of its own, stopped too
del os.environ["PYTHONPATH"]
got.update(paths_no_pythonpath=run(engine), initialized_after_second=ray.is_initialized())
# an instance the user started: the engine runs on it and leaves it running
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
got.update(paths_users_instance=run(engine), users_instance_running_after=ray.is_initialized())
ray.shutdown()
print(json.dumps(got))
'''


def test_a_local_instance_the_engine_starts_gives_workers_this_checkout_and_stops(synth_small):
    """Without ``--ray-address`` the engine starts a local instance of its own (a fresh process
    here: the other tests share one started by a fixture): its workers import grpolens from the
    checkout the driver imports it from, ahead of the user's PYTHONPATH; neither Ray's start-up
    messages nor the workers' output reach the user; and the instance stops with the command. The
    same engine used again starts and stops a new one, and on an instance the user started it runs
    without stopping it. The instance it starts serves no dashboard (Ray starts one by default, where
    its ``ray[default]`` packages are installed; here its dashboard process runs without its frontend)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": "/no/such/dir", "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run([sys.executable, "-c", LOCAL_START, str(synth_small)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got.pop("dashboard_frontends")) == {False}
    assert got == {"paths": [f"{root}{os.pathsep}/no/such/dir"], "initialized_after": False,
                   "paths_no_pythonpath": [str(root)], "initialized_after_second": False,
                   "paths_users_instance": [str(root)], "users_instance_running_after": True}
    assert "a line a worker printed" not in r.stdout + r.stderr
    assert "Started a local Ray instance" not in r.stderr


def test_a_local_instance_that_cannot_start_is_one_line(tmp_path):
    """Ray keeps a local instance's sockets and logs under ``RAY_TMPDIR`` (else ``TMPDIR``, else
    /tmp). Where that directory cannot be made (here a file stands in its path; on a cluster node,
    a ``TMPDIR`` too long for a Unix socket's path does the same), the start fails with an
    ``OSError``: one line saying that the local instance could not start, with Ray's reason, not a
    traceback; nothing is written."""
    import subprocess
    import sys

    pytest.importorskip("ray")
    root = Path(__file__).resolve().parents[2]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # RAY_ADDRESS would join, not start
    env.update(RAY_TMPDIR=str(blocker / "ray"), RAY_USAGE_STATS_ENABLED="0")
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "recompute", str(root / "sample_runs" / "tiny"),
                        "--engine", "ray", "--out", str(tmp_path / "out"), "-q"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip()
    where = "error: --engine ray: cannot start a local Ray instance: "
    assert "\n" not in line and line.startswith(where), line
    assert str(blocker) in line.removeprefix(where)  # Ray's reason names the directory it could not make
    assert not (tmp_path / "out").exists()


# ``map_steps`` on its own, with a work function of the test's (each shard's result names it), on the
# shared local instance: the order of steps and of shards, groups, the in-flight bound, errors.

@dataclass(frozen=True)
class NamedShard:
    step: int
    name: str

    @property
    def path(self) -> Path:
        return Path("/runs/r/tokens") / f"step={self.step}" / self.name


def _shard_name(sh: NamedShard) -> dict:
    return {"step": sh.step, "shard": sh.name}


def _by_step(sizes: dict[int, int]) -> dict[int, list[NamedShard]]:
    return {step: [NamedShard(step, f"s{step}-{i}") for i in range(n)] for step, n in sizes.items()}


#: steps given out of order, one without a shard, steps of one shard and of more than a group
SIZES = {7: 5, 2: 1, 4: 0, 0: 3, 9: 2, 5: 1, 3: 4, 8: 1, 1: 1, 6: 3}


@pytest.mark.parametrize("shards_per_task", [1, 2, 8])
def test_every_step_in_order_with_each_shards_result_in_shard_order(ray_local, shards_per_task):
    by_step = _by_step(SIZES)
    got = list(_engine(shards_per_task=shards_per_task).map_steps(by_step, _shard_name))
    want = [(step, [{"step": step, "shard": f"s{step}-{i}"} for i in range(SIZES[step])]) for step in range(10)]
    assert got == want


class RecordingRay:
    """The ``ray`` module itself (every call goes to it), recording how many tasks were in flight
    at each wait."""

    def __init__(self, ray):
        self._ray = ray
        self.in_flight: list[int] = []

    def __getattr__(self, name):
        return getattr(self._ray, name)

    def wait(self, refs, **kw):
        self.in_flight.append(len(refs))
        return self._ray.wait(refs, **kw)


def test_tasks_in_flight_never_exceed_the_clusters_limit(ray_local):
    from grpolens.metrics.engine_ray import _in_flight_limit

    limit = _in_flight_limit(ray_local.cluster_resources())
    assert limit == 4  # the fixture's 2 CPUs
    engine = _engine(shards_per_task=1)
    engine._ensure()
    spy = RecordingRay(ray_local)
    by_step = _by_step({s: 2 for s in range(8)})  # 16 tasks
    got = list(engine._map(spy, by_step, _shard_name))
    assert [s for s, _ in got] == list(range(8))
    assert max(spy.in_flight) == limit  # the window is filled, and never past the limit


def _raise_on(sh: NamedShard, failing: str, kind: str) -> dict:
    """Shard ``failing``'s error, made in the worker (grpolens' errors are not picklable)."""
    from grpolens.run.storage import StorageError

    if sh.name == failing:
        if kind == "format":
            raise RunFormatError(str(sh.path), "column has nulls", column="logp")
        raise StorageError(f"s3://runs/r/tokens/{sh.name}: access denied")
    return _shard_name(sh)


def test_a_shards_format_error_stops_the_run_with_its_file_message_and_column(ray_local):
    steps = []
    work = functools.partial(_raise_on, failing="s0-1", kind="format")
    with pytest.raises(RunFormatError) as e:
        for step, _ in _engine(shards_per_task=1).map_steps(_by_step(SIZES), work):
            steps.append(step)
    assert (e.value.path, e.value.message, e.value.column) == ("/runs/r/tokens/step=0/s0-1", "column has nulls", "logp")
    assert steps == []  # the failing shard is step 0's: no step was given out


def test_a_shards_storage_error_stops_the_run_with_its_message(ray_local):
    from grpolens.run.storage import StorageError

    work = functools.partial(_raise_on, failing="s3-2", kind="storage")
    with pytest.raises(StorageError) as e:
        list(_engine(shards_per_task=2).map_steps(_by_step(SIZES), work))
    assert e.value.message == "s3://runs/r/tokens/s3-2: access denied"


def _count_and_raise(sh: NamedShard, log: str) -> dict:
    with open(log, "a") as f:
        f.write(f"{sh.name}\n")
    raise KeyError(sh.name)  # a bug in grpolens, not a shard's fault: Ray re-raises it in the driver


def test_an_exception_in_grpolens_is_not_retried(ray_local, tmp_path):
    """Ray retries a task whose worker died (``test_worker_killed_mid_task_is_retried``), never one
    that raised: running it again would only raise again."""
    log = tmp_path / "calls"
    with pytest.raises(KeyError):
        list(_engine().map_steps(_by_step({0: 1}), functools.partial(_count_and_raise, log=str(log))))
    assert log.read_text() == "s0-0\n"
