"""Where a recompute's outputs go (local, staged for object storage, a variant's folder), the tables
it writes, and the notes it reports about the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from grpolens import plugins
from grpolens.metrics import reduce
from grpolens.metrics.registry import REGISTRY, Metric
from grpolens.run import format as fmt
from grpolens.run.reader import RunReader
from grpolens.run.variants import Variant
from grpolens.analysis.recompute.steps import step_values


def output_dirs(reader: RunReader, out, profile: str, variant: Variant | None = None,
                fetch: bool = True) -> tuple[Path, Path, Any]:
    """``(out_dir, cache_root, remote_out)``: where outputs and the per-step cache go. A local run
    keeps both under ``RUN/grpolens/`` unless ``--out``; a run on object storage writes locally by
    default (``./<run name>.grpolens/``); ``--out s3://...`` stages locally (copying what is there
    first, unless not ``fetch``) and uploads at the end.
    A what-if (``variant``) keeps both in its own directory, ``RUN/grpolens/variants/<key>/``, or
    in ``--out`` when given: never in the run's own, whose metrics and cache it would replace."""
    from grpolens.run.storage import is_remote, location

    if out is not None and (is_remote(str(out)) if isinstance(out, str) else fmt.is_remote_run(out)):
        import tempfile

        remote_out = location(out, reader.path.settings.storage_options() if fmt.is_remote_run(reader.path) else None) \
            if isinstance(out, str) else out
        staging = Path(tempfile.mkdtemp(prefix="grpolens-out-"))
        for rel, _ in remote_out.walk() if fetch else ():  # earlier outputs and the cache: kept steps are reused
            if rel.split("/", 1)[0] == "is_weights":
                # written in place by recompute --is-weights (ISWeightWriter), not staged: a staged copy
                # would go back up at the end over the new weights and restore the stale parts removed
                continue
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes((remote_out / rel).read_bytes())
        return staging, staging, remote_out
    if variant is not None:
        root = Path(out) if out is not None else variant.dir
        return (root if out is not None or profile == "grpolens" else root / profile), root, None
    if fmt.is_remote_run(reader.path):  # the local fmt.derived_dir of the run (./<run name>.grpolens)
        root = Path(out) if out is not None else fmt.derived_dir(reader.path)
        return (root if out is not None or profile == "grpolens" else root / profile), root, None
    return (Path(out) if out is not None else reader.out_dir(profile)), fmt.derived_dir(reader.path), None


def upload(staging: Path, remote_out) -> None:
    """Every staged file to its key under ``remote_out``, each atomically (temporary key, copy)."""
    import shutil

    try:
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        # the cache state last: an upload cut short leaves a state that does not vouch for new rows
        for f in sorted(files, key=lambda p: (p.parent.name == "cache" and p.name.startswith("state-"), str(p))):
            (remote_out / f.relative_to(staging).as_posix()).write_bytes(f.read_bytes())
    finally:
        shutil.rmtree(staging, ignore_errors=True)



def key_columns(columns, profile: str = "grpolens") -> list[str]:
    """The profile's names of the families' key metrics (``Family.key_metrics``) that ``columns`` has (the summary's rows)."""
    from grpolens.metrics.registry import FAMILIES

    plugins.load_plugins()
    out = []
    for name in (k for f in FAMILIES.values() for k in f.key_metrics):
        m = REGISTRY.get(name)
        alias = m.name_in(profile) if m is not None else None
        if alias is not None and alias in columns:
            out.append(alias)
    return out



def cumulative_offsets(run, metrics, all_steps, lo, valid_cache, cfg, prof) -> dict[str, float]:
    """Totals of cumulative metrics over the steps before ``--steps`` starts (samples only:
    cumulative metrics count generated tokens, so no token shard is read)."""
    cum = [m for m in metrics if m.cumulative]
    if not cum or lo is None:
        return {}
    totals = {m.name: 0.0 for m in cum}
    reader = RunReader(run)
    for s in all_steps:
        if s >= lo:
            break
        row = valid_cache.get(s)
        if row is None:
            row = step_values(reduce.StepData(s, {}, cfg, prof, reader.samples(s), set(), {}), cum)
        for m in cum:
            totals[m.name] += row.get(m.name) or 0.0
    return totals


def finalize(raw: pl.DataFrame, metrics: list[Metric], profile: str, offsets: dict[str, float] | None = None) -> pl.DataFrame:
    """Rename to the profile's names; cumulative metrics become running totals (from ``offsets``)."""
    exprs = [pl.col("step")]
    for m in metrics:
        e = pl.col(m.name)
        if m.cumulative:
            start = (offsets or {}).get(m.name, 0.0)
            e = pl.when(e.is_not_null()).then(e.fill_null(0).cum_sum() + start).otherwise(None)
        exprs.append(e.alias(m.name_in(profile)))
    return raw.select(exprs)


def to_jsonl(df: pl.DataFrame) -> str:
    lines = []
    for row in df.iter_rows(named=True):
        clean = {}
        for k, v in row.items():
            if v is None or (isinstance(v, float) and not np.isfinite(v)):
                continue
            clean[k] = v
        lines.append(json.dumps(clean))
    return "\n".join(lines) + ("\n" if lines else "")


def rejection_notes(cfg: dict, present: set[str], computed) -> list[str]:
    """A verl run with rejection filters but no ``rollout_rejected``: its stored mask is the one after
    verl's rejection, so the rollout-correction values cannot be verl's (said once). Bypass mode
    has no rejection before the loss (the loss rejects per call, which the profile replays)."""
    from grpolens.functional.rollout_is import ISConfig
    from grpolens.metrics.verl_actor import bypass

    if not computed or "verl_algorithm" not in cfg or bypass(cfg):
        return []
    if "rollout_rejected" in present or not ISConfig.from_cfg(cfg).rs:
        return []
    return ["no rollout_rejected in this run: verl's rollout_rs is re-applied to the mask after its rejection "
            "(rejection fractions 0, IS and mismatch values over the kept tokens; verl computes them before "
            "rejection: docs/integrations/verl.md)"]


def absent_notes(run, metrics, raw, present, computed) -> list[str]:
    """One line per optional column the run lacks, naming the metrics that are therefore empty."""
    if not computed:
        return []
    notes = []
    for col in ("old_logp", "ref_logp", "rollout_logp", "entropy", "old_entropy"):
        if col in present:
            continue
        hit = [m.name for m in metrics if col in m.requires]
        if hit:
            notes.append(f"no {col} in this run: {len(hit)} metric(s) left empty ({', '.join(hit[:4])}{', ...' if len(hit) > 4 else ''})")
    return notes
