"""Clipping: the clipped shares rising, per side (``clip-drift``), and ratios identically 1 so that
clipping cannot act at all (``clip-inactive``)."""

from __future__ import annotations

import numpy as np

from grpolens.analysis.doctor import signals
from grpolens.analysis.doctor.catalogue import Finding, Skip, detector
from grpolens.analysis.doctor.context import MIN_TREND_STEPS

SIDES = {"clip/low": ("low", "clip_low"), "clip/high": ("high", "clip_high")}
RATIO_MAX, RATIO_MIN = "policy/ratio_max", "policy/ratio_min"
#: a side drifts when its clipped share rises by at least this (absolute) ...
RISE = 0.05
#: ... to at least this many times its earlier level; critical from this share on
RISE_RATIO, CRITICAL = 3.0, 0.3
#: clip-inactive after active steps: this many inactive steps in a row ...
INACTIVE_RUN = 3
#: ... after a stretch where at least this share of the steps had ratios off 1
ACTIVE_BEFORE = 0.9


def _active(ctx) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, active)``: the steps with ratios, and whether any ratio differs from 1 there."""
    _, hi = ctx.series(RATIO_MAX)
    x, lo = ctx.series(RATIO_MIN)
    if len(hi) != len(lo):
        raise Skip(f"{RATIO_MAX} and {RATIO_MIN} have values at different steps")
    return x, (hi != 1.0) | (lo != 1.0)


@detector("clip-drift", "the share of clipped tokens rising, per side", tuple(SIDES))
def clip_drift(ctx) -> list[Finding]:
    if not ctx.has(RATIO_MAX):
        raise Skip("the run has no policy ratios (old_logp)")
    xa, active = _active(ctx)
    on = set(int(s) for s in xa[active])
    out = []
    for metric, (side, setting) in SIDES.items():
        x, y = ctx.series(metric)
        keep = np.array([int(s) in on for s in x], bool)  # a step with ratios all 1 cannot clip
        x, y = x[keep], y[keep]
        if len(y) < MIN_TREND_STEPS:
            raise Skip(f"{metric} has {len(y)} step(s) with ratios off 1; this detector needs {MIN_TREND_STEPS}")
        sh = signals.shift(x, y, up=True)
        d = signals.drift(x, y)
        if sh is not None and sh.after - sh.before >= RISE and sh.after >= RISE_RATIO * sh.before:
            onset, before, after = sh.onset, sh.before, sh.after
        elif d.significant(+1) and d.late - d.early >= RISE and d.late >= RISE_RATIO * d.early:
            onset, before, after = int(x[np.argmax(y >= (d.early + d.late) / 2)]), d.early, d.late
        else:
            ctx.checked(f"{metric} {d.early:.1%} → {d.late:.1%} over {len(y)} steps with ratios off 1")
            continue
        out.append(Finding(
            "clip-drift", "critical" if after >= CRITICAL else "warning", signals.steps_from(x, onset), metric,
            f"{side}-side clipped share rose from {before:.1%} to {after:.1%} at step {onset}",
            {"side": side, "before": before, "after": after, "onset": onset, "mann_kendall_p": d.trend.p},
            f"The policy moves further from the behaviour policy each step than the clip band allows: lower "
            f"{ctx.setting('learning_rate')} or {ctx.setting('num_iterations')}; widening {ctx.setting(setting)} "
            f"lets more of the update through.",
            worst_step=onset))
    return out


@detector("clip-inactive", "policy ratios identically 1: clipping cannot act", (RATIO_MAX, RATIO_MIN))
def clip_inactive(ctx) -> list[Finding]:
    if not ctx.has(RATIO_MAX):
        raise Skip("the run has no policy ratios (old_logp)")
    x, active = _active(ctx)
    if active.all():
        ctx.checked(f"ratios off 1 at all {len(x)} steps")
        return []
    iters = ctx.config.get("num_iterations")
    idle = [int(s) for s in x[~active]]
    if not active.any():
        off_policy = isinstance(iters, (int, float)) and iters > 1
        return [Finding(
            "clip-inactive", "warning" if off_policy else "info", idle, RATIO_MAX,
            f"policy ratios are exactly 1 at every step: clipping ({ctx.setting('clip_low')}, "
            f"{ctx.setting('clip_high')}) never acts"
            + (f", although the config says {iters} iterations per generation" if off_policy else
               " (on-policy with one iteration per generation)"),
            {"inactive_steps": len(idle), "num_iterations": iters},
            f"Expected with one pass per generation; for the clip band to matter, raise "
            f"{ctx.setting('num_iterations')}." if not off_policy else
            "old_logp equals logp although the policy is updated between passes: check that the old "
            "log-probs are computed before the first update of the generation.")]
    # an inactive stretch after a mostly active regime: the old log-probs stopped being the behaviour policy's
    runs, start = [], None
    for i, a in enumerate(list(active) + [True]):
        if not a and start is None:
            start = i
        elif a and start is not None:
            runs.append((start, i))
            start = None
    for a, b in runs:
        if b - a >= INACTIVE_RUN and a >= MIN_TREND_STEPS // 2 and active[:a].mean() >= ACTIVE_BEFORE:
            onset = int(x[a])
            return [Finding(
                "clip-inactive", "warning", [int(s) for s in x[a:b]], RATIO_MAX,
                f"policy ratios exactly 1 from step {onset} ({b - a} step(s)) after {a} step(s) where they were not: "
                f"clipping stopped acting",
                {"onset": onset, "inactive_steps": b - a, "active_before": float(active[:a].mean())},
                "old_logp now equals logp: the old log-probs are being recomputed after the update (or copied from "
                f"the current policy). Check the trainer's old-log-prob pass and {ctx.setting('num_iterations')}.",
                worst_step=onset)]
    return [Finding(
        "clip-inactive", "info", idle, RATIO_MAX,
        f"policy ratios exactly 1 at {len(idle)} of {len(x)} step(s) (the first pass over each generation): "
        f"clipping acts only on the others",
        {"inactive_steps": len(idle), "steps": len(x), "num_iterations": iters}, "")]
