"""The Mismatch page's own panels (see :mod:`grpolens.serve.pages.curves`): after the
``rollout_is`` family's curves, a heat map of IS weights over steps (``is_hist.parquet``) and the
IS-threshold sweep tables recompute wrote; under them, one step's raw vs applied IS weights and
the constant-offset diagnosis."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
from dash import Input, Output, dash_table, dcc, html, no_update

from grpolens.errors import UserError
from grpolens.run import format as fmt
from grpolens.serve import data, downloads, figures, inputs, urlstate
from grpolens.serve.components import (
    GRAPH_CONFIG, TABLE_STYLE, csv_anchor, error_box, fmt_value, graph, guard, rows_json, table_columns,
)
from grpolens.serve.runs import RunSet

EMPTY = "no mismatch metrics in these runs (their token shards need rollout_logp)"


def after(view) -> list:
    out = []
    runs = view.runs
    for n in view.names[:2]:
        hm = data.is_heatmap(runs.path(n))
        if hm["counts"].size:
            out.append(graph(f"mismatch:is_hist:{n}", figures.is_heatmap_figure(n, runs.names.index(n), hm),
                             downloads.link("is_hist", run=n)))
    return out + sweep_tables(runs, view.names)


def layout_extra() -> list:
    return [html.H3("One step (the step chosen on the Tokens page, or the last)"),
            html.Div(id="mismatch-step", className="panel")]


def register(app, runs: RunSet) -> None:
    @app.callback(Output("mismatch-step", "children"),
                  Input("url", "pathname"), Input("runs", "value"), Input("tok-step", "value"))
    def render_mismatch_step(pathname, names, step):
        if pathname != "/mismatch":
            return no_update
        try:
            names = inputs.run_names(runs, names)
        except UserError as e:
            return [error_box(e.message)]
        if not names:
            return []
        return guard(mismatch_step_panel, 1)(runs, names[0], step)


def sweep_tables(runs: RunSet, names: list[str]) -> list:
    """Tables of IS-threshold sweep results recompute wrote (``RUN/grpolens/*sweep*.parquet``)."""
    out = []
    for n in names[:2]:
        d = fmt.derived_dir(runs.path(n))
        for p in sorted(d.glob("*sweep*.parquet")) if d.is_dir() else []:
            try:
                df = pl.read_parquet(p).head(200)
            except Exception:  # noqa: BLE001
                continue
            out.append(html.Div([html.H4([f"{n}: {p.name} ", csv_anchor(downloads.link("sweep", run=n, file=p.name))]),
                                 dash_table.DataTable(data=rows_json(df), columns=table_columns(df),
                                                      sort_action="native", page_size=10, **TABLE_STYLE)],
                                className="panel"))
    return out


def mismatch_step_panel(runs: RunSet, name: str, step: int | None) -> list:
    """Raw vs applied IS weights of one step, its mismatch metrics and the offset check."""
    path = runs.path(name)
    step = inputs.whole(step, "step")
    steps = fmt.list_steps(path, fmt.TOKENS)
    if not steps:
        return [error_box(f"{name}: no token shards")]
    if step is None or step not in steps:
        step = steps[-1]
    d = data.is_step_detail(path, step)
    if "raw" not in d or not d.get("tokens"):
        return [error_box(f"{name} step {step}: no rollout_logp, so no IS weights")]
    m, sd = d.get("offset_mean", float("nan")), d.get("offset_sd", float("nan"))
    flag = d["metrics"].get("mismatch/constant_offset")
    if flag is not None:  # the rollout-IS family's diagnosis (median and sign agreement of δ)
        verdict = ("constant offset: the engines differ by a near-constant shift (sampling temperature or "
                   "top-p/top-k renormalisation), not by noise" if flag >= 1 else "no constant offset")
    else:
        ratio = abs(m) / sd if sd and math.isfinite(sd) and sd > 0 else float("inf")
        verdict = (f"|mean|/sd = {ratio:.3g}: " + ("a constant offset dominates" if ratio > 0.5 else
                                                   "looks like noise around 0"))
    text = [
        html.Div(f"{name}, step {step}: {d['tokens']:,} loss tokens in {d['seqs']} completions; histograms from "
                 f"{d['source']}; rollout_is config: {d['config'] or 'none'}"),
        html.Div(f"δ = log π_train − log π_rollout: mean {m:.4g}, sd {sd:.4g}; {verdict}"),
    ]
    if d["metrics"]:
        text.append(html.Div(" · ".join(f"{k} {fmt_value(v)}" for k, v in d["metrics"].items())))
    return [html.Div(text, className="summary"),
            html.Div([dcc.Graph(figure=figures.is_step_figure(d, step), config=GRAPH_CONFIG, className="graph"),
                      html.Div(csv_anchor(downloads.link("is_step", run=name, step=step)), className="graph-foot")],
                     className="graph-box")]


def hist_rows(edges, **counts) -> pl.DataFrame:
    edges = np.asarray(edges, dtype=np.float64)
    return pl.DataFrame({"log10_lo": edges[:-1], "log10_hi": edges[1:],
                         **{k: np.asarray(v) for k, v in counts.items()}})


def _is_hist_csv(runs: RunSet, search: str):
    q = urlstate.decode("tokens", search, runs.names)
    run = downloads.need(q, "run")
    hm = data.is_heatmap(runs.path(run))
    counts = np.asarray(hm["counts"])
    edges = np.asarray(hm["log10_edges"], dtype=np.float64)
    steps = np.repeat(np.asarray(hm["steps"], dtype=np.int64), max(len(edges) - 1, 0))
    df = pl.DataFrame({"step": steps, "log10_lo": np.tile(edges[:-1], len(hm["steps"])),
                       "log10_hi": np.tile(edges[1:], len(hm["steps"])),
                       "tokens": counts.reshape(-1).astype(np.int64) if counts.size else np.zeros(0, np.int64)})
    return f"{run}-is-weights-per-step", df


def _is_step_csv(runs: RunSet, search: str):
    q = urlstate.decode("tokens", search, runs.names)
    run, step = downloads.need(q, "run"), downloads.need(q, "step")
    d = data.is_step_detail(runs.path(run), step)
    if "raw" not in d:
        raise UserError(f"CSV download: {run} step {step} has no IS weights")
    return f"{run}-step{step}-is-weights", hist_rows(d["edges"], raw=d["raw"], applied=d["applied"])


def _sweep_csv(runs: RunSet, search: str):
    q = urlstate.decode("tokens", search, runs.names)
    run = downloads.need(q, "run")
    file = downloads.name(urlstate.parse_query(search), "file")
    d = fmt.derived_dir(runs.path(run))
    allowed = {p.name: p for p in d.glob("*sweep*.parquet")} if d.is_dir() else {}
    if file not in allowed:
        raise UserError(f"CSV download: {run} has no sweep table {file!r}")
    return f"{run}-{file.removesuffix('.parquet')}", pl.read_parquet(allowed[file])


CSV = {"is_hist": _is_hist_csv, "is_step": _is_step_csv, "sweep": _sweep_csv}
