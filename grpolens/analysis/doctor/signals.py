"""Shapes the detectors look for in a per-step series, built on :mod:`grpolens.analysis.doctor.stats`:
a persistent level shift (CUSUM change point, held afterwards), a monotone trend (Mann–Kendall
with a Theil–Sen slope) and the series' early and late levels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grpolens.analysis.doctor import stats

#: a trend counts when Mann–Kendall's two-sided p-value is below this
TREND_ALPHA = 0.01
#: a change point is moved to the first value this many robust standard deviations beyond the earlier level
BAND = 3.0
#: sharpness compares the medians of this many values on each side of the onset with the two levels
SHARP_WINDOW = 5
#: a shift is held when this share of the values after it lie beyond the midpoint of the two levels
HELD = 0.8


@dataclass(frozen=True)
class Shift:
    onset: int  # the first step of the new level
    before: float  # median level before
    after: float  # median level from the onset on
    held: float  # share of the later values beyond the midpoint
    sharpness: float  # how much of the move happens across the onset: 1 for a step, near 0 for a slow trend

    @property
    def ratio(self) -> float:
        return self.after / self.before if self.before > 0 else float("inf")


def shift(x: np.ndarray, y: np.ndarray, *, up: bool = True, log: bool = False, min_size: int = 2) -> Shift | None:
    """The change point of ``y`` (of ``log y`` with ``log``, for quantities spanning decades) when
    the level moves in the direction asked (``up``) and stays there; None otherwise."""
    t = np.log(np.maximum(y, 1e-12)) if log else y
    ch = stats.cusum_change(t, min_size=min_size)
    if ch is None:
        return None
    k = _refine(t, ch.index, 1 if up else -1, min_size)
    before, after = float(np.median(y[:k])), float(np.median(y[k:]))
    if (after <= before) if up else (after >= before):
        return None
    mid = (before + after) / 2
    later = y[k:]
    held = float(np.mean(later > mid) if up else np.mean(later < mid))
    if held < HELD:
        return None
    w = min(SHARP_WINDOW, k, len(y) - k)
    sharp = (float(np.median(y[k:k + w])) - float(np.median(y[k - w:k]))) / (after - before)
    return Shift(int(x[k]), before, after, held, sharp)


def _refine(t: np.ndarray, k: int, direction: int, min_size: int) -> int:
    """CUSUM puts the split of a ramp, or of a series that was already trending, a few steps off.
    Forwards: past values not beyond the midpoint of the two levels (they belong to the old one).
    Backwards: onto the values, contiguous up to the split, that lie more than :data:`BAND` robust
    standard deviations of the earlier values beyond their median (the start of a ramp)."""
    n = len(t)
    mid = (float(np.median(t[:k])) + float(np.median(t[k:]))) / 2
    while k < n - min_size and (t[k] - mid) * direction <= 0:
        k += 1
    center, sigma = float(np.median(t[:k])), stats.mad_sigma(t[:k])
    beyond = (t - center) * direction > BAND * sigma
    while k - 1 >= min_size and beyond[k - 1]:
        k -= 1
    return k


@dataclass(frozen=True)
class Drift:
    trend: stats.Trend
    slope: stats.Slope  # per step
    early: float  # median of the first fifth (at least 3 values)
    late: float  # median of the last fifth

    def significant(self, direction: int, alpha: float = TREND_ALPHA) -> bool:
        return self.trend.p < alpha and self.trend.direction == direction


def drift(x: np.ndarray, y: np.ndarray) -> Drift:
    k = max(3, len(y) // 5)
    return Drift(stats.mann_kendall(y), stats.theil_sen(x, y), float(np.median(y[:k])), float(np.median(y[-k:])))


def steps_from(x: np.ndarray, onset: int) -> list[int]:
    return [int(s) for s in x if s >= onset]
