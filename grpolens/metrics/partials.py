"""Per-sequence partial states: what each family extracts from token rows, and how partials merge.

A *producer* turns a :class:`~grpolens.metrics.batch.TokenBatch` into named per-sequence arrays
(sums, counts, extrema). Each array has a merge rule, so partial tables computed on any split of
the data (shards, parts, even halves of one sequence) combine into exactly what one pass gives:

``sum``    add       (Σ x·m, token counts, ...)
``max``    maximum   (token extrema; -inf when a piece had no valid token)
``min``    minimum
``first``  a value constant over the sequence (its advantage), taken from any piece

Producers register through :func:`producer`, like metrics do, so a plugin adds one the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import polars as pl

from grpolens.metrics.batch import KEY_COLUMNS, TokenBatch

MERGES = ("sum", "max", "min", "first")


@dataclass(frozen=True)
class Producer:
    name: str
    fn: Callable[[TokenBatch, dict], dict[str, np.ndarray]]
    merge: dict[str, str]
    #: optional token columns it needs; when the batch lacks one, the producer is skipped
    requires: tuple[str, ...] = ()
    #: the metric families whose reductions read its columns: a recompute restricted to some
    #: families (``recompute --only``) runs only the producers of those families
    families: tuple[str, ...] = ()


PRODUCERS: dict[str, Producer] = {}


def producer(name: str, merge: dict[str, str], requires: tuple[str, ...] = (), families: tuple[str, ...] | None = None):
    """Decorator: register ``fn(batch, cfg) -> {column: per-sequence array}`` with merge rules.

    ``families``: the metric families that reduce its columns (default: the family named like it)."""
    bad = {k: v for k, v in merge.items() if v not in MERGES}
    if bad:
        raise ValueError(f"producer {name}: unknown merge rules {bad}")

    def deco(fn):
        if name in PRODUCERS:
            raise ValueError(f"producer {name} registered twice")
        PRODUCERS[name] = Producer(name, fn, dict(merge), tuple(requires), tuple(families or (name,)))
        return fn

    return deco


def merge_rules() -> dict[str, str]:
    rules: dict[str, str] = {}
    for p in PRODUCERS.values():
        rules.update(p.merge)
    return rules


def sequence_partials(batch: TokenBatch, cfg: dict, families: frozenset[str] | None = None) -> dict[str, np.ndarray]:
    """Run every applicable producer on ``batch``: key columns plus partial columns, one row per sequence.

    ``families``: only the producers those metric families need (None: all of them)."""
    out: dict[str, np.ndarray] = dict(batch.seq_keys)
    out["seq_tokens"] = batch.lengths.astype(np.float64)  # stored rows, masked or not
    for p in PRODUCERS.values():
        if not batch.has(*p.requires):
            continue
        if families is not None and families.isdisjoint(p.families):
            continue
        cols = p.fn(batch, cfg)
        missing = set(p.merge) - set(cols)
        extra = set(cols) - set(p.merge)
        if missing or extra:
            raise RuntimeError(f"producer {p.name}: columns {sorted(missing)} missing, {sorted(extra)} undeclared")
        out.update(cols)
    return out


def merge_partials(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """Combine partial tables of any split of the data into one row per sequence.

    Pieces of the same sequence (same step, rank, micro_batch, sample_id) are merged by each
    column's rule; a column absent from some pieces is null there and ignored by the rule.
    """
    frames = [f for f in frames if f.height]
    if not frames:
        return pl.DataFrame()
    df = pl.concat(frames, how="diagonal_relaxed")
    if not df.select(pl.struct(list(KEY_COLUMNS)).is_duplicated().any()).item():
        # The usual case: pieces are whole shards, so no sequence is split and nothing merges.
        return df.sort(list(KEY_COLUMNS))
    rules = merge_rules()
    aggs = []
    for c in df.columns:
        if c in KEY_COLUMNS:
            continue
        rule = rules.get(c, "sum")  # seq_tokens and any undeclared column add up
        e = pl.col(c)
        aggs.append({"sum": e.sum(), "max": e.max(), "min": e.min(), "first": e.drop_nulls().first()}[rule].alias(c))
    return df.group_by(list(KEY_COLUMNS)).agg(aggs).sort(list(KEY_COLUMNS))


#: What a piece that lacks a column contributes under each merge rule (nothing, in effect).
_NEUTRAL = {"sum": 0.0, "max": -np.inf, "min": np.inf, "first": np.nan}


def merge_arrays(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """:func:`merge_partials` for per-shard column dicts, without building DataFrames.

    Pieces from whole shards never split a sequence (the writer's promise), so the usual work is a
    concatenation and one sort; a column a piece lacks (a producer skipped for lack of an optional
    column on that rank) is filled with its merge rule's neutral value. Should two pieces share a
    sequence after all, the general merge runs.
    """
    pieces = [p for p in pieces if len(p.get("sample_id", ()))]
    if not pieces:
        return {}
    rules = merge_rules()
    names = list(dict.fromkeys(c for p in pieces for c in p))
    out = {}
    for c in names:
        fill = _NEUTRAL[rules.get(c, "sum")]
        out[c] = np.concatenate([p[c] if c in p else np.full(len(p["sample_id"]), fill) for p in pieces])
    keys = [out[k] for k in KEY_COLUMNS]
    order = np.lexsort(keys[::-1])
    out = {c: v[order] for c, v in out.items()}
    same = np.ones(len(order) - 1, dtype=bool)
    for k in KEY_COLUMNS:
        same &= out[k][1:] == out[k][:-1]
    if same.any():
        df = merge_partials([pl.DataFrame(p) for p in pieces])
        return {c: df[c].to_numpy() for c in df.columns}
    return out
