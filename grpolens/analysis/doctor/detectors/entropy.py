"""Entropy collapse: the policy's mean token entropy falls to a floor (a tenth of where the run
started), or is falling towards it fast enough to reach it within half as many steps again as
the run has had (projected by the Theil–Sen slope of the recent steps)."""

from __future__ import annotations

import numpy as np

from grpolens.analysis.doctor import signals
from grpolens.analysis.doctor.catalogue import Finding, detector
from grpolens.analysis.doctor.context import MIN_TREND_STEPS

METRIC = "entropy"
#: the floor, as a share of the run's initial entropy (median of its first tenth, at least 3 steps)
FLOOR_SHARE = 0.1
#: the recent window the projection's slope is fitted on: the last quarter, at least this many steps
RECENT_MIN = 8
#: project only this far ahead, as a share of the steps the run has had
HORIZON_SHARE = 0.5


@detector("entropy-collapse", "policy entropy at, or heading for, a tenth of its starting level", (METRIC,))
def entropy_collapse(ctx) -> list[Finding]:
    x, y = ctx.series(METRIC, min_steps=MIN_TREND_STEPS)
    initial = float(np.median(y[:max(3, len(y) // 10)]))
    floor = FLOOR_SHARE * initial
    evidence = {"initial": initial, "floor": floor, "current": float(y[-1])}
    below = y < floor
    if below[-1] or below.sum() >= 2:
        sh = signals.shift(x, y, up=False)
        # the collapse starts where the last stretch below the floor begins (or the change point before it)
        last_above = np.flatnonzero(~below)
        start = int(x[last_above[-1] + 1]) if len(last_above) and last_above[-1] + 1 < len(x) else int(x[np.argmax(below)])
        onset = sh.onset if sh is not None and sh.onset <= start and sh.after < floor else start
        evidence.update(onset=onset, steps_below=int(below.sum()))
        return [Finding(
            "entropy-collapse", "critical", signals.steps_from(x, onset), METRIC,
            f"entropy collapsed to {y[-1]:.3g} nats (floor {floor:.3g}, a tenth of the initial {initial:.3g}) from step {onset}",
            evidence, _suggestion(ctx), worst_step=onset)]
    k = max(RECENT_MIN, len(y) // 4)
    d = signals.drift(x[-k:], y[-k:])
    ctx.checked(f"{METRIC} {initial:.3g} → {y[-1]:.3g} nats over {len(y)} steps, floor {floor:.3g}")
    if not d.significant(-1) or d.slope.slope >= 0:
        return []
    span = int(x[-1] - x[0]) + 1
    eta = float((y[-1] - floor) / -d.slope.slope)
    if eta > HORIZON_SHARE * span:
        ctx.checked(f"at {d.slope.slope:+.3g}/step the floor is {eta:.0f} steps away")
        return []
    projected = int(x[-1] + np.ceil(eta))
    evidence.update(slope=d.slope.slope, mann_kendall_p=d.trend.p, projected_step=projected, window=k)
    return [Finding(
        "entropy-collapse", "warning", [int(s) for s in x[-k:]], METRIC,
        f"entropy falling {d.slope.slope:+.3g}/step (Mann–Kendall p={d.trend.p:.2g}): projected to reach the floor "
        f"{floor:.3g} at step {projected}",
        evidence, _suggestion(ctx), worst_step=int(x[-1]))]


def _suggestion(ctx) -> str:
    return (f"The policy is becoming deterministic and will stop exploring: raise {ctx.setting('clip_high')} "
            f"(clip-higher lets low-probability tokens grow), add or raise {ctx.setting('entropy_coef')}, or lower "
            f"{ctx.setting('learning_rate')}.")
