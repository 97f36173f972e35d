"""The dashboard's static layout: a header (pages, run selector, curve controls) and one container
per page, each page's own (:mod:`grpolens.serve.pages`). Every page's controls exist from the
start, so callbacks never refer to missing components; the active page is shown by
:func:`grpolens.serve.callbacks.register_callbacks`' ``show_page``."""

from __future__ import annotations

from dash import dcc, html

from grpolens.serve.components import SCORE_LABELS, TABLE_STYLE, labelled, run_options  # noqa: F401 - re-exported
from grpolens.serve.runs import RunSet


def __getattr__(name: str):
    """``PAGES`` ((path, label) of each page, in the navigation bar's order), ``CURVE_PAGES`` (path
    -> curve page name) and ``PAGE_IDS`` (path -> the id in its components' ids), from the page
    modules (computed on use: the page modules import this one)."""
    from grpolens.serve import pages

    if name == "PAGES":
        return tuple((p.path, p.label) for p in pages.all_pages())
    if name == "CURVE_PAGES":
        return pages.curve_pages()
    if name == "PAGE_IDS":
        return {p.path: p.id for p in pages.all_pages()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_runs(runs: RunSet) -> list[str]:
    """The runs the header selects when the URL names none: the first six besides the baseline
    (runs, not their what-if variants, which one adds from the list)."""
    return [n for n in runs.run_names if n != runs.baseline][:6] or runs.names[:1]


def header(runs: RunSet) -> html.Header:
    from grpolens.serve.pages import nav_order

    selected = default_runs(runs)
    return html.Header([
        html.Span("grpolens", className="brand"),
        html.Nav([dcc.Link(p.label, href=p.path, id=f"nav-{p.id}", className="nav-link") for p in nav_order(runs)],
                 className="nav"),
        html.Div(dcc.Dropdown(id="runs", options=run_options(runs), value=selected, multi=True,
                              placeholder="runs", clearable=False), className="run-select"),
    ], className="header")


def curve_controls(runs: RunSet) -> html.Div:
    return html.Div([
        labelled("smoothing", dcc.Slider(id="smoothing", min=0, max=0.99, step=0.01, value=0.0,
                                         marks={0: "0", 0.5: "0.5", 0.9: "0.9"},
                                         updatemode="mouseup", tooltip={"placement": "bottom"}), "ctl ctl-wide"),
        labelled("steps", dcc.RangeSlider(id="range", min=0, max=1, step=1, value=[0, 1], allowCross=False,
                                          updatemode="mouseup", tooltip={"placement": "bottom"}), "ctl ctl-wider"),
        labelled("metric filter", dcc.Input(id="metric-filter", type="text", debounce=True, placeholder="e.g. raw seq",
                                            className="filter")),
        dcc.Checklist(id="y-scale", options=[{"label": " log y", "value": "log"},
                                             {"label": " robust y (p1–p99)", "value": "robust"}],
                      value=[], inline=True, className="ctl"),
        dcc.Checklist(id="show-baseline", options=[{"label": " baseline", "value": "on"}],
                      value=["on"] if runs.baseline else [], className="ctl",
                      style={} if runs.baseline else {"display": "none"}),
        html.Span("click a point to open that step's tokens", className="hint"),
    ], id="curve-controls", className="controls")


def build_layout(runs: RunSet, watch: bool) -> html.Div:
    from grpolens.serve.pages import all_pages

    return html.Div([
        dcc.Location(id="url", refresh=False),
        dcc.Store(id="version", data=None),
        dcc.Store(id="cmp-default", data=[]),  # the Compare page's default delta curves (kept out of its URL)
        dcc.Interval(id="watch", interval=5000, disabled=not watch),
        header(runs),
        curve_controls(runs),
        html.Main([p.layout(runs) for p in all_pages()], className="main"),
    ], className="app")
