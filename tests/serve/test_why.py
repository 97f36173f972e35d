"""The Why panel of the Tokens page (issue #30): a clicked curve's metric explained at that step."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlparse

import pytest
from dash import dcc, html

from grpolens.analysis.explain import explain
from grpolens.serve import callbacks as cb
from grpolens.serve.pages import why
from tests.serve.test_callbacks import graphs, walk


def test_curve_metric_of_a_graph_key():
    assert cb.curve_metric("policy:kl/k3") == "kl/k3" and cb.curve_metric("overview:reward/mean") == "reward/mean"
    assert cb.curve_metric("compare:entropy") == "entropy"
    for key in ("rewards:band:reward", "mismatch:is_hist:alpha", "policy:", "", None, "policy:a b", {"a": 1}):
        assert cb.curve_metric(key) is None


def test_click_opens_the_why_panel_of_the_curve(runset):
    click = {"points": [{"x": 9, "y": 0.1, "customdata": 0}]}
    path, search = cb.click_target(runset, ["alpha", "beta"], click, metric="kl/k3")
    assert path == "/tokens" and parse_qs(search.lstrip("?")) == {"run": ["alpha"], "step": ["9"], "why": ["kl/k3"]}
    assert cb.click_target(runset, ["alpha", "beta"], click) == ("/tokens", "?run=alpha&step=9")


def test_panel_shows_the_explanation_of_the_kl_spike(runset):
    """alpha has a KL spike planted at step 9: the panel says what explain says, one chart per
    dimension, the concentration curve, and links from the top keys."""
    e = explain(runset.path("alpha"), "kl/k3", 9, top=why.TOP)
    out = why.why_panel(runset, "alpha", 9, "kl/k3")
    head = next(c for c in walk(out) if getattr(c, "id", None) == "why-headline")
    assert head.children == e.headline() and "kl/k3" in head.children and "step 9" in head.children
    dims = [c.id for c in walk(out) if isinstance(getattr(c, "id", None), str) and c.id.startswith("why-")
            and c.id not in ("why-headline", "why-lorenz")]
    assert set(dims) == {f"why-{d}" for d in e.by}
    for d, entries in e.by.items():
        box = next(c for c in walk(out) if getattr(c, "id", None) == f"why-{d}")
        fig = graphs(box)[0].figure
        assert sorted(fig["data"][0]["x"]) == sorted(x["contribution"] for x in entries)
        assert sum(fig["data"][0]["x"]) == pytest.approx(e.delta, rel=1e-9)  # the bars sum to the change
    lorenz = next(c for c in walk(out) if getattr(c, "id", None) == "why-lorenz").figure
    ys = lorenz["data"][0]["y"]
    assert ys[0] == 0 and ys[-1] == 1 and ys[1:-1] == [e.concentration[k] for k in
                                                        ("top_0.1%_tokens", "top_1%_tokens", "top_10%_tokens")]
    links = {c.href for c in walk(out) if isinstance(c, dcc.Link)}
    top_sample = next(x["key"] for x in e.by["completion"] if x["key"] != "other")
    top_group = next(x["key"] for x in e.by["group"] if x["key"] != "other")
    assert f"/tokens?run=alpha&step=9&sample={top_sample}&why=kl%2Fk3" in links  # the panel stays open
    assert f"/completions?run=alpha&step=9&group={top_group}" in links
    token_links = [h for h in links if "pos=" in h]
    assert token_links  # a token id opens the completion where it scores highest, outlined


def test_token_link_points_at_a_completion_holding_the_token(runset):
    import polars as pl

    from grpolens.serve import data

    t = data.step_tokens(runset.path("alpha"), 9).filter(pl.col("mask"))
    tok = int(t["token_id"][0])
    href = why._token_link(runset.path("alpha"), "alpha", 9, tok)
    q = parse_qs(urlparse(href).query)
    row = t.filter((pl.col("sample_id") == int(q["sample"][0])) & (pl.col("pos") == int(q["pos"][0])))
    assert row.height == 1 and int(row["token_id"][0]) == tok
    assert why._token_link(runset.path("alpha"), "alpha", 9, -12345) is None


def test_panel_refuses_and_explains_what_it_cannot(runset):
    assert why.why_panel(runset, "alpha", 9, None) == []
    out = why.why_panel(runset, "alpha", 9, "samples/reward/mean")
    assert any("does not decompose" in str(getattr(c, "children", "")) for c in walk(out))
    from grpolens.errors import UserError

    with pytest.raises(UserError):
        why.why_panel(runset, "alpha", 9, "no/such_metric")
    with pytest.raises(UserError):
        why.why_panel(runset, "../alpha", 9, "kl/k3")


def test_chart_labels_carry_no_markup():
    fig = why.bars_figure("token_id", [{"key": 1, "label": "<b>x</b><a href='y'>", "contribution": 0.5, "share": 1.0}])
    assert "<" not in json.dumps(fig["layout"]["yaxis"]["ticktext"])


def test_why_in_the_url_roundtrips_and_is_checked():
    from grpolens.serve import urlstate

    assert urlstate.decode("tokens", "?run=alpha&step=3&why=kl/k3", ["alpha"]) == \
        {"run": "alpha", "step": 3, "why": "kl/k3"}
    assert "why" not in urlstate.decode("tokens", "?why=<script>", ["alpha"])
    assert "why" not in urlstate.decode("tokens", "?why=" + "a" * 200, ["alpha"])
