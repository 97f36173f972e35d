"""Small pieces every page builds with: error boxes, charts, labelled controls, table rows and
columns, CSV links, the guard that turns a user error into an error box."""

from __future__ import annotations

import math
from typing import Any

import polars as pl
from dash import dcc, html, no_update
from dash.dash_table.Format import Format, Scheme

from grpolens.errors import RunFormatError, UserError
from grpolens.plot_config import plot_config

#: Every dcc.Graph gets this config: no "Share chart" upload button (see grpolens.plot_config).
GRAPH_CONFIG = plot_config()
SCORE_LABELS = {"kl": "KL to ref", "mismatch": "|Δ| train-rollout", "ratio": "ratio", "entropy": "entropy",
                "adv_ratio": "|A·(ratio-1)|", "advantage": "advantage"}
TABLE_STYLE = dict(
    style_table={"overflowX": "auto"},
    style_cell={"fontFamily": "ui-monospace, SFMono-Regular, Menlo, monospace", "fontSize": "12px",
                "padding": "3px 6px", "maxWidth": "420px", "overflow": "hidden", "textOverflow": "ellipsis",
                "whiteSpace": "nowrap"},
    style_header={"fontWeight": "600", "backgroundColor": "#f3f4f6"},
)


def labelled(label: str, component, cls: str = "ctl") -> html.Label:
    return html.Label([html.Span(label, className="ctl-label"), component], className=cls)


def run_options(runs, names: list[str] | None = None) -> list[dict]:
    return [{"label": n + (" (baseline)" if n == runs.baseline else ""), "value": n}
            for n in (runs.names if names is None else names)]


def graph(key: str, fig, csv: str | None = None, doc: str | None = None, log_toggle: bool = False):
    """A clickable chart; with ``csv`` (a :func:`downloads.link`), a "CSV" link to the data behind it;
    with ``doc``, the metric's description in full under it (a chart title would cut it); with
    ``log_toggle``, its own "log y" box (redrawn in the browser: see :mod:`grpolens.serve.callbacks`)."""
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


def guard(fn, n_out: int):
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


def fmt_value(v: Any) -> str:
    """A number as the pages show it (4 significant digits), ``—`` for none."""
    if v is None:
        return "—"
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.4g}"
    return str(v)


def error_box(message: str) -> html.Div:
    return html.Div(message, className="error")


def rows_json(df: pl.DataFrame) -> list[dict]:
    """Rows for a DataTable: non-finite floats become null (JSON has no NaN)."""
    out = []
    for row in df.iter_rows(named=True):
        out.append({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()})
    return out


def table_columns(df: pl.DataFrame, hidden: tuple[str, ...] = ("id",)) -> list[dict]:
    cols = []
    for name, dtype in df.schema.items():
        if name in hidden:
            continue
        if dtype.is_float():
            cols.append({"name": name, "id": name, "type": "numeric",
                         "format": Format(precision=4, scheme=Scheme.decimal_or_exponent)})
        elif dtype.is_numeric():
            cols.append({"name": name, "id": name, "type": "numeric"})
        else:
            cols.append({"name": name, "id": name, "type": "text"})
    return cols


def csv_anchor(href: str, label: str = "CSV") -> html.A:
    return html.A(label, href=href, download="", className="csv-link",
                  title="download the data behind this view as CSV (all rows, not a picture)")


#: Shades of the diverging cell colours (the top one also takes everything beyond the robust range).
_SHADES = (0.12, 0.25, 0.4, 0.55)


def robust_scale(values) -> float | None:
    """The 99th percentile of the finite |values|: the colour scale's end, so a single huge value
    (a χ² of 1.4e16) saturates its own cell instead of washing every other cell out."""
    import numpy as np

    a = np.abs(np.asarray([v for v in values if v is not None], dtype=np.float64))
    a = a[np.isfinite(a)]
    if a.size == 0:
        return None
    s = float(np.percentile(a, 99))
    return s if s > 0 else (float(a.max()) or None)


def diverging_cell_styles(df: pl.DataFrame, columns: list[str]) -> list[dict]:
    """DataTable ``style_data_conditional`` colouring each column's cells by sign (red > 0 > blue)
    and size, in shades up to the column's robust scale (:func:`robust_scale`); beyond it, the
    darkest shade."""
    styles: list[dict] = []
    n = len(_SHADES)
    for c in columns:
        if c not in df.columns:
            continue
        scale = robust_scale(df[c].to_list())
        if scale is None:
            continue
        edges = [scale * i / n for i in range(1, n)]  # shade i: |v| in [edges[i-1], edges[i])
        for i, alpha in enumerate(_SHADES):
            lo = edges[i - 1] if i else 0.0
            hi = edges[i] if i < n - 1 else None
            for sign, rgb in ((1, "214,39,40"), (-1, "31,119,180")):
                a, b = (lo, hi) if sign > 0 else ((-hi if hi is not None else None), -lo)
                parts = []
                if sign > 0:
                    parts.append(f"{{{c}}} > {a!r}" if i == 0 else f"{{{c}}} >= {a!r}")
                    if b is not None:
                        parts.append(f"{{{c}}} < {b!r}")
                else:
                    parts.append(f"{{{c}}} < {b!r}" if i == 0 else f"{{{c}}} <= {b!r}")
                    if a is not None:
                        parts.append(f"{{{c}}} > {a!r}")
                styles.append({"if": {"filter_query": " && ".join(parts), "column_id": c},
                               "backgroundColor": f"rgba({rgb},{alpha})"})
    return styles
