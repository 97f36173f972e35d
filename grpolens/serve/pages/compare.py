"""The Compare page: two runs side by side, per metric the means of A and B over the common steps,
their difference and the largest one with its step (coloured by sign and size on a robust
scale), and B - A per step for chosen metrics."""

from __future__ import annotations

from typing import Any

import polars as pl
from dash import Input, Output, State, dash_table, dcc, html, no_update
from dash.exceptions import PreventUpdate

from grpolens.errors import RunFormatError, UserError
from grpolens.serve import data, downloads, figures, inputs, urlstate
from grpolens.serve.components import (
    TABLE_STYLE, csv_anchor, diverging_cell_styles, error_box, graph, labelled, rows_json, run_options, table_columns,
)
from grpolens.serve.pages import Page
from grpolens.serve.runs import RunSet
from grpolens.serve.urlsync import lenient, range_list, range_state, same, url_triggered

KEYS = ("a", "b", "delta", "from", "to")


def _bounds(lo, hi) -> dict:
    return {"from": lo, "to": hi}


def compare_search(a, b, metrics, default_metrics, bounds: dict, a0, b0) -> str:
    state = {"a": a, "b": b, "delta": list(metrics or []), **bounds}
    return urlstate.encode("compare", state, {"a": a0, "b": b0, "delta": list(default_metrics or [])})


def _default_pair(runs: RunSet) -> tuple[str, str]:
    """Runs A and B when the URL names none: the first two runs."""
    names = runs.names
    return names[0], names[1] if len(names) > 1 else names[0]


def header_search(runs: RunSet, search: str | None, header) -> str:
    """The Compare URL once the header's step range changed: A, B and the delta curves as the URL
    has them (sync_compare writes them there), the range from the header."""
    a0, b0 = _default_pair(runs)
    q = urlstate.decode("compare", search, runs.names)
    return compare_search(q.get("a", a0), q.get("b", b0), q.get("delta", []), [], header.bounds, a0, b0)


#: Compare table columns coloured by sign and size (on a robust scale: see components.robust_scale).
COMPARE_COLOURED = ["mean_delta", "rel_delta", "max_abs_delta"]


def compare_view(runs: RunSet, a: str, b: str, metrics: list[str] | None, rng=None):
    """``(summary, rows, columns, graphs, metric_options, chosen_metrics, default_metrics)`` for runs A
    and B (the defaults are the page's delta curves when none are chosen; the URL leaves them out)."""
    pa_, pb = runs.path(a), runs.path(b)
    lo, hi = inputs.step_range(rng)
    metrics = inputs.metric_names(metrics, "delta curves")
    fa, fb = data.series(pa_), data.series(pb)
    table = data.compare(fa, fb, lo, hi)
    options = [{"label": m, "value": m} for m in table["metric"].to_list()]
    defaults = [c for _, c in data.overview_metrics([fa, fb]) if c in set(table["metric"].to_list())]
    chosen = [m for m in (metrics if metrics else defaults) if m in set(table["metric"].to_list())]
    graphs = []
    for m in chosen[:12]:
        c = data.delta_curve(fa, fb, m, lo, hi)
        fig = figures.delta_figure(m, a, b, c["x"], c["y"], runs.names.index(b))
        graphs.append(graph(f"compare:{m}", fig, downloads.link("delta", a=a, b=b, metric=m, **_bounds(lo, hi))))
    common = fa.join(fb, on="step", how="inner").height if fa.height and fb.height else 0
    summary = html.Span([f"B - A per step over {common} common step(s); table: mean of each metric in A and B, the "
                         f"mean difference, and the largest |difference| with its step (click a delta curve to open "
                         f"run B's tokens) ", csv_anchor(downloads.link("compare", a=a, b=b, **_bounds(lo, hi)),
                                                         "CSV of the table")])
    return summary, rows_json(table), table_columns(table), graphs, options, chosen, defaults


def _metric_options(runs: RunSet) -> list[dict]:
    names: dict[str, None] = {}
    for path in runs.runs.values():
        names.update(dict.fromkeys(c for c in data.series(path).columns if c != "step"))
    return [{"label": m, "value": m} for m in names]


def layout(runs: RunSet) -> html.Div:
    names = runs.names
    return html.Div([
        html.Div([
            labelled("run A", dcc.Dropdown(id="cmp-a", options=run_options(runs), value=names[0], clearable=False)),
            labelled("run B", dcc.Dropdown(id="cmp-b", options=run_options(runs),
                                            value=names[1] if len(names) > 1 else names[0], clearable=False)),
            # every metric of every run, so a link's chosen curves are valid options before the page's own load
            labelled("delta curves", dcc.Dropdown(id="cmp-metrics", options=_metric_options(runs), value=[],
                                                   multi=True),
                      "ctl ctl-wider"),
        ], className="controls"),
        html.Div(id="cmp-summary", className="summary"),
        dash_table.DataTable(id="cmp-table", data=[], columns=[], sort_action="native", page_action="native",
                             page_size=15, filter_action="native", **TABLE_STYLE),
        html.Div(id="cmp-graphs", className="graphs"),
    ], id="page-compare", className="page")


def register(app, runs: RunSet) -> None:
    names = runs.names
    cmp_a0, cmp_b0 = _default_pair(runs)

    def run_or(value, default):
        return value if isinstance(value, str) and value in runs.runs else default

    @app.callback(Output("cmp-summary", "children"), Output("cmp-table", "data"), Output("cmp-table", "columns"),
                  Output("cmp-graphs", "children"), Output("cmp-metrics", "options"), Output("cmp-metrics", "placeholder"),
                  Output("cmp-default", "data"), Output("cmp-table", "style_data_conditional"),
                  Input("url", "pathname"), Input("cmp-a", "value"), Input("cmp-b", "value"),
                  Input("cmp-metrics", "value"), Input("range", "value"), Input("version", "data"))
    def render_compare(pathname, a, b, metrics, rng, _version):
        """The page for A and B. With no delta curves chosen the default ones are drawn and named in
        the dropdown's placeholder, not set as its value: the dropdown's value is sync_compare's
        alone (two writers that listen to each other would be a circular dependency)."""
        if pathname != "/compare":
            raise PreventUpdate
        try:
            summary, rows, columns, graphs, options, _chosen, defaults = compare_view(runs, a, b, metrics, rng)
        except (UserError, RunFormatError) as e:
            msg = e.message if isinstance(e, UserError) else str(e)
            return error_box(msg), [], [], [], [], "delta curves", [], []
        hint = "default: " + ", ".join(defaults) if defaults else "delta curves"
        return (summary, rows, columns, graphs, options, hint, defaults,
                diverging_cell_styles(pl.DataFrame(rows, infer_schema_length=None), COMPARE_COLOURED))

    # the view <-> the URL (see grpolens.serve.url_callbacks)
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Output("cmp-a", "value"), Output("cmp-b", "value"),
                  Output("cmp-metrics", "value"), Output("nav-compare", "href"),
                  Input("url", "pathname"), Input("url", "search"),
                  Input("cmp-a", "value"), Input("cmp-b", "value"), Input("cmp-metrics", "value"),
                  # the step range is sync_header's (it writes from/to here too): read, never listened to
                  State("range", "value"), State("range", "min"), State("range", "max"),
                  State("cmp-default", "data"),
                  prevent_initial_call="initial_duplicate")
    def sync_compare(pathname, search, a, b, metrics, rng, lo, hi, default_metrics):
        on_page = pathname == "/compare"
        a, b = run_or(a, cmp_a0), run_or(b, cmp_b0)
        metrics = lenient(lambda v: inputs.metric_names(v, "delta curves"), metrics, [])
        default_metrics = lenient(lambda v: inputs.metric_names(v, "delta curves"), default_metrics, [])
        rng = lenient(range_list, rng, None)
        lo, hi = inputs.whole_or_none(lo, "step"), inputs.whole_or_none(hi, "step")
        outs: list[Any] = [no_update] * 3
        bounds = range_state(rng, lo, hi)
        if url_triggered() and on_page:
            q = urlstate.decode("compare", search, names)
            bounds = {k: q[k] for k in ("from", "to") if k in q}
            want = (q.get("a", cmp_a0), q.get("b", cmp_b0), q.get("delta", []))
            outs = [same(w, c) for w, c in zip(want, (a, b, metrics or []))]
            if "delta" not in q and metrics:
                outs[2] = []  # the page's default curves (render_compare fills them in)
            a, b, metrics = want[0], want[1], want[2] or default_metrics
        query = compare_search(a, b, metrics, default_metrics, bounds, cmp_a0, cmp_b0)
        new_search = query if on_page and not url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/compare" + query)



def delta_rows(runs: RunSet, a: str, b: str, metric: str, lo=None, hi=None) -> pl.DataFrame:
    """A Compare delta curve: the common steps with both runs' values and B - A."""
    fa, fb = data.series(runs.path(a)), data.series(runs.path(b))
    if metric not in fa.columns or metric not in fb.columns:
        raise UserError(f"CSV download: {metric} is not in both {a} and {b}")
    j = fa.select("step", pl.col(metric).alias("a")).join(fb.select("step", pl.col(metric).alias("b")), on="step")
    if lo is not None:
        j = j.filter(pl.col("step") >= lo)
    if hi is not None:
        j = j.filter(pl.col("step") <= hi)
    return j.sort("step").with_columns((pl.col("b") - pl.col("a")).alias("b_minus_a"))


def _delta_csv(runs: RunSet, search: str):
    q = urlstate.decode("compare", search, runs.names)
    metric = downloads.name(urlstate.parse_query(search), "metric")
    return f"{metric}-{q.get('b')}-minus-{q.get('a')}", delta_rows(runs, downloads.need(q, "a"), downloads.need(q, "b"),
                                                                   metric, q.get("from"), q.get("to"))


def _compare_csv(runs: RunSet, search: str):
    q = urlstate.decode("compare", search, runs.names)
    a, b = downloads.need(q, "a"), downloads.need(q, "b")
    return f"compare-{a}-{b}", data.compare(data.series(runs.path(a)), data.series(runs.path(b)), q.get("from"),
                                            q.get("to"))


def pages() -> list[Page]:
    return [Page("/compare", "Compare", "compare", KEYS, layout, register,
                 csv={"compare": _compare_csv, "delta": _delta_csv}, curve_controls=True, header_search=header_search)]
