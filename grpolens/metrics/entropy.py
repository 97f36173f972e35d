"""Entropy of the policy at each completion position, averaged over masked tokens.

    entropy = Σ_t H_t·m_t / Σ_t m_t      (tokens with a finite entropy)

TRL logs it as ``entropy`` (token-weighted per micro-batch slot, then averaged over slots);
Twinkle as ``train/entropy`` (global token mean); MaxEnt-GRPO as ``train/policy_entropy``.
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.metrics.registry import Family, Metric, register, register_family


@producer("entropy", merge={"entropy.sum": "sum", "entropy.n": "sum"}, requires=("entropy",))
def _entropy(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    from grpolens.metrics import kernels

    # Σ H and the count over masked tokens with a finite entropy, in one pass
    s, n = kernels.finite_masked_sum(b.cols["entropy"], b.mask, b.starts, b.lengths)
    return {"entropy.sum": s, "entropy.n": n}


register(Metric(
    "entropy", "entropy",
    "Mean policy entropy over masked tokens: Σ H·m / Σ m.",
    kind="token_mean", num="entropy.sum", den="entropy.n", requires=("entropy",),
))


#: The built-in ``grpolens check`` rules over this family (see :mod:`grpolens.check.defaults`).
RULES = '''\
[[rule]]
name = "entropy collapse"
metric = "entropy"
direction = "lower"
early = { factor = 5.0 }
rel = 0.3
missing = "skip"
why = """A policy whose mean token entropy falls to a fifth of where the run started has stopped \
exploring: the group's completions become identical, advantages vanish and learning stalls. Entropy \
depends on vocabulary, temperature and model, so the bound is relative to the run's own start rather \
than absolute. Against a baseline: at least 70 % of the baseline's entropy at the same step."""
'''

register_family(Family(
    'entropy', page='policy',
    key_metrics=('entropy',),
    overview=(
        (5, 'entropy', ('^entropy$', '^entropy/mean$')),
    ),
    rules=RULES,
))
