"""The rollout-IS outputs a recompute writes beside the run's metrics: the per-step IS-weight
histograms of every recompute (``is_hist.parquet``, :class:`ISHistogram`) and, with
``--is-weights``, the per-token weights and modified loss mask, one Parquet file per token shard
(:class:`ISWeightWriter`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import polars as pl

from grpolens.functional.estimators import LOG_RATIO_BOUND
from grpolens.functional.histogram import edge_counts
from grpolens.functional.rollout_is import ISConfig
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.engine import Visitor, visitor
from grpolens.metrics.rollout_is import batch_applied_weights, batch_inputs, batch_token_weights
from grpolens.run import format as fmt
from grpolens.run.reader import resolve_config
from grpolens.run.step_table import write_step_table

#: Histogram bins on δ = ln w: 0.1-decade log-spaced |δ| from 1e-6 to the ±20 safety bound, both
#: signs, plus one centre bin (−1e-6, 1e-6): bf16 noise (~1e-3) and catastrophic tails both resolve.
_HALF = np.unique(np.append(10.0 ** np.arange(-6.0, np.log10(LOG_RATIO_BOUND), 0.1), LOG_RATIO_BOUND))
HIST_EDGES = np.concatenate([-_HALF[::-1], _HALF])
assert HIST_EDGES[0] == -LOG_RATIO_BOUND and HIST_EDGES[-1] == LOG_RATIO_BOUND  # histogram() clamps to them


def histogram(log_w: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Counts of ``clip_log_ratio(log_w)`` in the bins (``weights``: how many tokens each value
    stands for). The edges end at the ±20 bound, so clamping to them is that clip."""
    return edge_counts(log_w, HIST_EDGES, clamp=True, weights=weights)


@dataclass
class ISHistogram(Visitor):
    """Per-step histograms of the token raw weight e^δ and of the applied weight at the configured
    level (zero weights counted apart); written to ``is_hist.parquet`` by every recompute."""

    c: ISConfig
    name: str = "rollout_is.hist"
    collect: bool = True

    def shard(self, b: TokenBatch, shard) -> dict | None:
        if not b.has("rollout_logp"):
            return None
        x = batch_inputs(b)
        a, n = batch_applied_weights(b, self.c)  # n: tokens per value (sequence levels)
        pos = a > 0
        la = np.log(a[pos])
        zero = int((a == 0).sum()) if n is None else int(n[a == 0].sum())
        return {"raw": histogram(x.dv), "applied": histogram(la, None if n is None else n[pos]), "applied_zero": zero}

    def combine(self, step: int, pieces: list) -> dict | None:
        parts = [p for p in pieces if p is not None]
        if not parts:
            return None
        return {k: sum(p[k] for p in parts) for k in parts[0]}

    def at_step(self, step: int, h: dict | None, samples, run) -> pl.DataFrame | None:
        return None if h is None else hist_frame(step, h)

    def finish(self, run: Path, out_dir: Path, by_step: Mapping[int, pl.DataFrame], kept_steps: set[int]) -> None:
        """``by_step``: each recomputed step's :meth:`at_step` table."""
        write_step_table(out_dir / "is_hist.parquet", by_step, kept_steps, sort=["step", "kind", "lo"],
                         schemas=getattr(by_step, "schemas", None))


def hist_frame(step: int, h: dict) -> pl.DataFrame:
    """Long format: step, kind (``raw``/``applied``), weight bin [lo, hi), count; applied zeros as [0, 0]."""
    lo, hi = np.exp(HIST_EDGES[:-1]), np.exp(HIST_EDGES[1:])
    nb = len(lo)
    return pl.DataFrame({
        "step": np.full(2 * nb + 1, step, dtype=np.int64),
        "kind": ["raw"] * nb + ["applied"] * (nb + 1),
        "lo": np.concatenate([lo, lo, [0.0]]), "hi": np.concatenate([hi, hi, [0.0]]),
        "count": np.concatenate([h["raw"], h["applied"], [h["applied_zero"]]]).astype(np.int64),
    })


@visitor("rollout_is.hist")
def _hist_visitor(cfg: dict) -> ISHistogram:
    return ISHistogram(ISConfig.from_cfg(cfg))




NO_ROLLOUT = "no rollout_logp"  # the piece of a shard without rollout log-probs


class ISWeightWriter(Visitor):
    """``recompute --is-weights``: per-token weights and the modified loss mask, one Parquet file
    per token shard at ``RUN/grpolens/is_weights/step=S/rank=R[-P].parquet``, keyed like tokens
    (``OUT/is_weights/...`` with ``--out``: a directory, or an ``s3://`` prefix where each file is
    uploaded atomically as it is written, see :meth:`grpolens.run.storage.Location.atomic_writer`)."""

    name = "rollout_is.weights"

    def __init__(self, run: Path, c: ISConfig, out=None):
        from grpolens.run.storage import is_remote, location

        # absolute: shard() may run in a Ray worker, whose working directory is not this process's
        if out is None:
            self.root = fmt.derived_dir(run).absolute() / "is_weights"
        else:
            self.root = (location(out) if is_remote(str(out)) else Path(out).absolute()) / "is_weights"
        self.c = c
        #: token shards without rollout log-probs (no weights written for them), for the command to report
        self.without_rollout: list[str] = []

    def shard(self, b: TokenBatch, sh: fmt.Shard):
        if not b.has("rollout_logp"):
            # a piece, not an attribute set here: under --engine ray this runs on a copy in a worker
            return NO_ROLLOUT, str(sh.path)
        import pyarrow as pa

        tw = batch_token_weights(b, self.c)
        v = tw["valid"]
        cols = {"step": pa.array(b.cols["step"], pa.int64()), "rank": pa.array(b.cols["rank"], pa.int32()),
                "micro_batch": pa.array(b.cols["micro_batch"], pa.int32()),
                "sample_id": pa.array(b.cols["sample_id"], pa.int64()), "pos": pa.array(b.cols["pos"], pa.int32()),
                "mask": pa.array(b.mask), "valid": pa.array(v),
                "is_weight_raw": pa.array(tw["is_weight_raw"], pa.float64(), mask=~v),
                "is_weight": pa.array(tw["is_weight"], pa.float64(), mask=~v),
                "is_mask": pa.array(tw["is_mask"])}
        rel = fmt.shard_relpath("is_weights", sh.step, sh.rank, None if sh.part < 0 else sh.part)
        path = self.root.parent / rel
        fmt.atomic_write_table(path, pa.table(cols))
        return path

    def combine(self, step: int, pieces: list) -> int:
        self.without_rollout += [p[1] for p in pieces if isinstance(p, tuple) and p[0] == NO_ROLLOUT]
        written = {str(p) for p in pieces if p is not None and not isinstance(p, tuple)}
        step_dir = self.root / f"step={step:08d}"
        # files of an earlier layout of this step (other ranks or parts) would be read as current
        if isinstance(step_dir, Path):
            stale = [f for f in step_dir.glob("rank=*.parquet") if str(f) not in written] if step_dir.is_dir() else []
        else:  # an s3:// prefix: one LIST request per step
            stale = [step_dir / e.name for e in step_dir.list_dir()
                     if e.name.startswith("rank=") and e.name.endswith(".parquet") and str(step_dir / e.name) not in written]
        for f in stale:
            f.unlink()
        return len(written)

    def write_config(self) -> None:
        c = self.c
        doc = {"level": c.level, "mode": c.mode, "lower": c.lower, "upper": c.upper, "mask_lower": c.mask_lower,
               "mask_upper": c.mask_upper, "veto_lower": c.veto_lower, "veto_upper": c.veto_upper,
               "rs": [{"option": f.option, "lower": f.lower, "upper": f.upper} for f in c.rs],
               "configured": c.configured, "columns": {
                   "valid": "mask and the log-ratio is defined (weights are null elsewhere)",
                   "is_weight_raw": "safety-bounded weight at the level, before truncation/zeroing",
                   "is_weight": "applied weight (after truncation/zeroing)",
                   "is_mask": "the loss mask after the mask band, veto and rejection filters"}}
        fmt.atomic_write_bytes(self.root / "config.json", (json.dumps(doc, indent=2) + "\n").encode())


def is_weight_writer(run: Path, overrides: dict | None = None, config_file: Path | None = None,
                     out=None) -> ISWeightWriter:
    """The ``--is-weights`` visitor for ``recompute`` (fails early when the run has no rollout_logp);
    ``out`` is recompute's ``--out`` (a directory or an ``s3://`` prefix), the weights go below it."""
    from grpolens.errors import UserError

    run = fmt.as_run(run)  # a run on object storage: the weights go to its local ./<run name>.grpolens/
    shards = fmt.list_shards(run, fmt.TOKENS)
    if shards:
        import pyarrow.parquet as pq

        if "rollout_logp" not in pq.ParquetFile(fmt.parquet_source(shards[0].path)).schema_arrow.names:
            raise UserError(f"--is-weights: {shards[0].path} has no rollout_logp column, so there are no IS weights")
    w = ISWeightWriter(run, ISConfig.from_cfg(resolve_config(run, overrides, config_file)), out)
    from grpolens.run.variants import Variant, effective_overrides

    what_if = effective_overrides(overrides, config_file)
    if what_if and out is None:  # a what-if's weights go beside its metrics (RUN/grpolens/variants/<key>/)
        w.root = Variant.of(run, what_if).dir.absolute() / "is_weights"
    w.write_config()
    return w
