"""CSV of the data behind every chart and table of the dashboard: ``GET /csv/<what>?<query>``.

Each chart and table carries a "CSV" link whose query is the view's own (the same keys as the
page's URL, see :mod:`grpolens.serve.urlstate`, plus the chart's metric); the server rebuilds the
rows from the run's files with the same data functions the page uses, but whole: every step in the
range (curves are never downsampled here), every completion of the selection (not one page).

The query is untrusted like any URL: runs go through the allow-list, numbers and choices through
:func:`urlstate.decode`, metric names must look like metric names. Text cells that a spreadsheet
would run as a formula (starting with ``=``, ``+``, ``-``, ``@``, tab or carriage return: model text
can) are prefixed with ``'``, the usual defence against CSV injection; numbers are written as is.
"""

from __future__ import annotations

import io
import re
from typing import Any
from urllib.parse import urlencode

import polars as pl

from grpolens.errors import UserError
from grpolens.serve.runs import RunSet

PREFIX = "/csv/"
_NAME = re.compile(r"^[\w/.:@+\-]{1,160}$")
_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def link(what: str, **params: Any) -> str:
    """The href of a CSV download (None/empty parameters left out, lists repeated)."""
    pairs = []
    for k, v in params.items():
        if v is None or v == "" or v == []:
            continue
        pairs += [(k, str(x)) for x in v] if isinstance(v, (list, tuple)) else [(k, str(v))]
    return PREFIX + what + ("?" + urlencode(pairs) if pairs else "")


def name(args: dict[str, list[str]], key: str) -> str:
    """A metric-like name given as ``key=`` (one line naming the key when missing or malformed)."""
    v = (args.get(key) or [None])[-1]
    if v is None or not _NAME.match(v):
        raise UserError(f"CSV download: give a valid {key}=")
    return v


def need(q: dict, key: str):
    """A decoded key the download cannot do without."""
    if key not in q:
        raise UserError(f"CSV download: give a valid {key}=")
    return q[key]


def _safe_text(df: pl.DataFrame) -> pl.DataFrame:
    """Text cells cannot start a spreadsheet formula; nested columns become their text form."""
    out = []
    for name, dtype in df.schema.items():
        col = pl.col(name)
        if dtype == pl.String:
            starts = pl.any_horizontal([col.str.starts_with(p) for p in _FORMULA])
            out.append(pl.when(starts).then(pl.lit("'") + col).otherwise(col).alias(name))
        elif isinstance(dtype, (pl.List, pl.Array, pl.Struct, pl.Object)):
            out.append(col.map_elements(str, return_dtype=pl.String).alias(name))
    return df.with_columns(out) if out else df


def to_csv(df: pl.DataFrame) -> str:
    buf = io.StringIO()
    _safe_text(df).write_csv(buf)
    return buf.getvalue()


def build(runs: RunSet, what: str, search: str) -> tuple[str, pl.DataFrame]:
    """``(file name, rows)`` of download ``what`` for the query ``search``: the builder the page
    offering it declares (:func:`grpolens.serve.pages.csv_builders`)."""
    from grpolens.serve.pages import csv_builders

    builder = csv_builders().get(what) if isinstance(what, str) else None
    if builder is None:
        raise UserError(f"CSV download: unknown table {what!r}")
    return builder(runs, search)


def file_name(stem: str) -> str:
    return "grpolens-" + re.sub(r"[^\w.\-]+", "_", stem)[:150] + ".csv"


def register(app, runs: RunSet) -> None:
    """The ``/csv/<what>`` route on the dashboard's Flask server."""
    from flask import Response, request

    from grpolens.run.format import RunFormatError

    @app.server.route(PREFIX + "<what>")
    def csv_download(what: str):
        try:
            stem, df = build(runs, what, request.query_string.decode("utf-8", "replace"))
        except (UserError, RunFormatError) as e:
            msg = e.message if isinstance(e, UserError) else str(e)
            return Response(msg + "\n", status=400, mimetype="text/plain")
        return Response(to_csv(df), mimetype="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="{file_name(stem)}"'})
