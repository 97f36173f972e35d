"""The rollout-IS family's per-sequence partials: the IS partials under the run's config, and the
mismatch partials (KL k1/k3, perplexities, χ²) that need no config."""

from __future__ import annotations

import numpy as np

from grpolens.functional import rollout_is as ris
from grpolens.functional import estimators as est
from grpolens.functional.rollout_is import ISConfig
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.metrics.rollout_is.inputs import FAMILY, REQ, batch_partials, mismatch_inputs


@producer("rollout_is", merge=ris.IS_MERGE, requires=REQ, families=(FAMILY,))
def _is_partials(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    return batch_partials(b, ISConfig.from_cfg(cfg))


MM_MERGE = {"mm.n": "sum", "mm.old": "sum", "mm.roll": "sum", "mm.d": "sum", "mm.absd": "sum",
            "mm.absdmax": "max", "mm.k3": "sum", "mm.chi": "sum"}


def _mismatch_partials(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    """Over masked tokens (before the trainer's rejection: :attr:`TokenBatch.pre_rejection_mask`) whose two log-probs are finite: Σ log π_train, Σ log π_rollout, Σδ, Σ|δ|,
    max|δ|, Σ(e^δ − δ − 1) (k3, unbounded as in the reference) and Σ e^(2·clip(δ, ±20)) (χ²)."""
    s, _, _, d, sums = mismatch_inputs(b)
    return {"mm.n": s.n, "mm.old": sums["old"], "mm.roll": sums["roll"], "mm.d": sums["d"], "mm.absd": sums["absd"],
            "mm.absdmax": sums["absdmax"], "mm.k3": s.sum(est.k3(d)), "mm.chi": s.sum(est.bounded_exp2(d))}


# Registered by a call, not as a decorator: mutmut skips decorated functions (docs/mutation-testing.md).
producer("mismatch", merge=MM_MERGE, requires=REQ, families=(FAMILY,))(_mismatch_partials)
