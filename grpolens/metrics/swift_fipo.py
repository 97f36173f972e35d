"""ms-swift 4.6.0's FIPO influence weight (``loss_type fipo``: ``GRPOTrainer._compute_fipo_influence``).

With ``δ_t = logp − old_logp`` on the completion's tokens (0 off the mask, and 0 where the ratio
exceeds ``delta`` when that is set), the future KL of token t is the discounted sum of what follows
it, ``F_t = Σ_{s ≥ t} γ^(s − t) δ_s`` with ``γ = 2^(−1/fipo_decay_rate)``; the influence weight is
``exp(F_t)`` clamped to ``[1, 1 + r]`` (``fipo_clip_high_only``, the default) or ``[1 − r, 1 + r]``
with ``r = fipo_clip_range``, and on tokens with a negative advantage whose ratio exceeds
``fipo_safety_threshold`` clamped again to ``[0.8, 1]``. It multiplies the clipped PPO objective per
token; the loss is normalised like dapo's. ms-swift logs ``fipo/future_kl_mean``,
``fipo/influence_weight_mean`` and ``fipo/safety_keep_ratio`` (the token share not caught by the
safety rule), each rank's masked means over the call, then the mean over ranks.
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics.batch import TokenBatch

KEYS = ("future_kl_mean", "influence_weight_mean", "safety_keep_ratio")


def future_kl(b: TokenBatch, delta: np.ndarray, gamma: float) -> np.ndarray:
    """Per token, Σ over the rest of its sequence of γ^(distance)·δ (by the recurrence
    F_t = δ_t + γ·F_{t+1}, one position at a time for every sequence)."""
    out = np.zeros(b.n)
    if not b.n:
        return out
    pos = np.arange(b.n) - np.repeat(b.starts, b.lengths)  # the token's position in its completion
    width = int(b.lengths.max())
    grid = np.zeros((b.n_seq, width + 1))
    row = np.repeat(np.arange(b.n_seq), b.lengths)
    grid[row, pos] = delta
    acc = np.zeros(b.n_seq)
    for t in range(width - 1, -1, -1):
        acc = grid[:, t] + gamma * acc
        grid[:, t] = acc
    out[:] = grid[row, pos]
    return out


def influence(b: TokenBatch, s: dict, m: np.ndarray, c: np.ndarray, A: np.ndarray) -> dict[str, np.ndarray]:
    """Per token: the influence weight, the future KL and the safety rule's keep indicator, given the
    mask ``m``, the importance weight ``c`` (per token, or the sequence's on each token) and ``A``."""
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(m, b.logp - b.old, 0.0)
        if s["delta"] is not None:
            d = np.where(c > float(s["delta"]), 0.0, d)
        fk = np.where(m, future_kl(b, d, 2.0 ** (-1.0 / float(s["fipo_decay_rate"]))), 0.0)
        w = np.exp(fk)
        r = s["fipo_clip_range"]
        if r:
            w = np.clip(w, 1.0 if s["fipo_clip_high_only"] else 1 - float(r), 1 + float(r))
        keep = np.ones(b.n, dtype=bool)
        if s["fipo_safety_threshold"] is not None:
            keep = ~((A < 0) & (c > float(s["fipo_safety_threshold"])))
            w = np.where(keep, w, np.clip(w, 0.8, 1.0))
    return {"weight": w, "future_kl": fk, "keep": keep}
