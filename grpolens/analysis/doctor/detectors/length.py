"""Length pathology: completion length growing (or collapsing) steadily, and the share of
truncated completions rising. A run that truncates a large share throughout is told so (info):
that is a setting, not a change."""

from __future__ import annotations

import numpy as np

from grpolens.analysis.doctor import signals
from grpolens.analysis.doctor.catalogue import Finding, detector
from grpolens.analysis.doctor.context import MIN_TREND_STEPS

LENGTH, TRUNCATED = "completions/length/mean", "completions/truncated_frac"
#: length grows (shrinks) when the later level is at least GROW× (at most SHRINK×) the earlier one
GROW, SHRINK = 1.5, 0.6
#: truncation: reported when the share rises by RISE to at least LEVEL; a share above LEVEL throughout is info
TRUNC_RISE, TRUNC_LEVEL = 0.1, 0.2


def _change(x, y, up: bool, factor: float):
    """``(onset, before, after)`` of a shift or significant trend reaching ``factor`` times the start."""
    sh = signals.shift(x, y, up=up)
    ok = (lambda a, b: a >= factor * b) if up else (lambda a, b: a <= factor * b)
    if sh is not None and ok(sh.after, sh.before):
        return sh.onset, sh.before, sh.after
    d = signals.drift(x, y)
    if d.significant(1 if up else -1) and ok(d.late, d.early):
        mid = (d.early + d.late) / 2
        return int(x[np.argmax(y >= mid if up else y <= mid)]), d.early, d.late
    return None


@detector("length-pathology", "completion length growing or collapsing; truncation rising", (LENGTH, TRUNCATED))
def length_pathology(ctx) -> list[Finding]:
    x, y = ctx.series(LENGTH, min_steps=MIN_TREND_STEPS)
    limit = ctx.setting("max_completion_length")
    out = []
    d = signals.drift(x, y)
    ctx.checked(f"mean length {d.early:.4g} → {d.late:.4g} tokens over {len(y)} steps")
    for up, factor in ((True, GROW), (False, SHRINK)):
        ch = _change(x, y, up, factor)
        if ch is None:
            continue
        onset, before, after = ch
        out.append(Finding(
            "length-pathology", "warning", signals.steps_from(x, onset), LENGTH,
            f"completion length {'grew' if up else 'collapsed'} {after / before:.2g}× from {before:.4g} to "
            f"{after:.4g} tokens from step {onset}",
            {"before": before, "after": after, "onset": onset, "direction": "growth" if up else "collapse"},
            (f"Longer and longer completions waste generation and end truncated: penalise or mask overlong ones "
             f"({ctx.setting('overlong')}), or check the reward for a length bias." if up else
             "Completions are getting much shorter: check the reward for a shortcut (see reward-hacking) and "
             f"{ctx.setting('reward_weights')}."),
            worst_step=onset))
        break
    if ctx.has(TRUNCATED):
        xt, t = ctx.series(TRUNCATED)
        if len(t) >= MIN_TREND_STEPS:
            sh = signals.shift(xt, t, up=True)
            d = signals.drift(xt, t)
            if sh is not None and sh.after >= TRUNC_LEVEL and sh.after - sh.before >= TRUNC_RISE:
                onset, before, after = sh.onset, sh.before, sh.after
            elif d.significant(+1) and d.late >= TRUNC_LEVEL and d.late - d.early >= TRUNC_RISE:
                onset, before, after = int(xt[np.argmax(t >= (d.early + d.late) / 2)]), d.early, d.late
            else:
                onset = None
            ctx.checked(f"truncated {d.early:.0%} → {d.late:.0%}")
            if onset is not None:
                out.append(Finding(
                    "length-pathology", "warning", signals.steps_from(xt, onset), TRUNCATED,
                    f"truncated completions rose from {before:.0%} to {after:.0%} from step {onset}",
                    {"before": before, "after": after, "onset": onset},
                    f"More completions hit {limit}: raise it, or mask or penalise truncated ones "
                    f"({ctx.setting('overlong')}).", worst_step=onset))
            elif float(np.median(t)) >= TRUNC_LEVEL:
                out.append(Finding(
                    "length-pathology", "info", [int(s) for s in xt[t >= TRUNC_LEVEL]], TRUNCATED,
                    f"{np.median(t):.0%} of completions are truncated (median over {len(t)} steps), steadily",
                    {"median": float(np.median(t)), "max": float(t.max())},
                    f"Truncated completions get a reward for an unfinished answer: raise {limit} or mask them "
                    f"({ctx.setting('overlong')})."))
    return out
