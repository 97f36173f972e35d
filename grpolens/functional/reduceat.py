"""Per-segment sums inside a kernel, in numpy's order: bit for bit what ``np.add.reduceat`` gives.

The per-sequence partials were numpy's ``reduceat`` sums, and every output file of a recompute is
compared byte for byte across engine changes, so a kernel that replaces them adds in the same
order. numpy reduces a segment ``x[lo:hi]`` as ``x[lo] + pairwise(x[lo+1:hi])``, its pairwise sum
being: fewer than 8 values added in order onto −0.0; up to 128 values in 8 interleaved
accumulators combined as ``((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7))``, then the rest in order; more
than 128 split in two at half the count rounded down to a multiple of 8
(``tests/functional/test_reduceat.py`` holds it to numpy's on ragged segments).
"""

from __future__ import annotations

import numpy as np

from grpolens.functional.jit import kernel

# unsigned offsets: an index the compiler knows is not negative needs no wraparound test, so the
# eight accumulators' loads compile to one vector load
_U1, _U2, _U3, _U4, _U5, _U6, _U7, _U8 = (np.uint64(k) for k in range(1, 9))


@kernel
def pairwise_sum(x, lo, hi):
    """numpy's pairwise sum of ``x[lo:hi]`` (``-0.0`` when empty)."""
    v = x[lo:hi]  # indexed from 0: the compiler then knows no index is negative (no wraparound test)
    n = len(v)
    if n < 8:
        res = -0.0
        for i in range(n):
            res += v[i]
        return res
    if n <= 128:
        r0, r1, r2, r3, r4, r5, r6, r7 = v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]
        end = n - n % 8
        u = _U8
        while u < end:
            r0 += v[u]
            r1 += v[u + _U1]
            r2 += v[u + _U2]
            r3 += v[u + _U3]
            r4 += v[u + _U4]
            r5 += v[u + _U5]
            r6 += v[u + _U6]
            r7 += v[u + _U7]
            u += _U8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        for i in range(end, n):
            res += v[i]
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return pairwise_sum(x, lo, lo + n2) + pairwise_sum(x, lo + n2, hi)


@kernel
def segment_sum(x, lo, hi):
    """``np.add.reduceat``'s sum of the segment ``x[lo:hi]``; 0.0 for an empty one (the identity
    the partials give an empty sequence)."""
    if hi <= lo:
        return 0.0
    return x[lo] + pairwise_sum(x, lo + 1, hi)
