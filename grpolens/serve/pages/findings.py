"""The Findings page: ``grpolens doctor``'s findings for a run, each with links to its steps'
curves and to the Why panel of its worst step; listed first in the navigation bar when a run has
a warning or critical finding.

Doctor reads the run's recomputed metrics (the file ``serve`` recomputed before serving, or
``--watch`` after a change): the page never recomputes. A run whose metrics are stale (served
with ``--no-recompute``) gets one line saying so. Reports are cached per run and its files'
version, so a page load costs a dictionary lookup once the run has been diagnosed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
from dash import Input, Output, dash_table, dcc, html, no_update

from grpolens.errors import RunFormatError, UserError
from grpolens.run import format as fmt
from grpolens.serve import data, downloads, urlstate
from grpolens.serve.components import (
    TABLE_STYLE, csv_anchor, error_box, fmt_value, guard, labelled, rows_json, run_options, table_columns,
)
from grpolens.serve.pages import Page
from grpolens.serve.runs import RunSet
from grpolens.serve.urlsync import same, url_triggered

KEYS = ("run",)
#: Severities that put the page first in the navigation bar.
LEADING = ("warning", "critical")


def report(path: Path, explain: bool = True) -> dict | None:
    """``diagnose(run).to_dict()`` (with ``worst``, the worst severity), cached per run version;
    None when the run's recomputed metrics are missing or stale (reading them would mean a
    recompute) or the run is on object storage. Doctor gets the metrics file found up to date here
    (one check, one read): a step landing under ``--watch`` between a check and doctor's own would
    otherwise have it recompute from the page."""
    from grpolens.analysis import fresh
    from grpolens.serve.data.memo import _RUN_MEMO, run_key, run_version

    up = None if fmt.is_remote_run(path) else fresh.fresh_outputs(path, None, "grpolens", None, False)
    if up is None:
        return None

    def make() -> dict:
        from grpolens.analysis.doctor import diagnose

        r = diagnose(path, explain=explain, metrics=pl.read_parquet(Path(up.out_dir) / "metrics.parquet"))
        return {**r.to_dict(), "worst": r.worst_severity()}

    return _RUN_MEMO.get(("doctor", run_key(path), run_version(path), explain), make)


def worst(runs: RunSet) -> dict[str, str | None]:
    """Run -> its worst severity (None: nothing found, or not diagnosed), without explanations."""
    out: dict[str, str | None] = {}
    for n in runs.run_names:
        try:
            r = report(runs.path(n), explain=False)
        except (UserError, RunFormatError):
            r = None
        out[n] = r["worst"] if r else None
    return out


def leads(runs: RunSet) -> bool:
    """Whether the page goes first: some run has a warning or critical finding."""
    return any(w in LEADING for w in worst(runs).values())


def default_run(runs: RunSet) -> str:
    """The run the page opens on: the first with the worst severity."""
    w = worst(runs)
    rank = {None: 0, "info": 1, "warning": 2, "critical": 3}
    return max(runs.run_names, key=lambda n: rank.get(w.get(n), 0))


def curve_page_of(metric: str) -> str:
    """The path of the curve page that draws ``metric`` (its family's page)."""
    fam = data.metric_families().get(metric)
    for page, fams in data.page_families().items():
        if fam is not None and any(fam == f or fam.startswith(f + "/") for f in fams):
            return f"/{page}"
    return "/"


def finding_card(run: str, f: dict) -> html.Div:
    steps = f.get("steps") or []
    span = "" if not steps else f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}"
    ev = f.get("evidence") or {}
    why = ev.get("explain") or {}
    worst_step = why.get("step", steps[0] if steps else None)
    links: list = [dcc.Link(f"{f['metric']} curve", className="find-link",
                            href=curve_page_of(f["metric"]) + urlstate.encode("curves", {"runs": [run],
                                                                                        "filter": f["metric"]}))]
    if worst_step is not None:
        links += [" · ", dcc.Link(f"why, at step {worst_step}", className="find-link find-why",
                                  href="/tokens" + urlstate.encode("tokens", {"run": run, "step": worst_step,
                                                                             "why": f["metric"]}))]
    numbers = " · ".join(f"{k} {fmt_value(v)}" for k, v in ev.items()
                         if k != "explain" and isinstance(v, (int, float, str)) and not isinstance(v, bool))
    parts = [html.Div([html.Span(f["severity"], className=f"sev sev-{f['severity']}"),
                       html.Span(f" {f['id']} ", className="find-id"), html.Span(span, className="hint")]),
             html.Div(f["summary"], className="find-summary"),
             html.Div(links)]
    if why.get("headline") or why.get("note"):
        parts.append(html.Div(why.get("headline") or why.get("note"), className="hint"))
    if numbers:
        parts.append(html.Div(numbers, className="hint"))
    if f.get("suggestion"):
        parts.append(html.Div(["suggestion: ", f["suggestion"]], className="find-suggestion"))
    return html.Div(parts, className=f"panel finding finding-{f['severity']}")


def findings_view(runs: RunSet, run: Any) -> tuple[list, list, list, list]:
    """``(summary, cards, detector rows, detector columns)`` of ``run``."""
    path = runs.path(run)
    r = report(path)
    if r is None:
        why = ("its metrics are on object storage" if fmt.is_remote_run(path) else
               f"its recomputed metrics are missing or stale (served with --no-recompute?): run "
               f"`grpolens recompute {path}` and reload")
        return [error_box(f"{run}: no diagnosis: {why}")], [], [], []
    n = len(r["findings"])
    summary = [f"{run}: {n} finding(s)" + (f", the worst {r['worst']}" if r["worst"] else "") + "; "
               f"{len(r['detectors'])} detectors ran. ",
               csv_anchor(downloads.link("findings", run=run), "CSV of the findings")]
    cards = [finding_card(run, f) for f in r["findings"]] or [html.Div("no findings", className="hint")]
    det = pl.DataFrame(r["detectors"], schema={"id": pl.String, "status": pl.String, "why": pl.String})
    det = det.rename({"id": "detector"})  # a DataTable's "id" column is its row ids, not shown
    return summary, cards, rows_json(det), table_columns(det)


def layout(runs: RunSet) -> html.Div:
    return html.Div([
        html.Div([labelled("run", dcc.Dropdown(id="find-run", options=run_options(runs, runs.run_names),
                                                value=default_run(runs), clearable=False))], className="controls"),
        html.Div(id="find-summary", className="summary"),
        html.Div(id="find-list"),
        html.H3("Detectors"),
        dash_table.DataTable(id="find-detectors", data=[], columns=[], sort_action="native", page_size=20,
                             style_cell_conditional=[{"if": {"column_id": c}, "textAlign": "left"}
                                                     for c in ("detector", "status", "why")], **TABLE_STYLE),
    ], id="page-findings", className="page")


def register(app, runs: RunSet) -> None:
    first = default_run(runs)

    @app.callback(Output("find-summary", "children"), Output("find-list", "children"),
                  Output("find-detectors", "data"), Output("find-detectors", "columns"),
                  Input("url", "pathname"), Input("find-run", "value"), Input("version", "data"))
    def render(pathname, run, _version):
        if pathname != "/findings":
            return no_update, no_update, no_update, no_update
        out = guard(findings_view, 4)(runs, run)
        return out if out[1] is not no_update else (out[0], [], [], [])

    # the view <-> the URL (see grpolens.serve.url_callbacks)
    @app.callback(Output("url", "search", allow_duplicate=True), Output("find-run", "value"),
                  Output("nav-findings", "href"),
                  Input("url", "pathname"), Input("url", "search"), Input("find-run", "value"),
                  prevent_initial_call="initial_duplicate")
    def sync_findings(pathname, search, run):
        on_page = pathname == "/findings"
        run = run if isinstance(run, str) and run in runs.run_names else None
        out: Any = no_update
        if url_triggered() and on_page:
            want = urlstate.decode("findings", search, runs.run_names).get("run", first)
            out, run = same(want, run), want
        query = urlstate.encode("findings", {"run": run}, {"run": first})
        new_search = query if on_page and not url_triggered() and query != (search or "") else no_update
        return new_search, out, "/findings" + query


def _findings_csv(runs: RunSet, search: str):
    q = urlstate.decode("findings", search, runs.run_names)
    run = downloads.need(q, "run")
    r = report(runs.path(run))
    if r is None:
        raise UserError(f"CSV download: {run} has no diagnosis (its recomputed metrics are missing or stale)")
    rows = [{"id": f["id"], "severity": f["severity"], "first_step": (f["steps"] or [None])[0],
             "last_step": (f["steps"] or [None])[-1], "metric": f["metric"], "summary": f["summary"],
             "suggestion": f["suggestion"], "why": (f["evidence"].get("explain") or {}).get("headline")}
            for f in r["findings"]]
    schema = {"id": pl.String, "severity": pl.String, "first_step": pl.Int64, "last_step": pl.Int64,
              "metric": pl.String, "summary": pl.String, "suggestion": pl.String, "why": pl.String}
    return f"{run}-findings", pl.DataFrame(rows, schema=schema)


def pages() -> list[Page]:
    return [Page("/findings", "Findings", "findings", KEYS, layout, register, csv={"findings": _findings_csv},
                 lead=leads)]
