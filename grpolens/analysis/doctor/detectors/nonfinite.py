"""NaN or ±inf anywhere: in a token tensor the loss reads (``health/nonfinite/<column>``: masked
tokens whose value is not finite), in a reward (``reward/nonfinite``, ``rewards/<name>/nonfinite``),
or in a recomputed metric itself. Any one is critical: the trainer's loss and gradients are NaN
from there on, or it silently drops what grpolens had to exclude."""

from __future__ import annotations

import math

import numpy as np

from grpolens.analysis.doctor.catalogue import Finding, Skip, detector

TOKEN_PREFIX = "health/nonfinite/"
#: metrics whose non-finite value is the data's, not a consequence of another non-finite input
_WATCHED = ("loss", "entropy", "kl/k3", "advantage/mean", "reward/mean")


@detector("nonfinite", "NaN or ±inf in a token tensor, a reward or a metric: first step and where",
          ("health/nonfinite/<column>", "reward/nonfinite"))
def nonfinite(ctx) -> list[Finding]:
    df = ctx.metrics
    counters = [c for c in df.columns if c.startswith(TOKEN_PREFIX)]
    counters += [c for c in df.columns if c == "reward/nonfinite" or (c.startswith("rewards/") and c.endswith("/nonfinite"))]
    if not counters:
        raise Skip("the run's metrics have no non-finite counters (no token or sample data)")
    steps = df["step"].to_numpy()
    ctx.checked(f"{len(counters)} non-finite counters at {len(steps)} steps: all 0")
    out = []
    for c in counters:
        n = np.nan_to_num(df[c].to_numpy().astype(np.float64), nan=0.0)
        hit = n > 0
        if not hit.any():
            continue
        tensor = c[len(TOKEN_PREFIX):] if c.startswith(TOKEN_PREFIX) else c.removesuffix("/nonfinite")
        where = "tokens" if c.startswith(TOKEN_PREFIX) else "completions"
        first, worst = int(steps[hit][0]), int(steps[np.argmax(n)])
        out.append(Finding(
            "nonfinite", "critical", [int(s) for s in steps[hit]], c,
            f"NaN/inf in {tensor}: first at step {first}, {int(n.sum())} {where} in {int(hit.sum())} step(s)",
            {"tensor": tensor, "first_step": first, "count": int(n.sum()), "steps_hit": int(hit.sum()),
             "worst_step": worst, "worst_count": int(n.max())},
            f"Find where {tensor} stops being finite at step {first} (grpolens tokens RUN --step {first}); "
            f"grpolens leaves such {where} out of every metric, the trainer may not. Lower "
            f"{ctx.setting('learning_rate')} or {ctx.setting('max_grad_norm')} if the policy diverged.",
            worst_step=first))
    for c in _WATCHED:
        if c not in df.columns:
            continue
        vals = df[c].to_list()
        bad = [int(s) for s, v in zip(steps, vals) if v is not None and not math.isfinite(v)]
        if bad and not out:  # a metric made non-finite by no counted input: the data's own
            out.append(Finding(
                "nonfinite", "critical", bad, c, f"{c} is not finite at {len(bad)} step(s), first at step {bad[0]}",
                {"first_step": bad[0], "steps_hit": len(bad)},
                f"Inspect step {bad[0]}'s tokens and samples (grpolens tokens RUN --step {bad[0]})."))
    return out
