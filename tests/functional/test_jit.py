"""The kernel compiler's shared options hold: NaN and inf as numpy gives them, no exception on a
division by zero, the GIL released, and a kernel inlining a shared scalar formula gives the numpy
formula's value bit for bit on random data."""

from __future__ import annotations

import threading

import numpy as np

from grpolens.functional.jit import inline, kernel


@inline
def _half_square(x):
    return 0.5 * x * x


@kernel
def _seq_sums(x, starts, n):
    out = np.zeros(len(starts))
    for s in range(len(starts)):
        end = starts[s + 1] if s + 1 < len(starts) else n
        acc = 0.0
        for i in range(starts[s], end):
            acc += _half_square(x[i])
        out[s] = acc
    return out


@kernel
def _ratio(a, b):
    return a / b


def test_a_kernel_equals_the_numpy_formula_bit_for_bit_on_ragged_segments():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=200)
    x = rng.normal(size=int(lengths.sum())) * 10.0 ** rng.integers(-8, 8, size=int(lengths.sum()))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    got = _seq_sums(x, starts, len(x))
    # numpy sums 8 or more values pairwise; a kernel adds in order: compare in-order sums exactly
    want = np.array([float(sum(0.5 * v * v for v in x[s:s + n])) for s, n in zip(starts, lengths)])
    assert np.array_equal(got, want)


def test_division_by_zero_gives_ieee_values_not_an_exception():
    assert _ratio(1.0, 0.0) == np.inf
    assert np.isnan(_ratio(0.0, 0.0))
    assert np.isnan(_seq_sums(np.array([np.nan, 1.0]), np.array([0]), 2)[0])


def test_a_kernel_releases_the_gil():
    # two threads each running a long kernel finish in about the time of one when the GIL is
    # released; asserting on time would be a timing test, so check numba's own flag instead
    assert all(d.targetoptions.get("nogil") for d in (_seq_sums, _ratio))
    done = []
    threads = [threading.Thread(target=lambda: done.append(_ratio(1.0, 2.0))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done == [0.5, 0.5]
