"""Every reading command on an s3:// run prints what it prints for the same run on local disk.

The run is uploaded to the real local S3 server (moto, signature and IAM checks on) and each
command runs twice through the command line, once on the local directory and once on the
``s3://`` URL; their outputs (``--json`` where the command has it) must be identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.distributed.conftest import upload
from tests.sample_runs import copy_sample_run

pytestmark = pytest.mark.slow  # the S3 server subprocess and a synthetic run, once per session

TRL_TINY = Path(__file__).resolve().parents[2] / "sample_runs" / "trl-tiny"


@pytest.fixture
def trl_remote(s3_env, tmp_path, monkeypatch):
    """sample_runs/trl-tiny (a TRL run with its tokenizer.json, and its trainer's log and state in
    RUN/grpolens/) on the server, and a local copy."""
    local = tmp_path / "trl-tiny"
    copy_sample_run("trl-tiny", local)
    monkeypatch.chdir(tmp_path)
    return local, upload(s3_env, local, f"trl-{tmp_path.name}")


def test_validate(cli, synth_small, remote):
    code_l, out_l, _ = cli("validate", str(synth_small), "--json")
    code_r, out_r, err_r = cli("validate", remote, "--json")
    assert (code_r, out_r) == (code_l, out_l)
    assert f"OK {remote}:" in err_r.replace("\n", " ")


def test_validate_reads_an_empty_prefix_as_an_empty_run_directory(cli, s3_env, tmp_path):
    """A prefix with no object under it "exists" (object storage has no directories): validate
    names the missing manifest, by its path in the run, as for an empty local directory (not a
    missing run)."""
    (tmp_path / "empty").mkdir()
    local = cli("validate", str(tmp_path / "empty"), "--json")[:2]
    remote = cli("validate", f"s3://runs/empty-{tmp_path.name}", "--json")[:2]
    assert remote[0] == local[0] == 1
    where = [[p[k] for k in ("severity", "path", "column")] for p in map(json.loads, remote[1].splitlines())]
    assert where == [[p[k] for k in ("severity", "path", "column")] for p in map(json.loads, local[1].splitlines())]
    assert where[0] == ["error", "grpolens.json", None]  # relative to the run, as every problem's path


def test_storage_option_is_every_commands(cli, s3_env, remote, monkeypatch):
    """--storage-option is the one shared option: it reaches the readers below any command."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    code, _, err = cli("validate", remote, "--json")
    assert code == 2 and "cannot reach the storage endpoint" in err
    for args in (["validate", remote], ["completions", remote, "--step", "1"], ["tokens", remote, "--step", "1"]):
        code, out, err = cli(*args, "--storage-option", f"endpoint_url={s3_env.endpoint}")
        assert code == 0, err


def test_validate_reports_problems_in_the_bucket(cli, s3_env, synth_small, remote):
    """A stray key, an interrupted upload's temporary key and a truncated shard: the problems a
    local run with the same damage gives, named by their paths in the run."""
    client = s3_env.client()
    prefix = remote[len("s3://runs/"):]
    shard = "tokens/step=00000002/rank=00000.parquet"
    body = (synth_small / shard).read_bytes()
    client.put_object(Bucket="runs", Key=f"{prefix}/{shard}", Body=body[: len(body) // 2])
    client.put_object(Bucket="runs", Key=f"{prefix}/notes.txt", Body=b"x")
    code, out, _ = cli("validate", remote, "--json")
    problems = [json.loads(line) for line in out.splitlines()]
    assert code == 1
    by_path = {p["path"]: p for p in problems}
    assert by_path[shard]["severity"] == "error" and "unreadable" in by_path[shard]["message"]
    assert by_path["notes.txt"]["severity"] == "warning"


def test_validate_loads_the_buckets_tokenizer(cli, trl_remote):
    """tokenizer.json is read from the bucket, and loads: validate says of the s3:// run what it
    says of the local copy, and nothing of the tokenizer."""
    local, remote = trl_remote
    code_l, out_l, _ = cli("validate", str(local), "--json")
    code_r, out_r, _ = cli("validate", remote, "--json")
    assert (code_r, out_r) == (code_l, out_l)
    assert "tokenizer.json" not in out_r


def test_tokens_decodes_with_the_buckets_tokenizer(cli, trl_remote):
    local, remote = trl_remote
    for args in (["--step", "1", "--by", "kl", "--json"], ["--step", "2", "--sample", "1000003", "--json"]):
        code_l, out_l, _ = cli("tokens", str(local), *args)
        code_r, out_r, _ = cli("tokens", remote, *args)
        assert code_l == 0 and (code_r, out_r) == (code_l, out_l)
        rows = json.loads(out_r)
        assert rows and all(r["token"] is not None for r in rows)  # text from tokenizer.json, read from the bucket
    _, table, _ = cli("tokens", remote, "--step", "1")
    assert "decoded with the run's tokenizer.json" in table


def test_completions(cli, synth_small, remote):
    for step in ("0", "3"):
        code_l, out_l, _ = cli("completions", str(synth_small), "--step", step, "--json", "-n", "0")
        code_r, out_r, _ = cli("completions", remote, "--step", step, "--json", "-n", "0")
        assert code_l == 0 and (code_r, out_r) == (code_l, out_l)
        assert json.loads(out_r)
    # after a recompute, the table comes from the run's local outputs (./run.grpolens/completions.parquet)
    cli("recompute", remote, "-q")
    assert Path("run.grpolens", "completions.parquet").is_file()
    code, out, _ = cli("completions", remote, "--step", "3")
    assert code == 0 and "— completions.parquet" in out
    assert cli("completions", remote, "--step", "3", "--json", "-n", "0")[1] == out_l


@pytest.fixture
def local_copy(synth_small, tmp_path):
    """A copy of ``synth_small`` for commands that write beside the run (RUN/grpolens/)."""
    dst = tmp_path / "local" / "run"
    shutil.copytree(synth_small, dst, ignore=shutil.ignore_patterns("grpolens"))
    return dst


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_sidecars(cli, local_copy, remote):
    assert cli("sidecars", str(local_copy), "-q")[0] == 0
    assert cli("sidecars", remote, "-q")[0] == 0
    want = _files(local_copy / "grpolens" / "rich_completions")
    assert want and _files(Path("run.grpolens", "rich_completions")) == want


def test_recompute_is_weights(cli, local_copy, remote):
    import polars as pl

    assert cli("recompute", str(local_copy), "--is-weights", "-q")[0] == 0
    assert cli("recompute", remote, "--is-weights", "-q")[0] == 0
    local_dir, remote_dir = local_copy / "grpolens" / "is_weights", Path("run.grpolens", "is_weights")
    names = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*.parquet"))
    assert names and names == sorted(p.relative_to(remote_dir).as_posix() for p in remote_dir.rglob("*.parquet"))
    for n in names:
        assert pl.read_parquet(remote_dir / n).equals(pl.read_parquet(local_dir / n)), n
    assert (remote_dir / "config.json").read_bytes() == (local_dir / "config.json").read_bytes()


def test_recompute_is_weights_to_the_bucket(cli, s3_env, local_copy, remote):
    """--is-weights --out s3://: every weight file lands under OUT/is_weights/ in the bucket (each
    uploaded atomically: no temporary key left), the same bytes' tables as the local run's, and
    nothing of them is written locally."""
    assert cli("recompute", str(local_copy), "--is-weights", "-q")[0] == 0
    out = f"{remote}-out"
    code, _, err = cli("recompute", remote, "--is-weights", "--out", out, "-q")
    assert code == 0, err
    base = out[len("s3://runs/"):] + "/is_weights/"
    client = s3_env.client()
    keys = sorted(o["Key"][len(base):] for o in client.list_objects_v2(Bucket="runs", Prefix=base)["Contents"]
                  if not o["Key"].endswith("/"))
    local_dir = local_copy / "grpolens" / "is_weights"
    want = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
    assert want and keys == want  # no .grpolens-tmp- key among them
    _assert_bucket_holds_the_local_files(client, base, local_dir, want)
    assert not Path("run.grpolens", "is_weights").exists()


def _assert_bucket_holds_the_local_files(client, base: str, local_dir: Path, names: list[str]) -> None:
    """Each of ``names`` under ``base`` in the bucket holds what the local file of that name holds (a
    Parquet file: the same table)."""
    import io

    import polars as pl

    for n in names:
        body = client.get_object(Bucket="runs", Key=base + n)["Body"].read()
        if n.endswith(".parquet"):
            assert pl.read_parquet(io.BytesIO(body)).equals(pl.read_parquet(local_dir / n)), n
        else:
            assert body == (local_dir / n).read_bytes(), n


def test_recompute_is_weights_to_the_bucket_replaces_an_earlier_recomputes(cli, s3_env, local_copy, remote):
    """A second --is-weights --out s3:// over the weights of an earlier recompute with other settings
    (an upper bound of 1.001) and over parts of an earlier layout (a rank and a part the run no longer
    has): the bucket then holds the local run's files and nothing else of the weights', the other
    keys in a step's folder kept. The recompute stages the earlier outputs under OUT locally and
    uploads them at its end; staged weights went up over the new ones and restored the stale parts."""
    import polars as pl

    assert cli("recompute", str(local_copy), "--is-weights", "-q")[0] == 0
    local_dir = local_copy / "grpolens" / "is_weights"
    want = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
    assert max(pl.read_parquet(local_dir / n)["is_weight"].max() for n in want if n.endswith(".parquet")) > 1.001
    out = f"{remote}-out"
    code, _, err = cli("recompute", remote, "--is-weights", "--out", out, "-q",
                           "--set", "rollout_is.upper=1.001")
    assert code == 0, err
    base = out[len("s3://runs/"):] + "/is_weights/"
    client = s3_env.client()
    stale = ["step=00000001/rank=00007.parquet", "step=00000002/rank=00000-0003.parquet"]
    kept = ["step=00000001/notes.txt", "step=00000001/old.parquet", "step=00000001/rank=00007.json"]
    for n in stale + kept:
        client.put_object(Bucket="runs", Key=base + n, Body=b"not this recompute's")
    code, _, err = cli("recompute", remote, "--is-weights", "--out", out, "-q")
    assert code == 0, err
    keys = sorted(o["Key"][len(base):] for o in client.list_objects_v2(Bucket="runs", Prefix=base)["Contents"]
                  if not o["Key"].endswith("/"))
    assert keys == sorted(want + kept)
    _assert_bucket_holds_the_local_files(client, base, local_dir, want)


def test_parity_reads_the_trainers_log_from_the_bucket(cli, s3_env, trl_remote):
    local, remote = trl_remote
    code_l, out_l, _ = cli("parity", str(local), "--json")
    code_r, out_r, _ = cli("parity", remote, "--json")
    assert code_l == 0 and (code_r, out_r) == (code_l, out_l) and len(json.loads(out_r)) > 50


def test_export(cli, trl_remote):
    pytest.importorskip("tensorboard")
    from tests.export.readers import tensorboard_scalars

    local, remote = trl_remote
    assert cli("export", str(local), "--to", "tensorboard", "-q")[0] == 0
    assert cli("export", remote, "--to", "tensorboard", "-q")[0] == 0
    want = tensorboard_scalars(local / "grpolens" / "tensorboard" / "trl-tiny")
    assert want and tensorboard_scalars(Path("trl-tiny.grpolens", "tensorboard", "trl-tiny")) == want


def test_serve_draws_an_s3_run_as_the_local_one(local_copy, remote):
    """The dashboard's pages (curves, IS detail, top tokens, one completion, the completions table)
    built from the s3:// run are the ones built from the same run on disk."""
    from plotly.utils import PlotlyJSONEncoder
    from rich.console import Console

    from grpolens.commands.serve import _recompute_all
    from grpolens.serve import callbacks as cb
    from grpolens.serve import data
    from grpolens.serve.runs import resolve_runs

    def pages(runs) -> str:
        name = runs.names[0]
        views = [cb.curve_page_children(runs, page, [name]) for page in ("overview", "policy", "mismatch", "rewards")]
        views += [cb.mismatch_step_panel(runs, name, 3), cb.top_tokens_view(runs, name, 3, "kl", 10),
                  cb.completion_view(runs, name, 3, None, "kl"),
                  cb.completions_table(runs, name, 3, 0, 20, None, None)]
        return json.dumps(views, cls=PlotlyJSONEncoder, sort_keys=True)

    out = []
    for arg in (str(local_copy), remote):
        data.clear_caches()
        runs = resolve_runs([arg])
        _recompute_all(runs, Console(quiet=True))
        out.append(pages(runs))
    assert Path("run.grpolens", "metrics.parquet").is_file()  # the s3:// run's outputs, local
    assert out[1] == out[0]


def test_check_against_a_baseline_in_the_bucket(cli, synth_small, remote, tmp_path):
    """check --baseline s3://...: the verdicts (rule by rule) of the same check on disk."""
    base = tmp_path / "base"
    shutil.copytree(synth_small, base, ignore=shutil.ignore_patterns("grpolens"))
    code_l, out_l, _ = cli("check", str(synth_small), "--baseline", str(base), "--json")
    code_r, out_r, _ = cli("check", remote, "--baseline", remote, "--json")
    drop = ("drilldown", "message")  # these name the run's path

    def verdicts(out: str) -> list[dict]:
        return [{k: v for k, v in row.items() if k not in drop} for row in json.loads(out)]

    assert code_r == code_l and verdicts(out_r) == verdicts(out_l)
    assert any(row["rule"] == "baseline coverage" and row["status"] == "PASS" for row in json.loads(out_r))


def test_check_against_a_prefix_in_the_bucket_that_is_not_a_run_names_it(cli, s3_env, synth_small, tmp_path):
    """A baseline prefix with no run under it: one line naming it (no "directory": object storage has none)."""
    base = f"s3://runs/empty-{tmp_path.name}"
    code, _, err = cli("check", str(synth_small), "--baseline", base)
    assert code == 2 and err.strip() == f"error: --baseline: {base} is not a grpolens run (no grpolens.json)"


def test_serve_watch_picks_up_a_new_step_in_the_bucket(s3_env, synth_small, tmp_path, monkeypatch):
    """serve --watch on an s3:// run: an idle poll is three LIST requests and nothing else; a step
    uploaded while serving is recomputed once its completion markers are there, and the pages'
    data (the curves' series, the run's version the page polls) show it."""
    from polars.testing import assert_frame_equal
    from rich.console import Console

    from grpolens.analysis.recompute import recompute
    from grpolens.commands.serve import _recompute_all
    from grpolens.run import format as fmt
    from grpolens.serve import data
    from grpolens.serve.runs import resolve_runs
    from grpolens.serve.watch import Watcher

    monkeypatch.chdir(tmp_path)
    client, prefix = s3_env.client(), f"watch-{tmp_path.name}"
    files = {p.relative_to(synth_small).as_posix(): p for p in sorted(synth_small.rglob("*"))
             if p.is_file() and p.relative_to(synth_small).parts[0] != "grpolens"}

    def put(names):
        for n in names:
            client.put_object(Bucket="runs", Key=f"{prefix}/{n}", Body=files[n].read_bytes())

    last = [n for n in files if "step=00000005" in n or "finished" in n]  # a run still training: step 5 to come
    put(n for n in files if n not in last)
    fmt.forget_listings()
    data.clear_caches()
    runs = resolve_runs([f"s3://runs/{prefix}"])
    _recompute_all(runs, Console(quiet=True))
    (name, run), = runs.runs.items()
    assert data.series(run)["step"].to_list() == [0, 1, 2, 3, 4]
    errors = []
    watcher = Watcher(runs.runs, lambda n, e: errors.append((n, e)), every=0, remote_every=0)

    s3_env.reset_counts()
    assert [watcher.poll() for _ in range(3)] == [[], [], []]
    assert s3_env.counts() == {"LIST": 9}  # tokens/, samples/, complete/ per poll; no GET, no HEAD
    version = data.run_version(run)

    put(n for n in last if not n.startswith("complete/"))  # the shards first, as the writer does
    assert watcher.poll() == [name]
    assert data.series(run)["step"].to_list() == [0, 1, 2, 3, 4]  # not complete yet: skipped
    put(n for n in last if n.startswith("complete/"))
    assert watcher.poll() == [name] and errors == []
    assert data.run_version(run) != version
    got = data.series(run)
    assert got["step"].to_list() == [0, 1, 2, 3, 4, 5]
    want = recompute(synth_small, write=False, incremental=False)
    assert_frame_equal(got.select(want.columns), want, check_exact=True)


def test_an_s3_runs_hub_tokenizer_comes_from_the_local_cache_not_the_bucket(s3_env, tmp_path):
    """A manifest tokenizer is a hub name or, for a local run only, a directory of the run: on
    object storage a prefix of that name is not read, the name is looked up in the local Hugging
    Face cache (here one made by the test, in a fresh process), so the bucket's run decodes like
    the local copy does with that cache."""
    import os
    import subprocess
    import sys

    from tests.helpers.hub_cache import hub_cache

    local = tmp_path / "trl-tiny"
    copy_sample_run("trl-tiny", local)
    cache = hub_cache(tmp_path / "hf-cache", "grpolens-test/tiny", local / "tokenizer.json")
    (local / "tokenizer.json").unlink()
    shutil.copytree(cache / "models--grpolens-test--tiny" / "snapshots", local / "grpolens-test" / "tiny")
    manifest = json.loads((local / "grpolens.json").read_text())
    manifest["config"]["tokenizer"] = "grpolens-test/tiny"
    (local / "grpolens.json").write_text(json.dumps(manifest))
    remote = upload(s3_env, local, f"hub-{tmp_path.name}")
    script = ("import sys; from grpolens.run.decode import make_decoder; from grpolens.run.format import as_run; "
              "d, s = make_decoder(as_run(sys.argv[1]), {'tokenizer': 'grpolens-test/tiny'}); print(s, d(7))")
    root = Path(__file__).resolve().parents[2]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
           "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", script, remote], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "tokenizer b"


def test_explain(cli, synth_small, remote):
    """explain on an s3:// run: the local run's explanation, number for number (the JSON names no
    path), against the step before and against a baseline range; a bad step is the local line."""
    for args in (("--metric", "mismatch/kl_k3", "--step", "3"), ("--metric", "entropy", "--step", "4", "--baseline", "0:2"),
                 ("--metric", "clip/high", "--step", "3", "--by", "completion")):
        code_l, out_l, err_l = cli("explain", str(synth_small), *args, "--json")
        code_r, out_r, err_r = cli("explain", remote, *args, "--json")
        assert code_l == 0, err_l
        assert (code_r, out_r) == (code_l, out_l), err_r
    code_l, _, err_l = cli("explain", str(synth_small), "--metric", "entropy", "--step", "99")
    code_r, _, err_r = cli("explain", remote, "--metric", "entropy", "--step", "99")
    assert code_r == code_l == 2 and err_r.replace(remote, "RUN") == err_l.replace(str(synth_small), "RUN"), (err_l, err_r)


def test_doctor(cli, s3_env, tmp_path, monkeypatch):
    """The diagnosis of an s3:// run is the local one's (findings with their explanation, every
    detector's status), and it writes nothing beside the bucket or in the working directory."""
    from grpolens.adapters.synth import synth_run

    local = synth_run(tmp_path / "spike", steps=12, seed=3, inject=["kl-spike@6"])
    remote = upload(s3_env, local, f"doctor-{tmp_path.name}")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code_l, out_l, _ = cli("doctor", str(local), "--json", "--fail-on", "critical")
    code_r, out_r, err_r = cli("doctor", remote, "--json", "--fail-on", "critical")
    assert code_l == code_r == 1, err_r
    lj, rj = json.loads(out_l), json.loads(out_r)
    assert rj["run"] == remote and rj["findings"] == lj["findings"] and rj["detectors"] == lj["detectors"]
    assert rj["findings"][0]["id"] == "kl-spike" and "explain" in rj["findings"][0]["evidence"]
    assert list(work.iterdir()) == []
