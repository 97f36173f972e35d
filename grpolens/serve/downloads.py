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

import numpy as np
import polars as pl

from grpolens.errors import UserError
from grpolens.run import format as fmt
from grpolens.serve import data, urlstate
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


def _name(args: dict[str, list[str]], key: str) -> str:
    v = (args.get(key) or [None])[-1]
    if v is None or not _NAME.match(v):
        raise UserError(f"CSV download: give a valid {key}=")
    return v


def _need(q: dict, key: str):
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


def _bounds(q: dict) -> tuple[int | None, int | None]:
    return q.get("from"), q.get("to")


def curve_rows(runs: RunSet, names: list[str], metric: str, lo=None, hi=None, smoothing: float = 0.0) -> pl.DataFrame:
    """Every logged point of ``metric`` per run in ``[lo, hi]``: run, step, value (and the smoothed
    value the chart draws when smoothing)."""
    frames = []
    for n in names:
        c = data.curve(data.series(runs.path(n)), metric, lo, hi, smoothing, max_points=2**62)
        cols = {"run": [n] * len(c["x"]), "step": c["x"], "value": c["y"]}
        if smoothing > 0:
            cols["smoothed"] = c["smooth"]
        frames.append(pl.DataFrame(cols, schema={"run": pl.String, "step": pl.Int64, "value": pl.Float64,
                                                 **({"smoothed": pl.Float64} if smoothing > 0 else {})}))
    return pl.concat(frames) if frames else pl.DataFrame()


def band_rows(runs: RunSet, names: list[str], key: str, lo=None, hi=None) -> pl.DataFrame:
    """The quantiles of ``key`` per step and run (a Rewards band chart)."""
    frames = []
    for n in names:
        f = data.series(runs.path(n), with_samples=True)
        cols = [f"{key}/{q}" for q in ("p05", "p25", "p50", "p75", "p95", "mean") if f"{key}/{q}" in f.columns]
        if f"{key}/p50" not in cols:
            continue
        d = f.select("step", *cols)
        if lo is not None:
            d = d.filter(pl.col("step") >= lo)
        if hi is not None:
            d = d.filter(pl.col("step") <= hi)
        d = d.rename({c: c.rsplit("/", 1)[1] for c in cols}).with_columns(pl.lit(n).alias("run"))
        frames.append(d.select("run", "step", *[c.rsplit("/", 1)[1] for c in cols]))
    return pl.concat(frames, how="diagonal") if frames else pl.DataFrame()


def delta_rows(runs: RunSet, a: str, b: str, metric: str, lo=None, hi=None) -> pl.DataFrame:
    """A Compare delta curve: the common steps with both runs' values and B - A."""
    fa, fb = data.series(runs.path(a)), data.series(runs.path(b))
    if metric not in fa.columns or metric not in fb.columns:
        raise UserError(f"CSV download: {metric} is not in both {a} and {b}")
    j = fa.select("step", pl.col(metric).alias("a")).join(fb.select("step", pl.col(metric).alias("b")), on="step")
    if lo is not None:
        j = j.filter(pl.col("step") >= lo)
    if hi is not None:
        j = j.filter(pl.col("step") <= hi)
    return j.sort("step").with_columns((pl.col("b") - pl.col("a")).alias("b_minus_a"))


def hist_rows(edges, **counts) -> pl.DataFrame:
    edges = np.asarray(edges, dtype=np.float64)
    return pl.DataFrame({"log10_lo": edges[:-1], "log10_hi": edges[1:],
                         **{k: np.asarray(v) for k, v in counts.items()}})


def build(runs: RunSet, what: str, search: str) -> tuple[str, pl.DataFrame]:
    """``(file name, rows)`` of download ``what`` for the query ``search``."""
    args = urlstate.parse_query(search)
    names = runs.names
    if what == "curve":
        q = urlstate.decode("curves", search, names)
        metric = _name(args, "metric")
        df = curve_rows(runs, _need(q, "runs"), metric, *_bounds(q), q.get("smooth", 0.0))
        return f"{metric}", df
    if what == "band":
        q = urlstate.decode("curves", search, names)
        key = _name(args, "key")
        return f"{key}-quantiles", band_rows(runs, _need(q, "runs"), key, *_bounds(q))
    if what == "delta":
        q = urlstate.decode("compare", search, names)
        metric = _name(args, "metric")
        return f"{metric}-{q.get('b')}-minus-{q.get('a')}", delta_rows(runs, _need(q, "a"), _need(q, "b"), metric,
                                                                       *_bounds(q))
    if what == "compare":
        q = urlstate.decode("compare", search, names)
        a, b = _need(q, "a"), _need(q, "b")
        return f"compare-{a}-{b}", data.compare(data.series(runs.path(a)), data.series(runs.path(b)), *_bounds(q))
    if what == "is_hist":
        q = urlstate.decode("tokens", search, names)
        run = _need(q, "run")
        hm = data.is_heatmap(runs.path(run))
        counts = np.asarray(hm["counts"])
        edges = np.asarray(hm["log10_edges"], dtype=np.float64)
        steps = np.repeat(np.asarray(hm["steps"], dtype=np.int64), max(len(edges) - 1, 0))
        df = pl.DataFrame({"step": steps, "log10_lo": np.tile(edges[:-1], len(hm["steps"])),
                           "log10_hi": np.tile(edges[1:], len(hm["steps"])),
                           "tokens": counts.reshape(-1).astype(np.int64) if counts.size else np.zeros(0, np.int64)})
        return f"{run}-is-weights-per-step", df
    if what == "is_step":
        q = urlstate.decode("tokens", search, names)
        run, step = _need(q, "run"), _need(q, "step")
        d = data.is_step_detail(runs.path(run), step)
        if "raw" not in d:
            raise UserError(f"CSV download: {run} step {step} has no IS weights")
        return f"{run}-step{step}-is-weights", hist_rows(d["edges"], raw=d["raw"], applied=d["applied"])
    if what == "tokens":
        q = urlstate.decode("tokens", search, names, {"by": data.RANK_BY})
        run, step = _need(q, "run"), _need(q, "step")
        by = q.get("by", "kl")
        return f"{run}-step{step}-top-tokens-by-{by}", data.top_tokens(runs.path(run), step, by, q.get("k", 50))
    if what == "completion":
        q = urlstate.decode("tokens", search, names)
        run, step, sample = _need(q, "run"), _need(q, "step"), _need(q, "sample")
        c = data.completion(runs.path(run), step, sample)
        if c is None:
            raise UserError(f"CSV download: sample {sample} is not in {run} step {step}")
        toks = c["tokens"]
        if toks.height and "token_id" in toks.columns:
            decode, _ = data.decoder(runs.path(run))
            toks = toks.with_columns(pl.col("token_id").map_elements(lambda t: decode(int(t)), return_dtype=pl.String)
                                     .alias("token"))
        return f"{run}-step{step}-sample{sample}-tokens", toks
    if what == "completions":
        q = urlstate.decode("completions", search, names)
        run, step = _need(q, "run"), _need(q, "step")
        yes_no = {"yes": True, "no": False}
        rows, _ = data.completions_page(runs.path(run), step, 0, 2**31, q.get("sort"), q.get("where"),
                                        group=q.get("group"), truncated=yes_no.get(q.get("truncated", "any")),
                                        vetoed=yes_no.get(q.get("vetoed", "any")), max_rank=q.get("rank"))
        return f"{run}-step{step}-completions", rows
    if what == "runs":
        from grpolens.serve.data.runtable import runs_table

        return "runs", runs_table(runs.runs)
    if what == "sweep":
        q = urlstate.decode("tokens", search, names)
        run = _need(q, "run")
        file = _name(args, "file")
        d = fmt.derived_dir(runs.path(run))
        allowed = {p.name: p for p in d.glob("*sweep*.parquet")} if d.is_dir() else {}
        if file not in allowed:
            raise UserError(f"CSV download: {run} has no sweep table {file!r}")
        return f"{run}-{file.removesuffix('.parquet')}", pl.read_parquet(allowed[file])
    raise UserError(f"CSV download: unknown table {what!r}")


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
