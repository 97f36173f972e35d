"""Per-token rollout-IS outputs: each token's raw and applied weight and whether it stays in the
loss (``--is-weights``, the loss families' weights), from the same decisions the metrics count."""

from __future__ import annotations

import numpy as np

from grpolens.functional.rollout_is.config import ISConfig
from grpolens.functional.rollout_is.partials import SeqView, seq_view, sequence_partials, token_decisions
from grpolens.functional.rollout_is.weights import Inputs, TokenDecisions, apply_mode, inputs


def _decisions(b, c: ISConfig, x: Inputs, partials: dict | None) -> tuple[TokenDecisions, SeqView]:
    t = token_decisions(x, c)
    return t, seq_view(partials if partials is not None else sequence_partials(b, x, c, t), c)


def valid_token_weights(b, c: ISConfig, x: Inputs, partials: dict | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw weight, applied weight and kept-in-the-loss flag of each valid token (``x.seg.idx`` order).

    The decisions are the ones the metrics count (same partials, same :func:`seq_view`); pass
    ``partials`` when the batch's :func:`sequence_partials` under ``c`` are already at hand.
    """
    t, sv = _decisions(b, c, x, partials)
    seq_of = np.repeat(np.arange(len(sv.n)), sv.n.astype(np.int64))  # sequence of each valid token
    if c.level == "token":
        raw, app = t.w, t.a
    else:
        raw, app = sv.w[seq_of], sv.a[seq_of]
    return raw, app, ~t.rej & ~sv.seq_rej[seq_of]


def applied_weights(b, c: ISConfig, x: Inputs, partials: dict | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The applied weights of :func:`valid_token_weights` without repeating them: ``(a, None)``,
    one per valid token, at token level; ``(a, n)`` at sequence levels, one per sequence standing
    for its ``n`` valid tokens (the IS-weight histogram counts them so)."""
    if c.level == "token":
        return token_decisions(x, c).a, None
    sv = seq_view(partials if partials is not None else sequence_partials(b, x, c), c)
    return sv.a, sv.n.astype(np.int64)


def token_weights(b, c: ISConfig, x: Inputs | None = None, partials: dict | None = None) -> dict[str, np.ndarray]:
    """Per-token ``valid``, raw weight, applied weight and the modified loss mask (``is_mask``) of a
    batch, one entry per row; weights are NaN and ``is_mask`` False where the token is not valid."""
    x = x or inputs(b)
    raw_v, app_v, keep_v = valid_token_weights(b, c, x, partials)
    idx = x.seg.idx
    raw, app, keep = np.full(b.n, np.nan), np.full(b.n, np.nan), np.zeros(b.n, dtype=bool)
    raw[idx], app[idx], keep[idx] = raw_v, app_v, keep_v
    return {"valid": x.valid, "is_weight_raw": raw, "is_weight": app, "is_mask": keep}


def loss_weights(b, c: ISConfig, x: Inputs | None = None, partials: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the factor the trainer multiplies the policy loss by, and whether the token stays in
    the loss mask -- the decisions of :func:`valid_token_weights` (the ones the metrics count).

    Mode ``none`` changes no weight (factor 1). A masked token without a defined δ counts as δ = 0,
    as TRL's ``nan_to_num`` does: at token level it gets the mode applied to weight 1, at sequence
    levels its sequence's weight (its δ is not in Σδ); only sequence-level rules remove it.
    """
    x = x or inputs(b)
    t, sv = _decisions(b, c, x, partials)
    keep = ~b.broadcast(sv.seq_rej)
    keep[x.seg.idx] &= ~t.rej
    if c.mode == "none":
        return np.ones(b.n), keep
    if c.level == "token":
        a = np.full(b.n, apply_mode(np.ones(1), c)[0])
        a[x.seg.idx] = t.a
    else:
        a = b.broadcast(sv.a)
    return a, keep
