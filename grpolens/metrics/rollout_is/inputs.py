"""The rollout-IS inputs of a batch -- δ, the valid tokens, the IS partials under a config --
computed once per batch and shared by the producers, the visitors and the loss families."""

from __future__ import annotations

import numpy as np

from grpolens.functional import rollout_is as ris
from grpolens.functional.rollout_is import ISConfig
from grpolens.functional.rollout_is.mismatch import finite_pairs
from grpolens.metrics.batch import TokenBatch

FAMILY = "rollout_is"
REQ = ("rollout_logp",)

#: the visitors (:mod:`grpolens.metrics.rollout_is.visitors`) whose per-step pieces the summaries read
DELTA_VISITOR = "rollout_is.delta"
RS_VISITOR = "rollout_is.rs"


def batch_inputs(b: TokenBatch) -> ris.Inputs:
    """δ and valid tokens of a batch, computed once and shared by every visitor of the pass."""
    return b.cached("rollout_is.inputs", lambda: ris.inputs(b))


def mismatch_inputs(b: TokenBatch) -> tuple[ris.Segments, np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """``(segments, old, rollout, δ, sums)`` over the masked tokens (before the trainer's rejection:
    :attr:`TokenBatch.pre_rejection_mask`) whose two log-probs are finite, in token order, and
    their per-sequence sums (:func:`grpolens.functional.rollout_is.mismatch.finite_pairs`): what
    the mismatch partials and the δ quantiles both read, computed once per batch."""
    return b.cached("rollout_is.mismatch_inputs", lambda: finite_pairs(b))


def batch_partials(b: TokenBatch, c: ISConfig) -> dict[str, np.ndarray]:
    """The batch's IS partials under ``c`` (the producer's, when it ran with the same config)."""
    return b.cached(("rollout_is.partials", c), lambda: ris.sequence_partials(b, batch_inputs(b), c))


def batch_token_weights(b: TokenBatch, c: ISConfig) -> dict[str, np.ndarray]:
    return ris.token_weights(b, c, batch_inputs(b), batch_partials(b, c))


def batch_applied_weights(b: TokenBatch, c: ISConfig) -> tuple[np.ndarray, np.ndarray | None]:
    return ris.applied_weights(b, c, batch_inputs(b), batch_partials(b, c))


def batch_valid_weights(b: TokenBatch, c: ISConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return ris.valid_token_weights(b, c, batch_inputs(b), batch_partials(b, c))
