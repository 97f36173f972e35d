"""Train–inference mismatch growing (``rollout-drift``): the k3 KL between the rollout engine's
log-probs and the trainer's shifting up or trending up, the IS weights' effective sample size
falling through its bands, and the shares of sequences vetoed or rejected by the rollout
correction rising."""

from __future__ import annotations

import numpy as np

from grpolens.analysis.doctor import signals
from grpolens.analysis.doctor.catalogue import Finding, Skip, detector
from grpolens.analysis.doctor.context import MIN_TREND_STEPS

METRIC = "mismatch/kl_k3"
ESS = "rollout_is/raw/ess"
VETO, REJECTED = "rollout_is/veto/seq_fraction", "rollout_is/rejected/seq_fraction"
#: the offset diagnosis (docs/rollout-is.md): 1 where δ = log π_train − log π_rollout is a near-constant offset
OFFSET, DELTA = "mismatch/constant_offset", "mismatch/delta_median"
#: named as the cause when at least this share of the drifted steps show a constant offset
OFFSET_SHARE = 0.5
#: a shift or trend counts from this mismatch level on (bf16 engines sit around 1e-3) ...
LEVEL = 1e-3
#: ... and when it multiplies the earlier level by this much; critical from this level on
RATIO, CRITICAL = 3.0, 1e-2
#: ESS (normalised, 1 = every token counts fully) bands: warning below the first, critical below the second
ESS_BANDS = (0.9, 0.5)
#: steps below a band needed to report it (one bad step is noise)
ESS_MIN_STEPS = 3
#: vetoed or rejected sequence shares: reported from this level on
FRACTION = 0.05


@detector("rollout-drift", "train–inference mismatch growing: mismatch KL, IS-weight ESS, vetoed and rejected sequences",
          (METRIC, ESS, VETO, REJECTED))
def rollout_drift(ctx) -> list[Finding]:
    if not ctx.has(METRIC):
        raise Skip("the run has no rollout log-probs (rollout_logp), so no train–inference mismatch")
    x, y = ctx.series(METRIC, min_steps=MIN_TREND_STEPS)
    out = []
    sh = signals.shift(x, y, up=True, log=True)
    d = signals.drift(x, y)
    if sh is not None and sh.after >= LEVEL and sh.ratio >= RATIO:
        onset, before, after = sh.onset, sh.before, sh.after
        how = f"jumped {after / max(before, 1e-12):.3g}× from {before:.3g} to {after:.3g} at step {onset} and stayed"
    elif d.significant(+1) and d.late >= LEVEL and d.late >= RATIO * max(d.early, 1e-12):
        onset = int(x[np.argmax(y >= (d.early + d.late) / 2)])
        before, after = d.early, d.late
        how = f"rose from {before:.3g} to {after:.3g} (Theil–Sen {d.slope.slope:+.3g}/step, Mann–Kendall p={d.trend.p:.2g})"
    else:
        onset = None
        ctx.checked(f"{METRIC} {d.early:.3g} → {d.late:.3g} over {len(y)} steps")
    if onset is not None:
        steps = signals.steps_from(x, onset)
        evidence = {"before": before, "after": after, "onset": onset, "mann_kendall_p": d.trend.p,
                    "theil_sen_slope": d.slope.slope}
        cause = _offset(ctx, steps, evidence)
        out.append(Finding(
            "rollout-drift", "critical" if after >= CRITICAL else "warning", steps, METRIC,
            f"train–inference mismatch (k3 KL) {how}{cause}", evidence, _suggestion(ctx), worst_step=onset))
    if ctx.has(ESS):
        xe, e = ctx.series(ESS)
        ctx.checked(f"IS-weight ESS ≥ {e.min():.3g}")
        for band, severity in zip(ESS_BANDS[::-1], ("critical", "warning")):
            low = e < band
            if low.sum() >= ESS_MIN_STEPS:
                out.append(Finding(
                    "rollout-drift", severity, [int(s) for s in xe[low]], ESS,
                    f"IS-weight effective sample size below {band:g} at {int(low.sum())} step(s), first at step "
                    f"{int(xe[low][0])} (lowest {e.min():.3g})",
                    {"band": band, "steps_below": int(low.sum()), "min": float(e.min()), "first_step": int(xe[low][0])},
                    _suggestion(ctx), worst_step=int(xe[np.argmin(e)])))
                break
    for metric, what in ((VETO, "vetoed"), (REJECTED, "rejected")):
        if ctx.has(metric):
            xf, f = ctx.series(metric)
            high = f >= FRACTION
            if high.sum() >= ESS_MIN_STEPS:
                out.append(Finding(
                    "rollout-drift", "warning", [int(s) for s in xf[high]], metric,
                    f"{what} sequences at least {FRACTION:.0%} of the step at {int(high.sum())} step(s), first at step "
                    f"{int(xf[high][0])} (highest {f.max():.1%})",
                    {"threshold": FRACTION, "steps_above": int(high.sum()), "max": float(f.max())},
                    _suggestion(ctx), worst_step=int(xf[np.argmax(f)])))
    return out


def _offset(ctx, steps: list[int], evidence: dict) -> str:
    """What the token-level offset diagnosis says about the drifted steps (``""`` when it cannot)."""
    if not (ctx.has(OFFSET) and ctx.has(DELTA)):
        return ""
    sub = ctx.metrics.filter(ctx.metrics["step"].is_in(steps))
    flags = [v for v in sub[OFFSET].to_list() if v is not None]
    deltas = [v for v, f in zip(sub[DELTA].to_list(), sub[OFFSET].to_list()) if v is not None and f == 1]
    if not flags:
        return ""
    share = sum(f == 1 for f in flags) / len(flags)
    evidence["constant_offset_share"] = share
    if share < OFFSET_SHARE or not deltas:
        return ""
    median = float(np.median(deltas))
    evidence["offset_median_delta"] = median
    side = "above" if median > 0 else "below"
    return (f"; at {share:.0%} of those steps the trainer's log-probs sit a near-constant {abs(median):.3g} nats "
            f"{side} the engine's (a temperature or top-p/top-k mismatch)")


def _suggestion(ctx) -> str:
    return (f"The engine's log-probs drift from the trainer's: check that {ctx.setting('temperature')} matches on "
            f"both sides and that the engine's weights are synced, and turn on or tighten {ctx.setting('rollout_is')}.")
