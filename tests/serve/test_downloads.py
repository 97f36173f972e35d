"""CSV downloads: every chart's and table's link returns the run's own numbers, whole, and a bad
query gets one line and a 400, never a file outside the runs."""

from __future__ import annotations

import io
import math

import numpy as np
import polars as pl
import pytest

from grpolens.run import format as fmt
from grpolens.serve import callbacks as cb
from grpolens.serve import data, downloads
from tests.serve.test_callbacks import graphs, walk


@pytest.fixture(scope="module")
def client(runset):
    from grpolens.serve.app import create_app

    return create_app(runset).server.test_client()


def get_csv(client, href: str) -> pl.DataFrame:
    r = client.get(href)
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.mimetype == "text/csv" and "attachment" in r.headers["Content-Disposition"]
    return pl.read_csv(io.BytesIO(r.get_data()), infer_schema_length=None)


def metrics_file(run) -> pl.DataFrame:
    return pl.read_parquet(fmt.derived_dir(run) / "metrics.parquet")


def links(children) -> list[str]:
    return [c.href for c in walk(children) if getattr(c, "className", None) == "csv-link"]


def same(a, b) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("page", ["overview", "policy", "mismatch", "rewards"])
def test_every_chart_of_a_curve_page_has_a_csv(client, runset, page):
    out = cb.curve_page_children(runset, page, ["alpha", "beta"], 0.0, [2, 11])
    hrefs = [h for h in links(out) if not h.startswith("/csv/sweep")]
    assert hrefs and len(hrefs) == len(graphs(out))  # one per chart
    for href in hrefs:
        assert get_csv(client, href).height > 0, href


def test_curve_csv_is_the_runs_metrics(client, runset, serve_runs):
    """The chart's CSV holds metrics.parquet's values for its runs and steps, none downsampled away."""
    _, alpha, beta = serve_runs
    href = [h for h in links(cb.curve_page_children(runset, "policy", ["alpha", "beta"], 0.0, [2, 11], pattern="kl"))
            if "metric=kl%2Fk3&" in h][0]
    got = get_csv(client, href)
    for name, run in (("alpha", alpha), ("beta", beta)):
        m = metrics_file(run).filter(pl.col("step").is_between(2, 11) & pl.col("kl/k3").is_not_null()).sort("step")
        mine = got.filter(pl.col("run") == name).sort("step")
        assert mine["step"].to_list() == m["step"].to_list()
        assert same(mine["value"].to_list(), m["kl/k3"].cast(pl.Float64).to_list()), (mine, m["kl/k3"])


def test_smoothed_curve_csv(client, runset, serve_runs):
    _, alpha, _ = serve_runs
    got = get_csv(client, downloads.link("curve", runs=["alpha"], metric="entropy", smooth=0.6))
    m = metrics_file(alpha).filter(pl.col("entropy").is_not_null()).sort("step")
    x, y = m["step"].to_numpy(), m["entropy"].cast(pl.Float64).to_numpy()
    assert np.allclose(got["value"].to_numpy(), y)
    assert np.allclose(got["smoothed"].to_numpy(), data.ema(x, y, 0.6))  # what the chart draws


def test_tables_csv(client, runset, serve_runs):
    _, alpha, beta = serve_runs
    # Compare: the table the page shows, every metric.
    summary, rows, *_ = cb.compare_view(runset, "alpha", "beta", None)
    got = get_csv(client, links(summary)[0])
    assert got["metric"].to_list() == [r["metric"] for r in rows]
    assert same(got["mean_a"].to_list(), [r["mean_a"] if r["mean_a"] is not None else math.nan for r in rows])
    for href in links(cb.compare_view(runset, "alpha", "beta", ["entropy"])[3]):
        d = get_csv(client, href)
        ma = metrics_file(alpha).select("step", "entropy").join(metrics_file(beta).select("step", "entropy"), on="step")
        assert np.allclose(d["b_minus_a"].to_numpy(), (ma["entropy_right"] - ma["entropy"]).to_numpy())
    # Tokens: the top-K table.
    summary, rows, _ = cb.top_tokens_view(runset, "alpha", 9, "entropy", 25)
    got = get_csv(client, links(summary)[0])
    assert got.height == len(rows) == 25
    assert got["sample_id"].to_list() == [r["sample_id"] for r in rows]
    # Completions: every matching row, not one page, sorted and filtered as on screen.
    sort = [{"column_id": "tokens", "direction": "desc"}]
    rows, _, pages, summary = cb.completions_table(runset, "beta", 5, 0, 10, sort, "{tokens} > 5")
    got = get_csv(client, links(summary)[0])
    want, total = data.completions_page(beta, 5, 0, 10_000, sort, "{tokens} > 5")
    assert pages > 1 and got.height == total == want.height > len(rows)
    assert got["sample_id"].to_list() == want["sample_id"].to_list()


def test_completion_tokens_csv(client, runset, serve_runs):
    _, alpha, _ = serve_runs
    sid = int(data.step_tokens(alpha, 9)["sample_id"][0])
    parts = cb.completion_view(runset, "alpha", 9, sid, "kl")
    got = get_csv(client, links(parts)[0])
    want = data.completion(alpha, 9, sid)["tokens"]
    assert got["pos"].to_list() == want["pos"].to_list()
    assert got["logp"].cast(want["logp"].dtype).to_list() == want["logp"].to_list()  # float32 written exactly


def test_text_cannot_become_a_formula():
    df = pl.DataFrame({"completion": ["=HYPERLINK(\"http://x\")", "+1", "-cmd", "@a", "fine", None], "v": [-1.0] * 6})
    text = downloads.to_csv(df)
    back = pl.read_csv(io.StringIO(text))
    assert back["completion"].to_list() == ["'=HYPERLINK(\"http://x\")", "'+1", "'-cmd", "'@a", "fine", None]
    assert back["v"].to_list() == [-1.0] * 6  # numbers are numbers


@pytest.mark.parametrize("href", [
    "/csv/curve?runs=../../etc&metric=entropy", "/csv/curve?runs=alpha&metric=../x y", "/csv/curve?metric=entropy",
    "/csv/tokens?run=alpha&step=nan", "/csv/sweep?run=alpha&file=../../manifest.json", "/csv/nothing?run=alpha",
    "/csv/completion?run=alpha&step=9&sample=999999", "/csv/delta?a=alpha&b=beta&metric=no_such_metric",
])
def test_bad_queries_get_one_line(client, href):
    r = client.get(href)
    assert r.status_code == 400
    text = r.get_data(as_text=True)
    assert text.count("\n") == 1 and text.startswith("CSV download:"), text
