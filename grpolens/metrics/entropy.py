"""Entropy of the policy at each completion position, averaged over masked tokens.

    entropy = Σ_t H_t·m_t / Σ_t m_t      (tokens with a finite entropy)

TRL logs it as ``entropy`` (token-weighted per micro-batch slot, then averaged over slots);
Twinkle as ``train/entropy`` (global token mean); MaxEnt-GRPO as ``train/policy_entropy``.
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.metrics.registry import Metric, register


@producer("entropy", merge={"entropy.sum": "sum", "entropy.n": "sum"}, requires=("entropy",))
def _entropy(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    h = b.cols["entropy"]
    valid = b.mask & np.isfinite(h)
    return {"entropy.sum": b.masked_sum(h, valid), "entropy.n": b.count(valid)}


register(Metric(
    "entropy", "entropy",
    "Mean policy entropy over masked tokens: Σ H·m / Σ m.",
    kind="token_mean", num="entropy.sum", den="entropy.n", requires=("entropy",),
))
