"""The Runs page's callbacks (its layout is :func:`grpolens.serve.layout.runs_page`): every served run with its config as columns (sortable, filterable), and the
selected runs overlaid on any curve page (as many as are ticked, not only A and B)."""

from __future__ import annotations

from dash import Input, Output, dcc, no_update

from grpolens.serve import downloads, inputs, urlstate
from grpolens.serve.components import csv_anchor
from grpolens.serve.layout import CURVE_PAGES, PAGES, runs_table_rows
from grpolens.serve.runs import RunSet


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
    @app.callback(Output("runs-table", "data"), Output("runs-table", "columns"), Input("version", "data"),
                  prevent_initial_call=True)
    def refresh(_version):
        """--watch: new steps change the steps and last values."""
        return runs_table_rows(runs)

    # the ticked rows follow the URL, else the header's runs: sync_runs in grpolens.serve.url_callbacks

    @app.callback(Output("runs-summary", "children"), Input("runs-table", "selected_rows"),
                  Input("url", "pathname"))
    def summary(selected, pathname):
        if inputs.pathname(pathname) != "/runs":
            return no_update
        names = [runs.names[i] for i in inputs.row_indices(selected, len(runs.names))]
        return [f"{len(runs.names)} run(s). ", *overlay_links(runs, names), " ",
                csv_anchor(downloads.link("runs"), "CSV of the table")]
