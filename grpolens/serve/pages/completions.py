"""The Completions page: one step's completions, texts first, paged, sorted and filtered on the
server (group, reward rank, truncated, vetoed, and the table's own filter row); a row opens the
completion on the Tokens page."""

from __future__ import annotations

import math
from typing import Any

import polars as pl
from dash import Input, Output, State, ctx, dash_table, dcc, html, no_update
from dash.exceptions import PreventUpdate

from grpolens.errors import RunFormatError, UserError
from grpolens.serve import data, downloads, inputs, urlstate
from grpolens.serve.components import (
    TABLE_STYLE, csv_anchor, error_box, labelled, rows_json, run_options, table_columns,
)
from grpolens.serve.pages import Page
from grpolens.serve.pages.tokens import tokens_search
from grpolens.serve.runs import RunSet, default_step
from grpolens.serve.urlsync import header_runs_hooks, lenient, same, url_triggered

KEYS = ("run", "step", "group", "rank", "truncated", "vetoed", "page", "sort", "where", "runs")
COMPLETIONS_DEFAULTS = {"truncated": "any", "vetoed": "any", "page": 0}


def completions_search(run, step, group=None, rank=None, truncated="any", vetoed="any", page=0, sort_by=None,
                       where=None, header_runs=None, default_header=None) -> str:
    state = {"run": run, "step": step, "group": group, "rank": rank, "truncated": truncated, "vetoed": vetoed,
             "page": page, "sort": [s for s in (sort_by or []) if s.get("column_id")], "where": where,
             "runs": list(header_runs) if header_runs else None}
    return urlstate.encode("completions", state, {**COMPLETIONS_DEFAULTS, "runs": default_header})


def _yes_no(v: str | None) -> bool | None:
    return {"yes": True, "no": False}.get(inputs.choice(v, urlstate.YES_NO, "any"))


def completions_table(runs: RunSet, name: str, step: int | None, page: int, page_size: int,
                      sort_by: list | None, filter_query: str | None, group=None, max_rank=None,
                      truncated: str | None = "any", vetoed: str | None = "any"):
    """``(rows, columns, page_count, summary)`` for one page of the completions table."""
    path = runs.path(name)
    step = inputs.whole(step, "step")
    if step is None:
        return [], [], 1, error_box("pick a step")
    page_size = inputs.clamped(page_size, "page size", 20)
    page = inputs.whole(page, "page") or 0
    group, max_rank = inputs.whole(group, "group"), inputs.whole(max_rank, "rank")
    sort_by, filter_query = inputs.sort_by(sort_by), inputs.filter_query(filter_query)
    truncated, vetoed = inputs.choice(truncated, urlstate.YES_NO, "any"), inputs.choice(vetoed, urlstate.YES_NO, "any")
    rows, total = data.completions_page(path, step, page, page_size, sort_by, filter_query,
                                        group=group, truncated=_yes_no(truncated), vetoed=_yes_no(vetoed),
                                        max_rank=max_rank)
    if rows.height == 0 and total == 0 and data.sequence_table(path, step).height == 0:
        return [], [], 1, error_box(f"{name}: no completions at step {step}")
    rows = rows.with_columns(pl.col("sample_id").alias("id")) if "sample_id" in rows.columns else rows
    n_pages = max(1, math.ceil(total / page_size))
    every = completions_search(name, step, group, max_rank, truncated, vetoed, 0, sort_by, filter_query)
    summary = html.Span([f"{name}, step {step}: {total} completion(s) match; page {page + 1} of {n_pages} ",
                         csv_anchor(downloads.PREFIX + "completions" + every, "CSV of all matching rows")])
    return rows_json(rows), table_columns(rows), n_pages, summary


def layout(runs: RunSet) -> html.Div:
    bool_opts = [{"label": "any", "value": "any"}, {"label": "yes", "value": "yes"}, {"label": "no", "value": "no"}]
    return html.Div([
        html.Div([
            labelled("run", dcc.Dropdown(id="comp-run", options=run_options(runs, runs.run_names), value=runs.run_names[0],
                                          clearable=False)),
            labelled("step", dcc.Input(id="comp-step", type="number", min=0, step=1, debounce=True)),
            labelled("group", dcc.Input(id="comp-group", type="number", step=1, debounce=True)),
            labelled("reward rank ≤", dcc.Input(id="comp-rank", type="number", min=1, step=1, debounce=True)),
            labelled("truncated", dcc.Dropdown(id="comp-trunc", options=bool_opts, value="any", clearable=False)),
            labelled("vetoed", dcc.Dropdown(id="comp-veto", options=bool_opts, value="any", clearable=False)),
        ], className="controls"),
        html.Div(id="comp-summary", className="summary"),
        dash_table.DataTable(
            id="comp-table", data=[], columns=[], page_action="custom", page_current=0, page_size=20,
            sort_action="custom", sort_mode="multi", sort_by=[], filter_action="custom", filter_query="",
            **TABLE_STYLE),
        html.Div("click a row to open the completion", className="hint"),
    ], id="page-completions", className="page")


def register(app, runs: RunSet) -> None:
    from grpolens.serve.layout import default_runs

    names = runs.names
    header_default = default_runs(runs)

    def runs_or(value, default):
        return lenient(lambda v: inputs.run_names(runs, v), value, default)

    def run_or(value, default):
        return value if isinstance(value, str) and value in runs.runs else default

    @app.callback(Output("comp-table", "data"), Output("comp-table", "columns"), Output("comp-table", "page_count"),
                  Output("comp-summary", "children"),
                  Input("url", "pathname"), Input("comp-run", "value"), Input("comp-step", "value"),
                  Input("comp-table", "page_current"), Input("comp-table", "page_size"),
                  Input("comp-table", "sort_by"), Input("comp-table", "filter_query"),
                  Input("comp-group", "value"), Input("comp-rank", "value"), Input("comp-trunc", "value"),
                  Input("comp-veto", "value"))
    def render_completions(pathname, name, step, page, size, sort_by, fq, group, rank, trunc, veto):
        if pathname != "/completions":
            raise PreventUpdate
        try:
            return completions_table(runs, name, step, page, size, sort_by, fq, group, rank, trunc, veto)
        except (UserError, RunFormatError) as e:
            return no_update, no_update, no_update, error_box(e.message if isinstance(e, UserError) else str(e))

    @app.callback(Output("url", "pathname", allow_duplicate=True), Output("url", "search", allow_duplicate=True),
                  Input("comp-table", "active_cell"), State("comp-run", "value"), State("comp-step", "value"),
                  State("tok-by", "value"), State("tok-k", "value"), State("tok-color", "value"), State("runs", "value"),
                  prevent_initial_call=True)
    def on_completion_row(cell, name, step, by, k, color, header_runs):
        sample = inputs.whole_or_none(cell.get("row_id"), "sample") if isinstance(cell, dict) else None
        if sample is None or not isinstance(name, str) or name not in runs.runs:
            raise PreventUpdate
        return "/tokens", tokens_search(name, inputs.whole_or_none(step, "step"), sample, None,
                                        inputs.choice(by, data.RANK_BY, "kl"), inputs.clamped(k, "top", 50),
                                        inputs.choice(color, data.COLOR_BY, "kl"), inputs.run_names_or_none(runs, header_runs),
                                        default_runs(runs))

    # the view <-> the URL (see grpolens.serve.url_callbacks)
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
        run = run_or(run, None)
        step, group = inputs.whole_or_none(step, "step"), inputs.whole_or_none(group, "group")
        rank, page = inputs.whole_or_none(rank, "rank"), inputs.whole_or_none(page, "page")
        trunc, veto = inputs.choice(trunc, urlstate.YES_NO, "any"), inputs.choice(veto, urlstate.YES_NO, "any")
        sort_by = lenient(inputs.sort_by, sort_by, [])
        where = lenient(inputs.filter_query, where, None)
        header_runs = runs_or(header_runs, None)
        cur = (run, step, group, rank, trunc, veto, page, sort_by or [], where or "")
        outs: list[Any] = [no_update] * 9
        if url_triggered():
            if on_page or step is None:
                q = urlstate.decode("completions", search if on_page else "", names)
                header_runs = q.get("runs", header_runs)
                r = runs.run_of(q.get("run", runs.run_names[0]))
                want = (r, q["step"] if "step" in q else default_step(runs, r), q.get("group"), q.get("rank"),
                        q.get("truncated", "any"), q.get("vetoed", "any"), q.get("page", 0), q.get("sort", []),
                        q.get("where", ""))
                outs = [same(w, c) for w, c in zip(want, cur)]
                run, step, group, rank, trunc, veto, page, sort_by, where = want
        elif ctx.triggered_id in filters or ctx.triggered_id == "comp-table" and \
                any(t["prop_id"] == "comp-table.filter_query" for t in ctx.triggered):
            if page:  # a new selection starts at its first page
                page, outs[6] = 0, 0
        query = completions_search(run, step, group, rank, trunc, veto, page or 0, sort_by, where, header_runs,
                                   header_default)
        new_search = query if on_page and not url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/completions" + query)



def _completions_csv(runs: RunSet, search: str):
    q = urlstate.decode("completions", search, runs.names)
    run, step = downloads.need(q, "run"), downloads.need(q, "step")
    yes_no = {"yes": True, "no": False}
    rows, _ = data.completions_page(runs.path(run), step, 0, 2**31, q.get("sort"), q.get("where"),
                                    group=q.get("group"), truncated=yes_no.get(q.get("truncated", "any")),
                                    vetoed=yes_no.get(q.get("vetoed", "any")), max_rank=q.get("rank"))
    return f"{run}-step{step}-completions", rows


def pages() -> list[Page]:
    header_search, header_runs = header_runs_hooks("completions", COMPLETIONS_DEFAULTS)
    return [Page("/completions", "Completions", "completions", KEYS, layout, register,
                 csv={"completions": _completions_csv}, header_search=header_search, header_runs=header_runs)]
