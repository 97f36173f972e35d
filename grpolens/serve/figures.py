"""Plotly figures of the dashboard, as plain dicts with numpy data sent as typed arrays.

Building ``go.Figure`` objects validates every property and deep-copies a template: ~0.3 s per
figure, more than everything else on a page. Dicts skip that; the arrays go out base64-encoded
(``{"dtype", "bdata"}``, which plotly.js reads natively), several times smaller and faster than
JSON number lists. Long curves use WebGL traces (``scattergl``). Every point carries its run's
index as ``customdata`` so that a click on any curve tells the server which run and step to open.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
BASELINE_COLOR = "#555555"
#: Above this many points a curve is drawn with WebGL.
GL_THRESHOLD = 500
_DTYPES = {"float64": "f8", "float32": "f4", "int32": "i4", "int16": "i2", "int8": "i1", "uint8": "u1",
           "uint16": "u2", "uint32": "u4"}


def typed(a: Any) -> Any:
    """A numpy array as a plotly.js typed-array spec (int64 narrowed to int32 when it fits)."""
    a = np.asarray(a)
    if a.dtype == np.int64:
        if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
            return a.astype(np.float64).tolist()
        a = a.astype(np.int32)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    code = _DTYPES.get(str(a.dtype))
    if code is None or a.size == 0:
        return a.tolist()
    spec = {"dtype": code, "bdata": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")}
    if a.ndim > 1:
        spec["shape"] = ", ".join(str(s) for s in a.shape)
    return spec


def run_color(idx: int) -> str:
    return PALETTE[idx % len(PALETTE)]


#: Right margin of a figure (px): room for plotly's vertical mode bar (about 30 px wide).
MODEBAR_MARGIN = 36


def _axis(**extra) -> dict:
    return {"gridcolor": "#eceff4", "zeroline": False, "linecolor": "#d0d7de", "exponentformat": "e",
            "showexponent": "all", **extra}


def _layout(title: str, height: int = 260, ytitle: str | None = None, **extra) -> dict:
    return {
        "title": {"text": title, "x": 0.01, "font": {"size": 13}},
        # the right margin holds the vertical mode bar, so it covers neither the legend nor the plot
        "height": height, "margin": {"l": 55, "r": MODEBAR_MARGIN, "t": 34, "b": 32},
        "paper_bgcolor": "white", "plot_bgcolor": "white", "font": {"size": 11, "color": "#2a3f5f"},
        "hovermode": "x unified", "uirevision": "keep", "modebar": {"orientation": "v"},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right", "font": {"size": 10}},
        "xaxis": _axis(), "yaxis": _axis(title={"text": ytitle} if ytitle else None),
        **extra,
    }


def _kind(n: int) -> str:
    return "scattergl" if n > GL_THRESHOLD else "scatter"


#: The share of the visible values the robust y range leaves out at each end (p1 to p99).
ROBUST_QUANTILES = (0.01, 0.99)
#: ... and the range between those quantiles is widened by this share of itself on each side.
ROBUST_PAD = 0.05


def y_axis_scale(values: np.ndarray, log: bool = False, robust: bool = False) -> tuple[dict, str]:
    """The y axis settings for the values a figure shows, and a note for its title (or "").

    ``log``: a log axis. Plotly cannot place a value <= 0 on it and leaves such points out, so the
    note says how many are hidden; with no positive value at all the axis stays linear.
    ``robust``: the range spans only p1-p99 of the visible values (of the positive ones on a log
    axis), so one spike cannot flatten the rest of the curve; the points outside are cut off."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    axis: dict = {}
    note = ""
    if log:
        pos = v[v > 0]
        if pos.size == 0:
            note = "no positive value: linear y" if v.size else ""
            log = False
        else:
            axis["type"] = "log"
            if pos.size < v.size:
                note = f"{v.size - pos.size} value(s) ≤ 0 not drawn on log y"
            v = pos
    if robust and v.size:
        lo, hi = np.quantile(v, ROBUST_QUANTILES)
        if log:
            lo, hi = np.log10(lo), np.log10(hi)
        if hi > lo:
            pad = ROBUST_PAD * (hi - lo)
            axis["range"] = [float(lo - pad), float(hi + pad)]
            axis["autorange"] = False
    return axis, note


def curve_figure(title: str, lines: list[dict[str, Any]], verdicts: list[dict] | None = None,
                 log_y: bool = False, robust_y: bool = False) -> dict:
    """One metric for several runs. ``lines``: dicts with ``run``, ``idx`` (run index),
    ``x``, ``y``, ``smooth`` (or None) and ``baseline`` (drawn dashed grey). ``log_y`` and
    ``robust_y``: see :func:`y_axis_scale` (applied to the drawn values: smoothed when smoothing)."""
    traces = []
    for ln in lines:
        x, y, smooth = ln["x"], ln["y"], ln.get("smooth")
        color = BASELINE_COLOR if ln.get("baseline") else run_color(ln["idx"])
        name = f"{ln['run']} (baseline)" if ln.get("baseline") else ln["run"]
        cd = {"customdata": typed(np.full(len(x), ln["idx"], dtype=np.int16))}
        dash = "dash" if ln.get("baseline") else "solid"
        base = {"type": _kind(len(x)), "x": typed(x), "name": name, "legendgroup": name}
        if smooth is not None:  # the raw curve faint behind, not hoverable (so it needs no customdata)
            traces.append({**base, "y": typed(y), "mode": "lines", "showlegend": False, "opacity": 0.3,
                           "hoverinfo": "skip", "line": {"color": color, "width": 1, "dash": dash}})
            traces.append({**base, **cd, "y": typed(smooth), "mode": "lines",
                           "line": {"color": color, "width": 2, "dash": dash}})
        else:
            traces.append({**base, **cd, "y": typed(y), "mode": "lines+markers" if len(x) <= 60 else "lines",
                           "line": {"color": color, "width": 1.6, "dash": dash}, "marker": {"size": 4}})
    shapes, notes = [], []
    for v in [v for v in (verdicts or []) if v.get("step") is not None][:20]:
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": v["step"], "x1": v["step"], "y0": 0, "y1": 1,
                       "line": {"color": "#d62728", "width": 1, "dash": "dot"}})
        notes.append({"x": v["step"], "y": 1, "xref": "x", "yref": "paper", "text": v.get("status") or "check",
                      "showarrow": False, "font": {"size": 9, "color": "#d62728"}, "yanchor": "bottom"})
    layout = _layout(title, shapes=shapes, annotations=notes)
    shown = [np.asarray(ln["y"] if ln.get("smooth") is None else ln["smooth"], dtype=np.float64) for ln in lines]
    axis, note = y_axis_scale(np.concatenate(shown) if shown else np.zeros(0), log_y, robust_y)
    # one uirevision per scale, so that switching it drops a zoom kept from the other scale
    layout["yaxis"].update(axis, uirevision=f"log={log_y},robust={robust_y}")
    if note:
        layout["title"]["text"] += f" <span style='font-size:10px;color:#b54708'>({note})</span>"
    return {"data": traces, "layout": layout}


def band_figure(title: str, bands: list[dict[str, Any]]) -> dict:
    """Quantile bands over steps: per run, p05-p95 and p25-p75 shaded, the median as a line.
    ``bands``: dicts with ``run``, ``idx``, ``x`` and ``q`` = {"p05": y, ..., "p95": y, "mean": y}."""
    traces = []
    for b in bands:
        x, q, color = b["x"], b["q"], run_color(b["idx"])
        base = {"type": _kind(len(x)), "x": typed(x), "customdata": typed(np.full(len(x), b["idx"], dtype=np.int16))}
        for lo, hi, alpha in (("p05", "p95", 0.12), ("p25", "p75", 0.25)):
            if lo in q and hi in q:
                traces.append({**base, "y": typed(q[hi]), "mode": "lines", "line": {"width": 0, "color": color},
                               "showlegend": False, "hoverinfo": "skip"})
                traces.append({**base, "y": typed(q[lo]), "mode": "lines", "line": {"width": 0, "color": color},
                               "fill": "tonexty", "fillcolor": _rgba(color, alpha), "showlegend": False,
                               "hoverinfo": "skip"})
        if "p50" in q:
            traces.append({**base, "y": typed(q["p50"]), "mode": "lines", "name": f"{b['run']} median",
                           "line": {"color": color, "width": 1.8}})
        if "mean" in q:
            traces.append({**base, "y": typed(q["mean"]), "mode": "lines", "name": f"{b['run']} mean",
                           "line": {"color": color, "width": 1, "dash": "dot"}})
    return {"data": traces, "layout": _layout(title)}


def _rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def is_heatmap_figure(run: str, idx: int, hm: dict[str, Any]) -> dict:
    """IS weights over steps: x = step, y = log10(weight) bin, colour = log10 of the fraction of
    the step's tokens in the bin. The y range is cut to the bins that hold any token."""
    counts = np.asarray(hm["counts"], dtype=np.float64)
    edges = np.asarray(hm["log10_edges"], dtype=np.float64)
    centres = (edges[:-1] + edges[1:]) / 2
    tot = counts.sum(axis=1, keepdims=True)
    frac = np.divide(counts, tot, out=np.zeros_like(counts), where=tot > 0)
    used = np.flatnonzero(counts.sum(axis=0) > 0)
    lo, hi = (used[0], used[-1] + 1) if used.size else (0, len(centres))
    lo, hi = max(0, lo - 2), min(len(centres), hi + 2)
    z = np.where(frac > 0, np.log10(np.maximum(frac, 1e-12)), np.nan)[:, lo:hi].T
    # y given as the hi - lo + 1 bin edges: plotly draws each row between its edges (bins may be uneven)
    trace = {"type": "heatmap", "x": typed(np.asarray(hm["steps"])), "y": typed(edges[lo:hi + 1]), "z": typed(z),
             "customdata": typed(np.full(z.shape, idx, dtype=np.int16)), "colorscale": "Viridis",
             "colorbar": {"title": {"text": "log10 frac", "side": "right"}, "thickness": 10},
             "hovertemplate": "step %{x}<br>log10 w %{y:.3f}<br>log10 fraction %{z:.2f}<extra></extra>"}
    layout = _layout(f"{run}: IS weight exp(old - rollout) per step ({hm['source']})", height=300,
                     ytitle="log10 weight", hovermode="closest")
    return {"data": [trace], "layout": layout}


def is_step_figure(detail: dict[str, Any], step: int) -> dict:
    """Raw vs applied IS weights of one step (log-spaced bins), zoomed to the occupied bins."""
    edges = np.asarray(detail["edges"], dtype=np.float64)
    centres = (edges[:-1] + edges[1:]) / 2
    raw = np.asarray(detail.get("raw", np.zeros(len(centres))))
    used = np.flatnonzero(raw > 0)
    lo, hi = (used[0], used[-1] + 1) if used.size else (0, len(centres))
    lo, hi = max(0, lo - 3), min(len(centres), hi + 3)
    traces = []
    for key, name, color in (("raw", "raw", "#1f77b4"), ("applied", "applied (truncated / masked / vetoed)", "#d62728")):
        if key in detail:
            traces.append({"type": "bar", "x": typed(centres[lo:hi]), "y": typed(np.asarray(detail[key], float)[lo:hi]),
                           "width": typed(np.diff(edges)[lo:hi]), "name": name, "marker": {"color": color},
                           "opacity": 0.55})
    layout = _layout(f"step {step}: raw vs applied IS weights", ytitle="tokens", hovermode="closest",
                     barmode="overlay", bargap=0)
    layout["xaxis"] = _axis(title={"text": "log10 weight"})
    return {"data": traces, "layout": layout}


def delta_figure(metric: str, a: str, b: str, x: np.ndarray, y: np.ndarray, idx_b: int) -> dict:
    trace = {"type": _kind(len(x)), "x": typed(x), "y": typed(y), "mode": "lines+markers" if len(x) <= 60 else "lines",
             "name": f"{b} - {a}", "line": {"color": "#444", "width": 1.5}, "marker": {"size": 4},
             "customdata": typed(np.full(len(x), idx_b, dtype=np.int16))}
    layout = _layout(f"{metric}: {b} - {a}")
    layout["shapes"] = [{"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": 0, "y1": 0,
                         "line": {"color": "#999", "width": 1}}]
    return {"data": [trace], "layout": layout}


def profile_figure(pos: np.ndarray, values: np.ndarray, label: str, focus: int | None = None) -> dict:
    """One completion's score along its positions (the chips below show the same, token by token)."""
    trace = {"type": _kind(len(pos)), "x": typed(pos), "y": typed(values), "mode": "lines+markers" if len(pos) <= 300
             else "lines", "line": {"color": "#d62728", "width": 1.2}, "marker": {"size": 3}, "name": label,
             "hovertemplate": "pos %{x}<br>" + label + " %{y:.4g}<extra></extra>"}
    layout = _layout(f"{label} along the completion", height=170, hovermode="closest", showlegend=False)
    layout["margin"] = {"l": 55, "r": 10, "t": 28, "b": 28}
    if focus is not None:
        layout["shapes"] = [{"type": "line", "xref": "x", "yref": "paper", "x0": focus, "x1": focus, "y0": 0, "y1": 1,
                             "line": {"color": "#111", "width": 1, "dash": "dot"}}]
    return {"data": [trace], "layout": layout}
