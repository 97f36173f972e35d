"""Per-step completion tables: MaxEnt-GRPO's rich-completion sidecars, and a Parquet table with
what only per-token data can add.

Rows are the completions *generated* at a step (the ``samples`` table, every rank), in gather
order -- by (rank, sample_id), rank-major as ``gather_object`` concatenates -- then grouped:

``prompt_index``      index of the prompt group (``group_id``) by first appearance in that order;
                      a group whose completions straddle ranks is one group
``completion_index``  position within the group, in the same order; ``group_size`` its size
``reward_rank_desc``  1-based rank by descending ``reward_total`` within the group, ties broken by
                      completion_index; null/NaN rewards rank last (the reference leaves that order
                      undefined), −inf just before them
``q_mass``            the optional samples column ``q_mass`` (MaxEnt listwise q); null for GRPO
``update_weight_raw`` q_mass when the whole group's q is finite and sums to > 0, else the advantage
``update_mass_proxy`` q / Σq over the group in the first case; otherwise max(A, 0) / Σ max(A, 0)
                      when every advantage of the group is finite and some is positive; else null
                      (the TRL-path writer's cascade, twinkle-maxent-notes §2.6)

NaN floats are stored as null (±inf stay). Per-sequence token columns come from the engine's
per-sequence partials (the families' producers, never re-derived here) of the **same step's**
loss calls; a completion trained in several loss calls of the step takes its **first** one (lowest
rank, micro_batch -- the one ``grpolens tokens --sample`` shows) and ``loss_calls`` counts them.
Token data of other steps is not joined: no token rows for the sample at its step gives null token
columns and ``loss_calls = 0``.

A step that trains on completions generated at an earlier step (TRL's ``steps_per_generation`` or
``num_iterations`` > 1, verl's and Twinkle's mini-batches and epochs over one rollout) has no
samples of its own for them: its table finds them **by sample_id** in the samples of the step that
generated them (searched backwards, at most :data:`REUSE_LOOKBACK` earlier steps with samples),
with that step's group columns (prompt_index, rank of the reward in its group) and this step's
token columns; ``generated_at_step`` says where each row was generated.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import polars as pl
import pyarrow as pa

from grpolens.run import format as fmt
from grpolens.run.format import RunFormatError
from grpolens.run.step_table import write_step_table
from grpolens.metrics.batch import KEY_COLUMNS, TokenBatch
from grpolens.metrics.engine import visitor

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
_STEP_FILE = re.compile(r"_step_(\d+)\.json$")


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


def sequence_columns(seq: pl.DataFrame, cfg: dict) -> pl.DataFrame:
    """One row per sample_id (its first loss call of the step) with :data:`TOKEN_COLUMNS`."""
    schema = {"sample_id": pl.Int64, **TOKEN_COLUMNS}
    if seq.height == 0:
        return pl.DataFrame(schema=schema)
    # rows in key order; each sample_id's first row there, in order of first appearance, and its count
    order = np.lexsort([seq[c].to_numpy() for c in reversed(KEY_COLUMNS)])
    ids = seq["sample_id"].to_numpy()[order]
    _, first_at, calls = np.unique(ids, return_index=True, return_counts=True)
    by_appearance = np.argsort(first_at)
    rows = order[first_at[by_appearance]]
    p = {c: seq[c].cast(pl.Float64).to_numpy()[rows] for c in seq.columns if c not in KEY_COLUMNS}
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
        from grpolens.functional import is_weights as ris

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


# ---------------------------------------------------------------------------------------------
# The recompute visitor and on-demand builds
# ---------------------------------------------------------------------------------------------

@dataclass
class Completions:
    """Visitor: each step's per-sequence token columns, joined to the step's samples while the
    recompute holds them (``at_step``); ``finish`` writes ``completions.parquet`` (fresh rows for
    recomputed steps, earlier rows for the rest)."""

    cfg: dict = field(default_factory=dict)
    name: str = "completions"
    collect: bool = True

    def shard(self, batch: TokenBatch, shard) -> pl.DataFrame:
        p = shard_partials(batch, self.cfg)
        return pl.DataFrame({k: v for k, v in p.items() if k in KEY_COLUMNS or k in PARTIAL_COLUMNS or k.startswith("ris.")})

    def combine(self, step: int, pieces: list[pl.DataFrame]) -> pl.DataFrame:
        from grpolens.metrics.partials import merge_partials

        return sequence_columns(merge_partials(pieces), self.cfg)

    def at_step(self, step: int, seqcols: pl.DataFrame, samples: pl.DataFrame | None, run) -> pl.DataFrame:
        """The step's completions table: the completions generated at it, from the samples the
        recompute already read for the step, and those it trains on that an earlier step generated."""
        table = own_rows(step, samples, seqcols)
        if _trained(seqcols) - _ids(samples):
            table = concat([table, *reused_rows(run, step, seqcols, _ids(table))])
        return table

    def finish(self, run: Path, out_dir: Path, by_step: Mapping[int, pl.DataFrame], kept_steps: set[int]) -> None:
        """``by_step``: each recomputed step's :meth:`at_step` table (a :class:`SpilledSteps`)."""
        # steps with samples but no token shards: sample columns only
        sample_only = set(fmt.list_steps(run, fmt.SAMPLES)) - set(fmt.list_steps(run, fmt.TOKENS)) - kept_steps
        for s in sorted(sample_only - set(by_step)):
            by_step.put(s, step_table(run, s, None))
        write_step_table(out_dir / COMPLETIONS_FILE, by_step, kept_steps,
                         sort=["step", "prompt_index", "completion_index"], order=column_order, empty=empty_table(),
                         schemas=getattr(by_step, "schemas", None))


@visitor("completions")
def _completions(cfg: dict) -> Completions:
    return Completions(cfg)


#: Earlier steps with samples searched for the completions a step trains on but did not generate.
REUSE_LOOKBACK = 16


def generating_samples(run: Path, step: int, sample_ids: Iterable[int]):
    """``(generating step, its samples rows, the ids of sample_ids found there)`` for the
    completions ``sample_ids`` that ``step`` trains on but did not generate: searched in the samples
    of earlier steps, newest first, at most :data:`REUSE_LOOKBACK` of them."""
    from grpolens.run.reader import read_samples

    missing = set(sample_ids)
    if not missing:
        return
    for s in [s for s in fmt.list_steps(run, fmt.SAMPLES) if s < step][::-1][:REUSE_LOOKBACK]:
        gen = read_samples(fmt.as_run(run), s)
        found = set(gen["sample_id"].to_list()) & missing if gen is not None else set()
        if found:
            yield s, gen, found
            missing -= found
            if not missing:
                return


def _ids(df: pl.DataFrame | None) -> set[int]:
    return set(df["sample_id"].to_list()) if df is not None and df.height and "sample_id" in df.columns else set()


def _trained(seqcols: pl.DataFrame | None) -> set[int]:
    return _ids(seqcols)


def own_rows(step: int, samples: pl.DataFrame | None, seqcols: pl.DataFrame | None) -> pl.DataFrame:
    """The completions generated at ``step`` (``generated_at_step`` = step)."""
    table = completions_table(step, samples, seqcols)
    return table.hstack([pl.Series("generated_at_step", np.full(table.height, step), dtype=pl.Int64)]) if table.height else table


def reused_rows(run, step: int, seqcols: pl.DataFrame | None, have: set[int]) -> list[pl.DataFrame]:
    """The rows of the completions ``step`` trains on (``seqcols``) that are not in ``have``,
    found by sample_id at the step that generated them (see the module docstring)."""
    frames = []
    for s, gen, found in generating_samples(fmt.as_run(run), step, _trained(seqcols) - have):
        # group columns from the whole generation (a group's reward ranks), rows of this step's ids
        rows = completions_table(step, gen, seqcols).filter(pl.col("sample_id").is_in(sorted(found)))
        frames.append(rows.with_columns(generated_at_step=pl.lit(s, pl.Int64)))
    return frames


def step_table(run: Path, step: int, seqcols: pl.DataFrame | None) -> pl.DataFrame:
    """The completions of ``step``: those generated at it, and those it trains on that an earlier
    step generated (found by sample_id, see the module docstring)."""
    from grpolens.run.reader import read_samples

    run = fmt.as_run(run)
    own = read_samples(run, step)
    frames = [own_rows(step, own, seqcols)] + reused_rows(run, step, seqcols, _ids(own))
    frames = [f for f in frames if f.height]
    return concat(frames) if frames else pl.DataFrame()


def build_steps(run: os.PathLike | str, steps: Iterable[int], cfg: dict | None = None,
                progress: Callable[[int, int], None] | None = None) -> pl.DataFrame:
    """The completions of ``steps`` computed from the shards (one pass over those steps only)."""
    from grpolens.metrics.engine import iter_steps
    from grpolens.metrics.registry import load_families
    from grpolens.run.reader import resolve_config

    run = fmt.as_run(run)
    load_families()
    cfg = cfg if cfg is not None else resolve_config(run)
    steps = sorted(set(steps))
    tok = sorted(set(steps) & set(fmt.list_steps(run, fmt.TOKENS)))
    v = Completions(cfg)
    frames, done = [], set()
    for res in iter_steps(run, tok, [v]):
        frames.append(step_table(run, res.step, res.pieces[v.name]))
        done.add(res.step)
        if progress:
            progress(len(done), len(steps))
    for s in steps:
        if s not in done:
            frames.append(step_table(run, s, None))
            done.add(s)
            if progress:
                progress(len(done), len(steps))
    return concat(frames)


def completions_path(run: os.PathLike | str) -> Path:
    return fmt.derived_dir(run) / COMPLETIONS_FILE


def fresh_rows(run: os.PathLike | str, step: int) -> pl.DataFrame | None:
    """The step's rows of ``completions.parquet`` if it is newer than the step's shards and the
    manifest and holds that step; else None (compute the step instead)."""
    run = fmt.as_run(run)
    path = completions_path(run)
    if not path.is_file():
        return None
    made = path.stat().st_mtime_ns
    inputs = [sh.path for t in fmt.TABLES for sh in fmt.list_shards(run, t, [step])] + [run / fmt.MANIFEST_NAME]
    if any(p.stat().st_mtime_ns > made for p in inputs if p.exists()):
        return None
    try:
        df = pl.scan_parquet(path).filter(pl.col("step") == step).collect()
    except Exception:  # noqa: BLE001 - a damaged derived file is rebuilt from the shards
        return None
    return df if df.height else None


# ---------------------------------------------------------------------------------------------
# Sidecar JSON: writing
# ---------------------------------------------------------------------------------------------

def sidecar_name(key: str, step: int) -> str:
    return f"{key}_step_{int(step):06d}.json"


def check_key(key: str) -> str:
    from grpolens.errors import UserError

    k = (key or "").strip()
    if not k or "/" in k or "\\" in k or k.startswith(".") or any(ord(ch) < 32 for ch in k):
        raise UserError(f"--key: {key!r} is not usable in a file name (non-empty, no '/', no leading '.')")
    return k


def sidecar_columns(df: pl.DataFrame) -> list[str]:
    return [*REFERENCE_COLUMNS, *sorted(c for c in df.columns if c.startswith(fmt.REWARD_PREFIX))]


def sidecar_payload(df: pl.DataFrame, nan_literals: bool = False) -> dict:
    """``{"columns": [...], "data": [[...]]}`` for one step's rows. Missing floats are None, or
    float('nan') with ``nan_literals`` (what the reference's ``json.dump`` writes)."""
    cols = sidecar_columns(df)
    missing = [c for c in cols if c not in df.columns]
    if missing:
        df = df.with_columns([pl.lit(None).alias(c) for c in missing])
    df = df.sort(["prompt_index", "completion_index"]) if df.height else df
    floats = [i for i, c in enumerate(cols) if c not in INT_COLUMNS and c not in TEXT_COLUMNS]
    data = []
    for row in df.select(cols).iter_rows():
        row = list(row)
        for i in floats:
            v = row[i]
            if v is None:
                row[i] = math.nan if nan_literals else None
            elif not nan_literals and not math.isfinite(v):
                row[i] = None
            else:
                row[i] = float(v)
        data.append(row)
    return {"columns": cols, "data": data}


def sidecar_bytes(df: pl.DataFrame, nan_literals: bool = False) -> bytes:
    """The file's bytes: ``json.dumps`` defaults (the reference's ``json.dump``); strict JSON
    (``allow_nan=False``: null, never NaN/Infinity) unless ``nan_literals``."""
    return json.dumps(sidecar_payload(df, nan_literals), allow_nan=nan_literals).encode()


def write_sidecars(run: os.PathLike | str, table: pl.DataFrame, key: str = DEFAULT_KEY, nan_literals: bool = False,
                   out_dir: os.PathLike | str | None = None,
                   progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """One file per step of ``table`` under ``RUN/grpolens/rich_completions/`` (atomic writes)."""
    key = check_key(key)
    d = Path(out_dir) if out_dir is not None else fmt.derived_dir(run) / SIDECAR_DIR
    paths = []
    steps = sorted(table["step"].unique().to_list()) if table.height else []
    for i, step in enumerate(steps, 1):
        p = d / sidecar_name(key, step)
        fmt.atomic_write_bytes(p, sidecar_bytes(table.filter(pl.col("step") == step), nan_literals))
        paths.append(p)
        if progress:
            progress(i, len(steps))
    return paths


# ---------------------------------------------------------------------------------------------
# Sidecar JSON: reading (ours and the reference's)
# ---------------------------------------------------------------------------------------------

def _typed(name: str, values: list, path: Path) -> pl.Series:
    if name in INT_COLUMNS:
        out = []
        for i, v in enumerate(values):
            if v is None or (isinstance(v, float) and math.isnan(v)):
                out.append(None)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer():
                out.append(int(v))
            else:
                raise RunFormatError(path, f"row {i}: expected an integer, got {v!r}", column=name)
        return pl.Series(name, out, dtype=pl.Int64)
    if name in TEXT_COLUMNS or any(isinstance(v, str) for v in values):
        return pl.Series(name, [None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values],
                         dtype=pl.Utf8)
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
        elif isinstance(v, (int, float)):
            out.append(None if (isinstance(v, float) and math.isnan(v)) else float(v))
        else:
            raise RunFormatError(path, f"row {i}: expected a number or null, got {type(v).__name__}", column=name)
    return pl.Series(name, out, dtype=pl.Float64)


def read_sidecar(path: os.PathLike | str) -> pl.DataFrame:
    """A rich-completion sidecar (grpolens' or MaxEnt-GRPO's, either writer) as a DataFrame.

    Lenient where the reference is: bare ``NaN``/``Infinity`` literals parse (NaN becomes null,
    ±inf stay), the TRL-path writer's files without ``reward/*`` columns load, and reference
    columns a file lacks are added as nulls (``step`` from the file name when absent). Integer
    columns are Int64, text Utf8, the rest Float64.
    """
    path = Path(path)
    try:
        payload = json.loads(path.read_bytes())
    except OSError as e:
        raise RunFormatError(path, f"unreadable: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RunFormatError(path, f"not valid JSON: {e}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("columns"), list):
        raise RunFormatError(path, 'expected a JSON object with "columns" (a list) and "data" (a list of rows)')
    columns, data = payload["columns"], payload.get("data", [])
    if not isinstance(data, list):
        raise RunFormatError(path, '"data" must be a list of rows')
    if not all(isinstance(c, str) for c in columns) or len(set(columns)) != len(columns):
        raise RunFormatError(path, '"columns" must be distinct strings')
    for i, row in enumerate(data):
        if not isinstance(row, list) or len(row) != len(columns):
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise RunFormatError(path, f"data row {i} has {got} values for {len(columns)} columns")
    series = {c: _typed(c, [row[j] for row in data], path) for j, c in enumerate(columns)}
    n = len(data)
    for c in REFERENCE_COLUMNS:
        if c in series:
            continue
        if c == "step" and (m := _STEP_FILE.search(path.name)):
            series[c] = pl.Series(c, [int(m.group(1))] * n, dtype=pl.Int64)
        else:
            dtype = pl.Int64 if c in INT_COLUMNS else pl.Utf8 if c in TEXT_COLUMNS else pl.Float64
            series[c] = pl.Series(c, [None] * n, dtype=dtype)
    df = pl.DataFrame(list(series.values()))
    return df.select(column_order(df.columns))


def sidecar_files(directory: os.PathLike | str, key: str | None = None) -> list[Path]:
    """Sidecar files in ``directory`` (or its ``rich_completions/``) sorted by step: ``<key>_step_N.json``;
    without ``key``, ``rich_completions_*`` files, else ``completions_*`` (the reference's fallback)."""
    d = Path(directory)
    if (d / SIDECAR_DIR).is_dir():
        d = d / SIDECAR_DIR
    if not d.is_dir():
        return []
    keys = [key] if key else [DEFAULT_KEY, "completions"]
    for k in keys:
        files = [p for p in d.iterdir() if p.name.startswith(f"{k}_step_") and _STEP_FILE.search(p.name)]
        if files:
            return sorted(files, key=lambda p: int(_STEP_FILE.search(p.name).group(1)))
    return []


def read_sidecars(directory: os.PathLike | str, key: str | None = None, steps: Iterable[int] | None = None) -> pl.DataFrame:
    """Every sidecar of a directory as one table (see :func:`sidecar_files`)."""
    wanted = None if steps is None else set(steps)
    files = [p for p in sidecar_files(directory, key)
             if wanted is None or int(_STEP_FILE.search(p.name).group(1)) in wanted]
    return concat([read_sidecar(p) for p in files])
