"""Reward hacking: the reward rising while something it should move with goes the other way: a
reward component falling, the completion length collapsing or exploding, or the entropy halving,
at the same time."""

from __future__ import annotations

import numpy as np

from grpolens.analysis.doctor import signals, stats
from grpolens.analysis.doctor.catalogue import Finding, detector
from grpolens.analysis.doctor.context import MIN_TREND_STEPS

REWARD, LENGTH, ENTROPY = "reward/mean", "completions/length/mean", "entropy"
#: the reward's rise must be at least this many robust standard deviations of its earlier steps
RISE_SIGMA = 2.0
#: a divergent length: later/earlier outside [SHRINK, GROW]
SHRINK, GROW = 0.6, 1.6
#: a divergent entropy: at most this share of its earlier level from its change point on (a healthy
#: run's entropy decays gradually; halving at the reward's jump is the policy locking onto a shortcut)
ENTROPY_DROP = 0.5
#: a divergent component: falling by at least this many robust sds of its earlier steps
FALL_SIGMA = 2.0
#: ... and be abrupt: at least this share of its move across its onset (a slow trend is not a divergence)
SHARP = 0.5
#: the other signal's change point must lie within this many steps (or a tenth of the run) of the reward's
NEAR = 3


def _components(ctx) -> list[str]:
    return [c for c in ctx.metrics.columns if c.startswith("rewards/") and c.endswith("/mean")]


@detector("reward-hacking", "reward rising while a reward component, the length or the entropy diverges",
          (REWARD, LENGTH, ENTROPY))
def reward_hacking(ctx) -> list[Finding]:
    x, y = ctx.series(REWARD, min_steps=MIN_TREND_STEPS)
    sh = signals.shift(x, y, up=True)
    if sh is None:
        ctx.checked(f"{REWARD} over {len(y)} steps: no upward shift")
        return []
    k = int(np.searchsorted(x, sh.onset))
    if k < 3 or sh.after - sh.before < RISE_SIGMA * max(stats.mad_sigma(y[:k]), 1e-12):
        ctx.checked(f"{REWARD} {sh.before:.3g} → {sh.after:.3g} from step {sh.onset}: within {RISE_SIGMA:g} robust σ")
        return []
    near = max(NEAR, len(x) // 10)
    diverging = []
    for metric in [LENGTH, ENTROPY, *_components(ctx)]:
        if not ctx.has(metric):
            continue
        xm, m = ctx.series(metric)
        if len(m) < MIN_TREND_STEPS:
            continue
        other = signals.shift(xm, m, up=metric == LENGTH and _grew(xm, m, sh.onset))  # entropy, components: falls
        if other is None or abs(other.onset - sh.onset) > near or other.sharpness < SHARP:
            continue
        if metric == LENGTH:
            if SHRINK < other.ratio < GROW:
                continue
        elif metric == ENTROPY:
            if other.ratio > ENTROPY_DROP:
                continue
        else:
            km = int(np.searchsorted(xm, other.onset))
            if other.after >= other.before or other.before - other.after < FALL_SIGMA * max(stats.mad_sigma(m[:km]), 1e-12):
                continue
        diverging.append((metric, other))
    if not diverging:
        ctx.checked(f"{REWARD} rose {sh.before:.3g} → {sh.after:.3g} at step {sh.onset}; length, entropy and "
                    f"components moved with it")
        return []
    metric, other = diverging[0]
    onset = max(sh.onset, other.onset)  # the divergence holds once both have moved
    what = (f"completion length went {other.before:.4g} → {other.after:.4g}" if metric == LENGTH else
            f"entropy fell {other.before:.3g} → {other.after:.3g}" if metric == ENTROPY else
            f"{metric} fell {other.before:.3g} → {other.after:.3g}")
    return [Finding(
        "reward-hacking", "warning", signals.steps_from(x, onset), REWARD,
        f"reward rose {sh.before:.3g} → {sh.after:.3g} from step {onset} while {what}",
        {"reward_before": sh.before, "reward_after": sh.after, "onset": onset, "reward_onset": sh.onset,
         "diverging": [{"metric": mm, "before": o.before, "after": o.after, "onset": o.onset} for mm, o in diverging]},
        f"The reward may be exploited rather than earned: read completions from step {onset} on "
        f"(grpolens completions RUN --step {onset}), check the reward functions and "
        f"{ctx.setting('reward_weights')}, and raise {ctx.setting('kl_coef')} to hold the policy nearer the reference.",
        worst_step=onset)]


def _grew(x, y, onset: int) -> bool:
    k = int(np.searchsorted(x, onset))
    return k > 0 and k < len(y) and float(np.median(y[k:])) > float(np.median(y[:k]))
