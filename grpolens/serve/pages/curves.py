"""The curve pages: Overview, and one page per dashboard page the metric families declare
(``Family.page`` in :mod:`grpolens.metrics.registry`: Policy, Mismatch, Rewards, Health, ...), each
drawing every metric of its families for the selected runs.

A curve page's own panels beyond its families' curves (the Mismatch page's IS-weight heat map,
the Rewards page's quantile bands) live in ``pages/curve_<page>.py``, found by that name: a module
may define ``before(view)`` and ``after(view)`` (components drawn before/after the families'
curves, ``view`` a :class:`CurveView`), ``layout_extra()``, ``register(app, runs)`` and ``CSV``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from functools import partial

import polars as pl
from dash import Input, Output, State, html, no_update

from grpolens.serve import data, downloads, figures, inputs, urlstate
from grpolens.serve.components import error_box, graph, guard
from grpolens.serve.pages import Page
from grpolens.serve.runs import RunSet

KEYS = ("runs", "smooth", "from", "to", "filter", "y", "baseline", "log", "lin")


def _bounds(lo, hi) -> dict:
    return {"from": lo, "to": hi}


def _range(rng) -> tuple[int | None, int | None]:
    return inputs.step_range(rng)


def _lines(runs: RunSet, names: list[str], column: str, lo, hi, smoothing, with_baseline: bool) -> list[dict]:
    lines = []
    shown = list(names)
    if with_baseline and runs.baseline and runs.baseline not in shown:
        shown.append(runs.baseline)
    for n in shown:
        df = data.series(runs.path(n))
        if column not in df.columns:
            continue
        c = data.curve(df, column, lo, hi, smoothing)
        if len(c["x"]) == 0:
            continue
        lines.append({"run": n, "idx": runs.names.index(n), **c,
                      "baseline": n == runs.baseline and n not in names})
    return lines


def _verdicts(runs: RunSet, names: list[str], column: str) -> list[dict]:
    out = []
    base = runs.path(runs.baseline) if runs.baseline else None
    for n in names:
        if n != runs.baseline:
            out += [v for v in data.check_verdicts(runs.path(n), base) if v["metric"] == column]
    return out


def curve_graph(runs: RunSet, page: str, names: list[str], column: str, title: str, lo=None, hi=None,
                smoothing: float = 0.0, with_baseline: bool = True, y_scale: frozenset = frozenset(),
                doc: str | None = None):
    """``y_scale``: the chosen y options, "log" and/or "robust" (see :func:`figures.y_axis_scale`);
    ``doc``: the metric's description, shown whole under the chart."""
    lines = _lines(runs, names, column, lo, hi, smoothing, with_baseline)
    if not lines:
        return None
    csv = downloads.link("curve", runs=[ln["run"] for ln in lines], metric=column, smooth=smoothing or None,
                         **_bounds(lo, hi))
    return graph(f"{page}:{column}", figures.curve_figure(title, lines, _verdicts(runs, names, column),
                                                           log_y="log" in y_scale, robust_y="robust" in y_scale), csv,
                  doc, log_toggle=True)


#: Most metric graphs on one page (each costs the browser a WebGL context and a render); the
#: metric filter brings in the others.
MAX_GRAPHS = 16
#: Metrics each page draws first (regular expressions, in order); the rest follow in catalogue order.
PAGE_PRIORITY = {
    "policy": (r"^kl/k3$", r"^kl/k1$", r"^clip/(low|high|region)$", r"^clip/cispo$", r"^entropy$", r"^loss$",
               r"^policy/(approx_kl|ratio_max|ratio_min|ratio_abs_dev_mean|token_kl_max)$"),
    "mismatch": (r"^mismatch/kl_k3$", r"^mismatch/abs_logp_diff$", r"^mismatch/delta_median$",
                 r"^mismatch/constant_offset$", r"^rollout_is/raw/(mean|max|ess)$", r"^rollout_is/applied/(mean|max)$",
                 r"^rollout_is/(truncated_fraction|zeroed_fraction)$", r"^rollout_is/veto/seq_fraction$",
                 r"^rollout_is/modified/token_fraction$", r"^mismatch/chi2_token$"),
    "rewards": (r"^reward/(mean|std|frac_zero_std)$", r"^advantage/frac_zero_groups$",
                r"^completions/(length/mean|truncated_frac|clipped_frac)$", r"^diversity/(distinct_1|distinct_2|jaccard)$"),
}


def prioritised(page: str, cols: list[str]) -> list[str]:
    pats = PAGE_PRIORITY.get(page, ())

    def key(c: str) -> int:
        return next((i for i, p in enumerate(pats) if re.search(p, c)), len(pats))

    return sorted(cols, key=key)  # stable: catalogue order within each priority


def _matches(column: str, pattern: str | None) -> bool:
    return not pattern or all(p in column for p in pattern.lower().split())


@dataclass
class CurveView:
    """What a curve page draws for: its runs' per-step frames, the step range, and a function that
    draws one metric's curve the way the page does (None when no run has it)."""

    runs: RunSet
    page: str
    names: list[str]
    frames: list[pl.DataFrame]
    lo: int | None
    hi: int | None
    curve: object


def extras(page: str):
    """The module of a curve page's own panels (``pages/curve_<page>.py``), or None."""
    name = f"grpolens.serve.pages.curve_{page}"
    return importlib.import_module(name) if re.fullmatch(r"\w+", page) and importlib.util.find_spec(name) else None


def curve_page_children(runs: RunSet, page: str, names: list[str], smoothing: float = 0.0, rng=None,
                        with_baseline: bool = True, pattern: str | None = None, y_scale=(),
                        panels: dict[str, bool] | None = None) -> list:
    """The graphs of a curve page (overview, or a page the families declare) for the selected runs;
    ``pattern``: only metrics whose name contains each of its words; ``y_scale``: "log", "robust";
    ``panels``: metric -> log y of the panels whose own box says otherwise than the header."""
    y_scale = frozenset(inputs.choices(y_scale, urlstate.Y_OPTIONS, "y scale"))
    smoothing = inputs.smoothing(smoothing)
    pattern = inputs.text(pattern, "metric filter")
    panels = panels or {}

    def ys(col: str) -> frozenset:  # the header's y options, with the panel's own log y where it has one
        own = panels.get(col)
        return y_scale if own is None else (y_scale | {"log"}) if own else (y_scale - {"log"})

    names = inputs.run_names(runs, names)
    if not names:
        return [error_box("select at least one run")]
    lo, hi = _range(rng)
    extra = extras(page)
    frames = [data.series(runs.path(n), with_samples=bool(getattr(extra, "WITH_SAMPLES", False))) for n in names]

    def draw(col: str, title: str | None = None, doc: str | None = None):
        return curve_graph(runs, page, names, col, title or col, lo, hi, smoothing, with_baseline, ys(col), doc)

    view = CurveView(runs, page, names, frames, lo, hi, draw)
    out: list = []
    if page == "overview":
        for label, col in data.overview_metrics(frames):
            out.append(draw(col, f"{label} <span style='font-size:10px;color:#888'>{col}</span>"))
    if hasattr(extra, "before"):
        out += extra.before(view)
    pages = data.page_families()
    if page in pages:
        skip = set(extra.drawn_elsewhere(view)) if hasattr(extra, "drawn_elsewhere") else set()
        cols = [c for c in data.family_metrics(frames, pages[page]) if c not in skip]
        cols = prioritised(page, [c for c in cols if _matches(c, pattern)])
        docs = data.metric_docs()
        out += [draw(col, doc=docs.get(col)) for col in cols[:MAX_GRAPHS]]
        if len(cols) > MAX_GRAPHS:
            out.append(html.Div(f"{len(cols) - MAX_GRAPHS} more metric(s) not drawn: narrow them down with the "
                                "metric filter", className="hint"))
    if hasattr(extra, "after"):
        out += extra.after(view)
    out = [c for c in out if c is not None]
    if not out:
        out.append(error_box(getattr(extra, "EMPTY", "nothing to show for these runs")))
    return out


def layout(page: str, runs: RunSet) -> html.Div:
    extra = extras(page)
    more = extra.layout_extra() if hasattr(extra, "layout_extra") else []
    return html.Div([html.Div(id=f"{page}-graphs", className="graphs"), *more], id=f"page-{page}", className="page")


def register(path: str, page: str, app, runs: RunSet) -> None:
    @app.callback(Output(f"{page}-graphs", "children"),
                  Input("url", "pathname"), Input("runs", "value"), Input("smoothing", "value"),
                  Input("range", "value"), Input("show-baseline", "value"), Input("metric-filter", "value"),
                  Input("y-scale", "value"), Input("version", "data"), State("url", "search"))
    def render(pathname, names, smoothing, rng, baseline, pattern, y_scale, _version, search):
        if inputs.pathname(pathname) != path:
            return no_update
        # the panels' own log y boxes, from the URL (sync_panel_log writes them there)
        q = urlstate.decode("curves", search, runs.names)
        panels = {**{m: True for m in q.get("log", [])}, **{m: False for m in q.get("lin", [])}}
        return guard(curve_page_children, 1)(runs, page, names, smoothing, rng, bool(baseline), pattern, y_scale,
                                             panels)

    extra = extras(page)
    if hasattr(extra, "register"):
        extra.register(app, runs)


def curve_rows(runs: RunSet, names: list[str], metric: str, lo=None, hi=None, smoothing: float = 0.0) -> pl.DataFrame:
    """Every logged point of ``metric`` per run in ``[lo, hi]``: run, step, value (and the smoothed
    value the chart draws when smoothing)."""
    frames = []
    for n in names:
        c = data.curve(data.series(runs.path(n)), metric, lo, hi, smoothing, max_points=2**62)
        cols = {"run": [n] * len(c["x"]), "step": c["x"], "value": c["y"]}
        if smoothing > 0:
            cols["smoothed"] = c["smooth"]
        frames.append(pl.DataFrame(cols, schema={"run": pl.String, "step": pl.Int64, "value": pl.Float64,
                                                 **({"smoothed": pl.Float64} if smoothing > 0 else {})}))
    return pl.concat(frames) if frames else pl.DataFrame()


def _curve_csv(runs: RunSet, search: str):
    q = urlstate.decode("curves", search, runs.names)
    metric = downloads.name(urlstate.parse_query(search), "metric")
    return metric, curve_rows(runs, downloads.need(q, "runs"), metric, q.get("from"), q.get("to"), q.get("smooth", 0.0))


def curve_page_names() -> list[str]:
    """"overview", then every page a metric family declares, in the registry's order."""
    from grpolens.metrics.registry import PAGES
    from grpolens.plugins import load_plugins

    load_plugins()
    return ["overview", *PAGES]


def pages() -> list[Page]:
    out = []
    for name in curve_page_names():
        path = "/" if name == "overview" else f"/{name}"
        extra = extras(name)
        csv = {"curve": _curve_csv, **getattr(extra, "CSV", {})}
        out.append(Page(path, name.capitalize(), "curves", KEYS, partial(layout, name), partial(register, path, name),
                        csv=csv, curve_controls=True, curves=name))
    return out
