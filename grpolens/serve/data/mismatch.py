"""The mismatch page: IS-weight histograms and heat map, one step's IS detail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from grpolens.run import format as fmt
from grpolens.serve.data.curves import read_metrics
from grpolens.serve.data.memo import _RUN_MEMO, _stat, run_key, run_version
from grpolens.serve.data.tokens import _run_config, step_tokens


#: Log-spaced bins of the IS weight exp(old - rollout): log10 edges from 1e-3 to 1e3, 0.025 wide
#: (a 6 % step in the weight, fine enough to see a 1e-2 mismatch).
IS_LOG10_EDGES = np.linspace(-3, 3, 241)


def is_hist_file(run: Path) -> Path:
    return fmt.derived_dir(run) / "is_hist.parquet"


def _hist_log10(w: np.ndarray) -> np.ndarray:
    """Counts per bin of log10(w); values beyond the edges land in the first/last bin."""
    lw = np.log10(w[(w > 0) & np.isfinite(w)])
    lw = np.clip(lw, IS_LOG10_EDGES[0], IS_LOG10_EDGES[-1] - 1e-12)
    return np.histogram(lw, IS_LOG10_EDGES)[0].astype(np.float64)


def is_hist_table(run: Path) -> pl.DataFrame | None:
    """``RUN/grpolens/is_hist.parquet`` (long form: step, kind raw/applied, weight bin [lo, hi),
    count), written by recompute's IS-histogram visitor; None when absent or unreadable."""
    p = is_hist_file(run)
    if not p.is_file():
        return None

    def make():
        try:
            df = pl.read_parquet(p)
        except Exception:  # noqa: BLE001 - fall back to computing from tokens
            return None
        return df if {"step", "kind", "lo", "hi", "count"} <= set(df.columns) else None

    return _RUN_MEMO.get(("ishist", run_key(run), _stat(p)), make)


def _hist_from_table(df: pl.DataFrame, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(steps, log10 edges, counts steps x bins)`` of one kind; bins with lo <= 0 (the applied
    weights' exact zeros) are left out."""
    d = df.filter((pl.col("kind") == kind) & (pl.col("lo") > 0)).sort("step", "lo")
    bins = d.select("lo", "hi").unique().sort("lo")
    steps = d["step"].unique().sort().to_numpy()
    edges = np.log10(np.append(bins["lo"].to_numpy(), bins["hi"].to_numpy()[-1:]))
    counts = np.zeros((len(steps), bins.height))
    si = np.searchsorted(steps, d["step"].to_numpy())
    bi = np.searchsorted(bins["lo"].to_numpy(), d["lo"].to_numpy())
    np.add.at(counts, (si, bi), d["count"].to_numpy().astype(np.float64))
    return steps, edges, counts


def is_heatmap(run: Path, max_steps: int = 64) -> dict[str, Any]:
    """IS-weight distribution per step: ``{steps, log10_edges, counts (steps x bins), source}``.

    From ``RUN/grpolens/is_hist.parquet`` when recompute wrote it (every step, mergeable
    histograms); otherwise computed here from the tokens of at most ``max_steps`` evenly spaced
    steps (``source`` says which)."""
    tab = is_hist_table(run)
    if tab is not None and tab.height:
        def from_file() -> dict[str, Any]:
            steps, edges, counts = _hist_from_table(tab, "raw")
            return {"steps": steps, "log10_edges": edges, "counts": counts, "source": is_hist_file(run).name}

        return _RUN_MEMO.get(("ishist-map", run_key(run), _stat(is_hist_file(run))), from_file)

    def make() -> dict[str, Any]:
        all_steps = fmt.list_steps(run, fmt.TOKENS)
        steps = all_steps
        if len(steps) > max_steps:
            steps = [steps[i] for i in np.linspace(0, len(steps) - 1, max_steps).round().astype(int)]
        rows = []
        for s in steps:
            t = step_tokens(run, s)
            w = t.filter(pl.col("mask"))["is_weight"].drop_nulls().to_numpy() if t.height else np.zeros(0)
            rows.append(_hist_log10(w))
        counts = np.vstack(rows) if rows else np.zeros((0, len(IS_LOG10_EDGES) - 1))
        src = "tokens" if len(steps) == len(all_steps) else f"tokens of {len(steps)} sampled steps"
        return {"steps": np.asarray(steps, np.int64), "log10_edges": IS_LOG10_EDGES, "counts": counts, "source": src}

    return _RUN_MEMO.get(("ishist-tokens", str(run), run_version(run), max_steps), make)


#: Step metrics shown beside one step's IS weights, when the run has them.
IS_STEP_METRICS = ("mismatch/kl_k3", "mismatch/abs_logp_diff", "mismatch/delta_median", "mismatch/delta_iqr",
                   "mismatch/delta_sign_agreement", "mismatch/constant_offset", "rollout_is/raw/max",
                   "rollout_is/raw/ess", "rollout_is/truncated_fraction", "rollout_is/zeroed_fraction",
                   "rollout_is/modified/token_fraction", "rollout_is/veto/seq_fraction",
                   "rollout_is/mask/seq_fraction")


def is_step_detail(run: Path, step: int) -> dict[str, Any]:
    """One step's raw and applied IS weights (log10 bins), with the step's mismatch/rollout-IS
    metrics and the mean/sd of log(train/rollout) for the constant-offset check.

    Histograms come from ``is_hist.parquet`` (the rollout-IS family's exact weights) when
    present; otherwise raw weights are binned here and "applied" follows the manifest's
    ``rollout_is`` (truncate at ``upper``; mask outside [lower, upper]; veto whole sequences)."""
    t = step_tokens(run, step)
    cfg = _run_config(run).get("rollout_is") or {}
    cfg = cfg if isinstance(cfg, dict) else {}
    out: dict[str, Any] = {"config": cfg, "edges": IS_LOG10_EDGES, "source": "tokens"}
    m = read_metrics(run)
    row = m.filter(pl.col("step") == step).row(0, named=True) if m.height and step in set(m["step"]) else {}
    out["metrics"] = {k: row[k] for k in IS_STEP_METRICS if row.get(k) is not None}
    if t.height == 0:
        return out
    t = t.filter(pl.col("mask") & pl.col("is_weight").is_not_null())
    w = t["is_weight"].to_numpy()
    out["tokens"] = int(len(w))
    out["seqs"] = int(t["sample_id"].n_unique())
    if len(w) == 0:
        return out
    d = np.log(w)
    out["offset_mean"] = float(d.mean())
    out["offset_sd"] = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
    tab = is_hist_table(run)
    if tab is not None and step in set(tab["step"]):
        one = tab.filter(pl.col("step") == step)
        _, edges, raw = _hist_from_table(one, "raw")
        _, edges_a, applied = _hist_from_table(one, "applied")
        if len(edges_a) == len(edges):
            out.update(edges=edges, raw=raw[0], applied=applied[0], source=is_hist_file(run).name)
            zero = one.filter((pl.col("kind") == "applied") & (pl.col("lo") <= 0))["count"].sum()
            out["zeroed"] = int(zero or 0)
            return out
    # No is_hist.parquet for this step: the rollout-IS family's own per-token decisions, on the
    # step's shards (one implementation of truncation, masking and veto for every view).
    from grpolens.analysis import drilldown
    from grpolens.functional.rollout_is import ISConfig, token_weights
    from grpolens.run.reader import resolve_config

    b = drilldown.load_step(run, step)
    tw = token_weights(b, ISConfig.from_cfg(resolve_config(run)))
    valid = tw["valid"]
    out["raw"] = _hist_log10(tw["is_weight_raw"][valid])
    out["applied"] = _hist_log10(tw["is_weight"][valid & tw["is_mask"]])
    out["zeroed"] = int((valid & ~tw["is_mask"]).sum())
    return out
