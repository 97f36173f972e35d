"""Each page's view <-> its URL query (see :mod:`grpolens.serve.urlstate` for the keys and their checks).

One callback per page group listens to the URL and to the group's controls, and writes both:

* the URL changed (a loaded link, a reload, back/forward, a click that navigates): the controls
  take the query's values, the default for every key the query lacks;
* a control changed: the URL of the page on screen is rewritten (a new browser history entry),
  unless it already says the same.

Dash lets one callback have a property as both input and output without calling itself again, so
the two directions cannot chase each other. The navigation links are rewritten too, so going from
Policy to Overview keeps the runs, smoothing and toggles in the URL.
"""

from __future__ import annotations

from typing import Any

from dash import Input, Output, State, ctx, no_update

from grpolens.serve import data, urlstate
from grpolens.serve.layout import CURVE_PAGES, PAGE_IDS, default_runs
from grpolens.serve.runs import RunSet, default_step
from grpolens.serve.urlstate import as_int

TOKENS_DEFAULTS = {"by": "kl", "k": 50, "color": "kl"}
COMPLETIONS_DEFAULTS = {"truncated": "any", "vetoed": "any", "page": 0}
TOKEN_CHOICES = {"by": data.RANK_BY, "color": data.COLOR_BY}


def _url_triggered() -> bool:
    """True on the first call and when the URL (path or query) changed, not a control."""
    return not ctx.triggered_id or ctx.triggered_id == "url"


def _same(new, old):
    return no_update if new == old else new


def range_state(rng, lo, hi) -> dict[str, int]:
    """``from``/``to`` of the step range, each only when narrower than the runs' steps."""
    out: dict[str, int] = {}
    if rng and len(rng) == 2 and lo is not None and hi is not None:
        if rng[0] is not None and rng[0] > lo:
            out["from"] = int(rng[0])
        if rng[1] is not None and rng[1] < hi:
            out["to"] = int(rng[1])
    return out


def range_value(search: str | None, pathname: str | None, lo: int, hi: int) -> list[int] | None:
    """The step range the URL asks for, clamped into ``[lo, hi]`` (None: the URL's page has none)."""
    group = urlstate.GROUP_OF_PATH.get(pathname or "/")
    if group not in ("curves", "compare"):
        return None
    q = urlstate.decode(group, search, ())
    a = min(max(q.get("from", lo), lo), hi)
    b = min(max(q.get("to", hi), lo), hi)
    return [a, b] if a <= b else [lo, hi]


def curves_search(runs: RunSet, names, smoothing, bounds: dict, pattern, y_scale, baseline) -> str:
    """``bounds``: the step range's ``from``/``to`` (see :func:`range_state`)."""
    state = {"runs": list(names or []), "smooth": round(float(smoothing or 0), 2), "filter": pattern,
             "y": [o for o in urlstate.Y_OPTIONS if o in (y_scale or ())],
             "baseline": None if not runs.baseline else ("on" if baseline else "off"), **bounds}
    return urlstate.encode("curves", state, {"runs": default_runs(runs), "smooth": 0.0, "baseline": "on"})


def tokens_search(run, step, sample=None, pos=None, by="kl", k=50, color="kl") -> str:
    state = {"run": run, "step": step, "sample": sample, "pos": pos, "by": by, "k": k, "color": color}
    return urlstate.encode("tokens", state, TOKENS_DEFAULTS)


def completions_search(run, step, group=None, rank=None, truncated="any", vetoed="any", page=0, sort_by=None,
                       where=None) -> str:
    state = {"run": run, "step": step, "group": group, "rank": rank, "truncated": truncated, "vetoed": vetoed,
             "page": page, "sort": [s for s in (sort_by or []) if s.get("column_id")], "where": where}
    return urlstate.encode("completions", state, COMPLETIONS_DEFAULTS)


def compare_search(a, b, metrics, default_metrics, bounds: dict, a0, b0) -> str:
    state = {"a": a, "b": b, "delta": list(metrics or []), **bounds}
    return urlstate.encode("compare", state, {"a": a0, "b": b0, "delta": list(default_metrics or [])})


def register_url_callbacks(app, runs: RunSet) -> None:  # noqa: C901 - one callback per page group
    names = runs.names
    curve_paths = list(CURVE_PAGES)
    cmp_a0, cmp_b0 = names[0], names[1] if len(names) > 1 else names[0]

    # -- Overview, Policy, Mismatch, Rewards -----------------------------------------------------
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Output("runs", "value"), Output("smoothing", "value"), Output("metric-filter", "value"),
                  Output("y-scale", "value"), Output("show-baseline", "value"),
                  *[Output(f"nav-{PAGE_IDS[p]}", "href") for p in curve_paths],
                  Input("url", "pathname"), Input("url", "search"),
                  Input("runs", "value"), Input("smoothing", "value"), Input("range", "value"),
                  Input("metric-filter", "value"), Input("y-scale", "value"), Input("show-baseline", "value"),
                  State("range", "min"), State("range", "max"),
                  prevent_initial_call="initial_duplicate")
    def sync_curves(pathname, search, sel, smoothing, rng, pattern, y_scale, baseline, lo, hi):
        on_page = (pathname or "/") in curve_paths
        new_search = no_update
        controls = [no_update] * 5
        bounds = range_state(rng, lo, hi)
        if _url_triggered():
            if on_page:
                q = urlstate.decode("curves", search, names)
                # the slider follows (set_range); until then the URL's bounds are the view's
                bounds = {k: q[k] for k in ("from", "to") if k in q}
                want = [q.get("runs", default_runs(runs)), q.get("smooth", 0.0), q.get("filter", ""),
                        q.get("y", []), ["on"] if runs.baseline and q.get("baseline", "on") == "on" else []]
                controls = [_same(w, c) for w, c in zip(want, (sel, smoothing, pattern or "", y_scale or [],
                                                                baseline or []))]
                sel, smoothing, pattern, y_scale, baseline = want
        query = curves_search(runs, sel, smoothing, bounds, pattern, y_scale, baseline)
        if on_page and not _url_triggered() and query != (search or ""):
            new_search = query
        return (new_search, *controls, *[p + query for p in curve_paths])

    # -- Tokens ------------------------------------------------------------------------------------
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Output("tok-run", "value"), Output("tok-step", "value"), Output("tok-sample", "value"),
                  Output("tok-focus", "data"), Output("tok-by", "value"), Output("tok-k", "value"),
                  Output("tok-color", "value"), Output("nav-tokens", "href"),
                  Input("url", "pathname"), Input("url", "search"),
                  Input("tok-run", "value"), Input("tok-step", "value"), Input("tok-sample", "value"),
                  Input("tok-by", "value"), Input("tok-k", "value"), Input("tok-color", "value"),
                  State("tok-focus", "data"),
                  prevent_initial_call="initial_duplicate")
    def sync_tokens(pathname, search, run, step, sample, by, k, color, focus):
        on_page = pathname == "/tokens"
        cur = (run, step, sample, focus, by, k, color)
        outs: list[Any] = [no_update] * 7
        if _url_triggered():
            if on_page or step is None:
                q = urlstate.decode("tokens", search if on_page else "", names, TOKEN_CHOICES)
                r = q.get("run", names[0])
                want = (r, q["step"] if "step" in q else default_step(runs, r), q.get("sample"), q.get("pos"),
                        q.get("by", "kl"), q.get("k", 50), q.get("color", "kl"))
                outs = [_same(w, c) for w, c in zip(want, cur)]
                run, step, sample, focus, by, k, color = want
        elif ctx.triggered_id in ("tok-run", "tok-step", "tok-sample") and focus is not None:
            focus = None  # the outlined token belonged to the completion shown before
            outs[3] = None
        query = tokens_search(run, as_int(step), as_int(sample), as_int(focus), by, as_int(k), color)
        new_search = query if on_page and not _url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/tokens" + query)

    # -- Completions ---------------------------------------------------------------------------------
    filters = ("comp-run", "comp-step", "comp-group", "comp-rank", "comp-trunc", "comp-veto")

    @app.callback(Output("url", "search", allow_duplicate=True),
                  *[Output(c, "value") for c in filters],
                  Output("comp-table", "page_current"), Output("comp-table", "sort_by"),
                  Output("comp-table", "filter_query"), Output("nav-completions", "href"),
                  Input("url", "pathname"), Input("url", "search"),
                  *[Input(c, "value") for c in filters],
                  Input("comp-table", "page_current"), Input("comp-table", "sort_by"),
                  Input("comp-table", "filter_query"),
                  prevent_initial_call="initial_duplicate")
    def sync_completions(pathname, search, run, step, group, rank, trunc, veto, page, sort_by, where):
        on_page = pathname == "/completions"
        cur = (run, step, group, rank, trunc, veto, page, sort_by or [], where or "")
        outs: list[Any] = [no_update] * 9
        if _url_triggered():
            if on_page or step is None:
                q = urlstate.decode("completions", search if on_page else "", names)
                r = q.get("run", names[0])
                want = (r, q["step"] if "step" in q else default_step(runs, r), q.get("group"), q.get("rank"),
                        q.get("truncated", "any"), q.get("vetoed", "any"), q.get("page", 0), q.get("sort", []),
                        q.get("where", ""))
                outs = [_same(w, c) for w, c in zip(want, cur)]
                run, step, group, rank, trunc, veto, page, sort_by, where = want
        elif ctx.triggered_id in filters or ctx.triggered_id == "comp-table" and \
                any(t["prop_id"] == "comp-table.filter_query" for t in ctx.triggered):
            if page:  # a new selection starts at its first page
                page, outs[6] = 0, 0
        query = completions_search(run, as_int(step), as_int(group), as_int(rank), trunc, veto, as_int(page) or 0,
                                   sort_by, where)
        new_search = query if on_page and not _url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/completions" + query)

    # -- Compare ---------------------------------------------------------------------------------------
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Output("cmp-a", "value"), Output("cmp-b", "value"),
                  Output("cmp-metrics", "value", allow_duplicate=True), Output("nav-compare", "href"),
                  Input("url", "pathname"), Input("url", "search"),
                  Input("cmp-a", "value"), Input("cmp-b", "value"), Input("cmp-metrics", "value"),
                  Input("range", "value"), State("range", "min"), State("range", "max"),
                  State("cmp-default", "data"),
                  prevent_initial_call="initial_duplicate")
    def sync_compare(pathname, search, a, b, metrics, rng, lo, hi, default_metrics):
        on_page = pathname == "/compare"
        outs: list[Any] = [no_update] * 3
        bounds = range_state(rng, lo, hi)
        if _url_triggered() and on_page:
            q = urlstate.decode("compare", search, names)
            bounds = {k: q[k] for k in ("from", "to") if k in q}
            want = (q.get("a", cmp_a0), q.get("b", cmp_b0), q.get("delta", []))
            outs = [_same(w, c) for w, c in zip(want, (a, b, metrics or []))]
            if "delta" not in q and metrics:
                outs[2] = []  # the page's default curves (render_compare fills them in)
            a, b, metrics = want[0], want[1], want[2] or default_metrics
        query = compare_search(a, b, metrics, default_metrics, bounds, cmp_a0, cmp_b0)
        new_search = query if on_page and not _url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/compare" + query)

    # -- Runs ------------------------------------------------------------------------------------------
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Output("runs-table", "sort_by"), Output("runs-table", "filter_query"), Output("nav-runs", "href"),
                  Input("url", "pathname"), Input("url", "search"),
                  Input("runs-table", "sort_by"), Input("runs-table", "filter_query"),
                  prevent_initial_call="initial_duplicate")
    def sync_runs(pathname, search, sort_by, where):
        on_page = pathname == "/runs"
        outs: list[Any] = [no_update] * 2
        if _url_triggered() and on_page:
            q = urlstate.decode("runs", search, names)
            want = (q.get("sort", []), q.get("where", ""))
            outs = [_same(w, c) for w, c in zip(want, (sort_by or [], where or ""))]
            sort_by, where = want
        query = urlstate.encode("runs", {"sort": [s for s in (sort_by or []) if s.get("column_id")], "where": where})
        new_search = query if on_page and not _url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/runs" + query)
