"""The decomposition itself: additive unit terms of two steps (or a baseline range) -> exact
contributions per key, their mix/rate split, and the concentration of a step.

A step's value is the sum of its units' terms ``a_u`` (tokens or sequences; see
:mod:`grpolens.analysis.explain.reductions`). For a key ``k`` of a dimension, ``A_k`` is the sum of
its units' terms and ``W_k`` its share of the step's unit weight (the metric's own denominator where
it has one: valid tokens of a token mean). Then

    contribution_k = A_k(S) − A_k(B),  Σ_k contribution_k = value(S) − value(B) = delta

exactly (a baseline range uses the mean of its steps' A_k and W_k). Writing ``A_k = W_k · r_k``
(``r_k``: the key's own mean), a key present in both steps splits into

    mix_k  = (W_k(S) − W_k(B)) · (r_k(S) + r_k(B)) / 2     its share changed
    rate_k = contribution_k − mix_k = (r_k(S) − r_k(B)) · (W_k(S) + W_k(B)) / 2   its mean changed

(the symmetric split: no order of the two effects is favoured). A key present in one step only
contributes its own share, with sign, and has no split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Units:
    """One step's units: terms (Σ = the step's value), weights, and which count."""

    terms: np.ndarray
    weight: np.ndarray
    #: per unit, the row of its sequence (tokens), or None when the units are sequences
    seq: np.ndarray | None = None
    #: per unit, how many counted units it stands for (None: itself, when it takes part)
    n: np.ndarray | None = None

    @property
    def counted(self) -> np.ndarray:
        """Units that take part: a weight or a term (masked-out tokens do not)."""
        if self.n is not None:
            return self.n > 0
        return (self.weight != 0) | (self.terms != 0)

    def per_sequence(self, n_seq: int) -> "Units":
        """Token units summed per sequence (the same sums for any key that is a sequence's)."""
        if self.seq is None:
            return self
        return Units(np.bincount(self.seq, self.terms, n_seq), np.bincount(self.seq, self.weight, n_seq), None,
                     np.bincount(self.seq, self.counted.astype(np.float64), n_seq))


@dataclass
class Table:
    """Per key of one dimension (keys sorted): the contribution and its parts."""

    keys: np.ndarray
    contribution: np.ndarray
    mix: np.ndarray  # NaN where the key is not in both steps
    rate: np.ndarray
    count: np.ndarray  # units of the key in step S
    in_step: np.ndarray  # present in step S
    in_base: np.ndarray  # present in the baseline


def _per_key(u: Units, codes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.bincount(codes, u.terms, k)
    wtot = u.weight.sum()
    w = np.bincount(codes, u.weight, k) / wtot if wtot else np.zeros(k)
    n = np.bincount(codes, u.n, k) if u.n is not None else np.bincount(codes[u.counted], minlength=k).astype(np.float64)
    return a, w, n


#: Keys below this are counted densely (token ids, buckets): no sort of the keys.
_DENSE = 1 << 21


def table(step: tuple[Units, np.ndarray], base: list[tuple[Units, np.ndarray]]) -> Table:
    """Contributions of each key of one dimension: ``step`` and every baseline step as
    (units, key per unit)."""
    every = np.concatenate([step[1], *(k for _, k in base)])
    dense = len(every) and every.min() >= 0 and every.max() < _DENSE
    if dense:
        keys = np.arange(int(every.max()) + 1)
        code = lambda kk: kk  # noqa: E731
    else:
        keys = np.unique(every)
        code = lambda kk: np.searchsorted(keys, kk)  # noqa: E731
    k = len(keys)
    a_s, w_s, n_s = _per_key(step[0], code(step[1]), k)
    a_b, w_b, n_b = np.zeros(k), np.zeros(k), np.zeros(k)
    for u, kk in base:
        a, w, n = _per_key(u, code(kk), k)
        a_b += a
        w_b += w
        n_b += n
    if base:
        a_b /= len(base)
        w_b /= len(base)
    c = a_s - a_b
    in_s, in_b = n_s > 0, n_b > 0
    shared = in_s & in_b & (w_s > 0) & (w_b > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        r_s, r_b = a_s / w_s, a_b / w_b
        mix = np.where(shared, (w_s - w_b) * (r_s + r_b) / 2, np.nan)
    rate = np.where(shared, c - mix, np.nan)
    if dense:  # only the keys some step has
        at = np.zeros(k, dtype=bool)
        at[step[1]] = True
        for _, kk in base:
            at[kk] = True
        return Table(keys[at], c[at], mix[at], rate[at], n_s[at].astype(np.int64), in_s[at], in_b[at])
    return Table(keys, c, mix, rate, n_s.astype(np.int64), in_s, in_b)


def ranked(t: Table, delta: float) -> np.ndarray:
    """Key indices, those that pushed the value the way it moved first (largest first); with no
    movement, by size."""
    if delta > 0:
        return np.argsort(-t.contribution, kind="stable")
    if delta < 0:
        return np.argsort(t.contribution, kind="stable")
    return np.argsort(-np.abs(t.contribution), kind="stable")


def shares(terms: np.ndarray, counted: np.ndarray, fractions: tuple[float, ...] = (),
           counts: tuple[int, ...] = ()) -> list[float | None]:
    """Share of the sum of ``terms`` held by the top ``fractions`` of the counted units (at least
    one unit each) and by the top ``counts`` units, the largest terms in the direction of the sum
    first (None when the sum is 0)."""
    x = terms[counted]
    total = float(x.sum())
    if not len(x) or total == 0 or not math.isfinite(total):
        return [None] * (len(fractions) + len(counts))
    sign = 1.0 if total > 0 else -1.0
    csum = np.cumsum(np.sort(x * sign)[::-1]) * sign
    sizes = [max(1, math.ceil(f * len(x) - 1e-9)) for f in fractions] + [min(n, len(x)) for n in counts]
    return [float(csum[n - 1] / total) for n in sizes]


def concentration(u: Units, n_seq: int) -> dict[str, float | None]:
    """Within one step: the share of its value held by its top 0.1 / 1 / 10 % tokens and top 1 /
    10 completions (token shares None when the units are sequences)."""
    out: dict[str, float | None] = {}
    if u.seq is not None:
        t = shares(u.terms, u.counted, fractions=(0.001, 0.01, 0.1))
        per_seq = np.bincount(u.seq, u.terms, n_seq)
        per_seq_counted = np.bincount(u.seq, u.counted.astype(np.float64), n_seq) > 0
    else:
        t = [None, None, None]
        per_seq, per_seq_counted = u.terms, u.counted
    out["top_0.1%_tokens"], out["top_1%_tokens"], out["top_10%_tokens"] = t
    out["top_1_completions"], out["top_10_completions"] = shares(per_seq, per_seq_counted, counts=(1, 10))
    return out
