"""Robust trend statistics over a metric's per-step series, in one place for every detector.

Each function takes plain float arrays (steps as ``x``, values as ``y``) and ignores nothing: the
caller drops missing and non-finite values first (:func:`finite`). All are exact textbook forms,
tested against scipy in ``tests/doctor/test_stats.py``:

* :func:`theil_sen`: the median of the pairwise slopes (robust to a third of outliers);
* :func:`mann_kendall`: the rank test for a monotone trend (normal approximation with the ties
  correction of the variance, no continuity correction: scipy's ``kendalltau(method="asymptotic")``);
* :func:`cusum_change`: the single change point of the mean that maximises the cumulative sum of
  deviations, with the medians on either side;
* :func:`robust_z`: distance from the median in units of the normal-consistent MAD.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: 1 / Φ⁻¹(3/4): makes the MAD a consistent estimator of a normal distribution's standard deviation
MAD_NORMAL = 1.482602218505602


def finite(x, y) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` as float arrays, keeping the pairs whose value is finite (None -> NaN -> dropped)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray([np.nan if v is None else v for v in y], dtype=np.float64)
    keep = np.isfinite(y) & np.isfinite(x)
    return x[keep], y[keep]


@dataclass(frozen=True)
class Slope:
    slope: float
    intercept: float  # median(y) - slope * median(x), scipy's convention


def theil_sen(x, y) -> Slope:
    """Theil–Sen estimator: the median of ``(y_j - y_i) / (x_j - x_i)`` over pairs with ``x_i != x_j``.
    Needs two distinct ``x``; O(n²) memory (a 1,000-step series is half a million pairs)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    ok = dx != 0
    if not ok.any():
        raise ValueError("theil_sen needs at least two distinct x values")
    slope = float(np.median((y[j] - y[i])[ok] / dx[ok]))
    return Slope(slope, float(np.median(y) - slope * np.median(x)))


@dataclass(frozen=True)
class Trend:
    s: int  # Mann–Kendall S: concordant minus discordant pairs
    var: float  # variance of S under no trend, corrected for ties in y
    z: float
    p: float  # two-sided
    tau: float  # S / (n (n-1) / 2), Kendall's tau-a

    @property
    def direction(self) -> int:
        return int(np.sign(self.s))


def mann_kendall(y) -> Trend:
    """Mann–Kendall test of ``y`` in the order given (time order) for a monotone trend."""
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 3:
        return Trend(0, 0.0, 0.0, 1.0, 0.0)
    i, j = np.triu_indices(n, k=1)
    s = int(np.sign(y[j] - y[i]).sum())
    _, counts = np.unique(y, return_counts=True)
    ties = counts[counts > 1].astype(np.float64)
    var = (n * (n - 1) * (2 * n + 5) - float((ties * (ties - 1) * (2 * ties + 5)).sum())) / 18.0
    z = s / math.sqrt(var) if var > 0 else 0.0
    return Trend(s, var, z, math.erfc(abs(z) / math.sqrt(2.0)), s / (n * (n - 1) / 2))


@dataclass(frozen=True)
class Change:
    index: int  # first index of the second segment
    before: float  # median of y[:index]
    after: float  # median of y[index:]
    strength: float  # max |S_k| / (n · MAD-σ of y): how far the cumulative sum wanders


def cusum_change(y, min_size: int = 2) -> Change | None:
    """The change point of the mean: ``S_k = Σ_{i<k} (y_i − ȳ)`` and ``k* = argmax |S_k|`` over
    splits leaving ``min_size`` values on each side (the first such maximum). None when the
    series is too short for two segments."""
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 2 * min_size:
        return None
    s = np.concatenate([[0.0], np.cumsum(y - y.mean())])  # s[k] = sum of the first k deviations
    ks = np.arange(min_size, n - min_size + 1)
    k = int(ks[np.argmax(np.abs(s[ks]))])
    sigma = mad_sigma(y)
    strength = float(abs(s[k]) / (n * sigma)) if sigma > 0 else math.inf if s[k] != 0 else 0.0
    return Change(k, float(np.median(y[:k])), float(np.median(y[k:])), strength)


def mad_sigma(y) -> float:
    """Median absolute deviation from the median, scaled to a normal standard deviation."""
    y = np.asarray(y, dtype=np.float64)
    return float(MAD_NORMAL * np.median(np.abs(y - np.median(y)))) if len(y) else 0.0


def robust_z(value: float, reference, floor: float = 0.0) -> float:
    """``(value − median(reference)) / max(MAD-σ(reference), floor)``; ±inf when both are 0 and
    the value differs, 0 when it does not."""
    ref = np.asarray(reference, dtype=np.float64)
    center, scale = float(np.median(ref)), max(mad_sigma(ref), floor)
    d = value - center
    if scale > 0:
        return d / scale
    return 0.0 if d == 0 else math.copysign(math.inf, d)
