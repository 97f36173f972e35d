"""The completions tables of whole steps: the recompute visitor that writes ``completions.parquet``,
completions a step trains on but an earlier step generated, and on-demand builds."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import polars as pl

from grpolens.run import format as fmt
from grpolens.run.step_table import write_step_table
from grpolens.metrics.batch import KEY_COLUMNS, TokenBatch
from grpolens.metrics.engine import Visitor, visitor
from grpolens.analysis.sidecars.table import (COMPLETIONS_FILE, PARTIAL_COLUMNS, column_order, completions_table,
                                              concat, empty_table, sequence_columns, shard_partials)


@dataclass
class Completions(Visitor):
    """Visitor: each step's per-sequence token columns, joined to the step's samples while the
    recompute holds them (``at_step``); ``finish`` writes ``completions.parquet`` (fresh rows for
    recomputed steps, earlier rows for the rest)."""

    cfg: dict = field(default_factory=dict)
    name: str = "completions"
    collect: bool = True

    def shard(self, batch: TokenBatch, shard) -> dict[str, np.ndarray]:
        p = shard_partials(batch, self.cfg)
        return {k: v for k, v in p.items() if k in KEY_COLUMNS or k in PARTIAL_COLUMNS or k.startswith("ris.")}

    def combine(self, step: int, pieces: list[dict[str, np.ndarray]]) -> pl.DataFrame:
        return sequence_columns(concat_pieces(pieces), self.cfg)

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
        from grpolens.run.reader import RunReader

        reader = RunReader(run)
        sample_only = set(reader.steps(fmt.SAMPLES)) - set(reader.steps(fmt.TOKENS)) - kept_steps
        for s in sorted(sample_only - set(by_step)):
            by_step.put(s, step_table(reader, s, None))
        write_step_table(out_dir / COMPLETIONS_FILE, by_step, kept_steps,
                         sort=["step", "prompt_index", "completion_index"], order=column_order, empty=empty_table(),
                         schemas=getattr(by_step, "schemas", None))


def concat_pieces(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray] | pl.DataFrame:
    """The shards' per-sequence columns of a step, as :func:`sequence_columns` reads them: key
    columns as they are, every other column as float64 with NaN where a shard lacks it (what
    :func:`~grpolens.metrics.partials.merge_partials`' null gives there), in no particular order
    (``sequence_columns`` orders the rows by key). Shards of one step never split a sequence (the
    writer's promise); should two pieces share one after all, ``merge_partials`` merges them by
    each column's rule, as before. A dict of arrays, not a polars concat and sort per step."""
    pieces = [p for p in pieces if len(p["sample_id"])]
    if not pieces:
        return pl.DataFrame()
    names = list(dict.fromkeys(c for p in pieces for c in p))
    out = {c: np.concatenate([p[c] for p in pieces]) for c in KEY_COLUMNS}
    order = np.lexsort([out[c] for c in reversed(KEY_COLUMNS)])
    same = np.ones(len(order) - 1, dtype=bool)
    for c in KEY_COLUMNS:
        k = out[c][order]
        same &= k[1:] == k[:-1]
    if same.any():
        from grpolens.metrics.partials import merge_partials

        return merge_partials([pl.DataFrame(p) for p in pieces])
    for c in names:
        if c not in KEY_COLUMNS:
            out[c] = np.concatenate([np.asarray(p[c], dtype=np.float64) if c in p
                                     else np.full(len(p["sample_id"]), np.nan) for p in pieces])
    return out


@visitor("completions")
def _completions(cfg: dict) -> Completions:
    return Completions(cfg)


#: Earlier steps with samples searched for the completions a step trains on but did not generate.
REUSE_LOOKBACK = 16


def generating_samples(run, step: int, sample_ids: Iterable[int]):
    """``(generating step, its samples rows, the ids of sample_ids found there)`` for the
    completions ``sample_ids`` that ``step`` trains on but did not generate: searched in the samples
    of earlier steps, newest first, at most :data:`REUSE_LOOKBACK` of them. ``run``: a path or a
    :class:`~grpolens.run.reader.RunReader`."""
    from grpolens.run.reader import RunReader

    missing = set(sample_ids)
    if not missing:
        return
    reader = RunReader.of(run)
    for s in [s for s in reader.steps(fmt.SAMPLES) if s < step][::-1][:REUSE_LOOKBACK]:
        gen = reader.samples(s)
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
    for s, gen, found in generating_samples(run, step, _trained(seqcols) - have):
        # group columns from the whole generation (a group's reward ranks), rows of this step's ids
        rows = completions_table(step, gen, seqcols).filter(pl.col("sample_id").is_in(sorted(found)))
        frames.append(rows.with_columns(generated_at_step=pl.lit(s, pl.Int64)))
    return frames


def step_table(run, step: int, seqcols: pl.DataFrame | None) -> pl.DataFrame:
    """The completions of ``step``: those generated at it, and those it trains on that an earlier
    step generated (found by sample_id, see the module docstring). ``run``: a path or a
    :class:`~grpolens.run.reader.RunReader` (one reader for many steps reads the manifest once)."""
    from grpolens.run.reader import RunReader

    reader = RunReader.of(run)
    own = reader.samples(step)
    frames = [own_rows(step, own, seqcols)] + reused_rows(reader, step, seqcols, _ids(own))
    frames = [f for f in frames if f.height]
    return concat(frames) if frames else pl.DataFrame()


def build_steps(run: os.PathLike | str, steps: Iterable[int], cfg: dict | None = None,
                progress: Callable[[int, int], None] | None = None) -> pl.DataFrame:
    """The completions of ``steps`` computed from the shards (one pass over those steps only)."""
    from grpolens.metrics.engine import iter_steps
    from grpolens.metrics.registry import load_families
    from grpolens.run.reader import RunReader

    reader = RunReader(run)
    run = reader.path
    load_families()
    cfg = cfg if cfg is not None else reader.config()
    steps = sorted(set(steps))
    tok = sorted(set(steps) & set(fmt.list_steps(run, fmt.TOKENS)))
    v = Completions(cfg)
    frames, done = [], set()
    for res in iter_steps(run, tok, [v]):
        frames.append(step_table(reader, res.step, res.pieces[v.name]))
        done.add(res.step)
        if progress:
            progress(len(done), len(steps))
    for s in steps:
        if s not in done:
            frames.append(step_table(reader, s, None))
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
