"""One step's completions table: the reference's columns from the samples, grouped, and the
per-sequence token columns from the families' partials (see :mod:`grpolens.analysis.sidecars`)."""

from __future__ import annotations

import re
from typing import Any, Iterable

import numpy as np
import polars as pl
import pyarrow as pa

from grpolens.run import format as fmt
from grpolens.metrics.batch import KEY_COLUMNS, TokenBatch

#: The reference's columns, in its order; ``reward/<name>`` columns (sorted) follow them.
REFERENCE_COLUMNS = (
    "step", "prompt_index", "completion_index", "group_size", "reward_rank_desc", "prompt", "completion",
    "reward_total", "advantage", "q_mass", "update_weight_raw", "update_mass_proxy",
)
INT_COLUMNS = ("step", "prompt_index", "completion_index", "group_size", "reward_rank_desc")
TEXT_COLUMNS = ("prompt", "completion")
#: Sample columns grpolens adds after the reference's (Parquet only).
SAMPLE_EXTRA = {"rank": pl.Int64, "sample_id": pl.Int64, "group_id": pl.Int64, "completion_len": pl.Int64,
                "truncated": pl.Boolean}
#: Per-sequence columns from token data (Parquet only), with the partial columns behind each.
TOKEN_COLUMNS = {
    "loss_calls": pl.Int64,        # loss calls of the step that trained the completion
    "tokens": pl.Int64,            # seq_tokens: stored token rows
    "masked_tokens": pl.Int64,     # health.masked: tokens with mask = true
    "kl_mean": pl.Float64,         # kl.k3.sum / kl.n
    "kl_max": pl.Float64,          # kl.k3.max (when the kl family provides it)
    "mismatch_mean": pl.Float64,   # mm.absd / mm.n: mean |old − rollout|
    "mismatch_max": pl.Float64,    # mm.absdmax
    "is_weight_max": pl.Float64,   # ris.twmax: max raw token IS weight exp(clip(δ, ±20))
    "entropy_mean": pl.Float64,    # entropy.sum / entropy.n
    "clip_frac": pl.Float64,       # (clip.g.region + clip.g.cispo) / clip.g.n: the loss' clip
    "is_vetoed": pl.Boolean,       # rollout IS veto (seq_view); null when rollout_is is not configured
    "is_masked_tokens": pl.Int64,  # tokens rollout IS removed from the loss mask (veto, band, filters)
}
COMPLETIONS_FILE = "completions.parquet"
SIDECAR_DIR = "rich_completions"
DEFAULT_KEY = "rich_completions"
Q_COLUMN = "q_mass"
_STEP_FILE = re.compile(r"_step_([0-9]+)\.json$")


# ---------------------------------------------------------------------------------------------
# Samples side: the reference's columns
# ---------------------------------------------------------------------------------------------

# The tables below are one step's few hundred rows: each polars query (sort, join, with_columns,
# Series.fill_nan...) costs ~1 ms of fixed overhead there, so row orders and per-row values are
# computed with numpy and handed to polars as whole columns, and only the group-window columns
# (:func:`_mass_columns`) and the join stay polars queries.

def _in_order(df: pl.DataFrame, order: np.ndarray) -> pl.DataFrame:
    """``df``'s rows in ``order`` (a permutation); ``df`` itself when that is the order it has
    (samples mostly are: the gather would copy every prompt and completion text)."""
    return df if np.array_equal(order, np.arange(len(order))) else df[order]


def _float(df: pl.DataFrame, name: str) -> pl.Series:
    if name not in df.columns:
        return pl.Series(name, [None] * df.height, dtype=pl.Float64)
    # nulls reach numpy as NaN, and NaN goes back as null
    return pl.Series(name, df[name].cast(pl.Float64).to_numpy(), dtype=pl.Float64, nan_to_null=True)


def group_rows(samples: pl.DataFrame, step: int) -> pl.DataFrame:
    """The reference's columns (plus ids) for one step's samples, ordered by prompt group."""
    df = _in_order(samples, np.lexsort((samples["sample_id"].to_numpy(), samples["rank"].to_numpy()))) if samples.height else samples
    n = df.height
    gid = df["group_id"].to_numpy() if n else np.zeros(0, dtype=np.int64)
    # dense group index by first appearance (integer ids: hashes beyond 2**53 must not merge)
    uniq, first, inv = np.unique(gid, return_index=True, return_inverse=True)
    order_of_group = np.argsort(np.argsort(first, kind="stable"), kind="stable")
    prompt_index = order_of_group[inv.reshape(-1)] if n else np.zeros(0, dtype=np.int64)
    sizes = np.bincount(prompt_index, minlength=len(uniq)) if n else np.zeros(0, dtype=np.int64)
    # completion_index: position within the group in gather order
    by_group = np.argsort(prompt_index, kind="stable")
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])) if n else np.zeros(0, dtype=np.int64)
    completion_index = np.empty(n, dtype=np.int64)
    completion_index[by_group] = np.arange(n) - np.repeat(starts, sizes)
    reward = _float(df, "reward").alias("reward_total")
    r = reward.to_numpy().astype(np.float64) if n else np.zeros(0)
    rank = np.empty(n, dtype=np.int64)
    if n:
        missing = np.isnan(r)
        ordered = np.lexsort((completion_index, np.where(missing, 0.0, -r), missing, prompt_index))
        rank[ordered] = np.arange(n) - np.repeat(starts, sizes) + 1
    out = pl.DataFrame({
        "step": pl.Series([step] * n, dtype=pl.Int64),
        "prompt_index": pl.Series(prompt_index, dtype=pl.Int64),
        "completion_index": pl.Series(completion_index, dtype=pl.Int64),
        "group_size": pl.Series(sizes[prompt_index] if n else [], dtype=pl.Int64),
        "reward_rank_desc": pl.Series(rank, dtype=pl.Int64),
        **{c: (df[c].cast(pl.Utf8) if c in df.columns else pl.Series([None] * n, dtype=pl.Utf8)) for c in TEXT_COLUMNS},
        "reward_total": reward,
        "advantage": _float(df, "advantage"),
        Q_COLUMN: _float(df, Q_COLUMN),
    })
    rewards = sorted(c for c in df.columns if c.startswith(fmt.REWARD_PREFIX))
    extra = {c: (df[c].cast(t) if c in df.columns else pl.Series([None] * n, dtype=t)) for c, t in SAMPLE_EXTRA.items()}
    out = out.with_columns(_mass_columns() + [_float(df, c) for c in rewards] + [s.alias(c) for c, s in extra.items()])
    return _in_order(out, np.lexsort((completion_index, prompt_index))) if n else out


def _mass_columns() -> list[pl.Expr]:
    g = "prompt_index"
    q, a = pl.col(Q_COLUMN), pl.col("advantage")
    q_ok = q.is_finite().fill_null(False).all().over(g) & (q.sum().over(g) > 0)
    pos = a.clip(lower_bound=0.0)
    a_ok = a.is_finite().fill_null(False).all().over(g) & (pos.sum().over(g) > 0)
    return [
        pl.when(q_ok).then(q).otherwise(a).alias("update_weight_raw"),
        pl.when(q_ok).then(q / q.sum().over(g)).when(a_ok).then(pos / pos.sum().over(g))
          .otherwise(None).cast(pl.Float64).alias("update_mass_proxy"),
    ]


# ---------------------------------------------------------------------------------------------
# Token side: per-sequence columns from the families' partials
# ---------------------------------------------------------------------------------------------

#: Producers whose columns the token side reads (computed here only when the engine did not
#: leave its per-shard partials on the batch).
NEEDED_PRODUCERS = ("health", "entropy", "kl", "clip", "mismatch", "rollout_is")


#: The partial columns the token side reads (plus every ``ris.*`` one, for the rollout-IS view).
PARTIAL_COLUMNS = ("seq_tokens", "health.masked", "kl.k3.sum", "kl.n", "kl.k3.max", "mm.absd", "mm.n", "mm.absdmax",
                   "entropy.sum", "entropy.n", "clip.g.region", "clip.g.cispo", "clip.g.n")


def shard_partials(batch: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    """The per-sequence partials of a batch: the engine's own when it kept them on the batch,
    else the needed producers run once here (same functions, same columns)."""
    cached = batch.partials
    if cached is not None:
        return cached
    from grpolens.metrics.partials import PRODUCERS

    out: dict[str, np.ndarray] = dict(batch.seq_keys)
    out["seq_tokens"] = batch.lengths.astype(np.float64)
    for name in NEEDED_PRODUCERS:
        p = PRODUCERS.get(name)
        if p is not None and batch.has(*p.requires):
            out.update(p.fn(batch, cfg))
    return out


def _div(num, den) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def sequence_columns(seq: pl.DataFrame | dict[str, np.ndarray], cfg: dict) -> pl.DataFrame:
    """One row per sample_id (its first loss call of the step) with :data:`TOKEN_COLUMNS`.
    ``seq``: the step's per-sequence partials, a table or (from
    :func:`~grpolens.analysis.sidecars.steps.concat_pieces`) key arrays and float64 arrays."""
    schema = {"sample_id": pl.Int64, **TOKEN_COLUMNS}
    if isinstance(seq, pl.DataFrame):
        if seq.height == 0:
            return pl.DataFrame(schema=schema)
        seq = {c: seq[c].to_numpy() if c in KEY_COLUMNS else seq[c].cast(pl.Float64).to_numpy() for c in seq.columns}
    # rows in key order; each sample_id's first row there, in order of first appearance, and its count
    order = np.lexsort([seq[c] for c in reversed(KEY_COLUMNS)])
    ids = seq["sample_id"][order]
    _, first_at, calls = np.unique(ids, return_index=True, return_counts=True)
    by_appearance = np.argsort(first_at)
    rows = order[first_at[by_appearance]]
    p = {c: v[rows] for c, v in seq.items() if c not in KEY_COLUMNS}
    n = len(rows)
    none = np.full(n, np.nan)

    def col(name: str) -> np.ndarray:
        return p.get(name, none)

    def ok(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        return np.where(den > 0, num, np.nan)

    out: dict[str, Any] = {
        "sample_id": pl.Series(ids[first_at[by_appearance]]),
        "loss_calls": pl.Series(calls[by_appearance]),
        "tokens": col("seq_tokens"),
        "masked_tokens": col("health.masked"),
        "kl_mean": _div(col("kl.k3.sum"), col("kl.n")),
        "kl_max": ok(col("kl.k3.max"), col("kl.n")),
        "mismatch_mean": _div(col("mm.absd"), col("mm.n")),
        "mismatch_max": ok(col("mm.absdmax"), col("mm.n")),
        "is_weight_max": ok(col("ris.twmax"), col("ris.n")),
        "entropy_mean": _div(col("entropy.sum"), col("entropy.n")),
        "clip_frac": _div(col("clip.g.region") + np.nan_to_num(col("clip.g.cispo")), col("clip.g.n")),
    }
    vetoed = masked = none
    if "ris.n" in p:
        from grpolens.functional import rollout_is as ris

        c = ris.ISConfig.from_cfg(cfg)
        if c.configured:  # rows whose shard had no rollout_logp (null IS partials) stay null
            has = ~np.isnan(p["ris.n"])
            view = ris.seq_view({k: v[has] for k, v in p.items() if k.startswith("ris.")}, c)
            vetoed, masked = np.full(n, np.nan), np.full(n, np.nan)
            vetoed[has], masked[has] = view.vetoed, view.rejected
    out["is_vetoed"], out["is_masked_tokens"] = vetoed, masked
    cols = {}
    for name, dtype in schema.items():
        v = out[name]
        if isinstance(v, np.ndarray):
            s = pl.Series(name, v, dtype=pl.Float64, nan_to_null=True)
            cols[name] = s.cast(pl.Boolean) if dtype == pl.Boolean else s.cast(dtype)
        else:
            cols[name] = v.cast(dtype).alias(name)
    return pl.DataFrame(cols)


def completions_table(step: int, samples: pl.DataFrame | None, seqcols: pl.DataFrame | None) -> pl.DataFrame:
    """One step's completions: the reference's columns, ids, then the per-sequence token columns."""
    if samples is None:
        return pl.DataFrame()
    rows = group_rows(samples, step)
    if seqcols is None or seqcols.height == 0:
        seqcols = pl.DataFrame(schema={"sample_id": pl.Int64, **TOKEN_COLUMNS})
    out = _left_join(rows, seqcols)
    calls = out.get_column_index("loss_calls")  # 0 for the rows no loss call trained
    return out.replace_column(calls, pl.Series("loss_calls", np.nan_to_num(out["loss_calls"].to_numpy(), nan=0.0)
                                               .astype(np.int64), dtype=pl.Int64))


def _left_join(rows: pl.DataFrame, seqcols: pl.DataFrame) -> pl.DataFrame:
    """``rows.join(seqcols, on="sample_id", how="left")`` for a ``seqcols`` with one row per
    sample_id: each row's match found by a binary search and taken (nulls where none) in one
    Arrow take, instead of a polars join query per step."""
    if rows["sample_id"].null_count() or not rows.height:
        return rows.join(seqcols, on="sample_id", how="left")
    sid, keys = rows["sample_id"].to_numpy(), seqcols["sample_id"].to_numpy()
    by_key = np.argsort(keys, kind="stable")
    at = by_key[np.minimum(np.searchsorted(keys, sid, sorter=by_key), max(len(keys) - 1, 0))] if len(keys) \
        else np.zeros(len(sid), dtype=np.int64)
    found = keys[at] == sid if len(keys) else np.zeros(len(sid), dtype=bool)
    right = seqcols[[c for c in seqcols.columns if c != "sample_id"]].to_arrow()
    taken = pl.from_arrow(right.take(pa.array(at, mask=~found)))
    return rows.hstack(taken.get_columns())


def column_order(columns: Iterable[str]) -> list[str]:
    """Canonical order: reference columns, ``reward/*`` sorted, grpolens' extras, the rest."""
    cols = list(columns)
    rewards = sorted(c for c in cols if c.startswith(fmt.REWARD_PREFIX))
    known = [*REFERENCE_COLUMNS, *rewards, *SAMPLE_EXTRA, *TOKEN_COLUMNS]
    return [c for c in known if c in cols] + [c for c in cols if c not in known]


def empty_table() -> pl.DataFrame:
    """A completions table without rows (its schema without ``reward/*`` columns)."""
    text = {c: pl.Utf8 for c in TEXT_COLUMNS}
    schema = {c: pl.Int64 if c in INT_COLUMNS else text.get(c, pl.Float64) for c in REFERENCE_COLUMNS}
    return pl.DataFrame(schema={**schema, **SAMPLE_EXTRA, **TOKEN_COLUMNS})


def concat(frames: list[pl.DataFrame]) -> pl.DataFrame:
    frames = [f for f in frames if f.height]
    if not frames:
        return empty_table()
    df = pl.concat(frames, how="diagonal_relaxed")
    return df.select(column_order(df.columns)).sort(["step", "prompt_index", "completion_index"])
