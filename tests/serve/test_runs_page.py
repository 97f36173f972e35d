"""The Runs page: config columns from each run's manifest, and N runs overlaid on the curve pages."""

from __future__ import annotations

import json

import polars as pl

from grpolens.run import format as fmt
from grpolens.serve import callbacks as cb
from grpolens.serve.pages import runs as page_runs
from grpolens.serve.data.runtable import flatten, runs_table
from grpolens.serve.runs import RunSet
from tests.serve.test_callbacks import graphs, walk


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": None}) == \
        {"a.b": 1, "a.c.d": "x", "e": "[1, 2]", "f": None}


def test_config_columns_come_from_the_manifests(runset, serve_runs):
    _, alpha, beta = serve_runs
    t = runs_table(runset.runs)
    assert t["run"].to_list() == ["alpha", "beta"]
    for name, run in (("alpha", alpha), ("beta", beta)):
        row = t.filter(pl.col("run") == name).row(0, named=True)
        cfg = fmt.read_manifest(run).config
        assert row["config.loss_type"] == cfg["loss_type"] and row["config.beta"] == cfg["beta"]
        assert row["config.rollout_is.mode"] == cfg["rollout_is"]["mode"]
        assert row["config.reward_funcs"] == json.dumps(cfg["reward_funcs"])
        m = pl.read_parquet(fmt.derived_dir(run) / "metrics.parquet").sort("step")
        assert row["steps"] == m.height and row["last_step"] == m["step"][-1]
        assert row["reward/mean@last"] == m["reward/mean"].drop_nulls()[-1]


def test_columns_that_tell_runs_apart_come_first(tmp_path, serve_runs):
    """Three runs (copies of the manifests with a different loss type and a mixed-type field)."""
    import shutil

    _, alpha, beta = serve_runs
    runs = {}
    for name, src, loss, extra in (("r1", alpha, "grpo", 1), ("r2", beta, "dapo", "auto"), ("r3", alpha, "grpo", None)):
        dst = tmp_path / name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tokens", "samples"))
        m = json.loads((dst / fmt.MANIFEST_NAME).read_text())
        m["config"]["loss_type"] = loss
        m["config"]["num_iterations"] = extra
        (dst / fmt.MANIFEST_NAME).write_text(json.dumps(m))
        runs[name] = dst
    t = runs_table(runs)
    config = [c for c in t.columns if c.startswith("config.")]
    assert set(config[:2]) == {"config.loss_type", "config.num_iterations"}
    assert t["config.num_iterations"].dtype == pl.String  # 1 here, "auto" there: text
    assert t["config.num_iterations"].to_list() == ["1", "auto", None]


def test_n_runs_overlay(serve_runs):
    """More than two runs on one chart, each its own trace and colour, clicks knowing which."""
    _, alpha, beta = serve_runs
    three = RunSet({"alpha": alpha, "beta": beta, "gamma": alpha})
    for g in graphs(cb.curve_page_children(three, "overview", ["alpha", "beta", "gamma"])):
        runs_drawn = {t["name"] for t in g.figure["data"] if t.get("name")}
        assert runs_drawn >= {"alpha", "beta", "gamma"}, g.id
        colours = {t["name"]: t["line"]["color"] for t in g.figure["data"] if t.get("name") and t.get("line")}
        assert len({colours[n] for n in ("alpha", "beta", "gamma")}) == 3


def test_overlay_links_carry_the_ticked_runs(runset):
    links = [c.href for c in walk(page_runs.overlay_links(runset, ["beta"])) if hasattr(c, "href")]
    assert "/?runs=beta" in links and "/policy?runs=beta" in links
    both = [c.href for c in walk(page_runs.overlay_links(runset, ["alpha", "beta"])) if hasattr(c, "href")]
    assert "/" in both and "/compare?a=alpha&b=beta" in both  # the default selection: a bare link
