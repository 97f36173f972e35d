"""The per-token policy-ratio quantities the policy, clip, KL and loss families share.

Which tokens have a usable ratio (masked, ``logp`` and ``old_logp`` finite), the log-ratio
``d = logp − old_logp`` and ``e^d``, the importance-sampling level the loss uses, and the GSPO
sequence ratio ``s_i = exp(Σ_t d·v / max(Σ_t v, 1))`` (the geometric mean of the token ratios).
Each is computed once per batch and shared: every full-length pass costs about as much as the read.
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics.batch import TokenBatch



def ratio_valid(b: TokenBatch) -> np.ndarray:
    """Masked tokens whose current and old log-probs are finite (the ratio is defined)."""
    return b.cached("ratio_valid", lambda: b.mask & np.isfinite(b.logp) & np.isfinite(b.old))


def adv_valid(b: TokenBatch) -> np.ndarray:
    """Ratio-valid tokens whose advantage is finite too (what clip gates and the loss use)."""
    return b.cached("adv_valid", lambda: ratio_valid(b) & np.isfinite(b.adv))


def adv_masked(b: TokenBatch) -> np.ndarray:
    """The advantage on :func:`adv_valid` tokens, 0 elsewhere (so ``A < 0`` / ``A > 0`` also mask)."""
    return b.cached("adv_masked", lambda: np.where(adv_valid(b), b.adv, 0.0))


def count(b: TokenBatch, key: str, valid) -> np.ndarray:
    """Per-sequence count of a shared mask (``valid`` is the function that makes it)."""
    return b.cached(f"count:{key}", lambda: b.count(valid(b)))


def is_level(cfg: dict) -> str:
    """The importance-sampling level the loss uses: ``token``, ``sequence`` (GSPO, also implied
    by ``loss_type="gspo"``) or ``sequence_token`` (GSPO-token: the sequence ratio on each token)."""
    lvl = cfg.get("importance_sampling_level") or "token"
    if cfg.get("loss_type") == "gspo" and lvl == "token":
        return "sequence"
    return lvl


def log_ratio(b: TokenBatch, clamp: float | None = None) -> np.ndarray:
    """d per token, 0 where the ratio is undefined; clipped to ±clamp when given."""
    def make():
        if clamp is not None:
            d = log_ratio(b)
            if not len(d) or (d.max() <= clamp and d.min() >= -clamp):
                return d  # nothing to clamp (the usual case): the same array, so e^d is shared too
            return np.clip(d, -clamp, clamp)
        with np.errstate(invalid="ignore"):
            return np.where(ratio_valid(b), b.log_ratio, 0.0)
    return b.cached(f"log_ratio:{clamp}", make)


def ratio(b: TokenBatch) -> np.ndarray:
    """e^d per token (1 where the ratio is undefined)."""
    # = e^(log_ratio(b)) token by token (e^0 = 1), from the batch's own e^(logp − old), which the
    # top-tokens scores and other visitors use anyway: one exp pass instead of two. Cached under
    # a key of its own: TokenBatch.ratio stays every token's e^(logp − old), whichever family or
    # visitor asks first (a token table never shows this 1 as a token's ratio).
    def make():
        from grpolens.metrics import kernels

        return kernels.masked_ratio(b.ratio, b.logp, b.old, b.mask)
    return b.cached("ratio_masked", make)


def log_ratio_expm1(b: TokenBatch) -> np.ndarray:
    """expm1(logp − old_logp) per token, every token (numpy's, for the kernels: see
    :mod:`grpolens.metrics.kernels`); a kernel masks it itself."""
    def make():
        with np.errstate(over="ignore", invalid="ignore"):
            return np.expm1(b.log_ratio)
    return b.cached("log_ratio_expm1", make)


def seq_log_ratio(b: TokenBatch, clamp: float | None = None) -> np.ndarray:
    """Per sequence Σ_t d·v / max(Σ_t v, 1): the log of GSPO's sequence ratio (0 when no token)."""
    def make():
        return b.seq_sum(log_ratio(b, clamp)) / np.maximum(count(b, "ratio_valid", ratio_valid), 1.0)
    return b.cached(f"seq_log_ratio:{clamp}", make)


def coef_log(b: TokenBatch, cfg: dict, clamp: float | None = None) -> np.ndarray:
    """Per token, the log of the importance weight the loss uses (TRL's ``log(coef_1)``): d at
    token level, the sequence's mean d broadcast over its tokens at sequence levels."""
    if is_level(cfg) == "token":
        return log_ratio(b, clamp)
    return b.cached(f"coef_log_seq:{clamp}", lambda: b.broadcast(seq_log_ratio(b, clamp)))


def coef(b: TokenBatch, cfg: dict, clamp: float | None = None) -> np.ndarray:
    """The importance weight c = exp(:func:`coef_log`) per token."""
    if is_level(cfg) == "token" and (clamp is None or log_ratio(b, clamp) is log_ratio(b)):
        return ratio(b)

    def make():
        with np.errstate(over="ignore"):
            return np.exp(coef_log(b, cfg, clamp))
    return b.cached(f"coef:{is_level(cfg) == 'token'}:{clamp}", make)


def coef_input(b: TokenBatch, cfg: dict, clamp: float | None = None) -> tuple[np.ndarray, bool]:
    """(array, masked): :func:`coef` as a kernel reads it. At token level, with no clamp that
    changes a d, :func:`ratio` and ``masked`` True (the kernel takes 1 off the ratio-valid
    tokens itself); else :func:`coef`
    itself and ``masked`` False."""
    if is_level(cfg) == "token" and (clamp is None or ratio_abs_max(b) <= clamp):
        return ratio(b), True
    return coef(b, cfg, clamp), False


def ratio_abs_max(b: TokenBatch) -> float:
    """The largest |d| over the ratio-valid tokens (0 without one): whether a clamp changes any."""
    from grpolens.metrics import kernels

    return b.cached("ratio_abs_max", lambda: kernels.ratio_abs_max(b.logp, b.old, b.mask))
