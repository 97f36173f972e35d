"""grpolens.functional.histogram: exact merges, and the stated quantile bound against exact quantiles."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from grpolens.functional.histogram import LogBins, LogHistogram

BINS = LogBins()


def datasets(rng):
    yield "normal", rng.normal(size=20_001)
    yield "lognormal ratios", np.exp(rng.normal(scale=0.3, size=9_999))
    yield "tiny deltas", rng.normal(scale=1e-3, size=5_000)
    yield "heavy tails", rng.standard_cauchy(4_000) * 1e3
    yield "mixed zeros and sub-min", np.r_[np.zeros(50), rng.normal(scale=1e-8, size=300), rng.normal(size=300)]
    yield "one value", np.array([0.37])
    yield "constant", np.full(100, -2.5)


@pytest.mark.parametrize("seed", [0, 1])
def test_quantiles_within_stated_bound(seed):
    rng = np.random.default_rng(seed)
    for name, data in datasets(rng):
        h = LogHistogram.of(data)
        s = np.sort(data)
        for q in np.linspace(0, 1, 401):
            x = np.quantile(data, q, method="lower")
            assert x == s[math.floor(q * (len(s) - 1))]
            v = h.quantile(q)
            if q in (0.0, 1.0):
                assert v == x, name
            elif abs(x) < BINS.min_abs:
                assert abs(v) < BINS.min_abs, (name, q, x, v)
            elif abs(x) <= BINS.max_abs:
                assert abs(v - x) <= BINS.alpha * abs(x), (name, q, x, v)


def test_hand_worked_bin():
    # gamma = 1.005/0.995; 1.0 lies in bin k=0 (gamma**-1 < 1 <= gamma**0), reported as 2/(gamma+1)
    g = 1.005 / 0.995
    h = LogHistogram.of(np.array([-5.0, 1.0, 1.0, 7.0]))
    assert h.quantile(0.5) == pytest.approx(2 / (g + 1), rel=1e-12)
    assert abs(h.quantile(0.5) - 1.0) <= 0.005
    assert h.quantile(0) == -5.0 and h.quantile(1) == 7.0


def test_quantile_picks_the_bin_of_its_order_statistic():
    # [1, 2, 3]: the median is rank floor(0.5 * 2) = 1, the value 2 (not the maximum, which rank
    # n - 1 = 2 gives; not the bin of 1, whose cumulative count equals the rank)
    h = LogHistogram.of(np.array([1.0, 2.0, 3.0]))
    assert h.quantile(0.5) == pytest.approx(2.0, rel=BINS.alpha) and h.quantile(0.5) != 2.0


def test_values_exactly_on_min_abs_are_binned_not_zero():
    # the bound covers min_abs <= |x|: ±min_abs itself gets a bin within alpha, not the zero bin
    h = LogHistogram.of(np.array([-1.0, -BINS.min_abs, BINS.min_abs, 1.0]))
    for q, x in ((1 / 3, -BINS.min_abs), (2 / 3, BINS.min_abs)):
        assert abs(h.quantile(q) - x) <= BINS.alpha * BINS.min_abs, q


def test_quantiles_beyond_max_abs_are_the_exact_extremes():
    # beyond max_abs a value falls in its sign's overflow bin, reported as the exact min or max
    h = LogHistogram.of(np.array([-5e6, -4e6, -3e6, -2e6, 0.5, 2e6, 3e6, 4e6, 5e6]))
    assert h.quantile(0.25) == -5e6  # rank 2: -3e6, in the negative overflow bin
    assert h.quantile(0.75) == 5e6   # rank 6: 3e6, in the positive overflow bin
    assert h.quantile(0.5) == pytest.approx(0.5, rel=BINS.alpha)
    # the largest regular bins are not overflow bins: ±0.9e6 are reported within alpha, not as the extremes
    h = LogHistogram.of(np.array([-5e6, -0.9e6, 0.9e6, 5e6]))
    assert h.quantile(1 / 3) == pytest.approx(-0.9e6, rel=BINS.alpha)
    assert h.quantile(2 / 3) == pytest.approx(0.9e6, rel=BINS.alpha)


def test_float32_values_are_binned_at_float64_precision():
    # 1.5527129 in float32: its float32 log puts it in bin 44, its exact (float64) value in bin 45
    v = np.array([1.5527129173278809, -1.5527129173278809, 0.25], dtype=np.float32)
    h32, h64 = LogHistogram.of(v), LogHistogram.of(v.astype(np.float64))
    assert np.array_equal(h32.counts, h64.counts) and (h32.min, h32.max) == (h64.min, h64.max)


def test_merge_is_exact_for_any_split():
    rng = np.random.default_rng(3)
    data = np.r_[rng.normal(size=10_000), [np.nan, np.inf, -np.inf]]
    whole = LogHistogram.of(data)
    for pieces in (2, 7, 64):
        merged = LogHistogram.merge_all([LogHistogram.of(p) for p in np.array_split(rng.permutation(data), pieces)])
        assert np.array_equal(merged.counts, whole.counts)
        assert (merged.n, merged.min, merged.max, merged.nonfinite) == (whole.n, whole.min, whole.max, 3)
        assert [merged.quantile(q) for q in (0.01, 0.5, 0.99)] == [whole.quantile(q) for q in (0.01, 0.5, 0.99)]
    # pieces without a finite value (a shard whose tokens are all masked) change nothing
    small = np.array([0.991, 0.991, 0.991])  # its bin's midpoint is above 0.991: clamped to the exact max
    h = LogHistogram.of(small)
    for empty in (np.array([]), np.array([np.nan, -np.inf])):
        for parts in ([empty, small], [small, empty]):
            merged = LogHistogram.merge_all([LogHistogram.of(p) for p in parts])
            assert (merged.n, merged.min, merged.max) == (3, 0.991, 0.991)
            assert merged.quantile(0.5) == h.quantile(0.5) == 0.991


def test_empty_and_nonfinite_only():
    assert LogHistogram.of(np.array([])).quantile(0.5) is None
    h = LogHistogram.of(np.array([np.nan, np.inf]))
    assert h.quantile(0.5) is None and h.nonfinite == 2
    assert LogHistogram.merge_all([None]) is None


def test_pickles_sparse_and_round_trips():
    h = LogHistogram.of(np.random.default_rng(0).normal(size=1000))
    blob = pickle.dumps(h)
    assert len(blob) < h.counts.nbytes / 4
    back = pickle.loads(blob)
    assert np.array_equal(back.counts, h.counts) and (back.n, back.min, back.max) == (h.n, h.min, h.max)
    assert h.counts.dtype == back.counts.dtype == np.int64  # integer counts: merges stay exact


def test_a_pickled_histogram_keeps_its_bins_and_its_nonfinite_count():
    """The pickle holds the bins (not the default ones here) and the count of NaN/inf values: the
    unpickled histogram merges with one of the same bins and still counts the 3 non-finite values."""
    bins = LogBins(alpha=0.05)
    values = np.array([0.5, np.nan, 2.0, np.inf, -3.0, -np.inf])
    back = pickle.loads(pickle.dumps(LogHistogram.of(values, bins)))
    assert back.bins == bins and back.nonfinite == 3 and back.n == 3
    both = back.merge(LogHistogram.of(np.array([np.nan, 1.0]), bins))
    assert (both.n, both.nonfinite, both.min, both.max) == (4, 4, -3.0, 2.0)


def test_different_bins_refuse_to_merge():
    with pytest.raises(ValueError, match="^cannot merge histograms with different bins$"):
        LogHistogram.of(np.ones(3)).merge(LogHistogram.of(np.ones(3), LogBins(alpha=0.01)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_edge_counts_are_numpys_histogram(seed):
    """edge_counts against np.histogram: values on every edge (the last bin closed), outside the
    edges, ±inf, NaN of either sign, -0.0, empty input, uneven and even edges (one with 0.0 an edge)."""
    from grpolens.analysis.is_weights import HIST_EDGES
    from grpolens.functional.histogram import edge_counts

    rng = np.random.default_rng(seed)
    # the last: 40 edges inside one of the lookup's buckets, so values pass several bounds in it
    for edges in (HIST_EDGES, np.linspace(-3.0, 3.0, 7), np.array([0.0, 1.0]), np.sort(rng.normal(size=50)),
                  np.linspace(1.0, 1.01, 40)):
        x = np.concatenate([rng.normal(scale=edges[-1], size=5_000), rng.uniform(edges[0], edges[-1], 2_000), edges, edges[:: max(1, len(edges) // 5)],
                            [edges[0] - 1.0, edges[-1] + 1.0, np.inf, -np.inf, np.nan, np.copysign(np.nan, -1.0), -0.0, 0.0],
                            np.nextafter(edges, np.inf), np.nextafter(edges, -np.inf)])
        rng.shuffle(x)
        for part in (x, x[:0], x[:1], np.clip(x, edges[0], edges[-1])):
            want = np.histogram(part, bins=edges)[0]
            got = edge_counts(part, edges)
            assert got.dtype == np.int64 and np.array_equal(got, want)


@pytest.mark.parametrize("bins", [LogBins(), LogBins(alpha=0.01), LogBins(min_abs=1e-3, max_abs=10.0)])
def test_index_is_the_binning_formula(bins):
    """LogBins.index (worked in place on one buffer) against the module docstring's formula written
    plainly: k = ceil(ln max(|x|, min_abs) / ln gamma), capped at the overflow bin, mirrored by
    sign, the zero bin below min_abs; on every bin edge, its neighbours, ±0, the smallest and
    largest floats."""
    rng = np.random.default_rng(3)
    edges = bins.gamma ** np.arange(bins.k_min - 3, bins.k_max + 3, dtype=np.float64)
    x = np.concatenate([rng.normal(size=20_000), rng.standard_cauchy(5_000) * 1e3, rng.normal(scale=1e-7, size=2_000),
                        edges, -edges, np.nextafter(edges, 0), np.nextafter(edges, np.inf), -np.nextafter(edges, np.inf),
                        [0.0, -0.0, bins.min_abs, -bins.min_abs, np.nextafter(bins.min_abs, 0), bins.max_abs,
                         -bins.max_abs, 1e300, -1e300, 5e-324, -5e-324]])
    a = np.abs(x)
    k = np.ceil(np.log(np.maximum(a, bins.min_abs)) / math.log(bins.gamma)).astype(np.int64)
    off = np.minimum(k, bins.k_max + 1) - bins.k_min
    want = np.where(a < bins.min_abs, bins.per_sign, np.where(x > 0, bins.per_sign + 1 + off, bins.per_sign - 1 - off))
    got = bins.index(x)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert got.min() >= 0 and got.max() < bins.size


@pytest.mark.parametrize("seed", [0, 1])
def test_clamped_and_weighted_edge_counts_are_numpys_histogram_of_clipped_repeated_values(seed):
    """clamp: the histogram of the values clipped to the outer edges (±inf into the end bins, NaN
    never); weights: each value counted that many times (0 included)."""
    from grpolens.analysis.is_weights import HIST_EDGES
    from grpolens.functional.histogram import edge_counts

    rng = np.random.default_rng(seed)
    for edges in (HIST_EDGES, np.linspace(-3.0, 3.0, 7), np.array([0.0, 1.0]), np.sort(rng.normal(size=50))):
        x = np.concatenate([rng.normal(scale=2 * edges[-1] + 1, size=3_000), edges, np.nextafter(edges, np.inf),
                            np.nextafter(edges, -np.inf), [np.inf, -np.inf, np.nan, -np.nan, -0.0, 0.0, -1e300, 1e300]])
        rng.shuffle(x)
        w = rng.integers(0, 5, size=len(x))
        for part, wp in ((x, w), (x[:0], w[:0]), (x[:1], w[:1])):
            clipped = np.clip(part, edges[0], edges[-1])
            assert np.array_equal(edge_counts(part, edges, clamp=True), np.histogram(clipped, bins=edges)[0])
            got = edge_counts(part, edges, clamp=True, weights=wp)
            assert got.dtype == np.int64 and np.array_equal(got, np.histogram(np.repeat(clipped, wp), bins=edges)[0])
            assert np.array_equal(edge_counts(part, edges, weights=wp), np.histogram(np.repeat(part, wp), bins=edges)[0])


def test_a_histogram_with_signs_counts_each_sign_and_bins_by_the_index_formula():
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.normal(size=5_000), rng.normal(scale=1e-8, size=500), rng.standard_cauchy(500) * 1e7,
                        [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, BINS.min_abs, -BINS.min_abs, 5e-324]])
    rng.shuffle(x)
    h, neg, pos = LogHistogram.with_signs(x)
    assert (neg, pos) == (int((x < 0).sum()), int((x > 0).sum()))
    fin = x[np.isfinite(x)]
    assert np.array_equal(h.counts, np.bincount(BINS.index(fin), minlength=BINS.size))
    assert (h.n, h.min, h.max, h.nonfinite) == (len(fin), fin.min(), fin.max(), 4)
    e, neg, pos = LogHistogram.with_signs(np.array([]))
    assert (e.n, e.min, e.max, e.nonfinite, int(e.counts.sum()), neg, pos) == (0, math.inf, -math.inf, 0, 0, 0, 0)
