"""Data health: what was stored, what counted, what was not finite.

Non-finite values are counted here and excluded from every other family (each family's valid
mask requires the values it uses to be finite), so one NaN never silently poisons a step.
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.metrics.registry import Family, Metric, register, register_family

NONFINITE_COLUMNS = ("logp", "old_logp", "ref_logp", "rollout_logp", "advantage", "entropy")


@producer(
    "health",
    merge={"health.masked": "sum", **{f"health.nonfinite.{c}": "sum" for c in NONFINITE_COLUMNS}},
)
def _health(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    from grpolens.metrics import kernels

    # the masked tokens and, per column the batch has, those of them not finite: one pass
    have = [c for c in NONFINITE_COLUMNS if c in b.present or c in ("logp", "advantage")]
    counts = kernels.nonfinite_counts(b.mask, tuple(b.cols[c] for c in have), b.starts, b.lengths)
    out = {"health.masked": counts[0]}
    for c in NONFINITE_COLUMNS:
        out[f"health.nonfinite.{c}"] = counts[1 + have.index(c)] if c in have else np.zeros(b.n_seq)
    return out


def _count_sequences(sd) -> float | None:
    return float(sd.n_seq)


register(Metric(
    "health/tokens", "health", "Token rows stored for the step (masked or not; padding is never stored).",
    kind="sum", num="seq_tokens",
))
register(Metric(
    "health/masked_tokens", "health", "Tokens that count in the loss (mask = true).",
    kind="sum", num="health.masked",
))
register(Metric(
    "health/sequences", "health", "Sequences seen in the step's loss calls (a completion reused in two loss calls counts twice).",
    kind="custom", fn=_count_sequences,
))
for _c in NONFINITE_COLUMNS:
    register(Metric(
        f"health/nonfinite/{_c}", "health",
        f"Masked tokens whose `{_c}` is NaN or ±inf; they are excluded from every metric that uses `{_c}`.",
        kind="sum", num=f"health.nonfinite.{_c}",
        requires=() if _c in ("logp", "advantage") else (_c,),
    ))


#: The built-in ``grpolens check`` rules over this family (see :mod:`grpolens.check.defaults`).
RULES = '''\
[[rule]]
name = "non-finite tokens"
metric = "health/nonfinite/*"
max = 0
missing = "skip"
why = """Every metric excludes tokens whose log-probs, advantages or entropies are NaN or ±inf, so a \
NaN cannot silently poison a curve; this rule makes sure such tokens are never silently dropped either. \
One non-finite log-prob is already a numerical bug (overflow in the logits, a bad fp16 cast)."""
'''

register_family(Family(
    'health', page='health',
    key_metrics=('health/masked_tokens', 'health/nonfinite/logp'),
    rules=RULES,
))
