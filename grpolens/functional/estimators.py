"""The KL estimators and the log-ratio bound, each written once.

For a log-ratio ``x = log p(t) − log q(t)`` of a token sampled from ``q``, Schulman's estimators of
``KL(q‖p)`` per token are::

    k1 = −x                 unbiased, may be negative
    k2 = x² / 2             biased, >= 0
    k3 = e^x − 1 − x        unbiased, >= 0 (written ``expm1(x) − x``: accurate for small x)

Every family (policy, kl, rollout IS, the verl actor, Twinkle), the token scores and the dashboard
call these; which x each one passes is in its module (``ref − logp`` for the KL to the reference,
``logp − old_logp`` for the policy ratio, ``old_logp − rollout_logp`` for the train–rollout
mismatch). Trainers clip log-ratios to ±:data:`LOG_RATIO_BOUND` before ``exp`` (xtuner, verl,
Twinkle's loss, the rollout-IS reference); :func:`clip_log_ratio` and :func:`bounded_exp` are
that bound. :func:`formula` gives the text the dashboard shows for each.

NaN stays NaN; ``k3(+inf)`` is NaN (inf − inf) and ``k3(−inf)`` inf, without a warning: the
families keep only tokens with finite log-probs, and the health family counts the others.
"""

from __future__ import annotations

import numpy as np

#: The ±bound on a log-ratio before ``exp`` (e^20 ≈ 4.9e8): xtuner's and verl's clamp, Twinkle's
#: loss' ``log_ratio_clamp`` default, the rollout-IS reference's safety bound.
LOG_RATIO_BOUND = 20.0


def k1(x: np.ndarray) -> np.ndarray:
    """−x: the k1 estimate of KL(q‖p) for x = log p − log q under samples of q."""
    return -x


def k2(x: np.ndarray) -> np.ndarray:
    """x² / 2."""
    return 0.5 * x * x


def k3(x: np.ndarray, em1: np.ndarray | None = None) -> np.ndarray:
    """e^x − 1 − x (Schulman's k3), as ``expm1(x) − x``; ``em1``: ``expm1(x)`` when the caller
    has it already (the ratio − 1), so that it is not computed twice."""
    with np.errstate(over="ignore", invalid="ignore"):
        if em1 is None:
            em1 = np.expm1(x)
        return k3_of(x, em1)


def k3_of(x, em1):
    """k3 from x and ``em1 = expm1(x)``: on arrays or scalars, so that a compiled kernel calls the
    same formula (:func:`grpolens.functional.jit.inline`). Kernels take ``em1`` from numpy's
    ``expm1`` rather than compute it: on a machine where numpy's ``expm1`` is vectorised (AVX-512)
    it differs from the C library's in the last bit of a few percent of values."""
    return em1 - x


def clip_log_ratio(x: np.ndarray, bound: float = LOG_RATIO_BOUND) -> np.ndarray:
    """x clipped to ±``bound`` (NaN stays NaN)."""
    return np.clip(x, -bound, bound)


def bounded_exp(x: np.ndarray) -> np.ndarray:
    """exp(clip(x, ±:data:`LOG_RATIO_BOUND`)): the ratio with the trainers' overflow guard."""
    return np.exp(clip_log_ratio(x))


def bounded_exp2(x: np.ndarray) -> np.ndarray:
    """exp(2·clip(x, ±:data:`LOG_RATIO_BOUND`)): the squared bounded ratio, the χ² divergence's term."""
    return np.exp(2.0 * clip_log_ratio(x))


#: How each is shown (plain text, ``{x}`` standing for the log-ratio), see :func:`formula`.
FORMULAS = {
    "k1": "-({x})",
    "k2": "({x})^2 / 2",
    "k3": "exp({x}) - ({x}) - 1",
    "ratio": "exp({x})",
    "bounded_ratio": f"exp(clip({{x}}, ±{LOG_RATIO_BOUND:g}))",
}


def formula(name: str, x: str = "x") -> str:
    """The text of estimator ``name`` (a key of :data:`FORMULAS`) with ``x`` written as given,
    e.g. ``formula("k3", "ref - logp")`` is ``exp(ref - logp) - (ref - logp) - 1``."""
    return FORMULAS[name].format(x=x)
