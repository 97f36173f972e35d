"""Per-token rollout-IS weights and decisions: the bounded weight, the modes, the veto, the
rejection filters' statistics, and each valid token's decisions under a config."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from grpolens.functional.estimators import LOG_RATIO_BOUND, bounded_exp, clip_log_ratio, k1, k2, k3
from grpolens.functional.rollout_is.config import ISConfig


def in_band(w: np.ndarray, lower: float | None, upper: float | None) -> np.ndarray:
    """lower ≤ w ≤ upper (an unset bound is open; NaN is outside)."""
    with np.errstate(invalid="ignore"):
        keep = ~np.isnan(w)
        if lower is not None:
            keep &= w >= lower
        if upper is not None:
            keep &= w <= upper
    return keep


def apply_mode(w: np.ndarray, c: ISConfig) -> np.ndarray:
    """The applied weight of raw weights ``w`` under the mode (rejection is separate)."""
    if c.mode in ("truncate", "both"):
        return np.clip(w, c.lower if c.lower is not None else -np.inf, c.upper)
    if c.mode == "truncate_upper":
        return np.minimum(w, c.upper)
    if c.mode == "icepop":
        return np.where(in_band(w, c.lower, c.upper), w, 0.0)
    return w


def catastrophic(delta: np.ndarray, c: ISConfig) -> np.ndarray:
    """Raw (unbounded) token ratio e^δ outside the veto band; a lower bound of 0 disables that side."""
    out = np.zeros(delta.shape, dtype=bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        if c.veto_lower is not None and c.veto_lower > 0:
            out |= delta < np.log(c.veto_lower)
        if c.veto_upper is not None:
            out |= delta > np.log(c.veto_upper)
    return out


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
        self.idx = np.flatnonzero(keep)
        self.n = b.count(keep)
        counts = self.n.astype(np.int64)
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
    #: :func:`token_decisions` under each config, made once: the producer's partials, the loss
    #: weights and the IS visitors of a batch all ask for the same ones
    decisions: dict = field(default_factory=dict, repr=False, compare=False)


def inputs(b) -> Inputs:
    """δ and the valid set of a :class:`~grpolens.metrics.batch.TokenBatch` (needs ``rollout_logp``)."""
    with np.errstate(invalid="ignore"):
        delta = b.old - b.cols["rollout_logp"]
    # the mask the trainer's rollout correction saw: before its own rejection (``rollout_rejected``)
    valid = b.pre_rejection_mask & ~np.isnan(delta)
    pinf, ninf = valid & (delta == np.inf), valid & (delta == -np.inf)
    if pinf.any() and ninf.any():
        both = b.seq_any(pinf) & b.seq_any(ninf)
        if both.any():
            valid &= ~b.broadcast(both)
    seg = Segments(b, valid)
    adv = b.adv[seg.idx]
    return Inputs(valid, seg, delta[seg.idx], np.where(np.isfinite(adv), np.abs(adv), 0.0))


@dataclass
class TokenDecisions:
    """Token-level quantities on the valid tokens; ``rej``/``drop``/``mod`` count only token-level
    rules (sequence-level rules -- veto, sequence/geometric bands, sequence filters -- come from
    :func:`seq_view`)."""

    w: np.ndarray      # token raw weight exp(clip δ)
    a: np.ndarray      # token applied weight (level token; = w otherwise)
    cat: np.ndarray    # catastrophic tokens (veto)
    band: np.ndarray   # rejected by the mask band (level token)
    rej: np.ndarray    # rejected by a token-level rule (band or token filter)
    chg: np.ndarray    # weight changed by truncation/zeroing (level token)
    drop: np.ndarray   # rejected or weight zeroed
    mod: np.ndarray    # rejected or weight changed


def token_decisions(x: Inputs, c: ISConfig) -> TokenDecisions:
    """The token-level decisions on ``x`` under ``c`` (computed once per inputs and config)."""
    t = x.decisions.get(c)
    if t is None:
        t = x.decisions[c] = _token_decisions(x, c)
    return t


def _token_decisions(x: Inputs, c: ISConfig) -> TokenDecisions:
    d = x.dv
    w = bounded_exp(d)
    none = np.zeros(len(d), dtype=bool)
    if c.level == "token":
        a = apply_mode(w, c)
        band = ~in_band(w, c.mask_lower, c.mask_upper) if c.masks else none
        chg = a != w
    else:
        a, band, chg = w, none, none
    rej = band
    for f in c.token_filters:
        rej = rej | ~f.keep(rs_stat(f.k, d))
    cat = catastrophic(d, c) if c.veto else none
    zero = chg & (a == 0)
    return TokenDecisions(w, a, cat, band, rej, chg, rej | zero, rej | chg)
