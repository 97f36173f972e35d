"""grpolens.functional.reduceat: a kernel's segment sums equal numpy's add.reduceat bit for bit
(ragged segments across the pairwise sum's 8- and 128-value thresholds, signed zeros, inf, NaN)."""

from __future__ import annotations

import numpy as np

from grpolens.functional.jit import kernel
from grpolens.functional.reduceat import segment_sum


@kernel
def _sums(x, starts, ends):
    out = np.empty(len(starts))
    for s in range(len(starts)):
        out[s] = segment_sum(x, starts[s], ends[s])
    return out


def _same(a, b):
    """Equal values with equal signs of zero (a NaN is a NaN: which of two NaN operands an addition
    passes on, and so its sign bit, is the compiler's choice)."""
    nan = np.isnan(a)
    return (np.array_equal(a, b, equal_nan=True)
            and np.array_equal(np.signbit(a[~nan]), np.signbit(b[~nan])))


def test_segment_sums_are_numpys_reduceat_to_the_last_bit():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([np.arange(1, 300), rng.integers(1, 3000, size=60), [127, 128, 129, 136, 256, 257, 1024]])
    rng.shuffle(lengths)
    n = int(lengths.sum())
    x = rng.normal(size=n) * 10.0 ** rng.integers(-12, 12, size=n)  # magnitudes apart: the order shows
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    got = _sums(x, starts, starts + lengths)
    assert _same(got, np.add.reduceat(x, starts))
    # in order differs (so this test would catch a kernel that adds in order)
    assert not np.array_equal(got, np.array([np.cumsum(x[s:s + m])[-1] for s, m in zip(starts, lengths)]))


def test_signed_zeros_inf_nan_and_empty_segments():
    rng = np.random.default_rng(1)
    for length in (1, 2, 7, 8, 9, 16, 127, 128, 129, 300):
        for _ in range(20):
            x = rng.choice([-0.0, 0.0, -0.0, 1e-300, -1e-300, np.inf, -np.inf, np.nan, 1.5], size=length,
                           p=[0.3, 0.1, 0.3, 0.1, 0.1, 0.02, 0.02, 0.01, 0.05])
            with np.errstate(invalid="ignore"):
                want = np.add.reduceat(x, [0])
            assert _same(_sums(x, np.array([0]), np.array([length])), want)
    assert _sums(np.ones(3), np.array([1]), np.array([1]))[0] == 0.0
