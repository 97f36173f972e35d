"""The functions behind the callbacks, and the server's refusal of runs it was not given."""

from __future__ import annotations

import json

import polars as pl
import pytest
from dash import dcc, html

from grpolens.serve import callbacks as cb
from grpolens.serve import data
from grpolens.serve.runs import UnknownRun


def walk(component):
    """Every component in a tree (children lists, single children)."""
    stack = [component]
    while stack:
        c = stack.pop()
        if isinstance(c, (list, tuple)):
            stack.extend(c)
            continue
        yield c
        kids = getattr(c, "children", None)
        if kids is not None and not isinstance(kids, str):
            stack.append(kids)


def graphs(children):
    return [c for c in walk(children) if isinstance(c, dcc.Graph)]


@pytest.mark.parametrize("page", ["overview", "policy", "mismatch", "rewards"])
def test_curve_pages_draw_graphs_with_run_indices(runset, page):
    out = cb.curve_page_children(runset, page, ["alpha", "beta"], 0.5, [2, 11])
    gs = graphs(out)
    assert gs, page
    for g in gs:
        for tr in g.figure["data"]:
            if tr["type"] == "heatmap" or tr.get("hoverinfo") == "skip":
                continue
            x = tr["x"]
            n = len(x) if isinstance(x, list) else None
            assert tr["customdata"]["dtype"] == "i2"  # the run index rides on every clickable point
            if n is not None:
                assert min(x) >= 2 and max(x) <= 11


def test_overview_has_the_key_curves(runset):
    keys = [g.id["key"] for g in graphs(cb.curve_page_children(runset, "overview", ["alpha"]))]
    for metric in ("reward/mean", "kl/k3", "clip/low", "entropy", "mismatch/kl_k3", "completions/length/mean"):
        assert f"overview:{metric}" in keys


def test_metric_filter_and_cap(runset):
    some = graphs(cb.curve_page_children(runset, "mismatch", ["alpha"], pattern="raw seq"))
    keys = [g.id["key"] for g in some if "is_hist" not in g.id["key"]]
    assert keys and all("raw" in k and "seq" in k for k in keys)
    everything = cb.curve_page_children(runset, "mismatch", ["alpha"])
    assert len([g for g in graphs(everything) if "is_hist" not in g.id["key"]]) <= cb.MAX_GRAPHS
    assert any(isinstance(c, html.Div) and "more metric" in str(c.children) for c in everything)


def test_baseline_is_drawn_dashed(serve_runs):
    from grpolens.serve.runs import resolve_runs

    _, alpha, beta = serve_runs
    rs = resolve_runs([alpha], baseline=beta)
    g = graphs(cb.curve_page_children(rs, "overview", ["alpha"]))[0]
    names = [t.get("name") for t in g.figure["data"]]
    assert "beta (baseline)" in names
    assert [t for t in g.figure["data"] if t.get("name") == "beta (baseline)"][0]["line"]["dash"] == "dash"
    none = graphs(cb.curve_page_children(rs, "overview", ["alpha"], with_baseline=False))[0]
    assert "beta (baseline)" not in [t.get("name") for t in none.figure["data"]]


def test_check_verdicts_mark_the_kl_spike(runset):
    # alpha has a KL spike at step 9: the built-in KL rule fails there and the curve shows it
    verdicts = data.check_verdicts(runset.path("alpha"))
    kl = [v for v in verdicts if v["metric"].startswith("kl/")]
    assert kl and kl[0]["step"] == 9
    g = [g for g in graphs(cb.curve_page_children(runset, "overview", ["alpha"])) if g.id["key"] == f"overview:{kl[0]['metric']}"]
    if g:
        assert any(sh["x0"] == 9 for sh in g[0].figure["layout"]["shapes"])


def test_click_leads_to_tokens_of_that_run_and_step(runset):
    click = {"points": [{"x": 7, "y": 0.1, "customdata": 1, "curveNumber": 0}]}
    assert cb.click_target(runset, ["alpha", "beta"], click) == ("/tokens", "?run=beta&step=7")
    # a point without a run index (heat map drawn elsewhere): the first selected run; the header's
    # selection, not the default one here, goes along (a reload of the Tokens page keeps it)
    assert cb.click_target(runset, ["alpha"], {"points": [{"x": 3}]}) == ("/tokens", "?run=alpha&step=3&runs=alpha")
    assert cb.click_target(runset, ["alpha"], None) is None
    assert cb.click_target(runset, ["alpha"], {"points": [{"x": 3, "customdata": 99}]})[1] == \
        "?run=alpha&step=3&runs=alpha"


def test_top_tokens_view_rows(runset):
    summary, rows, cols = cb.top_tokens_view(runset, "alpha", 9, "kl", 10)
    assert len(rows) == 10 and rows[0]["score"] >= rows[-1]["score"]
    assert all(r["id"] == f"{r['sample_id']}:{r['pos']}" for r in rows)
    assert "id" not in [c["id"] for c in cols]
    summary, rows, cols = cb.top_tokens_view(runset, "alpha", 999, "kl", 10)
    assert rows == [] and "no tokens at step 999" in str(summary.children)


def test_completion_text_is_plain_text(runset):
    alpha = runset.path("alpha")
    hit = None
    for step in range(14):
        s = data.step_samples(alpha, step).filter(pl.col("completion").str.contains("<script>", literal=True))
        if s.height:
            hit = (step, int(s["sample_id"][0]), s["completion"][0], s["prompt"][0])
            break
    assert hit
    step, sid, text, prompt = hit
    out = cb.completion_view(runset, "alpha", step, sid, "kl")
    pres = [c for c in walk(out) if isinstance(c, html.Pre)]
    assert sorted(p.children for p in pres) == sorted([prompt, text])  # the strings themselves, not parsed markup
    blob = json.dumps([c.to_plotly_json() for c in out], default=lambda o: o.to_plotly_json())
    assert "dangerouslySetInnerHTML" not in blob and "Markdown" not in blob
    spans = [c for c in walk(out) if isinstance(c, html.Span) and c.className and "tok" in c.className]
    assert len(spans) == data.completion(alpha, step, sid)["tokens"].height
    assert all(isinstance(s.children, str) and isinstance(s.title, str) for s in spans)


@pytest.mark.parametrize("color", ["kl", "mismatch", "ratio", "entropy", "advantage"])
def test_completion_colours(runset, color):
    out = cb.completion_view(runset, "beta", 8, None, color)
    spans = [c for c in walk(out) if isinstance(c, html.Span) and "tok" in (c.className or "")]
    assert spans and all(s.style["backgroundColor"].startswith(("rgba", "#")) for s in spans)
    assert any("focus" in s.className for s in spans)  # the top token of the step is outlined
    prof = [g for g in graphs(out) if g.id == "completion-profile"]
    assert len(prof) == 1 and prof[0].figure["data"][0]["x"]["dtype"] == "i4"
    assert len(prof[0].figure["layout"]["shapes"]) == 1  # a line at the focused position


def test_colour_scale():
    assert cb._color(None, 1.0, False) == "#eeeeee"
    assert cb._color(2.0, 1.0, False) == "rgba(214,39,40,0.850)"  # saturates
    assert cb._color(-0.5, 1.0, True) == "rgba(31,119,180,0.425)"
    assert cb._color(0.0, 1.0, False) == "rgba(214,39,40,0.000)"


def test_completions_table_pages(runset):
    rows, cols, pages, summary = cb.completions_table(runset, "beta", 5, 1, 20, [], "")
    assert pages == 2 and len(rows) == 12 and "page 2 of 2" in summary.children[0]
    assert all(r["id"] == r["sample_id"] for r in rows)
    rows, cols, pages, summary = cb.completions_table(runset, "beta", 5, 0, 20, [], "", truncated="yes")
    assert all(r["truncated"] for r in rows)


def test_compare_view(runset):
    summary, rows, cols, gs, options, chosen, defaults = cb.compare_view(runset, "alpha", "beta", None)
    assert rows and chosen and len(gs) == len(chosen)
    assert {"metric", "mean_a", "mean_b", "mean_delta", "max_abs_delta", "at_step"} <= {c["id"] for c in cols}
    _, _, _, gs, _, chosen, _ = cb.compare_view(runset, "alpha", "beta", ["entropy"])
    assert chosen == ["entropy"] and len(gs) == 1


@pytest.mark.parametrize("bad", ["../alpha", "/etc/passwd", "gamma"])
def test_functions_refuse_unknown_runs(runset, bad):
    for call in (lambda: cb.top_tokens_view(runset, bad, 1, "kl", 5),
                 lambda: cb.completion_view(runset, bad, 1, None, "kl"),
                 lambda: cb.completions_table(runset, bad, 1, 0, 20, [], ""),
                 lambda: cb.compare_view(runset, "alpha", bad, None),
                 lambda: cb.curve_page_children(runset, "overview", ["alpha", bad])):
        with pytest.raises(UnknownRun):
            call()


def _post(client, output, outputs, inputs, state=()):
    body = {"output": output, "outputs": outputs, "inputs": inputs, "changedPropIds": [], "state": list(state)}
    return client.post("/_dash-update-component", json=body)


def test_server_refuses_forged_run_paths(runset, serve_runs):
    """A request naming a path instead of a run gets an error message and no data."""
    from grpolens.serve.app import create_app

    client = create_app(runset).server.test_client()
    secret = str(serve_runs[1] / "grpolens.json")
    r = _post(client, "..tok-summary.children...tok-table.data...tok-table.columns..",
              [{"id": "tok-summary", "property": "children"}, {"id": "tok-table", "property": "data"},
               {"id": "tok-table", "property": "columns"}],
              [{"id": "url", "property": "pathname", "value": "/tokens"},
               {"id": "tok-run", "property": "value", "value": str(serve_runs[1])},
               {"id": "tok-step", "property": "value", "value": 3},
               {"id": "tok-by", "property": "value", "value": "kl"},
               {"id": "tok-k", "property": "value", "value": 10}])
    assert r.status_code == 200
    resp = r.get_json()["response"]
    assert "unknown run" in json.dumps(resp["tok-summary"]) and resp["tok-table"]["data"] == []
    assert secret not in r.get_data(as_text=True)
    # The same request with a run name works.
    ok = _post(client, "..tok-summary.children...tok-table.data...tok-table.columns..",
               [{"id": "tok-summary", "property": "children"}, {"id": "tok-table", "property": "data"},
                {"id": "tok-table", "property": "columns"}],
               [{"id": "url", "property": "pathname", "value": "/tokens"},
                {"id": "tok-run", "property": "value", "value": "alpha"},
                {"id": "tok-step", "property": "value", "value": 3},
                {"id": "tok-by", "property": "value", "value": "kl"},
                {"id": "tok-k", "property": "value", "value": 10}])
    assert len(ok.get_json()["response"]["tok-table"]["data"]) == 10
    # Curve pages: a forged entry in the run list is refused as well.
    r = _post(client, "overview-graphs.children", {"id": "overview-graphs", "property": "children"},
              [{"id": "url", "property": "pathname", "value": "/"},
               {"id": "runs", "property": "value", "value": ["alpha", "/etc"]},
               {"id": "smoothing", "property": "value", "value": 0},
               {"id": "range", "property": "value", "value": None},
               {"id": "show-baseline", "property": "value", "value": []},
               {"id": "metric-filter", "property": "value", "value": None},
               {"id": "y-scale", "property": "value", "value": []},
               {"id": "version", "property": "data", "value": None}],
              [{"id": "url", "property": "search", "value": "?log=kl/k3"}])
    assert "unknown run" in r.get_data(as_text=True) and "scatter" not in r.get_data(as_text=True)


def test_watch_poll_reports_new_data_only(serve_runs, tmp_path):
    """--watch: the page's poll answers 204 (no update) until a run changes."""
    import shutil

    from grpolens.serve.app import create_app

    run = tmp_path / "runs" / "alpha"
    shutil.copytree(serve_runs[1], run)
    client = create_app([tmp_path / "runs"], watch=True).server.test_client()

    def poll(old):
        return _post(client, "version.data", {"id": "version", "property": "data"},
                     [{"id": "watch", "property": "n_intervals", "value": 1}],
                     [{"id": "version", "property": "data", "value": old}])

    first = poll(None)
    seen = first.get_json()["response"]["version"]["data"]
    assert poll(seen).status_code == 204
    shutil.copytree(run / "tokens" / "step=00000013", run / "tokens" / "step=00000014")
    again = poll(seen)
    assert again.status_code == 200 and again.get_json()["response"]["version"]["data"] != seen


def test_y_scale_reaches_every_curve_graph(runset):
    gs = graphs(cb.curve_page_children(runset, "overview", ["alpha"], y_scale=["log", "robust"]))
    assert gs
    for g in gs:
        ax = g.figure["layout"]["yaxis"]
        assert ax["uirevision"] == "log=True,robust=True"
        assert ax.get("type") == "log" or "no positive value" in g.figure["layout"]["title"]["text"]
