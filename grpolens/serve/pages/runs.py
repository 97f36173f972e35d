"""The Runs page: every served run, one row each, with its config as columns (sortable,
filterable), and the ticked runs overlaid on any curve page (as many as are ticked)."""

from __future__ import annotations

from typing import Any

from dash import Input, Output, State, dash_table, dcc, html, no_update

from grpolens.serve import downloads, inputs, urlstate
from grpolens.serve.components import TABLE_STYLE, csv_anchor, rows_json, table_columns
from grpolens.serve.data.runtable import runs_table
from grpolens.serve.pages import Page, all_pages
from grpolens.serve.runs import RunSet
from grpolens.serve.urlsync import lenient, same, url_triggered

KEYS = ("sort", "where", "tick")


def runs_table_rows(runs: RunSet) -> tuple[list[dict], list[dict]]:
    """Rows and columns of the Runs page's table."""
    df = runs_table(runs.runs)
    return rows_json(df), table_columns(df)


def layout(runs: RunSet) -> html.Div:
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


def overlay_links(runs: RunSet, names: list[str]) -> list:
    """"Overlay on Overview · Policy · …" for the ticked runs (each a link carrying them in its URL)."""
    from grpolens.serve.layout import default_runs

    if not names:
        return ["tick runs to overlay them"]
    query = urlstate.encode("curves", {"runs": names}, {"runs": default_runs(runs)})
    out: list = [f"{len(names)} run(s) ticked: overlay on "]
    for i, page in enumerate(p for p in all_pages() if p.curves):
        out += [" · " if i else "", dcc.Link(page.label, href=page.path + query, id=f"runs-overlay-{page.curves}")]
    if len(names) >= 2:
        out += [" · ", dcc.Link("compare the first two", href="/compare" + urlstate.encode(
            "compare", {"a": names[0], "b": names[1]}))]
    return out


def register(app, runs: RunSet) -> None:
    from grpolens.serve.layout import default_runs

    names = runs.names
    header_default = default_runs(runs)

    def runs_or(value, default):
        return lenient(lambda v: inputs.run_names(runs, v), value, default)

    @app.callback(Output("runs-table", "data"), Output("runs-table", "columns"), Input("version", "data"),
                  prevent_initial_call=True)
    def refresh(_version):
        """--watch: new steps change the steps and last values."""
        return runs_table_rows(runs)

    # the ticked rows follow the URL, else the header's runs: sync_runs below

    @app.callback(Output("runs-summary", "children"), Input("runs-table", "selected_rows"),
                  Input("url", "pathname"))
    def summary(selected, pathname):
        if inputs.pathname(pathname) != "/runs":
            return no_update
        names = [runs.names[i] for i in inputs.row_indices(selected, len(runs.names))]
        return [f"{len(runs.names)} run(s). ", *overlay_links(runs, names), " ",
                csv_anchor(downloads.link("runs"), "CSV of the table")]

    # the view <-> the URL (see grpolens.serve.url_callbacks)
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
        sort_by = lenient(inputs.sort_by, sort_by, [])
        where = lenient(lambda v: inputs.text(v, "table filter"), where, None)
        header_runs = runs_or(header_runs, None)
        ticked = [names[int(i)] for i in selected]
        if url_triggered() and on_page:
            q = urlstate.decode("runs", search, names)
            want = (q.get("sort", []), q.get("where", ""),
                    [names.index(n) for n in q.get("tick", header_runs or []) if n in names])
            outs = [same(w, c) for w, c in zip(want, (sort_by or [], where or "", sorted(selected or [])))]
            sort_by, where = want[:2]
            ticked = [names[i] for i in sorted(want[2])]
        query = urlstate.encode("runs", {"sort": [s for s in (sort_by or []) if s.get("column_id")], "where": where,
                                         "tick": ticked or None}, {"tick": header_default})
        new_search = query if on_page and not url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/runs" + query)


def _runs_csv(runs: RunSet, search: str):
    return "runs", runs_table(runs.runs)


def pages() -> list[Page]:
    return [Page("/runs", "Runs", "runs", KEYS, layout, register, csv={"runs": _runs_csv})]
