"""Per-token rollout-IS weights and decisions: the bounded weight, the modes, the veto, the
rejection filters' statistics, and each valid token's decisions under a config."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from grpolens.functional.estimators import LOG_RATIO_BOUND, bounded_exp, clip_log_ratio, k1, k2, k3
from grpolens.functional.jit import inline, kernel
from grpolens.functional.rollout_is.config import ISConfig

#: :func:`applied` 's modes, as the kernels take them
NONE, TRUNCATE, TRUNCATE_UPPER, ICEPOP = 0, 1, 2, 3


def mode_code(c: ISConfig) -> int:
    if c.mode in ("truncate", "both"):
        return TRUNCATE
    return {"truncate_upper": TRUNCATE_UPPER, "icepop": ICEPOP}.get(c.mode, NONE)


def _bound(x: float | None) -> float:
    """A bound as the kernels take it: NaN when unset (every comparison with it is False)."""
    return np.nan if x is None else float(x)


@inline
def band1(w, lower, upper):
    """lower ≤ w ≤ upper for one value (an unset, NaN, bound is open; a NaN w is outside)."""
    return w == w and (lower != lower or w >= lower) and (upper != upper or w <= upper)


@inline
def applied1(w, mode, lower, upper):
    """The applied weight of one raw weight under the mode: truncate (and both) clip to
    [lower, upper] (an unset lower is open), truncate_upper caps at upper, icepop zeroes a weight
    outside [lower, upper]; NaN stays NaN."""
    if mode == TRUNCATE or mode == TRUNCATE_UPPER:
        if mode == TRUNCATE and w < lower:  # np.clip's order: the lower bound, then the upper
            w = lower
        return upper if w > upper else w
    if mode == ICEPOP:
        return w if band1(w, lower, upper) else 0.0
    return w


@kernel
def _band(w, lower, upper):
    out = np.empty(len(w), dtype=np.bool_)
    for i in range(len(w)):
        out[i] = band1(w[i], lower, upper)
    return out


@kernel
def _applied(w, mode, lower, upper):
    out = np.empty(len(w))
    for i in range(len(w)):
        out[i] = applied1(w[i], mode, lower, upper)
    return out


def in_band(w: np.ndarray, lower: float | None, upper: float | None) -> np.ndarray:
    """lower ≤ w ≤ upper (an unset bound is open; NaN is outside)."""
    w = np.asarray(w, dtype=np.float64)
    return _band(w.ravel(), _bound(lower), _bound(upper)).reshape(w.shape)


def apply_mode(w: np.ndarray, c: ISConfig) -> np.ndarray:
    """The applied weight of raw weights ``w`` under the mode (rejection is separate)."""
    mode = mode_code(c)
    if mode == NONE:
        return w
    w = np.asarray(w, dtype=np.float64)
    return _applied(w.ravel(), mode, _bound(c.lower), _bound(c.upper)).reshape(w.shape)


def veto_log_band(c: ISConfig) -> tuple[float, float]:
    """The veto's band on δ: a token is catastrophic below the first or above the second (±inf:
    that side disabled; a lower bound of 0 disables its side)."""
    with np.errstate(divide="ignore"):
        lo = float(np.log(c.veto_lower)) if c.veto_lower is not None and c.veto_lower > 0 else -np.inf
        hi = float(np.log(c.veto_upper)) if c.veto_upper is not None else np.inf
    return lo, hi


def catastrophic(delta: np.ndarray, c: ISConfig) -> np.ndarray:
    """Raw (unbounded) token ratio e^δ outside the veto band (:func:`veto_log_band`)."""
    lo, hi = veto_log_band(c)
    with np.errstate(invalid="ignore"):
        return (delta < lo) | (delta > hi)


def rs_stat(k: int, delta: np.ndarray) -> np.ndarray:
    """verl's per-token divergence statistic k1/k2/k3 of the bounded log-ratio."""
    ds = clip_log_ratio(delta)
    if k == 1:
        return k1(ds)
    if k == 2:
        return k2(ds)
    return k3(ds)


class Segments:
    """Per-sequence reductions over a subset of each sequence's tokens, the values given for those
    tokens only (compressed once, so that every reduction is one ``reduceat`` without masking)."""

    def __init__(self, b, keep: np.ndarray):
        self._set(np.flatnonzero(keep), b.count(keep))

    @classmethod
    def of(cls, idx: np.ndarray, n: np.ndarray) -> "Segments":
        """From the kept tokens' positions and each sequence's count of them (float64)."""
        seg = cls.__new__(cls)
        seg._set(idx, n)
        return seg

    def _set(self, idx: np.ndarray, n: np.ndarray) -> None:
        self.idx, self.n = idx, n
        counts = n.astype(np.int64)
        self.starts = np.cumsum(counts) - counts
        self.empty = counts == 0

    def _reduce(self, op, x: np.ndarray, identity: float) -> np.ndarray:
        out = np.full(len(self.starts), identity)
        inside = self.starts < len(x)  # empty sequences at the end start past the last token
        if inside.any():
            out[inside] = op.reduceat(x, self.starts[inside], dtype=np.float64)
            out[self.empty] = identity  # reduceat gives an empty segment the next token's value
        return out

    def sum(self, x: np.ndarray) -> np.ndarray:
        return self._reduce(np.add, x, 0.0)

    def max(self, x: np.ndarray) -> np.ndarray:
        return self._reduce(np.maximum, x, -np.inf)

    def min(self, x: np.ndarray) -> np.ndarray:
        return self._reduce(np.minimum, x, np.inf)


@dataclass
class Inputs:
    """The per-token inputs of one batch: the valid tokens; ``dv``/``av`` are δ and |A| on the
    valid tokens only (|A| is 0 where the advantage is not finite)."""

    valid: np.ndarray
    seg: Segments
    dv: np.ndarray
    av: np.ndarray
    #: per sequence, the masked tokens that are not valid (δ NaN, or ±inf both in the sequence)
    undef: np.ndarray
    #: :func:`~grpolens.functional.rollout_is.partials.token_decisions` under each config, made once: the producer's partials, the loss
    #: weights and the IS visitors of a batch all ask for the same ones
    decisions: dict = field(default_factory=dict, repr=False, compare=False)
    #: the per-sequence partials made with each config's decisions (by the same compiled pass)
    partials: dict = field(default_factory=dict, repr=False, compare=False)


def inputs(b) -> Inputs:
    """δ and the valid set of a :class:`~grpolens.metrics.batch.TokenBatch` (needs ``rollout_logp``),
    in one compiled pass over the batch's tokens."""
    # the mask the trainer's rollout correction saw: before its own rejection (``rollout_rejected``)
    valid, idx, dv, av, n, undef = _valid_tokens(b.old, b.cols["rollout_logp"], b.pre_rejection_mask, b.adv,
                                                  b.starts, b.lengths)
    return Inputs(valid, Segments.of(idx, n), dv, av, undef)


@kernel
def _valid_tokens(old, roll, pre, adv, starts, lengths):
    """Valid tokens: masked (``pre``) with a δ that is not NaN, in a sequence that does not hold
    both +inf and −inf δ; their positions, δ and |A| (0 where A is not finite), and per sequence
    how many are valid and how many masked tokens are not (undefined)."""
    size = len(old)
    valid = np.zeros(size, dtype=np.bool_)
    idx = np.empty(size, dtype=np.int64)
    dv, av = np.empty(size), np.empty(size)
    n, undef = np.zeros(len(starts)), np.zeros(len(starts))
    m = 0
    for s in range(len(starts)):
        first, masked, pinf, ninf = m, 0, False, False
        lo, hi = starts[s], starts[s] + lengths[s]
        ps, os, rs, As, vs = pre[lo:hi], old[lo:hi], roll[lo:hi], adv[lo:hi], valid[lo:hi]
        for i in range(hi - lo):  # views indexed from 0: no negative-index test
            if not ps[i]:
                continue
            masked += 1
            d = os[i] - rs[i]
            if d != d:
                continue
            pinf |= d == np.inf
            ninf |= d == -np.inf
            vs[i] = True
            idx[m], dv[m] = lo + i, d
            av[m] = abs(As[i]) if np.isfinite(As[i]) else 0.0
            m += 1
        if pinf and ninf:  # no defined Σδ: the whole sequence is left out
            vs[:] = False
            m = first
        n[s], undef[s] = m - first, masked - (m - first)
    return valid, idx[:m], dv[:m], av[:m], n, undef


@dataclass
class TokenDecisions:
    """Token-level quantities on the valid tokens (what the per-token outputs read; the partials
    count the rest in the same pass). ``rej`` is only the token-level rules (mask band at token
    level, token filters); sequence-level rules -- veto, sequence/geometric bands, sequence
    filters -- come from :func:`seq_view`."""

    w: np.ndarray      # token raw weight exp(clip δ)
    a: np.ndarray      # token applied weight (level token; = w otherwise)
    rej: np.ndarray    # rejected by a token-level rule (band or token filter)
