"""A constant train–rollout offset (``mismatch/constant_offset``): the thresholds the δ-quantile
visitor flags a step with, and ``recompute``'s note on the flagged steps (which, how large, its
likely cause)."""

from __future__ import annotations

import polars as pl

#: constant-offset diagnosis: |median Δ| at least this many nats, and at least this share of
#: tokens on the median's side of 0 (bf16 noise is symmetric around 0; a temperature or
#: truncated-support mismatch shifts almost every token the same way)
OFFSET_MIN_NATS = 0.01
OFFSET_MIN_AGREEMENT = 0.75


def _ranges(steps: list[int]) -> str:
    out, start, prev = [], None, None
    for s in steps:
        if start is None:
            start = prev = s
        elif s == prev + 1:
            prev = s
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = s
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def offset_cause(median: float) -> str:
    """The likely cause of a constant per-token offset with this sign."""
    if median < 0:
        return ("the rollout engine's log-probs are higher than the trainer's almost everywhere: it likely "
                "renormalised over a truncated support (top-p/top-k/min-p, e.g. vLLM processed log-probs) or "
                "sampled at a lower temperature than the trainer's log-probs assume")
    return ("the trainer's log-probs are higher than the rollout engine's almost everywhere: the trainer likely "
            "scores with a lower temperature than the engine sampled with (logits not divided by the same "
            "temperature on both sides) or renormalises over a truncated support the engine does not")


def offset_notes(raw: pl.DataFrame) -> list[str]:
    """One note when some steps show a constant offset between the engines (``mismatch/constant_offset``)."""
    if "mismatch/constant_offset" not in raw.columns or "mismatch/delta_median" not in raw.columns:
        return []
    hit = raw.filter(pl.col("mismatch/constant_offset") == 1.0)
    if hit.height == 0:
        return []
    med = float(hit["mismatch/delta_median"].median())
    iqr = hit["mismatch/delta_iqr"].median() if "mismatch/delta_iqr" in hit.columns else None
    spread = f", IQR {iqr:.3g}" if iqr is not None else ""
    return [f"constant train–rollout offset at step(s) {_ranges(hit['step'].to_list())}: median δ = log π_train − "
            f"log π_rollout = {med:+.3g} nats{spread}; {offset_cause(med)}"]
