"""Runs on a real local S3 server: recompute from s3:// gives the local run's metrics, the per-step
cache reads no unchanged shard, outputs go back to the bucket atomically, and every storage failure
is one line with a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from grpolens.analysis.recompute import recompute
from grpolens.cli import main
from grpolens.run import format as fmt
from grpolens.run.storage import StorageError

pytestmark = pytest.mark.slow  # the S3 server subprocess and a synthetic run, once per session


def test_same_metrics_as_local_and_cache_reads_no_shard(s3_env, synth_small, remote, tmp_path):
    local = recompute(synth_small, write=False, incremental=False)
    s3_env.reset_counts()
    res = recompute(remote, result=True)
    first = s3_env.counts()
    assert_frame_equal(res.metrics, local, check_exact=True)
    assert res.out_dir == Path("run.grpolens") and (tmp_path / "run.grpolens" / "metrics.parquet").is_file()
    n_shards = len(fmt.list_shards(synth_small, fmt.TOKENS)) + len(fmt.list_shards(synth_small, fmt.SAMPLES))
    assert first.get("LIST", 0) <= 4  # one recursive listing per table (+ the bucket checks)
    assert first.get("GET tokens", 0) >= len(fmt.list_shards(synth_small, fmt.TOKENS))

    fmt.forget_listings()
    s3_env.reset_counts()
    again = recompute(remote, result=True)
    second = s3_env.counts()
    assert again.computed_steps == [] and again.reused_steps == list(range(6))
    assert_frame_equal(again.metrics, local, check_exact=True)
    # unchanged shards are not read again: neither their rows nor their footers
    assert second.get("GET tokens", 0) == 0 and second.get("GET samples", 0) == 0, second
    assert n_shards > 0


def test_outputs_back_to_the_bucket(s3_env, synth_small, remote):
    out = f"{remote}-out"
    main(["recompute", remote, "--out", out, "-q"])
    client = s3_env.client()
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="runs", Prefix=out[len("s3://runs/"):])["Contents"]}
    base = out[len("s3://runs/"):]
    assert {f"{base}/metrics.parquet", f"{base}/metrics.jsonl", f"{base}/cache/state-grpolens.json"} <= keys
    assert not any(".grpolens-tmp-" in k for k in keys)
    import io

    got = pl.read_parquet(io.BytesIO(client.get_object(Bucket="runs", Key=f"{base}/metrics.parquet")["Body"].read()))
    assert_frame_equal(got, recompute(synth_small, write=False, incremental=False), check_exact=True)
    # a second run finds its cache in the bucket: nothing recomputed, no shard read
    fmt.forget_listings()
    s3_env.reset_counts()
    res = recompute(remote, out=out, result=True)
    assert res.computed_steps == [] and s3_env.counts().get("GET tokens", 0) == 0


def _one_line_exit(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


def test_missing_bucket(s3_env, capsys):
    assert _one_line_exit(capsys, "recompute", "s3://nope/run", "-q") == "error: s3://nope/run: no such bucket"


def test_missing_credentials(s3_env, remote, capsys, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert "no S3 credentials" in _one_line_exit(capsys, "recompute", remote, "-q")


def test_permission_denied(s3_env, remote, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.lister[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.lister[1])
    line = _one_line_exit(capsys, "recompute", remote, "-q")
    assert line.endswith("grpolens.json: permission denied"), line


def test_storage_options_override_environment(s3_env, remote, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    assert "cannot reach the storage endpoint" in _one_line_exit(capsys, "recompute", remote, "-q")
    main(["recompute", remote, "-q", "--storage-option", f"endpoint_url={s3_env.endpoint}"])


def test_storage_options_apply_to_a_remote_output_of_a_local_run(s3_env, synth_small, tmp_path, monkeypatch):
    """A local run with --out s3://: the option is meaningful (it reaches the output) and is used."""
    import shutil

    run = tmp_path / "local-run"
    shutil.copytree(synth_small, run, ignore=shutil.ignore_patterns("grpolens"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # only the option leads to the server
    out = f"s3://runs/out-{tmp_path.name}"
    main(["recompute", str(run), "--out", out, "-q", "--storage-option", f"endpoint_url={s3_env.endpoint}"])
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket="runs", Prefix=f"out-{tmp_path.name}/")["Contents"]}
    assert f"out-{tmp_path.name}/metrics.parquet" in keys


def test_shard_removed_mid_read(s3_env, remote):
    gone = fmt.list_shards(remote, fmt.TOKENS, steps=[4])[0]
    key = gone.path.path.split("/", 1)[1]

    def delete_later(step, _pieces):
        if step == 0:
            s3_env.client().delete_object(Bucket="runs", Key=key)

    with pytest.raises(StorageError) as e:
        recompute(remote, on_step=delete_later)
    assert str(e.value) == f"{gone.path}: no such file or object (removed while being read?)"
    assert not Path("run.grpolens", "metrics.parquet").exists()


def test_ray_engine_reads_from_the_bucket(s3_env, ray_local, synth_small, remote):
    from grpolens.metrics.engine_ray import RayEngine

    got = recompute(remote, write=False, engine=RayEngine())
    assert_frame_equal(got, recompute(synth_small, write=False, incremental=False), check_exact=True)


def _exit_code(*args) -> int:
    try:
        main(list(args))
    except SystemExit as e:
        return e.code or 0
    return 0


def test_check_and_sweep_read_the_bucket(s3_env, synth_small, remote, tmp_path, capsys):
    from grpolens.analysis.sweep import sweep

    assert _exit_code("check", remote, "-q") == _exit_code("check", str(synth_small), "-q")  # the same verdict
    capsys.readouterr()
    main(["sweep", remote, "--param", "rollout_is.upper=1.5,3", "-q"])
    got = pl.read_parquet(tmp_path / "run.grpolens" / "sweep.parquet")
    assert_frame_equal(got, sweep(synth_small, {"upper": [1.5, 3.0]}), check_exact=True)


def test_only_to_an_s3_output_lands_in_the_bucket(s3_env, synth_small, tmp_path, monkeypatch):
    """--only --out s3://: the selected metrics are uploaded (they were written to a local staging
    folder and left there), nothing of an earlier full recompute there is fetched or rewritten, and
    no staging folder is left behind."""
    import io
    import shutil
    import tempfile

    run = tmp_path / "local-run"
    shutil.copytree(synth_small, run, ignore=shutil.ignore_patterns("grpolens"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the staging folders go here
    (tmp_path / "tmp").mkdir()
    out = f"s3://runs/only-{tmp_path.name}"
    recompute(run, out=out)  # a full recompute's outputs and cache in the bucket first
    client = s3_env.client()

    def objects() -> dict[str, str]:
        listed = client.list_objects_v2(Bucket="runs", Prefix=f"only-{tmp_path.name}/")["Contents"]
        return {o["Key"].split("/", 1)[1]: o["ETag"] for o in listed}

    before = objects()
    res = recompute(run, out=out, only=["clip,kl/k3"], result=True)
    after = objects()
    body = client.get_object(Bucket="runs", Key=f"only-{tmp_path.name}/metrics.parquet")["Body"].read()
    assert_frame_equal(pl.read_parquet(io.BytesIO(body)), res.metrics)
    assert res.metrics.columns[0] == "step" and "clip/low" in res.metrics.columns and "entropy" not in res.metrics.columns
    assert str(res.out_dir) == out
    changed = sorted(k for k in after if after[k] != before.get(k))
    assert changed == ["metrics.jsonl", "metrics.parquet"]
    assert list((tmp_path / "tmp").iterdir()) == []
