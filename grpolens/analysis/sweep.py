"""``grpolens sweep``: rollout-IS thresholds over a grid, every grid point in one pass over the tokens.

Each token shard is read once; for every grid point the per-sequence partials of
:func:`grpolens.functional.rollout_is.sequence_partials` are taken on that shard's batch (δ and the valid
tokens are computed once per shard), merged per step and summarised by
:func:`grpolens.functional.rollout_is.summarize` -- the same functions ``recompute`` uses, so a grid point's
row equals the ``rollout_is/*`` metrics of a recompute with that config.

Loss mass removed (``loss_mass_removed``): Σ|A| over valid tokens that leave the loss (mask band,
veto, rejection filters) or get weight 0 (IcePop), divided by Σ|A| over valid tokens.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import polars as pl

from grpolens.metrics.engine import Visitor
from grpolens.run import format as fmt
from grpolens.functional import rollout_is as ris
from grpolens.errors import UserError
from grpolens.metrics.batch import KEY_COLUMNS, TokenBatch
from grpolens.functional.rollout_is import ISConfig

#: ``rollout_is`` keys a sweep may vary (``--param rollout_is.<key>=v1,v2,...``).
SWEEPABLE = ("level", "mode", "lower", "upper", "mask_lower", "mask_upper", "veto_lower", "veto_upper")
MAX_POINTS = 512
READ = ("step", "rank", "micro_batch", "sample_id", "pos", "logp", "old_logp", "rollout_logp", "advantage", "mask")
#: Columns of the sweep table besides step, point and the parameters (canonical metric keys).
COLUMNS = ("valid_tokens", "veto/seq_fraction", "veto/catastrophic_token_fraction", "mask/token_fraction",
           "mask/seq_fraction", "rejected/token_fraction", "rejected/seq_fraction", "modified/token_fraction",
           "modified/seq_fraction", "truncated_fraction", "zeroed_fraction", "raw/mean", "raw/max", "raw/ess",
           "applied/mean", "applied/max", "applied/min", "applied/ess", "loss_mass_removed")


def _value(key: str, text: str) -> Any:
    t = text.strip()
    if key in ("level", "mode"):
        return t
    if t.lower() in ("none", "null", "off"):
        return None
    try:
        return float(t)
    except ValueError:
        raise UserError(f"--param rollout_is.{key}: {t!r} is not a number (or 'none')") from None


def parse_params(items: list[str]) -> dict[str, list[Any]]:
    """``rollout_is.upper=1.5,2,3`` -> ``{"upper": [1.5, 2.0, 3.0]}`` (order kept, repeats rejected)."""
    out: dict[str, list[Any]] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--param: expected rollout_is.KEY=V1,V2,..., got {item!r}")
        name, values = item.split("=", 1)
        name = name.strip()
        key = name.removeprefix("rollout_is.")
        if not name.startswith("rollout_is.") or key not in SWEEPABLE:
            raise UserError(f"--param: {name!r} cannot be swept; use rollout_is.<key> with key one of {', '.join(SWEEPABLE)}")
        if key in out:
            raise UserError(f"--param: rollout_is.{key} given twice")
        vals = [_value(key, v) for v in values.split(",") if v.strip()]
        if not vals:
            raise UserError(f"--param: no values for rollout_is.{key}")
        out[key] = list(dict.fromkeys(vals))
    if not out:
        raise UserError("--param: give at least one rollout_is.KEY=V1,V2,... to sweep")
    return out


def grid(base: dict | None, params: dict[str, list[Any]], fixed: dict[str, Any] | None = None) -> list[tuple[dict, ISConfig]]:
    """Every combination of ``params`` applied to the (normalised) ``base`` rollout_is config.

    The mask band follows the IS band unless the run set it apart (as when normalising), and
    ``fixed`` (``--level``, ``--mode``) applies to every point. Returns (point, config) pairs.
    """
    from grpolens.run.config import normalize_rollout_is

    n = int(np.prod([len(v) for v in params.values()]))
    if n > MAX_POINTS:
        raise UserError(f"--param: the grid has {n} points; at most {MAX_POINTS} per sweep")
    start = dict(base or {})
    if start and (start.get("mask_lower"), start.get("mask_upper")) == (start.get("lower"), start.get("upper")):
        start.pop("mask_lower", None)
        start.pop("mask_upper", None)
    start.update({k: v for k, v in (fixed or {}).items() if v is not None})
    out = []
    for combo in itertools.product(*params.values()):
        point = dict(zip(params, combo))
        spec = {**start, **point}
        try:
            norm = normalize_rollout_is(spec)
        except UserError as e:
            shown = ", ".join(f"rollout_is.{k}={v}" for k, v in point.items())
            raise UserError(f"--param grid point {shown}: {e.message}") from None
        out.append((point, ISConfig.from_cfg(norm)))
    return out


class SweepVisitor(Visitor):
    """Per shard: the IS partials of every grid point; per step: one summary row per point."""

    name = "sweep"

    def __init__(self, configs: list[ISConfig]):
        self.configs = configs

    def shard(self, b: TokenBatch, shard) -> pl.DataFrame | None:
        if not b.has("rollout_logp") or b.n_seq == 0:
            return None
        x = ris.inputs(b)
        frames = []
        for i, c in enumerate(self.configs):
            cols = dict(b.seq_keys)
            cols.update(ris.sequence_partials(b, x, c))
            cols["point"] = np.full(b.n_seq, i, dtype=np.int64)
            frames.append(pl.DataFrame(cols))
        return pl.concat(frames)

    def combine(self, step: int, pieces: list) -> list[dict[str, float | None]] | None:
        parts = [p for p in pieces if p is not None]
        if not parts:
            return None
        df = pl.concat(parts, how="vertical_relaxed")
        rule = {"sum": pl.Expr.sum, "max": pl.Expr.max, "min": pl.Expr.min}
        df = (df.group_by(["point", *KEY_COLUMNS])
                .agg([rule[ris.IS_MERGE[c]](pl.col(c)).alias(c) for c in ris.IS_MERGE])
                .sort(["point", *KEY_COLUMNS]))
        rows = []
        for i, c in enumerate(self.configs):
            sub = df.filter(pl.col("point") == i)
            p = {k: sub[k].to_numpy() for k in sub.columns}
            rows.append(ris.summarize(p, c))
        return rows


def sweep(
    run: os.PathLike | str,
    params: dict[str, list[Any]],
    *,
    overrides: dict[str, Any] | None = None,
    config_file: os.PathLike | str | None = None,
    steps: str | None = None,
    level: str | None = None,
    mode: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    engine: Any = None,
) -> pl.DataFrame:
    """One row per (step, grid point): the parameters and the :data:`COLUMNS` statistics
    (``engine``: see :func:`grpolens.metrics.engine.make_engine`)."""
    from grpolens.metrics.engine import iter_steps
    from grpolens.run.reader import parse_steps, resolve_config

    from grpolens.run.reader import RunReader

    run = fmt.as_run(run)
    RunReader(run).check()
    cfg = resolve_config(run, overrides, Path(config_file) if config_file is not None else None)
    points = grid(cfg.get("rollout_is"), params, {"level": level, "mode": mode})
    lo, hi = parse_steps(steps)
    all_steps = fmt.list_steps(run, fmt.TOKENS)
    sel = [s for s in all_steps if (lo is None or s >= lo) and (hi is None or s <= hi)]
    if not all_steps:
        raise fmt.RunFormatError(run, "the run has no token shards (expected tokens/step=*/rank=*.parquet)")
    if not sel:
        raise UserError(f"--steps: no steps of the run fall in {lo}:{hi} (the run has steps {all_steps[0]}..{all_steps[-1]})")
    import pyarrow.parquet as pq

    first = fmt.list_shards(run, fmt.TOKENS, steps=[sel[0]])[0].path
    if "rollout_logp" not in pq.ParquetFile(fmt.parquet_source(first)).schema_arrow.names:
        raise UserError(f"sweep: {first} has no rollout_logp column; rollout IS needs the inference engine's log-probs")

    v = SweepVisitor([c for _, c in points])
    done = 0

    def tick(_step: int) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, len(sel))

    records = []
    for res in iter_steps(run, sel, [v], columns=READ, on_step=tick, engine=engine):
        rows = res.pieces[v.name]
        if rows is None:
            continue
        for i, ((point, _), row) in enumerate(zip(points, rows)):
            rec = {"step": res.step, "point": i, **{f"rollout_is.{k}": val for k, val in point.items()}}
            rec.update({k: row.get(k) for k in COLUMNS})
            records.append(rec)
    schema: dict[str, Any] = {"step": pl.Int64, "point": pl.Int64}
    for k in params:
        schema[f"rollout_is.{k}"] = pl.Utf8 if k in ("level", "mode") else pl.Float64
    schema.update({k: pl.Float64 for k in COLUMNS})
    return pl.DataFrame(records, schema=schema, orient="row")


def summary(df: pl.DataFrame, params: dict[str, list[Any]]) -> pl.DataFrame:
    """Per grid point over the steps: mean vetoed-sequence, rejected-token and removed-|A| shares,
    the worst step's rejected-token share, the lowest applied ESS and the largest applied weight."""
    keys = [f"rollout_is.{k}" for k in params]
    return (df.group_by(["point", *keys], maintain_order=True).agg(
        pl.col("veto/seq_fraction").mean().alias("vetoed seq"),
        pl.col("rejected/token_fraction").mean().alias("rejected tok"),
        pl.col("rejected/token_fraction").max().alias("worst step"),
        pl.col("loss_mass_removed").mean().alias("|A| removed"),
        pl.col("applied/ess").min().alias("min ESS"),
        pl.col("applied/max").max().alias("max weight"),
    ).sort("point").drop("point"))


def write_html(df: pl.DataFrame, params: dict[str, list[Any]], path: Path, title: str) -> None:
    """A plotly chart: per metric, one line per grid point over the steps."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from grpolens.plot_config import plot_config

    metrics = [("rejected/token_fraction", "rejected tokens"), ("veto/seq_fraction", "vetoed sequences"),
               ("loss_mass_removed", "|A| mass removed"), ("applied/ess", "ESS (applied)"),
               ("applied/max", "largest applied weight")]
    fig = make_subplots(rows=len(metrics), cols=1, shared_xaxes=True, subplot_titles=[m[1] for m in metrics],
                        vertical_spacing=0.04)
    pcols = [f"rollout_is.{k}" for k in params]
    for i, sub in enumerate(df.partition_by("point", maintain_order=True)):
        label = ", ".join(f"{c.removeprefix('rollout_is.')}={sub[c][0]}" for c in pcols)
        for r, (m, _) in enumerate(metrics, start=1):
            fig.add_trace(go.Scatter(x=sub["step"].to_list(), y=sub[m].to_list(), mode="lines+markers", name=label,
                                     legendgroup=label, showlegend=r == 1, line={"color": _color(i)}), row=r, col=1)
    fig.update_layout(title=title, height=260 * len(metrics), template="plotly_white")
    fig.update_xaxes(title_text="step", row=len(metrics), col=1)
    fmt.atomic_write_bytes(path, fig.to_html(include_plotlyjs=True, full_html=True, config=plot_config()).encode())


def _color(i: int) -> str:
    import plotly.colors

    pal = plotly.colors.qualitative.Plotly
    return pal[i % len(pal)]
