"""The benchmark scripts measure what they say they measure."""

import importlib.util
from pathlib import Path

import pytest

from grpolens.metrics.engine import READ_COLUMNS
from tests.sample_runs import copy_sample_run

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_read_floor_reads_the_columns_recompute_reads():
    # read_floor.py spells the list out so that its process imports no grpolens
    assert tuple(_load("read_floor").TOKEN_COLUMNS) == tuple(READ_COLUMNS)


def test_shard_cpu_times_every_producer_and_visitor():
    from grpolens.metrics.engine import VISITORS
    from grpolens.metrics.partials import PRODUCERS

    cpu = _load("shard_cpu").shard_cpu(str(BENCH.parent / "sample_runs" / "tiny"))
    assert {f"visitor {v}" for v in VISITORS} | {"read", "TokenBatch.from_arrow", "producer loss"} <= set(cpu)
    assert {p[len("producer "):] for p in cpu if p.startswith("producer ")} <= set(PRODUCERS)
    assert all(s >= 0 for s in cpu.values()) and cpu["read"] > 0


def test_subset_is_a_valid_only_selection():
    from grpolens.analysis.recompute import metrics_for, select_metrics
    from grpolens.run.config import check_config

    subset = _load("bench_recompute").SUBSET
    from grpolens.run import format as fmt

    cfg = check_config(fmt.read_manifest(BENCH.parent / "sample_runs" / "tiny").resolved_config())
    picked = select_metrics(metrics_for("grpolens", cfg), [subset])
    assert [m.name for m in picked] and len(picked) == len(subset.split(","))


def test_doc_blocks_are_replaced_whole_and_rows_by_their_command(tmp_path, monkeypatch):
    block = _load("doc_block")
    monkeypatch.setattr(block, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("# Speed\n\nbefore\n\nafter\n")
    block.write_block("page.md", "b", "benchmarks/x.py", "one", after="before\n")
    block.write_block("page.md", "b", "benchmarks/x.py", "two\nlines")
    assert page.read_text() == ("# Speed\n\nbefore\n\n<!-- b: begin (written by benchmarks/x.py --write-doc) -->\n"
                                "two\nlines\n<!-- b: end -->\n\nafter\n")
    cols = ["command", "figure"]
    block.upsert_row("page.md", "b", "benchmarks/x.py", "intro", cols, "python benchmarks/x.py --n 1", ["1 ms"])
    block.upsert_row("page.md", "b", "benchmarks/x.py", "intro", cols, "python benchmarks/x.py --n 2", ["2 ms"])
    block.upsert_row("page.md", "b", "benchmarks/x.py", "intro", cols, "python benchmarks/x.py --n 1", ["3 ms"])
    rows = [ln for ln in page.read_text().splitlines() if ln.startswith("| `python")]
    assert rows == ["| `python benchmarks/x.py --n 2` | 2 ms |", "| `python benchmarks/x.py --n 1` | 3 ms |"]
    assert (block.shown_command("benchmarks/x.py", ["--tokens", "1e6", "--dir", "/tmp/x", "--write-doc", "--keep"])
            == "python benchmarks/x.py --tokens 1e6")


def test_serve_benchmark_fires_the_callbacks_the_dashboard_has(tmp_path):
    """bench_serve times the callbacks by their JSON requests; a changed callback signature (a new
    input) must fail here, not as an HTTP 500 half-way through a long benchmark."""

    from grpolens.run import format as fmt
    from grpolens.serve.app import create_app

    bench = _load("bench_serve")
    run = tmp_path / "tiny"
    copy_sample_run("tiny", run)
    app = create_app([run])
    client = app.server.test_client()
    step = fmt.list_steps(run, fmt.TOKENS)[1]
    fired = 0
    for label, requests in bench.page_requests(app.grpolens_runs.names[0], step).items():
        for outputs, inputs, state in requests:
            r = client.post("/_dash-update-component", json=bench.callback_body(outputs, inputs, state))
            assert r.status_code == 200, f"{label}: {outputs[0]} answered {r.status_code}"
            assert "error" not in r.get_data(as_text=True).lower()[:200], r.get_data(as_text=True)[:500]
            fired += 1
    assert fired == 4


@pytest.mark.slow  # synthesises two steps of the benchmark's shape (260 k token rows): 14 s on a loaded machine
def test_distributed_pieces_report_their_shares_and_the_estimate(tmp_path, monkeypatch, capsys):
    """`bench_distributed.py pieces` on a tiny run: the report docs/distributed.md quotes (the
    driver's share, the paper estimate) comes out of the measured per-row costs."""
    import argparse

    bench = _load("bench_distributed")
    bench.cmd_pieces(argparse.Namespace(tokens=0.3e6, dir=str(tmp_path), steps=1))
    report = "\n".join(bench.REPORT)
    assert "the driver's serial share" in report and "paper estimate" in report
    assert "so the run is bound by" in report
    work_us, driver_us = (float(x) for x in __import__("re").search(
        r"([\d.]+) µs of per-shard work, ([\d.]+) µs on the driver", report).groups())
    assert work_us > 0 and driver_us > 0


def test_trl_benchmark_describes_the_run_it_measured():
    """bench_trl writes the measured run's shape into its doc block, read from the run's shards."""
    spec = importlib.util.spec_from_file_location("bench_trl", BENCH.parent / "tests" / "integration" / "bench_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shape = mod.run_shape(BENCH.parent / "sample_runs" / "trl-tiny")
    # trl-tiny: 2 loss calls of 8 completions per step, 16 completions at every other step of 24
    assert shape.startswith("Run measured: 2 loss calls per optimizer step of at most 8 completions each")
    assert "16 completions per generation, generated at 12 of its 24 steps" in shape


@pytest.mark.slow  # a synthetic run, the S3 server and both layers: ~30 s
def test_s3_layers_benchmark_on_a_small_run(tmp_path):
    """bench_s3_layers.py end to end on a tiny input: both layers read the same rows and values
    (the script asserts it) and list every key; a changed s3fs or pyarrow API fails here."""
    import subprocess
    import sys

    pytest.importorskip("s3fs", reason="s3fs (the bench and dev extras) is the layer measured against pyarrow's")
    r = subprocess.run([sys.executable, str(BENCH / "bench_s3_layers.py"), "--tokens", "2e5", "--shards", "20",
                        "--repeat", "1", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| read the recompute columns of " in r.stdout and "| list 20 shard keys" in r.stdout
    assert "pyarrow: not exposed; s3fs: yes" in r.stdout


def test_serve_libs_benchmark_runs_and_both_sides_keep_the_extremes(capsys):
    """bench_serve_libs.py on small sizes: one row per comparison, the library's picks and the
    hand-written baseline's both holding the curve's global min and max."""
    rows = _load("bench_serve_libs").main(["--points", "5000", "--repeat", "1", "--ops", "500"])
    assert [r["what"].split(",")[0] for r in rows] == ["min-max downsampling", "LRU with a lock", "LRU with a lock"]
    assert rows[0]["note"] == "extremes kept by both: True"
    assert all(r["ours_ms"] > 0 and r["library_ms"] > 0 for r in rows)
    assert "| library / hand-written |" in capsys.readouterr().out


def test_bench_explain_times_explain_beside_recompute(tmp_path):
    rows = _load("bench_explain").main(["--steps", "2", "--groups", "2", "--max-len", "32", "--repeat", "1",
                                        "--run", str(tmp_path / "run"), "--metrics", "kl/k3,reward/mean"])
    assert [r["metric"] for r in rows] == ["kl/k3", "reward/mean"]
    assert [r["units"] for r in rows] == ["tokens", "completions"]
    assert all(r["explain"] > 0 and r["recompute"] > 0 and r["ratio"] == r["explain"] / r["recompute"] for r in rows)


def test_polars_read_floor_touches_every_column_recompute_reads():
    """The floor the issue's 2x target is measured against: one lazy scan of the engine's token
    columns (every one the shards have) and of every sample column, each reduced."""
    import polars as pl

    floor = _load("read_floor_polars")
    run = BENCH.parent / "sample_runs" / "tiny"
    tokens = sorted(str(p) for p in (run / "tokens").glob("step=*/*.parquet"))
    got = floor.scan(tokens, floor.TOKEN_COLUMNS)
    have = set(pl.read_parquet_schema(tokens[0]))
    assert set(got.columns) - {"_rows"} == have & set(READ_COLUMNS)
    expected = sum(pl.read_parquet(p, columns=["logp"]).height for p in tokens)
    assert got["_rows"][0] == expected
    assert got["logp"][0] == pytest.approx(sum(pl.read_parquet(p, columns=["logp"])["logp"].sum() for p in tokens))
