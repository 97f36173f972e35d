"""The dashboard's callbacks: each page's own (declared by its module in :mod:`grpolens.serve.pages`)
and those every page shares: which page is shown, a click on any curve point, a panel's own log y,
the ``--watch`` poll, and the header's controls in the URL (:mod:`grpolens.serve.url_callbacks`).

Every function that takes a run name resolves it through :meth:`RunSet.path`, which refuses
anything but the runs the server was started with, and every input is bounded where it arrives
(:mod:`grpolens.serve.inputs`). Model-generated text is only ever put into components as plain
strings (``html.Pre``/``html.Span`` children, ``title`` attributes, DataTable cells without
Markdown): React escapes them, so markup in a completion is shown, never run.
"""

from __future__ import annotations

from dash import ALL, MATCH, Input, Output, State, ctx
from dash.exceptions import PreventUpdate

from grpolens.errors import UserError
from grpolens.serve import data, inputs, pages, urlstate
from grpolens.serve.components import GRAPH_CONFIG, fmt_value as _fmt, graph as _graph, guard as _guard  # noqa: F401
from grpolens.serve.runs import RunSet
from grpolens.serve.url_callbacks import register_url_callbacks, tokens_search

# The pages' view functions, where the tests and benchmarks have always found them.
from grpolens.serve.pages.compare import COMPARE_COLOURED, compare_view  # noqa: F401,E402
from grpolens.serve.pages.completions import completions_table  # noqa: F401,E402
from grpolens.serve.pages.curve_mismatch import mismatch_step_panel, sweep_tables  # noqa: F401,E402
from grpolens.serve.pages.curve_rewards import reward_graphs  # noqa: F401,E402
from grpolens.serve.pages.curves import (  # noqa: F401,E402
    MAX_GRAPHS, PAGE_PRIORITY, curve_graph, curve_page_children, prioritised,
)
from grpolens.serve.pages.tokens import MAX_TOKENS_SHOWN, _color, completion_view, top_tokens_view  # noqa: F401,E402


def click_target(runs: RunSet, names: list[str] | None, click: dict | None, by: str = "kl", k: int = 50,
                 color: str = "kl", metric: str | None = None) -> tuple[str, str] | None:
    """Where a click on a curve point leads: the Tokens page for that run and step (the point's
    ``customdata`` is its run's index; a delta curve of the Compare page carries run B's), ranked
    and coloured as the Tokens page last was, with the Why panel of the curve's ``metric``."""
    if not isinstance(click, dict) or not click.get("points"):
        return None
    pts = [p for p in inputs.items(click["points"], "clicked points") if isinstance(p, dict)]
    if not pts:
        return None
    pt = next((p for p in pts if isinstance(p.get("customdata"), (int, float)) and p["customdata"] >= 0), pts[0])
    step = inputs.whole_or_none(pt.get("x"), "step")
    if step is None:
        return None
    names = inputs.run_names(runs, names)
    idx = inputs.index(pt.get("customdata"), len(runs.names))
    if idx is not None:
        name = runs.names[idx]
    else:
        name = (names or runs.names)[0]
    runs.path(name)
    name = runs.run_of(name)  # a what-if variant's tokens are its run's
    from grpolens.serve.layout import default_runs

    return "/tokens", tokens_search(name, step, by=inputs.choice(by, data.RANK_BY, "kl"), k=inputs.clamped(k, "top", 50),
                                    color=inputs.choice(color, data.COLOR_BY, "kl"), header_runs=names,
                                    default_header=default_runs(runs), why=metric)


def curve_metric(key) -> str | None:
    """The metric of a curve graph's key (``page:metric``); None for bands, heat maps and others."""
    where, _, metric = str(key or "").partition(":")
    if not metric or metric.startswith(("band:", "is_hist:")) or not urlstate.METRIC_NAME.match(metric):
        return None
    return metric


def register_callbacks(app, runs: RunSet) -> None:
    every = pages.all_pages()
    paths = [p.path for p in every]

    @app.callback([Output(f"page-{p.id}", "style") for p in every]
                  + [Output(f"nav-{p.id}", "className") for p in every]
                  + [Output("curve-controls", "style")],
                  Input("url", "pathname"))
    def show_page(pathname):
        path = inputs.pathname(pathname)
        shown = pages.by_path(path if path in paths else "/")
        styles = [{} if p is shown else {"display": "none"} for p in every]
        navs = ["nav-link active" if p is shown else "nav-link" for p in every]
        return [*styles, *navs, {} if shown.curve_controls else {"display": "none"}]

    # the step slider's bounds and value: sync_header (grpolens.serve.url_callbacks), with the URL

    for page in every:
        if page.register is not None:
            page.register(app, runs)

    @app.callback(Output("url", "pathname", allow_duplicate=True), Output("url", "search", allow_duplicate=True),
                  Input({"type": "curve", "key": ALL}, "clickData"), State("runs", "value"),
                  State("tok-by", "value"), State("tok-k", "value"), State("tok-color", "value"),
                  prevent_initial_call=True)
    def on_curve_click(_clicks, names, by, k, color):
        trig = ctx.triggered_id
        value = ctx.triggered[0].get("value") if ctx.triggered else None
        if not isinstance(trig, dict) or not value:
            raise PreventUpdate
        try:
            target = click_target(runs, names, value, by, k, color, curve_metric(trig.get("key")))
        except UserError:
            raise PreventUpdate from None
        if target is None:
            raise PreventUpdate
        return target

    # One panel's own log y, in the browser (no round trip): the figure is redrawn with plotly's
    # own range on the new axis (a robust range is in linear units, so it does not carry over).
    app.clientside_callback(
        """function(value, fig) {
            if (!fig) { return window.dash_clientside.no_update; }
            const log = (value || []).includes('log');
            const yaxis = Object.assign({}, fig.layout.yaxis, {type: log ? 'log' : 'linear', autorange: true});
            delete yaxis.range;
            return Object.assign({}, fig, {layout: Object.assign({}, fig.layout, {yaxis: yaxis})});
        }""",
        Output({"type": "curve", "key": MATCH}, "figure"),
        Input({"type": "panel-log", "key": MATCH}, "value"), State({"type": "curve", "key": MATCH}, "figure"),
        prevent_initial_call=True)

    register_url_callbacks(app, runs)

    # -- --watch: notice new data -------------------------------------------------------------------
    @app.callback(Output("version", "data"), Input("watch", "n_intervals"), State("version", "data"),
                  prevent_initial_call=True)
    def poll(_n, old):
        new = [str(data.run_version(p)) for p in runs.runs.values()]
        if new == old:
            raise PreventUpdate
        return new
