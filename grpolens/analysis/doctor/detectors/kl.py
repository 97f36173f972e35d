"""KL to the reference: one step far above its neighbours (``kl-spike``), or a sustained rise
(``kl-drift``)."""

from __future__ import annotations

import numpy as np

from grpolens.analysis.doctor import signals, stats
from grpolens.analysis.doctor.catalogue import Finding, detector
from grpolens.analysis.doctor.context import MIN_TREND_STEPS

METRIC = "kl/k3"
#: neighbours on each side a step is compared with
WINDOW = 10
#: a spike: robust z against its neighbours at least this ...
SPIKE_Z = 8.0
#: ... and at least this many times the median of the neighbours on each side ...
SPIKE_RATIO = 3.0
#: ... and at least this much above them in nats (tiny KLs jitter by large factors)
SPIKE_MIN_EXCESS = 1e-3
#: critical: this many times the neighbours and this far above them
SPIKE_CRITICAL_RATIO, SPIKE_CRITICAL_EXCESS = 10.0, 1e-2
#: a drift: the late level (or the level after a change point) at least this (nats per token) ...
DRIFT_LEVEL = 0.05
#: ... and this many times the early level; critical from this level on
DRIFT_RATIO, DRIFT_CRITICAL = 3.0, 0.5


@detector("kl-spike", "a step whose KL to the reference is far above its neighbours", (METRIC,))
def kl_spike(ctx) -> list[Finding]:
    x, y = ctx.series(METRIC, min_steps=5)
    out = []
    for i in range(len(y)):
        left, right = y[max(0, i - WINDOW):i], y[i + 1:i + 1 + WINDOW]
        neigh = np.concatenate([left, right])
        if len(neigh) < 4:
            continue
        base = float(np.median(neigh))
        sides = [float(np.median(s)) for s in (left, right) if len(s) >= 2]
        if not all(y[i] >= SPIKE_RATIO * s for s in sides) or y[i] - base < SPIKE_MIN_EXCESS:
            continue
        z = stats.robust_z(float(y[i]), neigh, floor=0.05 * abs(base) + 1e-12)
        if z < SPIKE_Z:
            continue
        ratio = float(y[i] / base) if base > 0 else float("inf")
        critical = ratio >= SPIKE_CRITICAL_RATIO and y[i] - base >= SPIKE_CRITICAL_EXCESS
        step = int(x[i])
        out.append(Finding(
            "kl-spike", "critical" if critical else "warning", [step], METRIC,
            f"KL to the reference {y[i]:.4g} at step {step}, {_times(ratio)} its neighbours' median {base:.3g}",
            {"value": float(y[i]), "neighbours_median": base, "ratio": ratio, "robust_z": float(z),
             "window": WINDOW},
            f"Look at the step's tokens first (the decomposition below); a spike from a few tokens is often one "
            f"bad batch. If spikes recur, lower {ctx.setting('learning_rate')} or {ctx.setting('max_grad_norm')}, "
            f"or raise {ctx.setting('kl_coef')}.",
            worst_step=step))
    if not out:
        ctx.checked(f"{METRIC} at {len(y)} steps: none {SPIKE_RATIO:g}× its neighbours with robust z ≥ {SPIKE_Z:g} "
                    f"(largest {y.max():.3g})")
    return out


@detector("kl-drift", "KL to the reference rising and staying high", (METRIC,))
def kl_drift(ctx) -> list[Finding]:
    x, y = ctx.series(METRIC, min_steps=MIN_TREND_STEPS)
    sh = signals.shift(x, y, up=True, log=True)
    d = signals.drift(x, y)
    if sh is not None and sh.after >= DRIFT_LEVEL and sh.after >= DRIFT_RATIO * max(sh.before, 1e-12):
        onset, level, before = sh.onset, sh.after, sh.before
        how = f"jumped from {before:.3g} to {level:.3g} at step {onset} and stayed"
    elif d.significant(+1) and d.late >= DRIFT_LEVEL and d.late >= DRIFT_RATIO * max(d.early, 1e-12):
        onset = int(x[np.argmax(y >= (d.early + d.late) / 2)])
        level, before = d.late, d.early
        how = f"rose from {before:.3g} to {level:.3g} (Theil–Sen {d.slope.slope:+.3g}/step, Mann–Kendall p={d.trend.p:.2g})"
    else:
        ctx.checked(f"{METRIC} {d.early:.3g} → {d.late:.3g} over {len(y)} steps (a drift needs ≥ {DRIFT_LEVEL:g})")
        return []
    return [Finding(
        "kl-drift", "critical" if level >= DRIFT_CRITICAL else "warning", signals.steps_from(x, onset), METRIC,
        f"KL to the reference {how}",
        {"before": before, "after": level, "onset": onset, "mann_kendall_p": d.trend.p, "theil_sen_slope": d.slope.slope,
         "threshold": DRIFT_LEVEL},
        f"The policy is moving away from the reference faster than the KL term holds it: raise "
        f"{ctx.setting('kl_coef')} or lower {ctx.setting('learning_rate')}.",
        worst_step=onset)]


def _times(ratio: float) -> str:
    return "far above" if not np.isfinite(ratio) else f"{ratio:.3g}×"
