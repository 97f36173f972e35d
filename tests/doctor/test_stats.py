"""doctor's trend statistics against scipy (an independent implementation) and brute force, on
random series with ties, outliers and edge cases, plus hand-worked examples."""

import math

import numpy as np
import pytest
from scipy import stats as sp

from grpolens.analysis.doctor import stats


@pytest.mark.parametrize("seed", range(12))
def test_theil_sen_equals_scipy(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 80))
    x = np.sort(rng.choice(1000, n, replace=False)).astype(float)
    y = 0.01 * x + rng.standard_normal(n)
    if seed % 3 == 0:
        y[rng.integers(0, n, max(1, n // 5))] += 50  # outliers
    if seed % 4 == 1:
        y = np.round(y)  # ties
    got = stats.theil_sen(x, y)
    ref = sp.theilslopes(y, x)
    assert got.slope == pytest.approx(ref.slope, rel=1e-12, abs=1e-15)
    assert got.intercept == pytest.approx(ref.intercept, rel=1e-12, abs=1e-12)


def test_theil_sen_repeated_x_and_hand_example():
    # slopes over pairs with distinct x: (0,0)-(1,1): 1, (0,0)-(2,4): 2, (1,1)-(2,4): 3 -> median 2
    got = stats.theil_sen([0, 1, 2], [0, 1, 4])
    assert got.slope == 2.0 and got.intercept == 1.0 - 2.0 * 1.0
    ref = sp.theilslopes([1, 2, 2, 5], [0, 1, 1, 3])  # a repeated x is skipped by both
    assert stats.theil_sen([0, 1, 1, 3], [1, 2, 2, 5]).slope == pytest.approx(ref.slope)
    with pytest.raises(ValueError):
        stats.theil_sen([1, 1], [0, 2])


@pytest.mark.parametrize("seed", range(12))
def test_mann_kendall_equals_kendall_tau_on_time(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(4, 120))
    y = 0.02 * seed * np.arange(n) + rng.standard_normal(n)
    if seed % 2:
        y = np.round(y * 2) / 2  # ties: the variance's correction
    got = stats.mann_kendall(y)
    ref = sp.kendalltau(np.arange(n), y, method="asymptotic")
    # Kendall's tau-b over (time, y) with untied time: S / sqrt(n0 (n0 - n2)); its p-value is the
    # Mann–Kendall z with the ties-corrected variance
    n0 = n * (n - 1) / 2
    _, counts = np.unique(y, return_counts=True)
    n2 = float((counts * (counts - 1) / 2).sum())
    assert got.s / math.sqrt(n0 * (n0 - n2)) == pytest.approx(ref.statistic, rel=1e-12)
    assert got.p == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-300)
    # S by brute force
    assert got.s == sum(np.sign(y[j] - y[i]) for i in range(n) for j in range(i + 1, n))


def test_mann_kendall_hand_example_and_edges():
    t = stats.mann_kendall([1, 2, 3, 4])  # S = 6, var = 4·3·13/18 = 26/3
    assert t.s == 6 and t.var == pytest.approx(26 / 3) and t.z == pytest.approx(6 / math.sqrt(26 / 3))
    assert t.tau == 1.0 and t.direction == 1
    assert stats.mann_kendall([5, 5, 5, 5]).p == 1.0  # all tied: no variance, no trend
    assert stats.mann_kendall([1, 2]).p == 1.0  # too short


def _cusum_brute(y, min_size):
    n, m = len(y), sum(y) / len(y)
    best, arg = -1.0, None
    for k in range(min_size, n - min_size + 1):
        s = abs(sum(v - m for v in y[:k]))
        if s > best + 1e-12 * max(1.0, best):
            best, arg = s, k
    return arg


@pytest.mark.parametrize("seed", range(12))
def test_cusum_change_point_equals_brute_force(seed):
    rng = np.random.default_rng(200 + seed)
    n = int(rng.integers(4, 60))
    k = int(rng.integers(1, n))
    y = rng.standard_normal(n) + np.where(np.arange(n) >= k, 3.0 * (seed % 3), 0.0)
    ch = stats.cusum_change(y, min_size=2)
    assert ch.index == _cusum_brute(list(y), 2)
    assert ch.before == np.median(y[:ch.index]) and ch.after == np.median(y[ch.index:])


def test_cusum_finds_a_clean_step_and_refuses_short_series():
    y = [1.0] * 7 + [5.0] * 5
    ch = stats.cusum_change(y)
    assert (ch.index, ch.before, ch.after) == (7, 1.0, 5.0)
    assert stats.cusum_change([1.0, 2.0, 3.0], min_size=2) is None


@pytest.mark.parametrize("seed", range(8))
def test_robust_z_equals_scipy_mad(seed):
    rng = np.random.default_rng(300 + seed)
    ref = rng.standard_normal(int(rng.integers(1, 40)))
    v = float(rng.standard_normal() * 5)
    sigma = sp.median_abs_deviation(ref, scale="normal")
    assert stats.mad_sigma(ref) == pytest.approx(sigma, rel=1e-12, abs=1e-300)
    if sigma > 0:
        assert stats.robust_z(v, ref) == pytest.approx((v - np.median(ref)) / sigma, rel=1e-12)


def test_robust_z_edges():
    assert stats.robust_z(3.0, [1.0, 1.0, 1.0]) == math.inf  # no spread: any difference is infinitely far
    assert stats.robust_z(1.0, [1.0, 1.0, 1.0]) == 0.0
    assert stats.robust_z(3.0, [1.0, 1.0, 1.0], floor=0.5) == 4.0
    # hand-worked: median 2, |dev| = 1,0,1 -> MAD 1 -> sigma 1.4826
    assert stats.robust_z(2 + 2 * stats.MAD_NORMAL, [1, 2, 3]) == pytest.approx(2.0)


def test_finite_drops_missing_and_nonfinite():
    x, y = stats.finite([0, 1, 2, 3, 4], [1.0, None, float("nan"), float("inf"), 2.0])
    assert x.tolist() == [0, 4] and y.tolist() == [1.0, 2.0]
