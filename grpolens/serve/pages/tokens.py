"""The Tokens page: one step's top-K tokens by a score across all ranks (a sortable table), and one
completion with every token coloured by a score, its text, and its score along the positions."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl
from dash import Input, Output, State, ctx, dash_table, dcc, html, no_update
from dash.exceptions import PreventUpdate

from grpolens.errors import UserError
from grpolens.run import format as fmt
from grpolens.serve import data, downloads, figures, inputs, urlstate
from grpolens.serve.components import (
    GRAPH_CONFIG, SCORE_LABELS, TABLE_STYLE, csv_anchor, error_box, fmt_value, guard, labelled, rows_json,
    run_options, table_columns,
)
from grpolens.serve.pages import Page
from grpolens.serve.pages.why import why_panel
from grpolens.serve.runs import RunSet, default_step
from grpolens.serve.urlsync import header_runs_hooks, same, url_triggered

#: Most tokens drawn in the completion view (the rest is summarised).
MAX_TOKENS_SHOWN = 4096
KEYS = ("run", "step", "sample", "pos", "by", "k", "color", "why", "runs")
TOKENS_DEFAULTS = {"by": "kl", "k": 50, "color": "kl"}
TOKEN_CHOICES = {"by": data.RANK_BY, "color": data.COLOR_BY}


def tokens_search(run, step, sample=None, pos=None, by="kl", k=50, color="kl", header_runs=None,
                  default_header=None, why=None) -> str:
    """``header_runs``: the header's selection, written when it is not ``default_header``; ``why``:
    the metric the Why panel explains."""
    state = {"run": run, "step": step, "sample": sample, "pos": pos, "by": by, "k": k, "color": color, "why": why,
             "runs": list(header_runs) if header_runs else None}
    return urlstate.encode("tokens", state, {**TOKENS_DEFAULTS, "runs": default_header})


def top_tokens_view(runs: RunSet, name: str, step: int | None, by: str, k: int | None):
    """``(summary, rows, columns)`` of the top-K tokens table."""
    path = runs.path(name)
    step = inputs.whole(step, "step")
    if step is None:
        return error_box("pick a step"), [], []
    by = inputs.choice(by, data.RANK_BY, "kl")
    k = inputs.clamped(k, "top", 50)
    t = data.step_tokens(path, step)
    if t.height == 0:
        steps = fmt.list_steps(path, fmt.TOKENS)
        span = f"{steps[0]}..{steps[-1]}" if steps else "none"
        return error_box(f"{name}: no tokens at step {step} (token steps: {span})"), [], []
    top = data.top_tokens(path, step, by, k)
    n_seq = t["sample_id"].n_unique()
    null_scores = t.filter(pl.col("mask"))[by if by != "ratio" else "log_ratio"].null_count()
    summary = html.Div([
        html.Span(f"{name}, step {step}: {t.height:,} tokens in {n_seq} completions from "
                  f"{t['rank'].n_unique()} rank(s). Top {top.height} by {SCORE_LABELS[by]} "
                  f"({data.SCORES[by]}), loss-masked-in tokens only"
                  + (f"; {null_scores} token(s) have no finite score" if null_scores else "") + ". "),
        dcc.Link("all completions of this step →",
                 href="/completions" + urlstate.encode("completions", {"run": name, "step": step})), " ",
        csv_anchor(downloads.link("tokens", run=name, step=step, by=by, k=k), "CSV of the table"),
    ])
    top = top.with_columns((pl.col("sample_id").cast(pl.String) + ":" + pl.col("pos").cast(pl.String)).alias("id"))
    return summary, rows_json(top), table_columns(top)


def _color(value: float | None, scale: float, diverging: bool) -> str:
    if value is None or not math.isfinite(value):
        return "#eeeeee"
    x = max(-1.0, min(1.0, value / scale)) if scale > 0 else 0.0
    if diverging:
        return f"rgba(214,39,40,{0.85 * x:.3f})" if x >= 0 else f"rgba(31,119,180,{-0.85 * x:.3f})"
    return f"rgba(214,39,40,{0.85 * max(x, 0.0):.3f})"


def completion_view(runs: RunSet, name: str, step: int | None, sample_id: int | None, color_by: str,
                    focus_pos: int | None = None, by: str = "kl") -> list:
    """One completion: its sample row, prompt and completion text (as text), and every token
    coloured by ``color_by`` with the token's numbers on hover."""
    path = runs.path(name)
    step, sample_id = inputs.whole(step, "step"), inputs.whole(sample_id, "sample")
    focus_pos = inputs.whole_or_none(focus_pos, "pos")
    if step is None:
        return [error_box("pick a step")]
    if sample_id is None:
        top = data.top_tokens(path, step, inputs.choice(by, data.RANK_BY, "kl"), 1)
        if top.height == 0:
            return [error_box(f"{name}: no tokens at step {step}")]
        sample_id, focus_pos = int(top["sample_id"][0]), int(top["pos"][0])
    c = data.completion(path, step, sample_id)
    if c is None:
        return [error_box(f"{name}: sample {sample_id} is not in step {step}; pick one from the table above")]
    color_by = inputs.choice(color_by, data.COLOR_BY, "kl")
    s, toks = c["sample"], c["tokens"]
    info = [f"sample {sample_id}"] + [f"{k} {fmt_value(s[k])}" for k in
                                      ("group_id", "rank", "reward", "advantage", "completion_len", "truncated")
                                      if k in s]
    info += [f"{k} {fmt_value(v)}" for k, v in s.items() if k.startswith(fmt.REWARD_PREFIX)]
    parts: list = [html.Div(" · ".join(info), className="summary")]
    if s.get("prompt") is not None:
        parts += [html.Div("prompt", className="ctl-label"), html.Pre(str(s["prompt"]), className="text prompt")]
    if s.get("completion") is not None:
        parts += [html.Div("completion text", className="ctl-label"),
                  html.Pre(str(s["completion"]), className="text", id="completion-text")]
    if toks.height:
        col = data.DIVERGING.get(color_by, color_by)
        diverging = color_by in data.DIVERGING
        scale = data.score_scale(path, step, color_by)
        decode, source = data.decoder(path)
        shown = toks.head(MAX_TOKENS_SHOWN)
        spans = []
        for r in shown.iter_rows(named=True):
            title = (f"pos {r['pos']} · token {fmt_value(r['token_id'])} · mask {r['mask']}\n"
                     f"logp {fmt_value(r['logp'])} old {fmt_value(r['old_logp'])} ref {fmt_value(r['ref_logp'])} "
                     f"rollout {fmt_value(r['rollout_logp'])}\n"
                     f"ratio {fmt_value(r['ratio'])} KL {fmt_value(r['kl'])} |Δ| {fmt_value(r['mismatch'])} "
                     f"IS w {fmt_value(r['is_weight'])}\nentropy {fmt_value(r['entropy'])} advantage {fmt_value(r['advantage'])}")
            cls = "tok" + ("" if r["mask"] else " masked") + (" focus" if r["pos"] == focus_pos else "")
            label = "·" if r["token_id"] is None else decode(int(r["token_id"]))
            spans.append(html.Span(label, title=title, className=cls,
                                   style={"backgroundColor": _color(r[col], scale, diverging)}))
        more = toks.height - shown.height
        from grpolens.run.decode import describe

        how = describe(source)
        legend = (f"{toks.height} tokens ({how}), coloured by {SCORE_LABELS[color_by]}"
                  f" -- {'blue < 0 < red' if diverging else 'white 0 → red'}, saturating at {scale:.3g}"
                  f" (99th percentile of the step); dashed: masked out of the loss; hover a token for its numbers")
        prof = figures.profile_figure(toks["pos"].to_numpy(), toks[col].cast(pl.Float64).fill_null(np.nan).to_numpy(),
                                      SCORE_LABELS[color_by] if col == color_by else "log ratio", focus_pos)
        parts += [html.Div([dcc.Graph(id="completion-profile", figure=prof, config=GRAPH_CONFIG, className="graph"),
                            html.Div(csv_anchor(downloads.link("completion", run=name, step=step, sample=sample_id)),
                                     className="graph-foot")],
                           className="graph-box"),
                  html.Div(legend, className="hint"), html.Div(spans, className="tokens", id="completion-tokens")]
        if more > 0:
            parts.append(html.Div(f"… {more} more tokens not drawn", className="hint"))
    return parts


def layout(runs: RunSet) -> html.Div:
    return html.Div([
        html.Div([
            labelled("run", dcc.Dropdown(id="tok-run", options=run_options(runs, runs.run_names), value=runs.run_names[0],
                                          clearable=False)),
            labelled("step", dcc.Input(id="tok-step", type="number", min=0, step=1, debounce=True)),
            labelled("rank tokens by", dcc.RadioItems(
                id="tok-by", value="kl", inline=True,
                options=[{"label": SCORE_LABELS[k], "value": k} for k in data.RANK_BY])),
            labelled("top", dcc.Input(id="tok-k", type="number", min=1, max=500, step=1, value=50, debounce=True)),
        ], className="controls"),
        html.Div(id="tok-summary", className="summary"),
        html.Div([  # the token table, and beside it the Why panel of the clicked curve's metric
            html.Div(dash_table.DataTable(id="tok-table", data=[], columns=[], sort_action="native",
                                          page_action="native", page_size=10, **TABLE_STYLE), className="tok-table-box"),
            html.Div(id="tok-why", className="why"),
        ], className="tok-row"),
        dcc.Store(id="tok-why-metric", data=None),
        html.H3("Completion"),
        html.Div([
            labelled("sample", dcc.Input(id="tok-sample", type="number", step=1, debounce=True)),
            labelled("colour by", dcc.RadioItems(
                id="tok-color", value="kl", inline=True,
                options=[{"label": SCORE_LABELS[k], "value": k} for k in data.COLOR_BY])),
        ], className="controls"),
        dcc.Store(id="tok-focus", data=None),
        html.Div(id="tok-completion", className="completion"),
    ], id="page-tokens", className="page")


def register(app, runs: RunSet) -> None:
    from grpolens.serve.layout import default_runs

    names = runs.names
    header_default = default_runs(runs)

    def runs_or(value, default):
        try:
            return inputs.run_names(runs, value)
        except UserError:
            return default

    def run_or(value, default):
        return value if isinstance(value, str) and value in runs.runs else default

    @app.callback(Output("tok-summary", "children"), Output("tok-table", "data"), Output("tok-table", "columns"),
                  Input("url", "pathname"), Input("tok-run", "value"), Input("tok-step", "value"),
                  Input("tok-by", "value"), Input("tok-k", "value"))
    def render_top(pathname, name, step, by, k):
        if pathname != "/tokens":
            return no_update, no_update, no_update
        out = guard(top_tokens_view, 3)(runs, name, step, by, k)
        return (out[0], [], []) if out[1] is no_update else out

    @app.callback(Output("tok-why", "children"),
                  Input("url", "pathname"), Input("tok-run", "value"), Input("tok-step", "value"),
                  Input("tok-why-metric", "data"))
    def render_why(pathname, name, step, metric):
        if pathname != "/tokens":
            return no_update
        return guard(lambda *a: why_panel(runs, name, inputs.whole(step, "step"), metric), 1)()

    @app.callback(Output("tok-completion", "children"),
                  Input("url", "pathname"), Input("tok-run", "value"), Input("tok-step", "value"),
                  Input("tok-sample", "value"), Input("tok-color", "value"), Input("tok-focus", "data"),
                  State("tok-by", "value"))
    def render_completion(pathname, name, step, sample, color_by, focus, by):
        if pathname != "/tokens":
            return no_update
        return guard(completion_view, 1)(runs, name, step, sample, color_by, focus, by)

    @app.callback(Output("url", "search", allow_duplicate=True),
                  Input("tok-table", "active_cell"), State("tok-run", "value"), State("tok-step", "value"),
                  State("tok-by", "value"), State("tok-k", "value"), State("tok-color", "value"), State("runs", "value"),
                  State("tok-why-metric", "data"), prevent_initial_call=True)
    def on_token_row(cell, name, step, by, k, color, header_runs, why):
        row = inputs.short(cell.get("row_id"), "row") if isinstance(cell, dict) else None
        if row is None or not isinstance(name, str) or name not in runs.runs:
            raise PreventUpdate
        sample, _, pos = row.partition(":")
        return tokens_search(name, inputs.whole_or_none(step, "step"), inputs.whole_or_none(sample, "sample"),
                             inputs.whole_or_none(pos, "pos"), inputs.choice(by, data.RANK_BY, "kl"),
                             inputs.clamped(k, "top", 50), inputs.choice(color, data.COLOR_BY, "kl"),
                             inputs.run_names_or_none(runs, header_runs), default_runs(runs),
                             why if isinstance(why, str) and urlstate.METRIC_NAME.match(why) else None)

    # the view <-> the URL (see grpolens.serve.url_callbacks)
    @app.callback(Output("url", "search", allow_duplicate=True),
                  Output("tok-run", "value"), Output("tok-step", "value"), Output("tok-sample", "value"),
                  Output("tok-focus", "data"), Output("tok-by", "value"), Output("tok-k", "value"),
                  Output("tok-color", "value"), Output("tok-why-metric", "data"), Output("nav-tokens", "href"),
                  Input("url", "pathname"), Input("url", "search"),
                  Input("tok-run", "value"), Input("tok-step", "value"), Input("tok-sample", "value"),
                  Input("tok-by", "value"), Input("tok-k", "value"), Input("tok-color", "value"),
                  State("tok-focus", "data"), State("runs", "value"), State("tok-why-metric", "data"),
                  prevent_initial_call="initial_duplicate")
    def sync_tokens(pathname, search, run, step, sample, by, k, color, focus, header_runs, why):
        on_page = pathname == "/tokens"
        run = run_or(run, None)
        step, sample = inputs.whole_or_none(step, "step"), inputs.whole_or_none(sample, "sample")
        focus = inputs.whole_or_none(focus, "pos")
        by, color = inputs.choice(by, data.RANK_BY, by), inputs.choice(color, data.COLOR_BY, color)
        k = inputs.clamped(k, "top", 50) if k is not None else None
        header_runs = runs_or(header_runs, None)
        why = why if isinstance(why, str) and urlstate.METRIC_NAME.match(why) else None
        cur = (run, step, sample, focus, by, k, color, why)
        outs: list[Any] = [no_update] * 8
        if url_triggered():
            if on_page or step is None:
                q = urlstate.decode("tokens", search if on_page else "", names, TOKEN_CHOICES)
                header_runs = q.get("runs", header_runs)  # sync_header sets the header from the same URL
                r = runs.run_of(q.get("run", runs.run_names[0]))  # a variant's tokens are its run's
                want = (r, q["step"] if "step" in q else default_step(runs, r), q.get("sample"), q.get("pos"),
                        q.get("by", "kl"), q.get("k", 50), q.get("color", "kl"), q.get("why"))
                outs = [same(w, c) for w, c in zip(want, cur)]
                run, step, sample, focus, by, k, color, why = want
        elif ctx.triggered_id in ("tok-run", "tok-step", "tok-sample") and focus is not None:
            focus = None  # the outlined token belonged to the completion shown before
            outs[3] = None
        query = tokens_search(run, step, sample, focus, inputs.choice(by, data.RANK_BY, "kl"), k,
                              inputs.choice(color, data.COLOR_BY, "kl"), header_runs, header_default, why)
        new_search = query if on_page and not url_triggered() and query != (search or "") else no_update
        return (new_search, *outs, "/tokens" + query)


def _tokens_csv(runs: RunSet, search: str):
    q = urlstate.decode("tokens", search, runs.names, {"by": data.RANK_BY})
    run, step = downloads.need(q, "run"), downloads.need(q, "step")
    by = q.get("by", "kl")
    return f"{run}-step{step}-top-tokens-by-{by}", data.top_tokens(runs.path(run), step, by, q.get("k", 50))


def _completion_csv(runs: RunSet, search: str):
    q = urlstate.decode("tokens", search, runs.names)
    run, step, sample = downloads.need(q, "run"), downloads.need(q, "step"), downloads.need(q, "sample")
    c = data.completion(runs.path(run), step, sample)
    if c is None:
        raise UserError(f"CSV download: sample {sample} is not in {run} step {step}")
    toks = c["tokens"]
    if toks.height and "token_id" in toks.columns:
        decode, _ = data.decoder(runs.path(run))
        toks = toks.with_columns(pl.col("token_id").map_elements(lambda t: decode(int(t)), return_dtype=pl.String)
                                 .alias("token"))
    return f"{run}-step{step}-sample{sample}-tokens", toks


def pages() -> list[Page]:
    header_search, header_runs = header_runs_hooks("tokens", TOKENS_DEFAULTS, TOKEN_CHOICES)
    return [Page("/tokens", "Tokens", "tokens", KEYS, layout, register,
                 csv={"tokens": _tokens_csv, "completion": _completion_csv},
                 header_search=header_search, header_runs=header_runs)]
