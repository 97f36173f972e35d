"""The train–rollout mismatch's tokens and sums: masked tokens (before the trainer's rejection)
whose two log-probs are finite, δ = old − rollout on them, and per sequence Σ old, Σ rollout, Σδ,
Σ|δ| and max|δ| -- in one compiled pass over the batch's tokens. The sums that need a
transcendental function of δ (k3, the χ² term) are numpy's, on the δ returned here."""

from __future__ import annotations

import numpy as np

from grpolens.functional.jit import kernel
from grpolens.functional.reduceat import segment_sum
from grpolens.functional.rollout_is.weights import Segments

#: the rows of :func:`finite_pairs`' sums, in order
SUMS = ("old", "roll", "d", "absd", "absdmax")


def finite_pairs(b) -> tuple[Segments, np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """``(segments, old, rollout, δ, sums)`` of a :class:`~grpolens.metrics.batch.TokenBatch` with
    ``rollout_logp``: the kept tokens' values in token order, and per sequence the :data:`SUMS`
    (numpy's reduceat sums to the last bit; max|δ| is −inf for a sequence without a kept token)."""
    idx, o, r, d, n, rows = _finite_pairs(b.old, b.cols["rollout_logp"], b.pre_rejection_mask, b.starts, b.lengths)
    return Segments.of(idx, n), o, r, d, dict(zip(SUMS, rows))


@kernel
def _finite_pairs(old, roll, pre, starts, lengths):
    size, ns = len(old), len(starts)
    idx = np.empty(size, dtype=np.int64)
    o, r, d = np.empty(size), np.empty(size), np.empty(size)
    n = np.zeros(ns)
    rows = np.zeros((5, ns))
    ad = np.empty(lengths.max() if ns else 0)
    m = 0
    for s in range(ns):
        lo, hi = starts[s], starts[s] + lengths[s]
        ps, os, rs = pre[lo:hi], old[lo:hi], roll[lo:hi]  # views indexed from 0: no negative-index test
        first = m
        top = -np.inf
        for i in range(hi - lo):
            if ps[i] and np.isfinite(os[i]) and np.isfinite(rs[i]):
                dj = os[i] - rs[i]
                idx[m], o[m], r[m], d[m] = lo + i, os[i], rs[i], dj
                ad[m - first] = abs(dj)
                top = max(top, abs(dj))
                m += 1
        n[s] = m - first
        rows[0, s], rows[1, s] = segment_sum(o, first, m), segment_sum(r, first, m)
        rows[2, s], rows[3, s], rows[4, s] = segment_sum(d, first, m), segment_sum(ad, 0, m - first), top
    return idx[:m], o[:m], r[:m], d[:m], n, rows
