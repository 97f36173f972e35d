"""Which elements ``torch.topk(x, k, largest=True)`` returns on the CPU when values tie.

verl's KL-Cov loss picks the tokens it penalises with ``torch.topk`` on the CPU. When the k-th and
the (k+1)-th largest values are equal, the tied elements it returns depend on the order in which
torch's CPU kernel (``at::native::topk_impl_loop``) lets the C++ standard library rearrange
``(value, index)`` pairs: ``std::partial_sort`` when ``k · 64 <= n``, else ``std::nth_element``,
both with the comparator ``x.value > y.value`` (NaN first, which the callers here never hand in).
This module replays GNU libstdc++'s algorithms (``__heap_select`` and ``__introselect``, the
library torch's Linux wheels are built against) comparison for comparison, so the tie is broken as
torch breaks it. Without a tie at the boundary the answer is simply the k largest values
(:func:`topk_indices` takes that path without replaying anything).
"""

from __future__ import annotations

import numpy as np


def topk_indices(x: np.ndarray, k: int, err: np.ndarray | None = None,
                 same: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """The indices (into ``x``, 1-D, no NaN; ascending) of the ``k`` elements torch's CPU ``topk``
    returns, and whether they are certain when ``x`` is only known to within ``err`` (per element):
    false when an element left out and one kept may be in the other order in torch's values, or
    when the replay of a tie compared two such elements. Elements with equal ``same`` labels are
    exactly equal in torch's values too (same inputs), never in doubt against each other."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if k <= 0 or n == 0:
        return np.zeros(0, dtype=np.int64), True
    if k >= n:
        return np.arange(n, dtype=np.int64), True
    kth = np.partition(x, n - k)[n - k]  # the k-th largest value
    if int((x > kth).sum()) + int((x == kth).sum()) == k:  # no tie across the boundary: the k largest
        top = np.flatnonzero(x >= kth)
        if err is None:
            return top, True
        out = np.ones(n, dtype=bool)
        out[top] = False
        return top, bool((x - err)[top].min() > (x + err)[out].max())
    doubt = [False]
    if err is None:
        less = _less
    else:
        e, lab = np.asarray(err, dtype=np.float64).tolist(), np.asarray(same).tolist()

        def less(a, b) -> bool:
            tol = e[a[1]] + e[b[1]]
            if tol > 0 and lab[a[1]] != lab[b[1]] and abs(a[0] - b[0]) <= tol:
                doubt[0] = True
            return a[0] > b[0]
    return np.sort(np.asarray(_replay(x.tolist(), k, less), dtype=np.int64)), not doubt[0]


def _replay(vals: list[float], k: int, less) -> list[int]:
    """The first ``k`` indices after libstdc++'s ``partial_sort``/``nth_element`` on ``(value, index)``."""
    q = [(v, i) for i, v in enumerate(vals)]
    n = len(q)
    if k * 64 <= n:
        _heap_select(q, 0, k, n, less)
    else:
        depth = 2 * (n.bit_length() - 1)  # std::__lg(n) * 2
        _introselect(q, 0, k - 1, n, depth, less)
    return [i for _, i in q[:k]]


def _less(a, b) -> bool:
    """torch's comparator for ``largest=True``: ``a`` goes before ``b``."""
    return a[0] > b[0]


def _introselect(q: list, first: int, nth: int, last: int, depth: int, less) -> None:
    while last - first > 3:
        if depth == 0:
            _heap_select(q, first, nth + 1, last, less)
            q[first], q[nth] = q[nth], q[first]
            return
        depth -= 1
        cut = _partition_pivot(q, first, last, less)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(q, first, last, less)


def _partition_pivot(q: list, first: int, last: int, less) -> int:
    mid = first + (last - first) // 2
    _median_to_first(q, first, first + 1, mid, last - 1, less)
    return _unguarded_partition(q, first + 1, last, first, less)


def _median_to_first(q: list, result: int, a: int, b: int, c: int, less) -> None:
    if less(q[a], q[b]):
        if less(q[b], q[c]):
            m = b
        elif less(q[a], q[c]):
            m = c
        else:
            m = a
    elif less(q[a], q[c]):
        m = a
    elif less(q[b], q[c]):
        m = c
    else:
        m = b
    q[result], q[m] = q[m], q[result]


def _unguarded_partition(q: list, first: int, last: int, pivot: int, less) -> int:
    p = q[pivot]
    while True:
        while less(q[first], p):
            first += 1
        last -= 1
        while less(p, q[last]):
            last -= 1
        if not first < last:
            return first
        q[first], q[last] = q[last], q[first]
        first += 1


def _insertion_sort(q: list, first: int, last: int, less) -> None:
    if first == last:
        return
    for i in range(first + 1, last):
        val = q[i]
        if less(val, q[first]):
            q[first + 1:i + 1] = q[first:i]
            q[first] = val
        else:  # __unguarded_linear_insert
            j = i
            while less(val, q[j - 1]):
                q[j] = q[j - 1]
                j -= 1
            q[j] = val


def _heap_select(q: list, first: int, middle: int, last: int, less) -> None:
    _make_heap(q, first, middle, less)
    for i in range(middle, last):
        if less(q[i], q[first]):  # __pop_heap(first, middle, i)
            val = q[i]
            q[i] = q[first]
            _adjust_heap(q, first, 0, middle - first, val, less)


def _make_heap(q: list, first: int, last: int, less) -> None:
    n = last - first
    if n < 2:
        return
    parent = (n - 2) // 2
    while True:
        _adjust_heap(q, first, parent, n, q[first + parent], less)
        if parent == 0:
            return
        parent -= 1


def _adjust_heap(q: list, first: int, hole: int, n: int, val, less) -> None:
    top = hole
    child = hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if less(q[first + child], q[first + child - 1]):
            child -= 1
        q[first + hole] = q[first + child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        q[first + hole] = q[first + child - 1]
        hole = child - 1
    # __push_heap
    parent = (hole - 1) // 2
    while hole > top and less(q[first + parent], val):
        q[first + hole] = q[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    q[first + hole] = val
