"""The curve figures' y axis: log scale and the outlier-robust (p1-p99) range, read off the figure dicts."""

from __future__ import annotations

import math

import numpy as np

from grpolens.serve import figures


def quantile_reference(values, q):
    """Linear-interpolation quantile of the sorted values, written out."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    i = math.floor(pos)
    j = min(i + 1, len(v) - 1)
    return v[i] + (pos - i) * (v[j] - v[i])


def line(y, smooth=None, idx=0):
    y = np.asarray(y, dtype=np.float64)
    return {"run": f"r{idx}", "idx": idx, "x": np.arange(len(y)), "y": y, "smooth": smooth}


def kl_with_spike():
    rng = np.random.default_rng(3)
    y = 1e-3 * (1 + 0.2 * rng.standard_normal(400))
    y[200] = 0.6  # one KL spike
    return y


def test_default_axis_is_linear_and_autoranged():
    lay = figures.curve_figure("kl", [line(kl_with_spike())])["layout"]
    assert "type" not in lay["yaxis"] and "range" not in lay["yaxis"]


def test_robust_range_is_p1_to_p99_so_a_spike_does_not_flatten_the_baseline():
    y = kl_with_spike()
    lay = figures.curve_figure("kl", [line(y)], robust_y=True)["layout"]
    lo, hi = quantile_reference(y, 0.01), quantile_reference(y, 0.99)
    pad = 0.05 * (hi - lo)
    np.testing.assert_allclose(lay["yaxis"]["range"], [lo - pad, hi + pad], rtol=1e-12)
    assert lay["yaxis"]["autorange"] is False
    assert lay["yaxis"]["range"][1] < 0.01 < 0.6  # the spike is off the axis, the baseline fills it


def test_robust_range_covers_all_runs_and_uses_the_smoothed_values():
    a, b = np.linspace(1, 2, 101), np.linspace(3, 4, 101)
    smooth = np.linspace(10, 20, 101)
    lay = figures.curve_figure("m", [line(a, idx=0), line(b, smooth=smooth, idx=1)], robust_y=True)["layout"]
    shown = np.concatenate([a, smooth])
    lo, hi = quantile_reference(shown, 0.01), quantile_reference(shown, 0.99)
    pad = 0.05 * (hi - lo)
    np.testing.assert_allclose(lay["yaxis"]["range"], [lo - pad, hi + pad], rtol=1e-12)


def test_robust_range_ignores_non_finite_and_leaves_a_flat_curve_autoranged():
    y = np.array([1.0, np.nan, np.inf, 2.0, 3.0])
    lay = figures.curve_figure("m", [line(y)], robust_y=True)["layout"]
    lo, hi = quantile_reference([1.0, 2.0, 3.0], 0.01), quantile_reference([1.0, 2.0, 3.0], 0.99)
    np.testing.assert_allclose(lay["yaxis"]["range"], [lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)])
    flat = figures.curve_figure("m", [line(np.full(5, 7.0))], robust_y=True)["layout"]
    assert "range" not in flat["yaxis"]


def test_log_y_sets_a_log_axis():
    lay = figures.curve_figure("kl", [line(kl_with_spike())], log_y=True)["layout"]
    assert lay["yaxis"]["type"] == "log"
    assert "not drawn" not in lay["title"]["text"]


def test_log_y_says_how_many_non_positive_values_it_hides():
    lay = figures.curve_figure("adv", [line([-1.0, 0.0, 0.5, 2.0, np.nan])], log_y=True)["layout"]
    assert lay["yaxis"]["type"] == "log"
    assert "2 value(s) ≤ 0 not drawn on log y" in lay["title"]["text"]


def test_log_y_without_a_positive_value_stays_linear():
    lay = figures.curve_figure("loss", [line([-1.0, 0.0, -3.0])], log_y=True)["layout"]
    assert "type" not in lay["yaxis"]
    assert "no positive value: linear y" in lay["title"]["text"]


def test_log_and_robust_range_is_in_decades_of_the_positive_values():
    y = np.concatenate([kl_with_spike(), [0.0, -1.0]])
    lay = figures.curve_figure("kl", [line(y)], log_y=True, robust_y=True)["layout"]
    pos = y[y > 0]
    lo, hi = math.log10(quantile_reference(pos, 0.01)), math.log10(quantile_reference(pos, 0.99))
    pad = 0.05 * (hi - lo)
    assert lay["yaxis"]["type"] == "log"
    np.testing.assert_allclose(lay["yaxis"]["range"], [lo - pad, hi + pad], rtol=1e-12)


def test_switching_the_scale_changes_the_axis_uirevision():
    # a zoom kept across re-renders (uirevision) must not carry over from one scale to another
    revs = {figures.curve_figure("m", [line([1.0, 2.0])], log_y=a, robust_y=b)["layout"]["yaxis"]["uirevision"]
            for a in (False, True) for b in (False, True)}
    assert len(revs) == 4
