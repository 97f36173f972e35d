"""``grpolens export`` against the real tracker clients in their offline/local modes, on the bundled
real TRL run: every exported value, read back with the tracker's own reader, equals
``metrics.jsonl``, at its training step; a second export of a run that grew adds only the new steps
(no point twice); the tables arrive where the tracker has a table type.

Each test exports a copy of the run cut to its first 12 steps, then the whole run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.export.readers import tensorboard_scalars, wandb_history

ROOT = Path(__file__).resolve().parents[2]
TRL_TINY = ROOT / "sample_runs" / "trl-tiny"
CUT = 12


def _cut(run: Path, last: int) -> None:
    for kind in ("tokens", "samples"):
        for d in (run / kind).iterdir():
            if int(d.name.split("=")[1]) > last:
                shutil.rmtree(d)


@pytest.fixture
def grown(tmp_path):
    """(run, grow): the run cut to its first CUT steps; grow() brings back the rest."""
    run = tmp_path / "trl-tiny"
    shutil.copytree(TRL_TINY, run, ignore=shutil.ignore_patterns("grpolens"))
    _cut(run, CUT)

    def grow():
        for kind in ("tokens", "samples"):
            for d in (TRL_TINY / kind).iterdir():
                if not (run / kind / d.name).exists():
                    shutil.copytree(d, run / kind / d.name)
    return run, grow


def expected(run: Path, where: Path | None = None) -> dict[str, dict[int, float]]:
    """metrics.jsonl (the run's, or the one in ``where``) as grpolens/<metric> -> {step: value},
    grpolens/step included."""
    out: dict[str, dict[int, float]] = {}
    for line in ((where or run / "grpolens") / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        step = row.pop("step")
        out.setdefault("grpolens/step", {})[step] = step
        for k, v in row.items():
            out.setdefault("grpolens/" + k, {})[step] = v
    return out


def assert_no_duplicates_and_equal(points: dict[str, list[tuple[int, float]]], want: dict[str, dict[int, float]]):
    assert set(points) == set(want)
    for key, pts in points.items():
        steps = [s for s, _ in pts]
        assert len(steps) == len(set(steps)), f"{key}: a step exported twice"
        assert dict(pts) == want[key], key  # exact: the values are float64 end to end


@pytest.mark.slow  # two recomputes and two exports of the run: ~25 s on a loaded 2-core machine
def test_tensorboard(cli, grown):
    run, grow = grown
    assert cli("export", run, "--to", "tensorboard", "-q").code == 0
    logdir = run / "grpolens" / "tensorboard" / "trl-tiny"
    assert max(s for s, _ in tensorboard_scalars(logdir)["grpolens/step"]) == CUT
    grow()
    assert cli("export", run, "--to", "tensorboard", "-q").code == 0
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1  # the earlier export's file was replaced
    assert_no_duplicates_and_equal(tensorboard_scalars(logdir), expected(run))


def test_tensorboard_logdir_option(cli, grown, tmp_path):
    run, _ = grown
    assert cli("export", run, "--to", "tensorboard", "--logdir", tmp_path / "tb", "--name", "mine", "-q").code == 0
    got = tensorboard_scalars(tmp_path / "tb" / "mine")
    assert_no_duplicates_and_equal(got, expected(run))


def test_tensorboard_variant(cli, grown, tmp_path):
    """--variant exports a what-if's metrics (recompute --set), as a tracker run of its own."""
    from grpolens.run.variants import variant_key

    run, _ = grown
    assert cli("recompute", run, "--set", "epsilon=0.1", "-q").code == 0
    where = run / "grpolens" / "variants" / variant_key({"epsilon": 0.1})
    assert cli("export", run, "--variant", "epsilon=0.1", "--to", "tensorboard", "--logdir", tmp_path / "tb", "-q").code == 0
    got = tensorboard_scalars(tmp_path / "tb" / "trl-tiny @ epsilon=0.1")
    assert_no_duplicates_and_equal(got, expected(run, where))
    assert cli("recompute", run, "-q").code == 0
    assert expected(run, where) != expected(run)  # the what-if's values were exported, not the run's
    assert cli("export", run, "--variant", "epsilon=9", "--to", "tensorboard", "-q").code == 2


@pytest.mark.slow  # MLflow creates its SQLite schema through ~100 alembic migrations: ~20 s
def test_mlflow(cli, grown, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from grpolens.export.mlflow import metric_key

    run, grow = grown
    # the default store keeps its artifacts beside it: MLflow's own default for a SQLite store is
    # ./mlruns of the working directory, which put them in whatever directory the export ran in
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli("export", run, "--to", "mlflow", "-q").code == 0
    grow()
    assert cli("export", run, "--to", "mlflow", "-q").code == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'grpolens' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("grpolens")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # the second export found the first one's run
    run_id = runs[0].info.run_id
    want = {metric_key(k): v for k, v in expected(run).items()}
    assert set(runs[0].data.metrics) == set(want)
    points = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in want}
    assert_no_duplicates_and_equal(points, want)
    # the tables: MLflow's own table artifacts, every step's rows once
    import polars as pl

    arts = {a.path for a in client.list_artifacts(run_id, "grpolens")}
    assert {"grpolens/completions.json", "grpolens/top_tokens.json"} <= arts
    local = client.download_artifacts(run_id, "grpolens/completions.json", str(run / "dl"))
    table = json.loads(Path(local).read_text())
    steps = [r[table["columns"].index("step")] for r in table["data"]]
    assert sorted(steps) == sorted(pl.read_parquet(run / "grpolens" / "completions.parquet")["step"].to_list())
    assert list(elsewhere.iterdir()) == []
    assert Path(local).read_bytes() == next((run / "grpolens" / "mlflow-artifacts").rglob("completions.json")).read_bytes()


@pytest.mark.slow  # wandb starts its service process for each export: ~50 s for three
def test_wandb_offline(cli, grown, tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    run, grow = grown
    assert cli("export", run, "--to", "wandb", "-q").code == 0
    grow()
    assert cli("export", run, "--to", "wandb", "-q").code == 0
    assert cli("export", run, "--to", "wandb", "-q").code == 0  # nothing new: no third offline run
    dirs = sorted((run / "grpolens" / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2 and all(d.name.endswith(dirs[0].name.split("-", 3)[-1]) for d in dirs)  # one run id
    rows = wandb_history(dirs)
    metric_rows = [r for r in rows if not any(k.startswith("grpolens/tables/") for k in r)]
    points: dict[str, list] = {}
    for r in metric_rows:
        for k, v in r.items():
            if k.startswith("grpolens/"):
                points.setdefault(k, []).append((r["grpolens/step"], v))
    assert_no_duplicates_and_equal(points, expected(run))
    tables = [k for r in rows for k in r if k.startswith("grpolens/tables/") and k.endswith("/_type")]
    assert {r[k] for r in rows for k in tables if k in r} == {"table-file"}
    # define_metric: grpolens/step is the x-axis of every grpolens metric
    defined = {}
    for d in dirs:
        for log in d.glob("run-*.wandb"):
            from tests.export.readers import wandb_records

            for rec in wandb_records(log):
                if rec.WhichOneof("record_type") == "metric":
                    defined[rec.metric.name or rec.metric.glob_name] = rec.metric.step_metric
    assert defined.get("grpolens/*") == "grpolens/step"


@pytest.mark.slow  # two fresh interpreters (trackio reads TRACKIO_DIR once, at import)
def test_trackio(grown, tmp_path):
    run, grow = grown
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def export():
        subprocess.run([sys.executable, "-m", "grpolens.cli", "export", str(run), "--to", "trackio", "-q"],
                       env=env, check=True, capture_output=True, text=True, timeout=300)

    export()
    grow()
    export()
    read = ("import json, sys\nfrom trackio.sqlite_storage import SQLiteStorage\n"
            "print(json.dumps({'runs': SQLiteStorage.get_runs('grpolens'), "
            "'logs': SQLiteStorage.get_logs('grpolens', 'trl-tiny')}, default=str))")
    out = json.loads(subprocess.run([sys.executable, "-c", read], env=env, check=True, capture_output=True,
                                    text=True, timeout=300).stdout)
    assert out["runs"] == ["trl-tiny"]
    points: dict[str, list] = {}
    tables = set()
    for row in out["logs"]:
        for k, v in row.items():
            if k.startswith("grpolens/tables/"):
                tables.add(k)
            elif k.startswith("grpolens/"):
                points.setdefault(k, []).append((row["step"], v))
    assert_no_duplicates_and_equal(points, expected(run))
    assert tables == {"grpolens/tables/completions", "grpolens/tables/top_tokens"}


def test_bad_options(cli, grown):
    run, _ = grown
    r = cli("export", run, "--to", "neptune")
    assert r.code == 2 and "--to: unknown tracker 'neptune'; choose one of wandb, tensorboard, mlflow, trackio" in r.err
    r = cli("export", run, "--to", "tensorboard", "--resume", "abc")
    assert r.code == 2 and "--resume applies to --to wandb only" in r.err
    assert cli("export", run / "nope", "--to", "tensorboard").code == 2
    assert not (run / "nope").exists()


def test_core_does_not_import_trackers():
    code = ("import sys, grpolens, grpolens.cli, grpolens.commands.export, grpolens.export\n"
            "bad = [m for m in ('wandb', 'tensorboard', 'mlflow', 'trackio') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
