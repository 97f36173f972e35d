"""Advantage collapse: more and more groups whose completions all get the same reward, so their
advantages are 0 and they teach nothing. Split into all-correct (too easy) and all-wrong (too
hard) groups from the samples of the flagged steps."""

from __future__ import annotations

import numpy as np
import polars as pl

from grpolens.analysis.doctor import signals
from grpolens.analysis.doctor.catalogue import Finding, detector
from grpolens.analysis.doctor.context import MIN_TREND_STEPS

METRIC = "advantage/frac_zero_groups"
#: reported when the share of zero-std groups reaches this (after a shift or at the end of a trend) ...
LEVEL = 0.5
#: ... having risen by at least this; critical from this share on
RISE, CRITICAL = 0.3, 0.9
#: the split into all-correct / all-wrong reads at most this many flagged steps' samples
SPLIT_STEPS = 32


@detector("advantage-collapse", "groups with zero reward spread (no learning signal) rising", (METRIC,))
def advantage_collapse(ctx) -> list[Finding]:
    x, y = ctx.series(METRIC, min_steps=MIN_TREND_STEPS)
    sh = signals.shift(x, y, up=True)
    d = signals.drift(x, y)
    if sh is not None and sh.after >= LEVEL and sh.after - sh.before >= RISE:
        onset, before, after = sh.onset, sh.before, sh.after
    elif d.significant(+1) and d.late >= LEVEL and d.late - d.early >= RISE:
        onset, before, after = int(x[np.argmax(y >= (d.early + d.late) / 2)]), d.early, d.late
    else:
        ctx.checked(f"groups with zero reward spread {d.early:.0%} → {d.late:.0%} over {len(y)} steps")
        return []
    steps = signals.steps_from(x, onset)
    split = _split(ctx, steps)
    evidence = {"before": before, "after": after, "onset": onset, **split}
    kind = ""
    if split.get("all_correct", 0) + split.get("all_wrong", 0):
        easy = split["all_correct"] >= split["all_wrong"]
        kind = (f": {split['all_correct']} all-correct vs {split['all_wrong']} all-wrong group(s) in "
                f"{split['steps_read']} step(s)")
        hint = ("most are all-correct: the prompts have become too easy; filter solved prompts"
                if easy else "most are all-wrong: the prompts are too hard; use an easier curriculum")
    else:
        hint = "filter groups without reward spread"
    return [Finding(
        "advantage-collapse", "critical" if after >= CRITICAL else "warning", steps, METRIC,
        f"groups with zero reward spread rose from {before:.0%} to {after:.0%} at step {onset}{kind}",
        evidence,
        f"Those groups' advantages are 0 and teach nothing; {hint}, or drop them with "
        f"{ctx.setting('dynamic_sampling')}, or raise {ctx.setting('num_generations')}.",
        worst_step=onset)]


def _split(ctx, steps: list[int]) -> dict:
    """Zero-spread groups at (up to :data:`SPLIT_STEPS` of) ``steps``, all-correct when their common
    reward is in the upper half of the rewards seen at those steps, all-wrong otherwise."""
    pick = steps if len(steps) <= SPLIT_STEPS else [steps[i] for i in np.linspace(0, len(steps) - 1, SPLIT_STEPS).astype(int)]
    frames = [f.select("group_id", "reward") for s in pick if (f := ctx.samples(s)) is not None
              and {"group_id", "reward"} <= set(f.columns)]
    if not frames:
        return {}
    df = pl.concat(frames).filter(pl.col("reward").is_finite())
    lo, hi = df["reward"].min(), df["reward"].max()
    g = df.group_by("group_id").agg(pl.col("reward").min().alias("lo"), pl.col("reward").max().alias("hi"),
                                    pl.len().alias("n"))
    flat = g.filter((pl.col("lo") == pl.col("hi")) & (pl.col("n") > 1))
    mid = (lo + hi) / 2 if lo is not None else 0.0
    correct = int((flat["lo"] > mid).sum()) if hi != lo else 0
    return {"all_correct": correct, "all_wrong": flat.height - correct, "groups": g.height, "steps_read": len(frames)}
