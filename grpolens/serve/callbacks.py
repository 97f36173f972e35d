"""The dashboard's callbacks, and the plain functions behind them (unit-tested without a browser).

Every function that takes a run name resolves it through :meth:`RunSet.path`, which refuses
anything but the runs the server was started with. Model-generated text is only ever put into
components as plain strings (``html.Pre``/``html.Span`` children, ``title`` attributes, DataTable
cells without Markdown): React escapes them, so markup in a completion is shown, never run.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import polars as pl
from dash import ALL, MATCH, Input, Output, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from grpolens.run import format as fmt
from grpolens.errors import UserError
from grpolens.run.format import RunFormatError
from grpolens.plot_config import plot_config
from grpolens.serve import data, downloads, figures, inputs, urlstate
from grpolens.serve.layout import CURVE_PAGES, PAGE_IDS, PAGES, SCORE_LABELS
from grpolens.serve.components import csv_anchor, diverging_cell_styles, error_box, rows_json, table_columns
from grpolens.serve.runs import RunSet
from grpolens.serve.url_callbacks import completions_search, register_url_callbacks, tokens_search

#: Most tokens drawn in the completion view (the rest is summarised).
MAX_TOKENS_SHOWN = 4096
#: Every dcc.Graph gets this config: no "Share chart" upload button (see grpolens.plot_config).
GRAPH_CONFIG = plot_config()


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------

def _graph(key: str, fig, csv: str | None = None, doc: str | None = None, log_toggle: bool = False):
    """A clickable chart; with ``csv`` (a :func:`downloads.link`), a "CSV" link to the data behind it;
    with ``doc``, the metric's description in full under it (a chart title would cut it); with
    ``log_toggle``, its own "log y" box (see ``panel_log`` in :func:`register_callbacks`)."""
    g = dcc.Graph(id={"type": "curve", "key": key}, figure=fig, config=GRAPH_CONFIG, className="graph")
    if csv is None and doc is None and not log_toggle:
        return g
    foot = [html.Div(doc or "", className="graph-doc")]
    if log_toggle:
        on = fig["layout"].get("yaxis", {}).get("type") == "log"
        foot.append(dcc.Checklist(id={"type": "panel-log", "key": key}, options=[{"label": " log y", "value": "log"}],
                                  value=["log"] if on else [], className="panel-log"))
    foot += [csv_anchor(csv)] if csv else []
    return html.Div([g, html.Div(foot, className="graph-foot")], className="graph-box")


def _bounds(lo, hi) -> dict:
    return {"from": lo, "to": hi}


def _range(rng: list | None) -> tuple[int | None, int | None]:
    return inputs.step_range(rng)


# ---------------------------------------------------------------------------------------------
# Curve pages
# ---------------------------------------------------------------------------------------------

def _lines(runs: RunSet, names: list[str], column: str, lo, hi, smoothing, with_baseline: bool) -> list[dict]:
    lines = []
    shown = list(names)
    if with_baseline and runs.baseline and runs.baseline not in shown:
        shown.append(runs.baseline)
    for n in shown:
        df = data.series(runs.path(n))
        if column not in df.columns:
            continue
        c = data.curve(df, column, lo, hi, smoothing)
        if len(c["x"]) == 0:
            continue
        lines.append({"run": n, "idx": runs.names.index(n), **c,
                      "baseline": n == runs.baseline and n not in names})
    return lines


def _verdicts(runs: RunSet, names: list[str], column: str) -> list[dict]:
    out = []
    base = runs.path(runs.baseline) if runs.baseline else None
    for n in names:
        if n != runs.baseline:
            out += [v for v in data.check_verdicts(runs.path(n), base) if v["metric"] == column]
    return out


def curve_graph(runs: RunSet, page: str, names: list[str], column: str, title: str, lo=None, hi=None,
                smoothing: float = 0.0, with_baseline: bool = True, y_scale: frozenset = frozenset(),
                doc: str | None = None):
    """``y_scale``: the chosen y options, "log" and/or "robust" (see :func:`figures.y_axis_scale`);
    ``doc``: the metric's description, shown whole under the chart."""
    lines = _lines(runs, names, column, lo, hi, smoothing, with_baseline)
    if not lines:
        return None
    csv = downloads.link("curve", runs=[ln["run"] for ln in lines], metric=column, smooth=smoothing or None,
                         **_bounds(lo, hi))
    return _graph(f"{page}:{column}", figures.curve_figure(title, lines, _verdicts(runs, names, column),
                                                           log_y="log" in y_scale, robust_y="robust" in y_scale), csv,
                  doc, log_toggle=True)


#: Most metric graphs on one page (each costs the browser a WebGL context and a render); the
#: metric filter brings in the others.
MAX_GRAPHS = 16
#: Metrics each page draws first (regular expressions, in order); the rest follow in catalogue order.
PAGE_PRIORITY = {
    "policy": (r"^kl/k3$", r"^kl/k1$", r"^clip/(low|high|region)$", r"^clip/cispo$", r"^entropy$", r"^loss$",
               r"^policy/(approx_kl|ratio_max|ratio_min|ratio_abs_dev_mean|token_kl_max)$"),
    "mismatch": (r"^mismatch/kl_k3$", r"^mismatch/abs_logp_diff$", r"^mismatch/delta_median$",
                 r"^mismatch/constant_offset$", r"^rollout_is/raw/(mean|max|ess)$", r"^rollout_is/applied/(mean|max)$",
                 r"^rollout_is/(truncated_fraction|zeroed_fraction)$", r"^rollout_is/veto/seq_fraction$",
                 r"^rollout_is/modified/token_fraction$", r"^mismatch/chi2_token$"),
    "rewards": (r"^reward/(mean|std|frac_zero_std)$", r"^advantage/frac_zero_groups$",
                r"^completions/(length/mean|truncated_frac|clipped_frac)$", r"^diversity/(distinct_1|distinct_2|jaccard)$"),
}


def prioritised(page: str, cols: list[str]) -> list[str]:
    pats = PAGE_PRIORITY.get(page, ())

    def key(c: str) -> int:
        return next((i for i, p in enumerate(pats) if re.search(p, c)), len(pats))

    return sorted(cols, key=key)  # stable: catalogue order within each priority


def _matches(column: str, pattern: str | None) -> bool:
    return not pattern or all(p in column for p in pattern.lower().split())


def curve_page_children(runs: RunSet, page: str, names: list[str], smoothing: float = 0.0, rng=None,
                        with_baseline: bool = True, pattern: str | None = None, y_scale=(),
                        panels: dict[str, bool] | None = None) -> list:
    """The graphs of a curve page (overview, policy, mismatch, rewards) for the selected runs;
    ``pattern``: only metrics whose name contains each of its words; ``y_scale``: "log", "robust";
    ``panels``: metric -> log y of the panels whose own box says otherwise than the header."""
    y_scale = frozenset(inputs.choices(y_scale, urlstate.Y_OPTIONS, "y scale"))
    smoothing = inputs.smoothing(smoothing)
    pattern = inputs.text(pattern, "metric filter")
    panels = panels or {}

    def ys(col: str) -> frozenset:  # the header's y options, with the panel's own log y where it has one
        own = panels.get(col)
        return y_scale if own is None else (y_scale | {"log"}) if own else (y_scale - {"log"})

    names = inputs.run_names(runs, names)
    if not names:
        return [error_box("select at least one run")]
    lo, hi = _range(rng)
    frames = [data.series(runs.path(n), with_samples=page == "rewards") for n in names]
    docs = data.metric_docs()
    out: list = []
    if page == "overview":
        for label, col in data.overview_metrics(frames):
            g = curve_graph(runs, page, names, col, f"{label} <span style='font-size:10px;color:#888'>{col}</span>",
                            lo, hi, smoothing, with_baseline, ys(col))
            if g is not None:
                out.append(g)
    elif page == "rewards":
        out += reward_graphs(runs, names, frames, lo, hi)
        for col in (f"{data.SAMPLES_PREFIX}zero_std_group_frac", f"{data.SAMPLES_PREFIX}truncated_frac"):
            g = curve_graph(runs, page, names, col, col, lo, hi, smoothing, with_baseline, ys(col))
            if g is not None:
                out.append(g)
    pages = data.page_families()
    if page in pages:
        banded = {c for f in frames for c in f.columns if re.search(r"/p\d\d$", c)} if page == "rewards" else set()
        cols = [c for c in data.family_metrics(frames, pages[page]) if c not in banded]
        cols = prioritised(page, [c for c in cols if _matches(c, pattern)])
        for col in cols[:MAX_GRAPHS]:
            g = curve_graph(runs, page, names, col, col, lo, hi, smoothing, with_baseline, ys(col), docs.get(col))
            if g is not None:
                out.append(g)
        if len(cols) > MAX_GRAPHS:
            out.append(html.Div(f"{len(cols) - MAX_GRAPHS} more metric(s) not drawn: narrow them down with the "
                                "metric filter", className="hint"))
    if page == "mismatch":
        for n in names[:2]:
            hm = data.is_heatmap(runs.path(n))
            if hm["counts"].size:
                out.append(_graph(f"mismatch:is_hist:{n}", figures.is_heatmap_figure(n, runs.names.index(n), hm),
                                  downloads.link("is_hist", run=n)))
        out += sweep_tables(runs, names)
    if not out:
        msg = {"policy": "no policy metrics in these runs (do their token shards have old_logp / ref_logp?)",
               "mismatch": "no mismatch metrics in these runs (their token shards need rollout_logp)"}
        out.append(error_box(msg.get(page, "nothing to show for these runs")))
    return out


def reward_graphs(runs: RunSet, names: list[str], frames: list[pl.DataFrame], lo, hi) -> list:
    """Quantile bands over steps of the total reward, each reward function, and the lengths."""
    keys: list[str] = []  # every "<key>/p50" with its quartiles: recomputed rewards, then samples-derived
    for f in frames:
        for c in f.columns:
            k = c[:-len("/p50")]
            if c.endswith("/p50") and f"{k}/p25" in f.columns and k not in keys and f[c].null_count() < f.height:
                keys.append(k)
    have = set(keys)
    keys = [k for k in keys if not (k.startswith(data.SAMPLES_PREFIX)
                                    and _recomputed_twin(k[len(data.SAMPLES_PREFIX):]) in have)]
    out = []
    for k in keys:
        bands = []
        for n, f in zip(names, frames):
            cols = {q: f"{k}/{q}" for q in ("p05", "p25", "p50", "p75", "p95", "mean")}
            if cols["p50"] not in f.columns:
                continue
            d = f.select("step", *[c for c in cols.values() if c in f.columns])
            if lo is not None:
                d = d.filter(pl.col("step") >= lo)
            if hi is not None:
                d = d.filter(pl.col("step") <= hi)
            idx = data.downsample_minmax(d.height, d[cols["p50"]].cast(pl.Float64).fill_null(np.nan).to_numpy())
            q = {name: d[c].cast(pl.Float64).fill_null(np.nan).to_numpy()[idx] for name, c in cols.items() if c in d.columns}
            bands.append({"run": n, "idx": runs.names.index(n), "x": d["step"].to_numpy()[idx], "q": q})
        if bands:
            title = ("completion length (tokens): quantiles over completions" if k.endswith("length")
                     else f"{k}: quantiles over completions")
            out.append(_graph(f"rewards:band:{k}", figures.band_figure(title, bands),
                              downloads.link("band", runs=[b["run"] for b in bands], key=k, **_bounds(lo, hi))))
    return out


def _recomputed_twin(key: str) -> str:
    """The recomputed metric prefix holding the same quantiles as a samples-derived one."""
    if key == "reward":
        return "reward"
    if key.startswith("reward/"):
        return "rewards/" + key[len("reward/"):]
    return key


def sweep_tables(runs: RunSet, names: list[str]) -> list:
    """Tables of IS-threshold sweep results recompute wrote (``RUN/grpolens/*sweep*.parquet``)."""
    from dash import dash_table

    from grpolens.serve.layout import TABLE_STYLE

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
        text.append(html.Div(" · ".join(f"{k} {_fmt(v)}" for k, v in d["metrics"].items())))
    return [html.Div(text, className="summary"),
            html.Div([dcc.Graph(figure=figures.is_step_figure(d, step), config=GRAPH_CONFIG, className="graph"),
                      html.Div(csv_anchor(downloads.link("is_step", run=name, step=step)), className="graph-foot")],
                     className="graph-box")]


# ---------------------------------------------------------------------------------------------
# Tokens page
# ---------------------------------------------------------------------------------------------

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
        dcc.Link("all completions of this step →", href="/completions" + completions_search(name, step)), " ",
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


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.4g}"
    return str(v)


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
    info = [f"sample {sample_id}"] + [f"{k} {_fmt(s[k])}" for k in
                                      ("group_id", "rank", "reward", "advantage", "completion_len", "truncated")
                                      if k in s]
    info += [f"{k} {_fmt(v)}" for k, v in s.items() if k.startswith(fmt.REWARD_PREFIX)]
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
            title = (f"pos {r['pos']} · token {_fmt(r['token_id'])} · mask {r['mask']}\n"
                     f"logp {_fmt(r['logp'])} old {_fmt(r['old_logp'])} ref {_fmt(r['ref_logp'])} "
                     f"rollout {_fmt(r['rollout_logp'])}\n"
                     f"ratio {_fmt(r['ratio'])} KL {_fmt(r['kl'])} |Δ| {_fmt(r['mismatch'])} "
                     f"IS w {_fmt(r['is_weight'])}\nentropy {_fmt(r['entropy'])} advantage {_fmt(r['advantage'])}")
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


# ---------------------------------------------------------------------------------------------
# Completions page
# ---------------------------------------------------------------------------------------------

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
    pages = max(1, math.ceil(total / page_size))
    every = completions_search(name, step, group, max_rank, truncated, vetoed, 0, sort_by, filter_query)
    summary = html.Span([f"{name}, step {step}: {total} completion(s) match; page {page + 1} of {pages} ",
                         csv_anchor(downloads.PREFIX + "completions" + every, "CSV of all matching rows")])
    return rows_json(rows), table_columns(rows), pages, summary


# ---------------------------------------------------------------------------------------------
# Compare page
# ---------------------------------------------------------------------------------------------

#: Compare table columns coloured by sign and size (on a robust scale: see components.robust_scale).
COMPARE_COLOURED = ["mean_delta", "rel_delta", "max_abs_delta"]


def compare_view(runs: RunSet, a: str, b: str, metrics: list[str] | None, rng=None):
    """``(summary, rows, columns, graphs, metric_options, chosen_metrics, default_metrics)`` for runs A
    and B (the defaults are the page's delta curves when none are chosen; the URL leaves them out)."""
    pa_, pb = runs.path(a), runs.path(b)
    lo, hi = _range(rng)
    metrics = inputs.metric_names(metrics, "delta curves")
    fa, fb = data.series(pa_), data.series(pb)
    table = data.compare(fa, fb, lo, hi)
    options = [{"label": m, "value": m} for m in table["metric"].to_list()]
    defaults = [c for _, c in data.overview_metrics([fa, fb]) if c in set(table["metric"].to_list())]
    chosen = [m for m in (metrics if metrics else defaults) if m in set(table["metric"].to_list())]
    graphs = []
    for m in chosen[:12]:
        c = data.delta_curve(fa, fb, m, lo, hi)
        fig = figures.delta_figure(m, a, b, c["x"], c["y"], runs.names.index(b))
        graphs.append(_graph(f"compare:{m}", fig, downloads.link("delta", a=a, b=b, metric=m, **_bounds(lo, hi))))
    common = fa.join(fb, on="step", how="inner").height if fa.height and fb.height else 0
    summary = html.Span([f"B - A per step over {common} common step(s); table: mean of each metric in A and B, the "
                         f"mean difference, and the largest |difference| with its step (click a delta curve to open "
                         f"run B's tokens) ", csv_anchor(downloads.link("compare", a=a, b=b, **_bounds(lo, hi)),
                                                         "CSV of the table")])
    return summary, rows_json(table), table_columns(table), graphs, options, chosen, defaults


# ---------------------------------------------------------------------------------------------
# Navigation
# ---------------------------------------------------------------------------------------------

def click_target(runs: RunSet, names: list[str] | None, click: dict | None, by: str = "kl", k: int = 50,
                 color: str = "kl") -> tuple[str, str] | None:
    """Where a click on a curve point leads: the Tokens page for that run and step (the point's
    ``customdata`` is its run's index; a delta curve of the Compare page carries run B's), ranked
    and coloured as the Tokens page last was."""
    if not isinstance(click, dict) or not click.get("points"):
        return None
    pts = [p for p in inputs.items(click["points"], "clicked points") if isinstance(p, dict)]
    if not pts:
        return None
    pt = next((p for p in pts if isinstance(p.get("customdata"), (int, float)) and p["customdata"] >= 0), pts[0])
    step = inputs.whole_or_none(pt.get("x"), "step")
    if step is None:
        return None
    names = inputs.run_names(runs, names)
    idx = inputs.index(pt.get("customdata"), len(runs.names))
    if idx is not None:
        name = runs.names[idx]
    else:
        name = (names or runs.names)[0]
    runs.path(name)
    name = runs.run_of(name)  # a what-if variant's tokens are its run's
    from grpolens.serve.layout import default_runs

    return "/tokens", tokens_search(name, step, by=inputs.choice(by, data.RANK_BY, "kl"), k=inputs.clamped(k, "top", 50),
                                    color=inputs.choice(color, data.COLOR_BY, "kl"), header_runs=names,
                                    default_header=default_runs(runs))


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

def _header_runs(runs: RunSet, value) -> list[str] | None:
    """The header's runs for a link (None, the default, when they are not valid)."""
    try:
        return inputs.run_names(runs, value) or None
    except UserError:
        return None


def _guard(fn, n_out: int):
    """Run ``fn``; turn a user/run-format error into an error box in the first output."""
    def wrapped(*args):
        try:
            return fn(*args)
        except (UserError, RunFormatError) as e:
            msg = e.message if isinstance(e, UserError) else str(e)
            box = [error_box(msg)]
            return box if n_out == 1 else (box, *([no_update] * (n_out - 1)))
    wrapped.__name__ = fn.__name__
    return wrapped


def register_callbacks(app, runs: RunSet) -> None:  # noqa: C901 - one place wires every page
    from grpolens.serve.layout import default_runs

    page_paths = [p for p, _ in PAGES]

    @app.callback([Output(f"page-{PAGE_IDS[p]}", "style") for p in page_paths]
                  + [Output(f"nav-{PAGE_IDS[p]}", "className") for p in page_paths]
                  + [Output("curve-controls", "style")],
                  Input("url", "pathname"))
    def show_page(pathname):
        path = inputs.pathname(pathname)
        path = path if path in page_paths else "/"
        styles = [{} if p == path else {"display": "none"} for p in page_paths]
        navs = ["nav-link active" if p == path else "nav-link" for p in page_paths]
        return [*styles, *navs, {} if path in CURVE_PAGES or path == "/compare" else {"display": "none"}]

    # the step slider's bounds and value: sync_header (grpolens.serve.url_callbacks), with the URL

    for path, page in CURVE_PAGES.items():
        def make(path=path, page=page):
            @app.callback(Output(f"{page}-graphs", "children"),
                          Input("url", "pathname"), Input("runs", "value"), Input("smoothing", "value"),
                          Input("range", "value"), Input("show-baseline", "value"), Input("metric-filter", "value"),
                          Input("y-scale", "value"), Input("version", "data"), State("url", "search"))
            def render(pathname, names, smoothing, rng, baseline, pattern, y_scale, _version, search):
                if inputs.pathname(pathname) != path:
                    return no_update
                # the panels' own log y boxes, from the URL (sync_panel_log writes them there)
                q = urlstate.decode("curves", search, runs.names)
                panels = {**{m: True for m in q.get("log", [])}, **{m: False for m in q.get("lin", [])}}
                return _guard(curve_page_children, 1)(runs, page, names, smoothing, rng,
                                                      bool(baseline), pattern, y_scale, panels)
        make()

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
        return _guard(mismatch_step_panel, 1)(runs, names[0], step)

    @app.callback(Output("url", "pathname", allow_duplicate=True), Output("url", "search", allow_duplicate=True),
                  Input({"type": "curve", "key": ALL}, "clickData"), State("runs", "value"),
                  State("tok-by", "value"), State("tok-k", "value"), State("tok-color", "value"),
                  prevent_initial_call=True)
    def on_curve_click(_clicks, names, by, k, color):
        trig = ctx.triggered_id
        value = ctx.triggered[0].get("value") if ctx.triggered else None
        if not isinstance(trig, dict) or not value:
            raise PreventUpdate
        try:
            target = click_target(runs, names, value, by, k, color)
        except UserError:
            raise PreventUpdate from None
        if target is None:
            raise PreventUpdate
        return target

    # -- Tokens page ----------------------------------------------------------------------------
    @app.callback(Output("tok-summary", "children"), Output("tok-table", "data"), Output("tok-table", "columns"),
                  Input("url", "pathname"), Input("tok-run", "value"), Input("tok-step", "value"),
                  Input("tok-by", "value"), Input("tok-k", "value"))
    def render_top(pathname, name, step, by, k):
        if pathname != "/tokens":
            return no_update, no_update, no_update
        out = _guard(top_tokens_view, 3)(runs, name, step, by, k)
        return (out[0], [], []) if out[1] is no_update else out

    @app.callback(Output("tok-completion", "children"),
                  Input("url", "pathname"), Input("tok-run", "value"), Input("tok-step", "value"),
                  Input("tok-sample", "value"), Input("tok-color", "value"), Input("tok-focus", "data"),
                  State("tok-by", "value"))
    def render_completion(pathname, name, step, sample, color_by, focus, by):
        if pathname != "/tokens":
            return no_update
        return _guard(completion_view, 1)(runs, name, step, sample, color_by, focus, by)

    @app.callback(Output("url", "search", allow_duplicate=True),
                  Input("tok-table", "active_cell"), State("tok-run", "value"), State("tok-step", "value"),
                  State("tok-by", "value"), State("tok-k", "value"), State("tok-color", "value"), State("runs", "value"),
                  prevent_initial_call=True)
    def on_token_row(cell, name, step, by, k, color, header_runs):
        row = inputs.short(cell.get("row_id"), "row") if isinstance(cell, dict) else None
        if row is None or not isinstance(name, str) or name not in runs.runs:
            raise PreventUpdate
        sample, _, pos = row.partition(":")
        return tokens_search(name, inputs.whole_or_none(step, "step"), inputs.whole_or_none(sample, "sample"),
                             inputs.whole_or_none(pos, "pos"), inputs.choice(by, data.RANK_BY, "kl"),
                             inputs.clamped(k, "top", 50), inputs.choice(color, data.COLOR_BY, "kl"),
                             _header_runs(runs, header_runs), default_runs(runs))

    # -- Completions page -------------------------------------------------------------------------
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
                                        inputs.choice(color, data.COLOR_BY, "kl"), _header_runs(runs, header_runs),
                                        default_runs(runs))

    # -- Compare page -------------------------------------------------------------------------------
    @app.callback(Output("cmp-summary", "children"), Output("cmp-table", "data"), Output("cmp-table", "columns"),
                  Output("cmp-graphs", "children"), Output("cmp-metrics", "options"), Output("cmp-metrics", "placeholder"),
                  Output("cmp-default", "data"), Output("cmp-table", "style_data_conditional"),
                  Input("url", "pathname"), Input("cmp-a", "value"), Input("cmp-b", "value"),
                  Input("cmp-metrics", "value"), Input("range", "value"), Input("version", "data"))
    def render_compare(pathname, a, b, metrics, rng, _version):
        """The page for A and B. With no delta curves chosen the default ones are drawn and named in
        the dropdown's placeholder, not set as its value: the dropdown's value is sync_compare's
        alone (two writers that listen to each other would be a circular dependency)."""
        if pathname != "/compare":
            raise PreventUpdate
        try:
            summary, rows, columns, graphs, options, _chosen, defaults = compare_view(runs, a, b, metrics, rng)
        except (UserError, RunFormatError) as e:
            msg = e.message if isinstance(e, UserError) else str(e)
            return error_box(msg), [], [], [], [], "delta curves", [], []
        hint = "default: " + ", ".join(defaults) if defaults else "delta curves"
        return (summary, rows, columns, graphs, options, hint, defaults,
                diverging_cell_styles(pl.DataFrame(rows, infer_schema_length=None), COMPARE_COLOURED))

    # One panel's own log y, in the browser (no round trip): the figure is redrawn with plotly's
    # own range on the new axis (a robust range is in linear units, so it does not carry over).
    app.clientside_callback(
        """function(value, fig) {
            if (!fig) { return window.dash_clientside.no_update; }
            const log = (value || []).includes('log');
            const yaxis = Object.assign({}, fig.layout.yaxis, {type: log ? 'log' : 'linear', autorange: true});
            delete yaxis.range;
            return Object.assign({}, fig, {layout: Object.assign({}, fig.layout, {yaxis: yaxis})});
        }""",
        Output({"type": "curve", "key": MATCH}, "figure"),
        Input({"type": "panel-log", "key": MATCH}, "value"), State({"type": "curve", "key": MATCH}, "figure"),
        prevent_initial_call=True)

    register_url_callbacks(app, runs)
    from grpolens.serve import page_runs

    page_runs.register(app, runs)

    # -- --watch: notice new data -------------------------------------------------------------------
    @app.callback(Output("version", "data"), Input("watch", "n_intervals"), State("version", "data"),
                  prevent_initial_call=True)
    def poll(_n, old):
        new = [str(data.run_version(p)) for p in runs.runs.values()]
        if new == old:
            raise PreventUpdate
        return new
