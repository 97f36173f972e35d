"""Rollout importance sampling (IS): weights, rejection and veto -- the one implementation.

A package: the config (:mod:`.config`), per-token weights and decisions (:mod:`.weights`), the
mergeable per-sequence partials (:mod:`.partials`), the step summary (:mod:`.summary`) and the
per-token outputs (:mod:`.per_token`); every name is re-exported here.

The trainer's behaviour policy π_train (``old_logp``; ``logp`` where the trainer had none) and the
inference engine π_rollout (``rollout_logp``) disagree. Per token ``δ = log π_train − log π_rollout``.
Everything below follows the reference (xtuner's port of verl's mismatch helper); the metrics, the
``--is-weights`` output and ``grpolens sweep`` all call these functions, so they cannot disagree.

Levels -- the log-weight X and the raw weight ``w = exp(clip(X, −20, 20))`` (the ±20 safety bound)::

    token       X_t = δ_t
    sequence    X_b = Σ_t δ_t            (every token of the sequence gets the same weight)
    geometric   X_b = Σ_t δ_t / T_b

Modes -- the applied weight ``a`` and which tokens leave the loss::

    none            a = w
    truncate        a = clip(w, lower, upper)          (two-sided: the xtuner reference)
    truncate_upper  a = min(w, upper)                  (verl TIS, TRL *_truncate without clip_min)
    mask            a = w; reject outside [mask_lower, mask_upper]
    both            mask, then truncate
    icepop          a = w inside [lower, upper], else 0; nothing rejected (verl IcePop, TRL *_mask)

Veto: a sequence with any token whose *raw* ratio e^δ is outside [veto_lower, veto_upper] is
rejected whole. Rejection filters (verl ``rollout_rs``) on ``δs = clip(δ, ±20)``: k1 = −δs,
k2 = δs²/2, k3 = e^δs − 1 − δs, per token (``token_kX``) or per sequence as a sum, a mean or a
max (``seq_sum_kX``, ``seq_mean_kX``, ``seq_max_kX``); k1 keeps ``log lower ≤ stat ≤ log upper``
(note: a band on π_rollout/π_train, the inverse of the IS ratio), k2/k3 keep ``stat ≤ upper``.

Valid tokens: ``mask`` (before the trainer's own rejection, when the run records it:
``rollout_rejected``) and δ not NaN. ±inf log-ratios stay in: their weight saturates at e^±20 and
the veto catches them, which is what a trainer does with them. A sequence holding both +inf and
−inf has no defined Σδ and is left out whole; both kinds are counted as *undefined* tokens.

Per-sequence partials (:func:`sequence_partials`) are sums, counts and extrema that merge
exactly; every non-linear per-sequence decision (sequence weight, veto, sequence rejection) is
taken from the merged partials by :func:`seq_view`, so it is the same however the data is split.
"""

from grpolens.functional.rollout_is.config import LEVELS, MODES, RS_OPTIONS, ISConfig, RSFilter
from grpolens.functional.rollout_is.partials import (IS_MERGE, SeqView, _col, _div, rs_row_value, seq_view,
                                                     sequence_partials, token_decisions)
from grpolens.functional.rollout_is.per_token import applied_weights, loss_weights, token_weights, valid_token_weights
from grpolens.functional.rollout_is.summary import _f, _mean, _moments, _seq_stats, summarize
from grpolens.functional.rollout_is.weights import (LOG_RATIO_BOUND, Inputs, Segments, TokenDecisions, apply_mode,
                                                    bounded_exp, catastrophic, in_band, inputs, rs_stat)

__all__ = [
    "LEVELS", "MODES", "RS_OPTIONS", "ISConfig", "RSFilter", "IS_MERGE", "SeqView", "rs_row_value", "seq_view",
    "sequence_partials", "applied_weights", "loss_weights", "token_weights", "valid_token_weights", "summarize", "LOG_RATIO_BOUND",
    "Inputs", "Segments", "TokenDecisions", "apply_mode", "bounded_exp", "catastrophic", "in_band", "inputs",
    "rs_stat", "token_decisions", "_col", "_div", "_f", "_mean", "_moments", "_seq_stats",
]
