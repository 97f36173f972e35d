"""The "Why" panel of the Tokens page: why a metric moved at a step (``grpolens explain``).

Clicking a point of a curve opens the Tokens page for that run and step with the curve's metric
in the URL (``why=``); this panel, beside the token table, shows the exact decomposition of the
metric's change against the previous step (:func:`grpolens.analysis.explain.explain`): one bar
chart per dimension (token ids, completions, prompts, positions, lengths, ranks, micro-batches,
outcomes; bars coloured by sign), the concentration (Lorenz) curve of the step's value, and links
from each top key to its completions and tokens.

Explanations are cached per run, step and metric, keyed by the step's files like every other
per-step view (:mod:`grpolens.serve.data.memo`).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from dash import dcc, html

from grpolens.errors import UserError
from grpolens.serve import data, urlstate
from grpolens.serve.components import GRAPH_CONFIG, error_box, fmt_value
from grpolens.serve.runs import RunSet
from grpolens.text import printable

#: Keys listed per dimension (the rest is summed as "other").
TOP = 8
#: Dimensions shown, in order (those the metric's terms support; see the explain module).
SHOWN = ("token_id", "completion", "group", "position", "length", "rank", "micro_batch", "outcome")
TITLES = {"token_id": "token ids", "completion": "completions", "group": "prompts", "position": "positions",
          "length": "completion lengths", "rank": "ranks", "micro_batch": "micro-batches", "outcome": "outcomes"}


def explanation(path: Path, metric: str, step: int) -> dict:
    """``explain(run, metric, step).to_dict()`` plus its headline, cached per step."""
    from grpolens.analysis.explain import explain
    from grpolens.serve.data.memo import _STEP_MEMO, _step_fingerprint, run_key

    def make() -> dict:
        e = explain(path, metric, step, top=TOP)
        return {**e.to_dict(), "headline": e.headline()}

    fp = (_step_fingerprint(path, step), _step_fingerprint(path, step - 1) if step > 0 else None)
    return _STEP_MEMO.get(("why", run_key(path), step, metric, fp), make)


def _plotly_text(text: str) -> str:
    """Untrusted text for a chart label: printable, and no markup plotly would read (``<b>``, ``<a>``)."""
    return printable(str(text), keep_newlines=False).replace("<", "&lt;").replace(">", "&gt;")[:40]


def bars_figure(dim: str, entries: list[dict]) -> dict:
    """Horizontal bars of one dimension's contributions (largest first), red > 0 > blue."""
    entries = list(reversed(entries))  # plotly draws the first bar at the bottom
    y = [_plotly_text(e["label"]) for e in entries]
    x = [e["contribution"] for e in entries]
    share = [("" if e.get("share") is None else f"{100 * e['share']:.0f} %") for e in entries]
    return {
        "data": [{"type": "bar", "orientation": "h", "x": x, "y": list(range(len(y))), "text": share,
                  "textposition": "auto", "hovertext": y, "hoverinfo": "text+x",
                  "marker": {"color": ["rgba(214,39,40,0.75)" if v >= 0 else "rgba(31,119,180,0.75)" for v in x]}}],
        "layout": {"title": {"text": TITLES.get(dim, dim), "font": {"size": 12}, "x": 0.01},
                   "height": 60 + 22 * len(entries), "margin": {"l": 130, "r": 10, "t": 28, "b": 24},
                   "yaxis": {"tickvals": list(range(len(y))), "ticktext": y, "automargin": True},
                   "xaxis": {"zeroline": True, "zerolinecolor": "#888"}, "showlegend": False,
                   "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)"},
    }


def lorenz_figure(conc: dict) -> dict | None:
    """The share of the step's value held by its top 0.1 / 1 / 10 % tokens (and by all): the
    concentration curve, against the line of an even spread."""
    pts = [(0.001, conc.get("top_0.1%_tokens")), (0.01, conc.get("top_1%_tokens")), (0.1, conc.get("top_10%_tokens"))]
    pts = [(x, y) for x, y in pts if y is not None]
    if not pts:
        return None
    xs, ys = [0.0, *[x for x, _ in pts], 1.0], [0.0, *[y for _, y in pts], 1.0]
    return {
        "data": [{"type": "scatter", "mode": "lines+markers", "x": xs, "y": ys, "name": "top tokens",
                  "line": {"color": "rgb(214,39,40)"},
                  "hovertemplate": "top %{x:.1%} of tokens hold %{y:.1%}<extra></extra>"},
                 {"type": "scatter", "mode": "lines", "x": [0, 1], "y": [0, 1], "name": "even",
                  "line": {"dash": "dot", "color": "#888"}, "hoverinfo": "skip"}],
        "layout": {"title": {"text": "concentration: share held by the top tokens", "font": {"size": 12}, "x": 0.01},
                   "height": 220, "margin": {"l": 40, "r": 10, "t": 28, "b": 30}, "showlegend": False,
                   "xaxis": {"type": "log", "range": [-3.2, 0], "tickformat": ".1%", "title": {"text": "top tokens"}},
                   "yaxis": {"range": [0, 1.05], "tickformat": ".0%"},
                   "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)"},
    }


def _token_link(path: Path, run: str, step: int, token_id, metric: str | None = None) -> str | None:
    """The Tokens page at the completion where ``token_id`` scores highest (the token outlined)."""
    t = data.step_tokens(path, step)
    if not isinstance(token_id, int) or t.height == 0 or "token_id" not in t.columns:
        return None
    hit = t.filter(pl.col("mask") & (pl.col("token_id") == token_id))
    if hit.height == 0:
        return None
    row = hit.sort(pl.col("kl").abs(), descending=True, nulls_last=True).row(0, named=True)
    return "/tokens" + urlstate.encode("tokens", {"run": run, "step": step, "sample": row["sample_id"],
                                                  "pos": row["pos"], "why": metric})


def key_links(path: Path, run: str, step: int, dim: str, key, metric: str | None = None) -> list:
    """Links from one key to its completions and tokens (none for buckets and micro-batches); a
    link to tokens keeps the panel of ``metric`` open."""
    comps = lambda **q: "/completions" + urlstate.encode("completions", {"run": run, "step": step, **q})  # noqa: E731
    out = []
    if dim == "completion" and isinstance(key, int):
        out.append(("tokens", "/tokens" + urlstate.encode("tokens", {"run": run, "step": step, "sample": key,
                                                                     "why": metric})))
    elif dim == "group" and isinstance(key, int):
        out.append(("completions", comps(group=key)))
    elif dim == "rank" and isinstance(key, int):
        out.append(("completions", comps(where=f"{{rank}} = {key}")))
    elif dim == "token_id":
        href = _token_link(path, run, step, key, metric)
        if href:
            out.append(("tokens", href))
    return out


def _keys_list(path: Path, run: str, step: int, dim: str, entries: list[dict], metric: str) -> html.Ul:
    items = []
    for e in entries:
        if e["key"] == "other":
            continue
        share = "" if e.get("share") is None else f" {100 * e['share']:.0f} %"
        links = [dcc.Link(label, href=href, className="why-link") for label, href in
                 key_links(path, run, step, dim, e["key"], metric)]
        items.append(html.Li([html.Span(str(e["label"]), className="why-key"),
                              html.Span(f"{fmt_value(e['contribution'])}{share}", className="why-num"), *links]))
    return html.Ul(items, className="why-keys")


def why_panel(runs: RunSet, run: str, step: int | None, metric: str | None) -> list:
    """The panel's children for ``metric`` at ``step`` of ``run`` (nothing when no metric is asked)."""
    if not metric:
        return []
    if not isinstance(metric, str) or not urlstate.METRIC_NAME.match(metric):
        raise UserError("why: not a metric name")
    path = runs.path(run)
    if step is None:
        return [error_box("pick a step")]
    if metric.startswith(data.SAMPLES_PREFIX):
        return [html.H3(f"Why: {metric}"), error_box(f"{metric} is drawn from the samples table, not recomputed "
                                                      "from token terms: grpolens explain does not decompose it")]
    d = explanation(path, metric, step)
    close = dcc.Link("close", href="/tokens" + urlstate.encode("tokens", {"run": run, "step": step}), className="why-close")
    parts: list = [html.H3([f"Why: {metric} at step {step} ", close]),
                   html.Div(d["headline"], className="summary", id="why-headline")]
    if d.get("note"):
        parts.append(html.Div(d["note"], className="hint"))
    parts += [html.Div(n, className="hint") for n in d.get("notes", [])]
    if d.get("by"):
        parts.append(html.Div(f"value {fmt_value(d['value'])}, baseline {fmt_value(d['baseline']['value'])} "
                              f"(steps {', '.join(map(str, d['baseline']['steps'])) or 'none'}), change "
                              f"{fmt_value(d['delta'])}; each dimension's contributions sum to the change",
                              className="hint"))
    lorenz = lorenz_figure(d.get("concentration") or {})
    if lorenz is not None:
        parts.append(dcc.Graph(id="why-lorenz", figure=lorenz, config=GRAPH_CONFIG, className="graph why-graph"))
    for dim in SHOWN:
        entries = d.get("by", {}).get(dim)
        if not entries:
            continue
        parts.append(html.Div([dcc.Graph(figure=bars_figure(dim, entries), config=GRAPH_CONFIG, className="graph"),
                               _keys_list(path, run, step, dim, entries, metric)],
                              className="why-dim", id=f"why-{dim}"))
    return parts
