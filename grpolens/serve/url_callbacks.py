"""Each page's view <-> its URL query (see :mod:`grpolens.serve.urlstate` for the keys and their checks).

One callback per page group listens to the URL and to the group's controls, and writes both:

* the URL changed (a loaded link, a reload, back/forward, a click that navigates): the controls
  take the query's values, the default for every key the query lacks;
* a control changed: the URL of the page on screen is rewritten (a new browser history entry),
  unless it already says the same.

Dash lets one callback have a property as both input and output without calling itself again, so
the two directions cannot chase each other. Across callbacks they could: a callback that sets a
control from the URL and another that writes the URL from that control form a loop (Dash breaks it
at run time and warns in debug mode). So each control is read from and written to the URL by one
callback only: :func:`sync_header` owns the header's controls (runs, smoothing, step range, filter,
y toggles) on every page, including the step slider's bounds, and the Compare page's and the
Tokens/Completions pages' copies of the header's values in their URLs; the other callbacks read
those controls as ``State`` only. The navigation links are rewritten too, so going from Policy to
Overview keeps the runs, smoothing and toggles in the URL.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from dash import ALL, Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from grpolens.serve import data, inputs, urlstate
from grpolens.serve.layout import CURVE_PAGES, PAGE_IDS, default_runs
from grpolens.errors import UserError
from grpolens.serve.runs import RunSet, default_step

TOKENS_DEFAULTS = {"by": "kl", "k": 50, "color": "kl"}
COMPLETIONS_DEFAULTS = {"truncated": "any", "vetoed": "any", "page": 0}
TOKEN_CHOICES = {"by": data.RANK_BY, "color": data.COLOR_BY}


def _url_triggered() -> bool:
    """True on the first call and when the URL (path or query) changed, not a control."""
    return not ctx.triggered_id or ctx.triggered_id == "url"


def _lenient(check, value, default):
    """``check(value)``, or ``default`` when the value is out of bounds (see :mod:`grpolens.serve.inputs`)."""
    try:
        return check(value)
    except UserError:
        return default


def _range_list(value) -> list[int]:
    lo, hi = inputs.step_range(value)
    if lo is None or hi is None:
        raise inputs.BadInput("step range: two steps")
    return [lo, hi]


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


def curves_search(runs: RunSet, names, smoothing, bounds: dict, pattern, y_scale, baseline,
                  panels: dict | None = None) -> str:
    """``bounds``: the step range's ``from``/``to`` (see :func:`range_state`); ``panels``: the
    ``log``/``lin`` lists of panels whose own log y box differs from the header's."""
    state = {"runs": list(names or []), "smooth": round(float(smoothing or 0), 2), "filter": pattern,
             "y": [o for o in urlstate.Y_OPTIONS if o in (y_scale or ())],
             "baseline": None if not runs.baseline else ("on" if baseline else "off"), **bounds, **(panels or {})}
    return urlstate.encode("curves", state, {"runs": default_runs(runs), "smooth": 0.0, "baseline": "on"})


def panel_flips(values, ids, page: str, header_log: bool, flips: dict | None = None) -> dict[str, list[str]]:
    """``{"log": [...], "lin": [...]}``: the panels of ``page`` whose own log y box (``values``,
    their component ``ids``, keys ``page:metric``) differs from the header's log y; the ``flips``
    of panels not on screen are kept."""
    log, lin = list((flips or {}).get("log", [])), list((flips or {}).get("lin", []))
    for value, cid in zip(values or [], ids or []):
        where, _, metric = str((cid or {}).get("key", "")).partition(":")
        if where != page or not metric:
            continue
        log, lin = [m for m in log if m != metric], [m for m in lin if m != metric]
        on = "log" in (value or [])
        if on and not header_log:
            log.append(metric)
        elif not on and header_log:
            lin.append(metric)
    return {k: v for k, v in (("log", log), ("lin", lin)) if v}


def tokens_search(run, step, sample=None, pos=None, by="kl", k=50, color="kl", header_runs=None,
                  default_header=None) -> str:
    """``header_runs``: the header's selection, written when it is not ``default_header``."""
    state = {"run": run, "step": step, "sample": sample, "pos": pos, "by": by, "k": k, "color": color,
             "runs": list(header_runs) if header_runs else None}
    return urlstate.encode("tokens", state, {**TOKENS_DEFAULTS, "runs": default_header})


def completions_search(run, step, group=None, rank=None, truncated="any", vetoed="any", page=0, sort_by=None,
                       where=None, header_runs=None, default_header=None) -> str:
    state = {"run": run, "step": step, "group": group, "rank": rank, "truncated": truncated, "vetoed": vetoed,
             "page": page, "sort": [s for s in (sort_by or []) if s.get("column_id")], "where": where,
             "runs": list(header_runs) if header_runs else None}
    return urlstate.encode("completions", state, {**COMPLETIONS_DEFAULTS, "runs": default_header})


def compare_search(a, b, metrics, default_metrics, bounds: dict, a0, b0) -> str:
    state = {"a": a, "b": b, "delta": list(metrics or []), **bounds}
    return urlstate.encode("compare", state, {"a": a0, "b": b0, "delta": list(default_metrics or [])})


def step_slider(runs: RunSet, names) -> tuple[int, int, dict]:
    """The step slider's bounds over the selected runs' steps, and its marks."""
    lo, hi = data.step_bounds([data.series(runs.path(n)) for n in names]) if names else (0, 1)
    hi = max(hi, lo + 1)
    return lo, hi, {int(v): str(int(v)) for v in np.linspace(lo, hi, 5).round()}


def register_url_callbacks(app, runs: RunSet) -> None:  # noqa: C901 - one callback per page group
    names = runs.names
    curve_paths = list(CURVE_PAGES)
    cmp_a0, cmp_b0 = names[0], names[1] if len(names) > 1 else names[0]
    header_default = default_runs(runs)

    def _runs_or(value, default):
        return _lenient(lambda v: inputs.run_names(runs, v), value, default)

    def _run_or(value, default):
        return value if isinstance(value, str) and value in runs.runs else default

    # -- The header's controls, on every page ------------------------------------------------------
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Output("runs", "value"), Output("smoothing", "value"), Output("metric-filter", "value"),
                  Output("y-scale", "value"), Output("show-baseline", "value"),
                  Output("range", "min"), Output("range", "max"), Output("range", "value"), Output("range", "marks"),
                  *[Output(f"nav-{PAGE_IDS[p]}", "href") for p in curve_paths],
                  Input("url", "pathname"), Input("url", "search"),
                  Input("runs", "value"), Input("smoothing", "value"), Input("range", "value"),
                  Input("metric-filter", "value"), Input("y-scale", "value"), Input("show-baseline", "value"),
                  Input("version", "data"),
                  State("range", "min"), State("range", "max"),
                  State("cmp-a", "value"), State("cmp-b", "value"), State("cmp-metrics", "value"),
                  State("cmp-default", "data"),
                  prevent_initial_call="initial_duplicate")
    def sync_header(pathname, search, sel, smoothing, rng, pattern, y_scale, baseline, _version, old_lo, old_hi,
                    cmp_a, cmp_b, cmp_metrics, cmp_default):
        """The header's controls <-> the URL of whichever page is on screen, and the step slider's
        bounds (the selected runs' steps) and value (the URL's ``from``/``to`` where the page has them)."""
        path = inputs.pathname(pathname)
        group = urlstate.GROUP_OF_PATH.get(path)
        # what the controls say, each bounded (a bad value is left out of the URLs: the page says why)
        sel = _runs_or(sel, None)
        smoothing = _lenient(inputs.smoothing, smoothing, 0.0)
        pattern = _lenient(lambda v: inputs.text(v, "metric filter"), pattern, None)
        y_scale = _lenient(lambda v: inputs.choices(v, urlstate.Y_OPTIONS, "y scale"), y_scale, [])
        baseline = _lenient(lambda v: inputs.choices(v, ("on",), "baseline"), baseline, [])
        rng = _lenient(_range_list, rng, None)
        old_lo, old_hi = inputs.whole_or_none(old_lo, "step"), inputs.whole_or_none(old_hi, "step")
        cmp_a, cmp_b = _run_or(cmp_a, cmp_a0), _run_or(cmp_b, cmp_b0)
        cmp_metrics = _lenient(lambda v: inputs.metric_names(v, "delta curves"), cmp_metrics, [])
        cmp_default = _lenient(lambda v: inputs.metric_names(v, "delta curves"), cmp_default, [])
        fired = {t["prop_id"] for t in ctx.triggered}
        # (on the first call every input counts as fired, the URL among them)
        from_url = _url_triggered() or bool(fired & {"url.pathname", "url.search"})
        controls: list[Any] = [no_update] * 5
        q: dict[str, Any] = {}
        if from_url and group == "curves":
            q = urlstate.decode("curves", search, names)
            want = [q.get("runs", header_default), q.get("smooth", 0.0), q.get("filter", ""),
                    q.get("y", []), ["on"] if runs.baseline and q.get("baseline", "on") == "on" else []]
            controls = [_same(w, c) for w, c in zip(want, (sel, smoothing, pattern or "", y_scale or [],
                                                            baseline or []))]
            sel, smoothing, pattern, y_scale, baseline = want
        elif from_url and group in ("tokens", "completions"):
            q = urlstate.decode(group, search, names, TOKEN_CHOICES)
            if "runs" in q:  # a link without the key (a row's, a point's) leaves the header as it is
                controls[0] = _same(q["runs"], sel)
                sel = q["runs"]

        # the step slider: its bounds follow the selected runs; its value the URL, the user, or a clamp
        checked = sel
        slider: list[Any] = [no_update] * 4
        if checked is not None:
            lo, hi, marks = step_slider(runs, checked)
            if not from_url and "range.value" in fired and rng:
                want_rng = rng
            else:
                want_rng = range_value(search, path, lo, hi) if from_url else None
                if want_rng is None:  # a page without a step range, or other runs: keep a narrowed range, clamped
                    narrowed = rng and old_hi is not None and (rng[1] < old_hi or rng[0] > (old_lo or 0))
                    want_rng = [max(rng[0], lo), min(rng[1], hi)] if narrowed and rng[0] <= hi else [lo, hi]
            if (lo, hi) != (old_lo, old_hi):
                slider = [lo, hi, _same(want_rng, rng), marks]
            else:
                slider[2] = _same(want_rng, rng)
            rng = want_rng
            bounds = range_state(rng, lo, hi)
        else:
            bounds = range_state(rng, old_lo, old_hi)
        if from_url and group in ("curves", "compare"):
            # until the slider follows, the URL's bounds are the view's
            bounds = {k: v for k, v in urlstate.decode(group, search, names).items() if k in ("from", "to")}

        nav_query = curves_search(runs, sel, smoothing, bounds, pattern, y_scale, baseline)
        new_search: Any = no_update
        if not from_url:
            if group == "curves":
                kept = urlstate.decode("curves", search, names)  # the panels' own log y boxes stay
                query = curves_search(runs, sel, smoothing, bounds, pattern, y_scale, baseline,
                                      {k: kept[k] for k in ("log", "lin") if k in kept})
            elif group == "compare":
                query = compare_search(cmp_a, cmp_b, cmp_metrics or cmp_default, cmp_default, bounds, cmp_a0, cmp_b0)
            elif group in ("tokens", "completions"):
                kept = urlstate.decode(group, search, names, TOKEN_CHOICES)
                kept["runs"] = list(sel or [])
                query = urlstate.encode(group, kept, {**(TOKENS_DEFAULTS if group == "tokens" else COMPLETIONS_DEFAULTS),
                                                      "runs": header_default})
            else:
                query = search or ""
            if query != (search or ""):
                new_search = query
        return (new_search, *controls, *slider, *[p + nav_query for p in curve_paths])

    # -- One curve panel's own log y box -----------------------------------------------------------
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Input({"type": "panel-log", "key": ALL}, "value"), State({"type": "panel-log", "key": ALL}, "id"),
                  State("url", "pathname"), State("url", "search"), State("y-scale", "value"),
                  prevent_initial_call=True)
    def sync_panel_log(values, ids, pathname, search, y_scale):
        """A panel's log y box ticked against the header's choice goes into the URL (``log``/``lin``)."""
        page = CURVE_PAGES.get(inputs.pathname(pathname))
        values, ids = _lenient(lambda v: inputs.items(v, "log y boxes"), values, None), \
            _lenient(lambda v: inputs.items(v, "log y boxes"), ids, None)
        if page is None or values is None or ids is None:
            raise PreventUpdate
        values = [v if isinstance(v, list) else [] for v in values]
        ids = [i if isinstance(i, dict) else {} for i in ids]
        y_scale = _lenient(lambda v: inputs.choices(v, urlstate.Y_OPTIONS, "y scale"), y_scale, [])
        q = urlstate.decode("curves", search, names)
        flips = panel_flips(values, ids, page, "log" in (y_scale or []), q)
        q.pop("log", None), q.pop("lin", None)
        query = urlstate.encode("curves", {**q, **flips}, {"runs": header_default, "smooth": 0.0, "baseline": "on"})
        if query == (search or ""):
            raise PreventUpdate
        return query

    # -- Tokens ------------------------------------------------------------------------------------
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Output("tok-run", "value"), Output("tok-step", "value"), Output("tok-sample", "value"),
                  Output("tok-focus", "data"), Output("tok-by", "value"), Output("tok-k", "value"),
                  Output("tok-color", "value"), Output("nav-tokens", "href"),
                  Input("url", "pathname"), Input("url", "search"),
                  Input("tok-run", "value"), Input("tok-step", "value"), Input("tok-sample", "value"),
                  Input("tok-by", "value"), Input("tok-k", "value"), Input("tok-color", "value"),
                  State("tok-focus", "data"), State("runs", "value"),
                  prevent_initial_call="initial_duplicate")
    def sync_tokens(pathname, search, run, step, sample, by, k, color, focus, header_runs):
        on_page = pathname == "/tokens"
        run = _run_or(run, None)
        step, sample = inputs.whole_or_none(step, "step"), inputs.whole_or_none(sample, "sample")
        focus = inputs.whole_or_none(focus, "pos")
        by, color = inputs.choice(by, data.RANK_BY, by), inputs.choice(color, data.COLOR_BY, color)
        k = inputs.clamped(k, "top", 50) if k is not None else None
        header_runs = _runs_or(header_runs, None)
        cur = (run, step, sample, focus, by, k, color)
        outs: list[Any] = [no_update] * 7
        if _url_triggered():
            if on_page or step is None:
                q = urlstate.decode("tokens", search if on_page else "", names, TOKEN_CHOICES)
                header_runs = q.get("runs", header_runs)  # sync_header sets the header from the same URL
                r = runs.run_of(q.get("run", runs.run_names[0]))  # a variant's tokens are its run's
                want = (r, q["step"] if "step" in q else default_step(runs, r), q.get("sample"), q.get("pos"),
                        q.get("by", "kl"), q.get("k", 50), q.get("color", "kl"))
                outs = [_same(w, c) for w, c in zip(want, cur)]
                run, step, sample, focus, by, k, color = want
        elif ctx.triggered_id in ("tok-run", "tok-step", "tok-sample") and focus is not None:
            focus = None  # the outlined token belonged to the completion shown before
            outs[3] = None
        query = tokens_search(run, step, sample, focus, inputs.choice(by, data.RANK_BY, "kl"), k,
                              inputs.choice(color, data.COLOR_BY, "kl"), header_runs, header_default)
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
                  Input("comp-table", "filter_query"), State("runs", "value"),
                  prevent_initial_call="initial_duplicate")
    def sync_completions(pathname, search, run, step, group, rank, trunc, veto, page, sort_by, where, header_runs):
        on_page = pathname == "/completions"
        run = _run_or(run, None)
        step, group = inputs.whole_or_none(step, "step"), inputs.whole_or_none(group, "group")
        rank, page = inputs.whole_or_none(rank, "rank"), inputs.whole_or_none(page, "page")
        trunc, veto = inputs.choice(trunc, urlstate.YES_NO, "any"), inputs.choice(veto, urlstate.YES_NO, "any")
        sort_by = _lenient(inputs.sort_by, sort_by, [])
        where = _lenient(inputs.filter_query, where, None)
        header_runs = _runs_or(header_runs, None)
        cur = (run, step, group, rank, trunc, veto, page, sort_by or [], where or "")
        outs: list[Any] = [no_update] * 9
        if _url_triggered():
            if on_page or step is None:
                q = urlstate.decode("completions", search if on_page else "", names)
                header_runs = q.get("runs", header_runs)
                r = runs.run_of(q.get("run", runs.run_names[0]))
                want = (r, q["step"] if "step" in q else default_step(runs, r), q.get("group"), q.get("rank"),
                        q.get("truncated", "any"), q.get("vetoed", "any"), q.get("page", 0), q.get("sort", []),
                        q.get("where", ""))
                outs = [_same(w, c) for w, c in zip(want, cur)]
                run, step, group, rank, trunc, veto, page, sort_by, where = want
        elif ctx.triggered_id in filters or ctx.triggered_id == "comp-table" and \
                any(t["prop_id"] == "comp-table.filter_query" for t in ctx.triggered):
            if page:  # a new selection starts at its first page
                page, outs[6] = 0, 0
        query = completions_search(run, step, group, rank, trunc, veto, page or 0, sort_by, where, header_runs,
                                   header_default)
        new_search = query if on_page and not _url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/completions" + query)

    # -- Compare ---------------------------------------------------------------------------------------
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
        a, b = _run_or(a, cmp_a0), _run_or(b, cmp_b0)
        metrics = _lenient(lambda v: inputs.metric_names(v, "delta curves"), metrics, [])
        default_metrics = _lenient(lambda v: inputs.metric_names(v, "delta curves"), default_metrics, [])
        rng = _lenient(_range_list, rng, None)
        lo, hi = inputs.whole_or_none(lo, "step"), inputs.whole_or_none(hi, "step")
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
                  Output("runs-table", "sort_by"), Output("runs-table", "filter_query"),
                  Output("runs-table", "selected_rows"), Output("nav-runs", "href"),
                  Input("url", "pathname"), Input("url", "search"),
                  Input("runs-table", "sort_by"), Input("runs-table", "filter_query"), Input("runs-table", "selected_rows"),
                  State("runs", "value"),
                  prevent_initial_call="initial_duplicate")
    def sync_runs(pathname, search, sort_by, where, selected, header_runs):
        """Sort, filter and the ticked rows; ticked by default: the runs the header has selected."""
        on_page = pathname == "/runs"
        outs: list[Any] = [no_update] * 3
        selected = inputs.row_indices(selected, len(names))
        sort_by = _lenient(inputs.sort_by, sort_by, [])
        where = _lenient(lambda v: inputs.text(v, "table filter"), where, None)
        header_runs = _runs_or(header_runs, None)
        ticked = [names[int(i)] for i in selected]
        if _url_triggered() and on_page:
            q = urlstate.decode("runs", search, names)
            want = (q.get("sort", []), q.get("where", ""),
                    [names.index(n) for n in q.get("tick", header_runs or []) if n in names])
            outs = [_same(w, c) for w, c in zip(want, (sort_by or [], where or "", sorted(selected or [])))]
            sort_by, where = want[:2]
            ticked = [names[i] for i in sorted(want[2])]
        query = urlstate.encode("runs", {"sort": [s for s in (sort_by or []) if s.get("column_id")], "where": where,
                                         "tick": ticked or None}, {"tick": header_default})
        new_search = query if on_page and not _url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/runs" + query)
