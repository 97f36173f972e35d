"""The per-token terms of the PPO-family losses and their clip indicators, each written once.

With ``c`` a token's importance weight (the token ratio e^d, or its sequence's ratio) and ``A``
its advantage::

    PPO clip (grpo, bnpo, dr_grpo, dapo, luspo, gspo)   L = −min(min(c, delta)·A, clip(c, lo, hi)·A)
    CISPO                                               L = −min(c, cap)·A·logp
    VESPO                                               L = −φ·A·logp   (φ: the sequence's weight)

    low clip   min(c, delta) < lo ∧ A < 0       high clip   min(c, delta) > hi ∧ A > 0
    CISPO clip c > cap ∧ A > 0

(lo = 1 − epsilon, hi = 1 + epsilon_high, cap = epsilon_high; ``delta = inf`` when unset, which
changes no value.) Each works on numpy arrays and on scalars, so the loss and clip families'
compiled per-token loops (:mod:`grpolens.metrics.kernels`) call these very functions, compiled
with :func:`grpolens.functional.jit.inline`; ``np.clip`` is written as max then min, which is
what it computes, bit for bit. Where each is used and normalised: :mod:`grpolens.metrics.loss`,
:mod:`grpolens.metrics.clip`.
"""

from __future__ import annotations

import numpy as np


def ppo_term(c, a, lo, hi, delta):
    """The PPO-clip loss of a token: −min(min(c, delta)·A, clip(c, lo, hi)·A)."""
    return -np.minimum(np.minimum(c, delta) * a, np.minimum(np.maximum(c, lo), hi) * a)


def cispo_term(c, a, cap, logp):
    """CISPO's loss of a token: −min(c, cap)·A·logp."""
    return -np.minimum(c, cap) * a * logp


def vespo_term(phi, a, logp):
    """VESPO's loss of a token: −φ·A·logp."""
    return -phi * a * logp


def clipped_low(c, a, lo, delta):
    """PPO's low clip of a weight c with advantage A: min(c, delta) < lo ∧ A < 0."""
    return (np.minimum(c, delta) < lo) & (a < 0)


def clipped_high(c, a, hi, delta):
    """PPO's high clip: min(c, delta) > hi ∧ A > 0."""
    return (np.minimum(c, delta) > hi) & (a > 0)


def clipped_cispo(c, a, cap):
    """CISPO's clip: c > cap ∧ A > 0 (cap: epsilon_high, the absolute cap of the weight)."""
    return (c > cap) & (a > 0)
