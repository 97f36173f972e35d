"""The Rewards page's own panels: quantile bands (p05-p95, p25-p75, median, mean) of the total
reward, each reward function and the completion lengths, and two samples-derived curves, before
the families' curves (see :mod:`grpolens.serve.pages.curves`)."""

from __future__ import annotations

import re

import numpy as np
import polars as pl

from grpolens.serve import data, downloads, figures, urlstate
from grpolens.serve.components import graph
from grpolens.serve.runs import RunSet

#: The page's frames carry the samples-derived series (the bands' quantiles).
WITH_SAMPLES = True


def before(view) -> list:
    out = reward_graphs(view.runs, view.names, view.frames, view.lo, view.hi)
    for col in (f"{data.SAMPLES_PREFIX}zero_std_group_frac", f"{data.SAMPLES_PREFIX}truncated_frac"):
        out.append(view.curve(col))
    return out


def drawn_elsewhere(view) -> set[str]:
    """The quantile columns: drawn as bands, not as curves of their own."""
    return {c for f in view.frames for c in f.columns if re.search(r"/p\d\d$", c)}


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
            out.append(graph(f"rewards:band:{k}", figures.band_figure(title, bands),
                              downloads.link("band", runs=[b["run"] for b in bands], key=k, **{"from": lo, "to": hi})))
    return out


def _recomputed_twin(key: str) -> str:
    """The recomputed metric prefix holding the same quantiles as a samples-derived one."""
    if key == "reward":
        return "reward"
    if key.startswith("reward/"):
        return "rewards/" + key[len("reward/"):]
    return key


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


def _band_csv(runs: RunSet, search: str):
    q = urlstate.decode("curves", search, runs.names)
    key = downloads.name(urlstate.parse_query(search), "key")
    return f"{key}-quantiles", band_rows(runs, downloads.need(q, "runs"), key, q.get("from"), q.get("to"))


CSV = {"band": _band_csv}
