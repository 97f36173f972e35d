"""Plotly figures of the dashboard, built from numpy arrays (sent as compact typed arrays).

Long curves use WebGL traces (``Scattergl``). Every point carries its run's index as
``customdata`` so that a click on any curve tells the server which run and step to open.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
BASELINE_COLOR = "#555555"
#: Above this many points a curve is drawn with WebGL.
GL_THRESHOLD = 500


def run_color(idx: int) -> str:
    return PALETTE[idx % len(PALETTE)]


def _layout(fig: go.Figure, title: str, height: int = 260, ytitle: str | None = None) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 13}},
        height=height, margin={"l": 55, "r": 10, "t": 34, "b": 32},
        template="plotly_white", hovermode="x unified", uirevision="keep",
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right", "font": {"size": 10}},
        xaxis={"title": None}, yaxis={"title": ytitle, "exponentformat": "e", "showexponent": "all"},
    )
    return fig


def _scatter(n: int):
    return go.Scattergl if n > GL_THRESHOLD else go.Scatter


def curve_figure(title: str, lines: list[dict[str, Any]], verdicts: list[dict] | None = None) -> go.Figure:
    """One metric for several runs. ``lines``: dicts with ``run``, ``idx`` (run index),
    ``x``, ``y``, ``smooth`` (or None) and ``baseline`` (drawn dashed grey)."""
    fig = go.Figure()
    for ln in lines:
        x, y, smooth = ln["x"], ln["y"], ln.get("smooth")
        color = BASELINE_COLOR if ln.get("baseline") else run_color(ln["idx"])
        name = f"{ln['run']} (baseline)" if ln.get("baseline") else ln["run"]
        cd = np.full(len(x), ln["idx"], dtype=np.int16)
        trace = _scatter(len(x))
        dash = "dash" if ln.get("baseline") else "solid"
        if smooth is not None:
            fig.add_trace(trace(x=x, y=y, mode="lines", name=name, legendgroup=name, showlegend=False,
                                line={"color": color, "width": 1, "dash": dash}, opacity=0.3, customdata=cd,
                                hoverinfo="skip"))
            fig.add_trace(trace(x=x, y=smooth, mode="lines", name=name, legendgroup=name,
                                line={"color": color, "width": 2, "dash": dash}, customdata=cd))
        else:
            fig.add_trace(trace(x=x, y=y, mode="lines+markers" if len(x) <= 60 else "lines", name=name,
                                line={"color": color, "width": 1.6, "dash": dash}, marker={"size": 4},
                                customdata=cd))
    for v in (verdicts or [])[:20]:
        if v.get("step") is not None:
            fig.add_vline(x=v["step"], line={"color": "#d62728", "width": 1, "dash": "dot"},
                          annotation_text=v.get("status") or "check", annotation_font_size=9)
    return _layout(fig, title)


def band_figure(title: str, bands: list[dict[str, Any]]) -> go.Figure:
    """Quantile bands over steps: per run, p05-p95 and p25-p75 shaded, the median as a line.
    ``bands``: dicts with ``run``, ``idx``, ``x`` and ``q`` = {"p05": y, ..., "p95": y, "mean": y}."""
    fig = go.Figure()
    for b in bands:
        x, q, color = b["x"], b["q"], run_color(b["idx"])
        cd = np.full(len(x), b["idx"], dtype=np.int16)
        trace = _scatter(len(x))
        for lo, hi, alpha in (("p05", "p95", 0.12), ("p25", "p75", 0.25)):
            if lo in q and hi in q:
                fig.add_trace(trace(x=x, y=q[hi], mode="lines", line={"width": 0, "color": color},
                                    showlegend=False, hoverinfo="skip", customdata=cd))
                fig.add_trace(trace(x=x, y=q[lo], mode="lines", line={"width": 0, "color": color}, fill="tonexty",
                                    fillcolor=_rgba(color, alpha), showlegend=False, hoverinfo="skip", customdata=cd))
        if "p50" in q:
            fig.add_trace(trace(x=x, y=q["p50"], mode="lines", name=f"{b['run']} median",
                                line={"color": color, "width": 1.8}, customdata=cd))
        if "mean" in q:
            fig.add_trace(trace(x=x, y=q["mean"], mode="lines", name=f"{b['run']} mean",
                                line={"color": color, "width": 1, "dash": "dot"}, customdata=cd))
    return _layout(fig, title)


def _rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def is_heatmap_figure(run: str, idx: int, hm: dict[str, Any]) -> go.Figure:
    """IS weights over steps: x = step, y = log10(weight) bin, colour = fraction of the step's tokens."""
    counts = np.asarray(hm["counts"], dtype=np.float64)
    edges = np.asarray(hm["log10_edges"])
    centres = (edges[:-1] + edges[1:]) / 2
    tot = counts.sum(axis=1, keepdims=True)
    frac = np.divide(counts, tot, out=np.zeros_like(counts), where=tot > 0)
    z = np.where(frac > 0, np.log10(np.maximum(frac, 1e-12)), np.nan).T
    cd = np.full(z.shape, idx, dtype=np.int16)
    fig = go.Figure(go.Heatmap(
        x=np.asarray(hm["steps"]), y=centres, z=z, customdata=cd, colorscale="Viridis",
        colorbar={"title": {"text": "log10 frac", "side": "right"}, "thickness": 10},
        hovertemplate="step %{x}<br>log10 w %{y:.2f}<br>log10 fraction %{z:.2f}<extra></extra>",
    ))
    fig.add_hline(y=0, line={"color": "white", "width": 1, "dash": "dot"})
    fig = _layout(fig, f"{run}: IS weight exp(old - rollout) per step ({hm['source']})", height=300,
                  ytitle="log10 weight")
    fig.update_layout(hovermode="closest")
    return fig


def is_step_figure(detail: dict[str, Any], step: int) -> go.Figure:
    """Raw vs applied IS weights of one step (log-spaced bins)."""
    edges = np.asarray(detail["edges"])
    centres = (edges[:-1] + edges[1:]) / 2
    fig = go.Figure()
    if "raw" in detail:
        fig.add_trace(go.Bar(x=centres, y=detail["raw"], name="raw", marker_color="#1f77b4", opacity=0.6))
    if "applied" in detail:
        fig.add_trace(go.Bar(x=centres, y=detail["applied"], name="applied (truncated / masked / vetoed)",
                             marker_color="#d62728", opacity=0.6))
    fig.update_layout(barmode="overlay", bargap=0)
    fig = _layout(fig, f"step {step}: raw vs applied IS weights", height=260, ytitle="tokens")
    fig.update_xaxes(title="log10 weight")
    fig.update_layout(hovermode="closest")
    return fig


def delta_figure(metric: str, a: str, b: str, x: np.ndarray, y: np.ndarray) -> go.Figure:
    trace = _scatter(len(x))
    fig = go.Figure(trace(x=x, y=y, mode="lines+markers" if len(x) <= 60 else "lines", name=f"{b} - {a}",
                          line={"color": "#444", "width": 1.5}, marker={"size": 4},
                          customdata=np.full(len(x), -1, dtype=np.int16)))
    fig.add_hline(y=0, line={"color": "#999", "width": 1})
    return _layout(fig, f"{metric}: {b} - {a}")


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 12, "color": "#777"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, "", height=120)
