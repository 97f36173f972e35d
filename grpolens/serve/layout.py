"""The dashboard's static layout: a header (pages, run selector, curve controls) and one container
per page. Every page's controls exist from the start, so callbacks never refer to missing
components; the active page is shown by :func:`grpolens.serve.callbacks.show_page`."""

from __future__ import annotations

from dash import dash_table, dcc, html

from grpolens.serve import data
from grpolens.serve.components import rows_json, table_columns
from grpolens.serve.data.runtable import runs_table
from grpolens.serve.runs import RunSet

#: (path, label) of each page, in the order of the navigation bar.
PAGES = (
    ("/runs", "Runs"),
    ("/", "Overview"),
    ("/policy", "Policy"),
    ("/mismatch", "Mismatch"),
    ("/rewards", "Rewards"),
    ("/tokens", "Tokens"),
    ("/completions", "Completions"),
    ("/compare", "Compare"),
)
CURVE_PAGES = {"/": "overview", "/policy": "policy", "/mismatch": "mismatch", "/rewards": "rewards"}
PAGE_IDS = {path: ("overview" if path == "/" else path.strip("/")) for path, _ in PAGES}

SCORE_LABELS = {"kl": "KL to ref", "mismatch": "|Δ| train-rollout", "ratio": "ratio", "entropy": "entropy",
                "adv_ratio": "|A·(ratio-1)|", "advantage": "advantage"}
TABLE_STYLE = dict(
    style_table={"overflowX": "auto"},
    style_cell={"fontFamily": "ui-monospace, SFMono-Regular, Menlo, monospace", "fontSize": "12px",
                "padding": "3px 6px", "maxWidth": "420px", "overflow": "hidden", "textOverflow": "ellipsis",
                "whiteSpace": "nowrap"},
    style_header={"fontWeight": "600", "backgroundColor": "#f3f4f6"},
)


def _run_options(runs: RunSet, names: list[str] | None = None) -> list[dict]:
    return [{"label": n + (" (baseline)" if n == runs.baseline else ""), "value": n}
            for n in (runs.names if names is None else names)]


def _labelled(label: str, component, cls: str = "ctl") -> html.Label:
    return html.Label([html.Span(label, className="ctl-label"), component], className=cls)


def default_runs(runs: RunSet) -> list[str]:
    """The runs the header selects when the URL names none: the first six besides the baseline
    (runs, not their what-if variants, which one adds from the list)."""
    return [n for n in runs.run_names if n != runs.baseline][:6] or runs.names[:1]


def header(runs: RunSet) -> html.Header:
    selected = default_runs(runs)
    return html.Header([
        html.Span("grpolens", className="brand"),
        html.Nav([dcc.Link(label, href=path, id=f"nav-{PAGE_IDS[path]}", className="nav-link")
                  for path, label in PAGES], className="nav"),
        html.Div(dcc.Dropdown(id="runs", options=_run_options(runs), value=selected, multi=True,
                              placeholder="runs", clearable=False), className="run-select"),
    ], className="header")


def curve_controls(runs: RunSet) -> html.Div:
    return html.Div([
        _labelled("smoothing", dcc.Slider(id="smoothing", min=0, max=0.99, step=0.01, value=0.0,
                                          marks={0: "0", 0.5: "0.5", 0.9: "0.9"},
                                          updatemode="mouseup", tooltip={"placement": "bottom"}), "ctl ctl-wide"),
        _labelled("steps", dcc.RangeSlider(id="range", min=0, max=1, step=1, value=[0, 1], allowCross=False,
                                           updatemode="mouseup", tooltip={"placement": "bottom"}), "ctl ctl-wider"),
        _labelled("metric filter", dcc.Input(id="metric-filter", type="text", debounce=True, placeholder="e.g. raw seq",
                                             className="filter")),
        dcc.Checklist(id="y-scale", options=[{"label": " log y", "value": "log"},
                                             {"label": " robust y (p1–p99)", "value": "robust"}],
                      value=[], inline=True, className="ctl"),
        dcc.Checklist(id="show-baseline", options=[{"label": " baseline", "value": "on"}],
                      value=["on"] if runs.baseline else [], className="ctl",
                      style={} if runs.baseline else {"display": "none"}),
        html.Span("click a point to open that step's tokens", className="hint"),
    ], id="curve-controls", className="controls")


def curve_page(name: str) -> html.Div:
    extra = []
    if name == "mismatch":
        extra = [html.H3("One step (the step chosen on the Tokens page, or the last)"),
                 html.Div(id="mismatch-step", className="panel")]
    return html.Div([html.Div(id=f"{name}-graphs", className="graphs"), *extra],
                    id=f"page-{name}", className="page")


def tokens_page(runs: RunSet) -> html.Div:
    return html.Div([
        html.Div([
            _labelled("run", dcc.Dropdown(id="tok-run", options=_run_options(runs, runs.run_names), value=runs.run_names[0],
                                          clearable=False)),
            _labelled("step", dcc.Input(id="tok-step", type="number", min=0, step=1, debounce=True)),
            _labelled("rank tokens by", dcc.RadioItems(
                id="tok-by", value="kl", inline=True,
                options=[{"label": SCORE_LABELS[k], "value": k} for k in data.RANK_BY])),
            _labelled("top", dcc.Input(id="tok-k", type="number", min=1, max=500, step=1, value=50, debounce=True)),
        ], className="controls"),
        html.Div(id="tok-summary", className="summary"),
        dash_table.DataTable(id="tok-table", data=[], columns=[], sort_action="native", page_action="native",
                             page_size=10, **TABLE_STYLE),
        html.H3("Completion"),
        html.Div([
            _labelled("sample", dcc.Input(id="tok-sample", type="number", step=1, debounce=True)),
            _labelled("colour by", dcc.RadioItems(
                id="tok-color", value="kl", inline=True,
                options=[{"label": SCORE_LABELS[k], "value": k} for k in data.COLOR_BY])),
        ], className="controls"),
        dcc.Store(id="tok-focus", data=None),
        html.Div(id="tok-completion", className="completion"),
    ], id="page-tokens", className="page")


def completions_page(runs: RunSet) -> html.Div:
    bool_opts = [{"label": "any", "value": "any"}, {"label": "yes", "value": "yes"}, {"label": "no", "value": "no"}]
    return html.Div([
        html.Div([
            _labelled("run", dcc.Dropdown(id="comp-run", options=_run_options(runs, runs.run_names), value=runs.run_names[0],
                                          clearable=False)),
            _labelled("step", dcc.Input(id="comp-step", type="number", min=0, step=1, debounce=True)),
            _labelled("group", dcc.Input(id="comp-group", type="number", step=1, debounce=True)),
            _labelled("reward rank ≤", dcc.Input(id="comp-rank", type="number", min=1, step=1, debounce=True)),
            _labelled("truncated", dcc.Dropdown(id="comp-trunc", options=bool_opts, value="any", clearable=False)),
            _labelled("vetoed", dcc.Dropdown(id="comp-veto", options=bool_opts, value="any", clearable=False)),
        ], className="controls"),
        html.Div(id="comp-summary", className="summary"),
        dash_table.DataTable(
            id="comp-table", data=[], columns=[], page_action="custom", page_current=0, page_size=20,
            sort_action="custom", sort_mode="multi", sort_by=[], filter_action="custom", filter_query="",
            **TABLE_STYLE),
        html.Div("click a row to open the completion", className="hint"),
    ], id="page-completions", className="page")


def _metric_options(runs: RunSet) -> list[dict]:
    names: dict[str, None] = {}
    for path in runs.runs.values():
        names.update(dict.fromkeys(c for c in data.series(path).columns if c != "step"))
    return [{"label": m, "value": m} for m in names]


def compare_page(runs: RunSet) -> html.Div:
    names = runs.names
    return html.Div([
        html.Div([
            _labelled("run A", dcc.Dropdown(id="cmp-a", options=_run_options(runs), value=names[0], clearable=False)),
            _labelled("run B", dcc.Dropdown(id="cmp-b", options=_run_options(runs),
                                            value=names[1] if len(names) > 1 else names[0], clearable=False)),
            # every metric of every run, so a link's chosen curves are valid options before the page's own load
            _labelled("delta curves", dcc.Dropdown(id="cmp-metrics", options=_metric_options(runs), value=[],
                                                   multi=True),
                      "ctl ctl-wider"),
        ], className="controls"),
        html.Div(id="cmp-summary", className="summary"),
        dash_table.DataTable(id="cmp-table", data=[], columns=[], sort_action="native", page_action="native",
                             page_size=15, filter_action="native", **TABLE_STYLE),
        html.Div(id="cmp-graphs", className="graphs"),
    ], id="page-compare", className="page")


def runs_table_rows(runs: RunSet) -> tuple[list[dict], list[dict]]:
    """Rows and columns of the Runs page's table."""
    df = runs_table(runs.runs)
    return rows_json(df), table_columns(df)


def runs_page(runs: RunSet) -> html.Div:
    # filled now, not by a callback, so that a link's filter finds its columns when the page opens
    rows, columns = runs_table_rows(runs)
    return html.Div([
        html.Div(id="runs-summary", className="summary"),
        dash_table.DataTable(id="runs-table", data=rows, columns=columns, row_selectable="multi", selected_rows=[],
                             sort_action="native", sort_mode="multi", filter_action="native", page_size=50,
                             **TABLE_STYLE),
        html.Div("tick runs to overlay them; the table's filter row takes e.g. {config.loss_type} = dapo or "
                 "{steps} > 100", className="hint"),
    ], id="page-runs", className="page")


def build_layout(runs: RunSet, watch: bool) -> html.Div:
    return html.Div([
        dcc.Location(id="url", refresh=False),
        dcc.Store(id="version", data=None),
        dcc.Store(id="cmp-default", data=[]),  # the Compare page's default delta curves (kept out of its URL)
        dcc.Interval(id="watch", interval=5000, disabled=not watch),
        header(runs),
        curve_controls(runs),
        html.Main([
            runs_page(runs),
            curve_page("overview"), curve_page("policy"), curve_page("mismatch"), curve_page("rewards"),
            tokens_page(runs), completions_page(runs), compare_page(runs),
        ], className="main"),
    ], className="app")
