"""The Runs page: every served run with its config as columns (sortable, filterable), and the
selected runs overlaid on any curve page (as many as are ticked, not only A and B)."""

from __future__ import annotations

from dash import Input, Output, State, dash_table, dcc, html, no_update
from dash.exceptions import PreventUpdate

from grpolens.serve import downloads, urlstate
from grpolens.serve.data.runtable import runs_table
from grpolens.serve.layout import CURVE_PAGES, PAGES, TABLE_STYLE
from grpolens.serve.runs import RunSet


def table(runs: RunSet) -> tuple[list[dict], list[dict]]:
    from grpolens.serve.callbacks import rows_json, table_columns

    df = runs_table(runs.runs)
    return rows_json(df), table_columns(df)


def layout(runs: RunSet) -> html.Div:
    # filled now, not by a callback, so that a link's filter finds its columns when the page opens
    rows, columns = table(runs)
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
    labels = dict(PAGES)
    out: list = [f"{len(names)} run(s) ticked: overlay on "]
    for i, path in enumerate(CURVE_PAGES):
        out += [" · " if i else "", dcc.Link(labels[path], href=path + query, id=f"runs-overlay-{CURVE_PAGES[path]}")]
    if len(names) >= 2:
        out += [" · ", dcc.Link("compare the first two", href="/compare" + urlstate.encode(
            "compare", {"a": names[0], "b": names[1]}))]
    return out


def register(app, runs: RunSet) -> None:
    from grpolens.serve.callbacks import csv_anchor

    @app.callback(Output("runs-table", "data"), Output("runs-table", "columns"), Input("version", "data"),
                  prevent_initial_call=True)
    def refresh(_version):
        """--watch: new steps change the steps and last values."""
        return table(runs)

    @app.callback(Output("runs-table", "selected_rows"), Input("url", "pathname"), State("runs", "value"))
    def tick_the_header_runs(pathname, names):
        """On opening the page, the runs the header has selected are ticked."""
        if pathname != "/runs":
            raise PreventUpdate
        return [runs.names.index(n) for n in (names or []) if n in runs.runs]

    @app.callback(Output("runs-summary", "children"), Input("runs-table", "selected_rows"),
                  Input("url", "pathname"))
    def summary(selected, pathname):
        if pathname != "/runs":
            return no_update
        names = [runs.names[i] for i in sorted(selected or []) if isinstance(i, int) and 0 <= i < len(runs.names)]
        return [f"{len(runs.names)} run(s). ", *overlay_links(runs, names), " ",
                csv_anchor(downloads.link("runs"), "CSV of the table")]
