"""Each page's view <-> its URL query (see :mod:`grpolens.serve.urlstate` for the keys and their checks).

One callback per page group listens to the URL and to the group's controls, and writes both (the
header's and the curve panels' here; each other page's in its module, :mod:`grpolens.serve.pages`):

* the URL changed (a loaded link, a reload, back/forward, a click that navigates): the controls
  take the query's values, the default for every key the query lacks;
* a control changed: the URL of the page on screen is rewritten (a new browser history entry),
  unless it already says the same.

Dash lets one callback have a property as both input and output without calling itself again, so
the two directions cannot chase each other. Across callbacks they could: a callback that sets a
control from the URL and another that writes the URL from that control form a loop (Dash breaks it
at run time and warns in debug mode). So each control is read from and written to the URL by one
callback only: :func:`sync_header` owns the header's controls (runs, smoothing, step range, filter,
y toggles) on every page, including the step slider's bounds, and the copies of the header's values
in other pages' URLs, which each such page's hooks write and read (``Page.header_search``,
``Page.header_runs``: the Compare page's step range, the Tokens and Completions pages' runs); the
other callbacks read those controls as ``State`` only. The navigation links are rewritten too, so going from Policy to
Overview keeps the runs, smoothing and toggles in the URL.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from dash import ALL, Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from grpolens.serve import data, inputs, pages, urlstate
from grpolens.serve.layout import default_runs
from grpolens.serve.pages.completions import completions_search  # noqa: F401 - re-exported
from grpolens.serve.pages.tokens import tokens_search  # noqa: F401 - re-exported
from grpolens.serve.runs import RunSet
from grpolens.serve.urlsync import (  # noqa: F401
    Header, has_step_range, lenient, range_list, range_state, same, url_triggered,
)

_url_triggered, _same, _lenient, _range_list = url_triggered, same, lenient, range_list


def range_value(search: str | None, pathname: str | None, lo: int, hi: int) -> list[int] | None:
    """The step range the URL asks for, clamped into ``[lo, hi]`` (None: the URL's page has none)."""
    group = urlstate.GROUP_OF_PATH.get(pathname or "/")
    if not has_step_range(group):
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


def step_slider(runs: RunSet, names) -> tuple[int, int, dict]:
    """The step slider's bounds over the selected runs' steps, and its marks."""
    lo, hi = data.step_bounds([data.series(runs.path(n)) for n in names]) if names else (0, 1)
    hi = max(hi, lo + 1)
    return lo, hi, {int(v): str(int(v)) for v in np.linspace(lo, hi, 5).round()}


def register_url_callbacks(app, runs: RunSet) -> None:
    """The header's controls and the curve panels' own log y boxes <-> the URL (each page's own
    view is its module's: :mod:`grpolens.serve.pages`)."""
    names = runs.names
    curve_pages = pages.curve_pages()
    curve_paths = list(curve_pages)
    header_default = default_runs(runs)

    def _runs_or(value, default):
        return _lenient(lambda v: inputs.run_names(runs, v), value, default)

    # -- The header's controls, on every page ------------------------------------------------------
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Output("runs", "value"), Output("smoothing", "value"), Output("metric-filter", "value"),
                  Output("y-scale", "value"), Output("show-baseline", "value"),
                  Output("range", "min"), Output("range", "max"), Output("range", "value"), Output("range", "marks"),
                  *[Output(f"nav-{curve_pages[p]}", "href") for p in curve_paths],
                  Input("url", "pathname"), Input("url", "search"),
                  Input("runs", "value"), Input("smoothing", "value"), Input("range", "value"),
                  Input("metric-filter", "value"), Input("y-scale", "value"), Input("show-baseline", "value"),
                  Input("version", "data"),
                  State("range", "min"), State("range", "max"),
                  prevent_initial_call="initial_duplicate")
    def sync_header(pathname, search, sel, smoothing, rng, pattern, y_scale, baseline, _version, old_lo, old_hi):
        """The header's controls <-> the URL of whichever page is on screen (another page's copy of
        them through its own hooks), and the step slider's bounds (the selected runs' steps) and value
        (the URL's ``from``/``to`` where the page has them)."""
        path = inputs.pathname(pathname)
        group = urlstate.GROUP_OF_PATH.get(path)
        page = pages.by_path(path)
        # what the controls say, each bounded (a bad value is left out of the URLs: the page says why)
        sel = _runs_or(sel, None)
        smoothing = _lenient(inputs.smoothing, smoothing, 0.0)
        pattern = _lenient(lambda v: inputs.text(v, "metric filter"), pattern, None)
        y_scale = _lenient(lambda v: inputs.choices(v, urlstate.Y_OPTIONS, "y scale"), y_scale, [])
        baseline = _lenient(lambda v: inputs.choices(v, ("on",), "baseline"), baseline, [])
        rng = _lenient(_range_list, rng, None)
        old_lo, old_hi = inputs.whole_or_none(old_lo, "step"), inputs.whole_or_none(old_hi, "step")
        fired = {t["prop_id"] for t in ctx.triggered}
        # (on the first call every input counts as fired, the URL among them)
        from_url = _url_triggered() or bool(fired & {"url.pathname", "url.search"})
        controls: list[Any] = [no_update] * 5
        if from_url and group == "curves":
            q = urlstate.decode("curves", search, names)
            want = [q.get("runs", header_default), q.get("smooth", 0.0), q.get("filter", ""),
                    q.get("y", []), ["on"] if runs.baseline and q.get("baseline", "on") == "on" else []]
            controls = [_same(w, c) for w, c in zip(want, (sel, smoothing, pattern or "", y_scale or [],
                                                            baseline or []))]
            sel, smoothing, pattern, y_scale, baseline = want
        elif from_url and page is not None and page.header_runs is not None:
            url_runs = page.header_runs(runs, search)
            if url_runs is not None:
                controls[0] = _same(url_runs, sel)
                sel = url_runs

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
        if from_url and has_step_range(group):
            # until the slider follows, the URL's bounds are the view's
            bounds = {k: v for k, v in urlstate.decode(group, search, names).items() if k in ("from", "to")}

        nav_query = curves_search(runs, sel, smoothing, bounds, pattern, y_scale, baseline)
        new_search: Any = no_update
        if not from_url:
            if group == "curves":
                kept = urlstate.decode("curves", search, names)  # the panels' own log y boxes stay
                query = curves_search(runs, sel, smoothing, bounds, pattern, y_scale, baseline,
                                      {k: kept[k] for k in ("log", "lin") if k in kept})
            elif page is not None and page.header_search is not None:
                query = page.header_search(runs, search, Header(sel, smoothing, bounds, pattern, y_scale, baseline))
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
        page = curve_pages.get(inputs.pathname(pathname))
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
