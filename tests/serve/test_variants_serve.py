"""The dashboard lists a run's what-if variants (``recompute --set``) as runs of their own: named
``RUN @ label``, drawn from the variant's metrics, with the overridden config on the Runs page."""

from __future__ import annotations

import polars as pl
import pytest


@pytest.fixture(scope="module")
def with_variant(tmp_path_factory):
    import grpolens
    from grpolens.adapters.synth import synth_run

    root = tmp_path_factory.mktemp("variant-runs")
    run = synth_run(root / "gamma", seed=2, steps=6, ranks=1, groups=2, generations=4, max_len=24, texts=True)
    grpolens.recompute(run)
    res = grpolens.recompute(run, overrides={"epsilon": 0.05}, result=True)
    return run, res


def test_variant_is_served_after_its_run(with_variant):
    from grpolens.serve.runs import resolve_runs

    run, res = with_variant
    runs = resolve_runs([run.parent])
    assert runs.names == ["gamma", "gamma @ epsilon=0.05"]
    assert runs.is_variant("gamma @ epsilon=0.05") and not runs.is_variant("gamma")
    assert runs.run_names == ["gamma"] and runs.run_of("gamma @ epsilon=0.05") == "gamma"


def test_variant_curves_are_its_own_metrics(with_variant):
    from grpolens.serve import data
    from grpolens.serve.data.memo import clear_caches
    from grpolens.serve.runs import resolve_runs

    run, res = with_variant
    clear_caches()
    runs = resolve_runs([run])
    own, what_if = data.series(runs.path("gamma")), data.series(runs.path("gamma @ epsilon=0.05"))
    assert own.select("clip/region").equals(pl.read_parquet(run / "grpolens" / "metrics.parquet").select("clip/region"))
    assert what_if.select("clip/region").equals(pl.read_parquet(res.out_dir / "metrics.parquet").select("clip/region"))
    assert not own["clip/region"].equals(what_if["clip/region"])


def test_runs_table_shows_the_overrides(with_variant):
    from grpolens.serve.data.runtable import runs_table
    from grpolens.serve.runs import resolve_runs

    run, _ = with_variant
    df = runs_table(resolve_runs([run]).runs)
    assert df.columns[:2] == ["run", "variant"]
    assert df["variant"].to_list() == [None, "epsilon=0.05"]
    assert df["config.epsilon"].to_list() == [0.2, 0.05]
    assert [c for c in df.columns if c.startswith("config.")][0] == "config.epsilon"  # what tells them apart comes first


def test_clicking_a_variants_curve_opens_its_runs_tokens(with_variant):
    from grpolens.serve.callbacks import click_target
    from grpolens.serve.runs import resolve_runs

    run, _ = with_variant
    runs = resolve_runs([run])
    from grpolens.serve import urlstate

    path, search = click_target(runs, runs.names, {"points": [{"x": 3, "customdata": 1}]})  # 1: the variant
    assert path == "/tokens" and urlstate.decode("tokens", search, runs.names)["run"] == "gamma"


def test_the_baselines_variants_are_not_listed(with_variant):
    from grpolens.serve.runs import resolve_runs

    run, _ = with_variant
    assert resolve_runs([], baseline=run).names == ["gamma"]
