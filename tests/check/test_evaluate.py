"""The rule engine on hand-made per-step series: reducers, windows, tolerances, directions, allowed
failing fractions, early bounds, missing metrics, short candidates and steps without data.

Expected verdicts come from a plain-Python reference written here from the rule definitions
(|x − b| ≤ abs + rel·|b|, one-sided by direction), not from the engine."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from grpolens.check.evaluate import ERROR, FAIL, NO_DATA, PASS, SKIP, Series, evaluate
from grpolens.check.rules import Early, Rule, Window, reduce_values


def series(values, steps=None) -> Series:
    steps = list(range(len(values))) if steps is None else steps
    return Series(np.array(steps, np.int64), np.array(values, np.float64))


def rule(**kw) -> Rule:
    kw.setdefault("name", "r")
    kw.setdefault("metric", "m")
    return Rule(**kw)


# -- reducers --------------------------------------------------------------------------------

@pytest.mark.parametrize("reducer,expected", [
    ("last", 2.0), ("mean", 3.25), ("median", 2.5), ("min", 1.0), ("max", 7.0),
    ("p50", 2.5), ("p0", 1.0), ("p100", 7.0),
    ("p25", 1.75),  # sorted 1,2,3,7: rank 0.75 -> 1 + 0.75*(2-1)
    ("p90", 5.8),  # rank 2.7 -> 3 + 0.7*(7-3)
    ("p99.5", 6.94),  # rank 2.985 -> 3 + 0.985*4
])
def test_reducers_by_hand(reducer, expected):
    assert reduce_values(reducer, np.array([1.0, 3.0, 7.0, 2.0])) == pytest.approx(expected)


@pytest.mark.parametrize("reducer", ["last", "mean", "median", "min", "max", "p95"])
def test_reducers_propagate_nan(reducer):
    v = np.array([1.0, np.nan, 2.0]) if reducer != "last" else np.array([1.0, np.nan])
    assert math.isnan(reduce_values(reducer, v))


@pytest.mark.parametrize("reducer", ["last", "mean", "median", "min", "max", "p95"])
def test_reducers_of_no_value_are_nan(reducer):
    """An empty window reduces to NaN, which fails any bound, rather than raising (numpy's min of
    nothing) or warning (its mean of nothing)."""
    assert math.isnan(reduce_values(reducer, np.array([], np.float64)))

def test_reduced_rule_uses_the_reduced_value():
    s = {"m": series([0.1, 0.2, 0.9, 0.2])}
    assert evaluate(rule(reduce="mean", max=0.36), s, None).status == PASS  # mean 0.35
    o = evaluate(rule(reduce="mean", max=0.34), s, None)
    assert o.status == FAIL and o.value == pytest.approx(0.35)
    assert o.step == 2  # the first step whose own value is beyond the limit
    assert evaluate(rule(reduce="median", max=0.2), s, None).status == PASS
    assert evaluate(rule(reduce="max", max=0.8), s, None).status == FAIL
    assert evaluate(rule(reduce="min", min=0.1), s, None).status == PASS
    assert evaluate(rule(reduce="last", max=0.19), s, None).status == FAIL


# -- windows ---------------------------------------------------------------------------------

@pytest.mark.parametrize("window,expected", [
    (Window(), [0, 10, 20, 30, 40]),
    (Window(start=10), [10, 20, 30, 40]),
    (Window(start=10, end=30), [10, 20, 30]),
    (Window(end=-2), [0, 10, 20, 30]),  # -1 is the last step, -2 the one before
    (Window(start=-2), [30, 40]),
    (Window(start=-9), [0, 10, 20, 30, 40]),  # before the first: from the start
    (Window(last=2), [30, 40]),
    (Window(last=99), [0, 10, 20, 30, 40]),
    (Window(start=11, end=19), []),
    (Window(start=0, end=0), [0]),  # step 0 is a step number, not "from the end"
    (Window(end=-5), [0]),  # -5 of 5 steps: the first
    (Window(end=-6), []),  # before the first step
])
def test_window_selection(window, expected):
    assert window.select([40, 0, 20, 10, 30]) == expected


def test_window_restricts_what_is_judged():
    s = {"m": series([5.0, 0.1, 0.1, 0.1])}  # warm-up spike at step 0
    assert evaluate(rule(max=1.0), s, None).status == FAIL
    assert evaluate(rule(max=1.0, window=Window(start=1)), s, None).status == PASS
    assert evaluate(rule(max=1.0, window=Window(last=3)), s, None).status == PASS
    empty = evaluate(rule(max=1.0, window=Window(start=50)), s, None)
    assert empty.status == FAIL and "selects no step" in empty.message


# -- tolerances and direction against a baseline ---------------------------------------------

def reference_step_ok(x, b, abs_, rel, direction):
    tol = abs_ + rel * abs(b)
    if direction == "upper":
        return x - b <= tol
    if direction == "lower":
        return b - x <= tol
    return abs(x - b) <= tol


@pytest.mark.parametrize("direction", ["upper", "lower", "both"])
@pytest.mark.parametrize("abs_,rel", [(0.05, 0.0), (0.0, 0.1), (0.02, 0.05)])
def test_per_step_tolerance_matches_reference(direction, abs_, rel):
    rng = np.random.default_rng(7)
    b = rng.normal(0, 1, 200)
    x = b + rng.normal(0, 0.08, 200)
    r = rule(abs=abs_, rel=rel, direction=direction, allow_fail_fraction=0.99)
    o = evaluate(r, {"m": series(x)}, {"m": series(b)})
    bad = [i for i in range(200) if not reference_step_ok(x[i], b[i], abs_, rel, direction)]
    assert o.failing == len(bad) and 0 < len(bad) < 200
    r0 = rule(abs=abs_, rel=rel, direction=direction)
    o0 = evaluate(r0, {"m": series(x)}, {"m": series(b)})
    assert o0.status == FAIL and o0.step == bad[0]
    assert o0.value == x[bad[0]] and o0.baseline == b[bad[0]]


@pytest.mark.parametrize("direction,x,ok", [
    ("upper", 1.30, False), ("upper", 0.50, True),
    ("lower", 1.30, True), ("lower", 0.50, False),
    ("both", 1.30, False), ("both", 0.50, False), ("both", 1.09, True),
])
def test_direction_is_one_sided(direction, x, ok):
    # baseline 1.0, tolerance 0.01 + 0.1*1.0 = 0.11
    o = evaluate(rule(abs=0.01, rel=0.1, direction=direction, reduce="last"),
                 {"m": series([0.0, x])}, {"m": series([0.0, 1.0])})
    assert (o.status == PASS) is ok
    assert o.baseline == 1.0


def test_reduced_comparison_compares_reduced_values():
    x, b = [1.0, 1.0, 4.0], [1.0, 1.0, 1.0]
    # mean 2.0 vs 1.0: rel 0.5 gives limit 1.5 -> fail; median 1.0 passes
    assert evaluate(rule(reduce="mean", rel=0.5, direction="upper"), {"m": series(x)}, {"m": series(b)}).status == FAIL
    assert evaluate(rule(reduce="median", rel=0.5, direction="upper"), {"m": series(x)}, {"m": series(b)}).status == PASS
    o = evaluate(rule(reduce="p50", abs=0.0), {"m": series(x)}, {"m": series(b)})
    assert o.status == PASS and o.upper == 1.0 and o.lower == 1.0


def test_tolerance_boundary_is_inclusive():
    # |x - b| == abs + rel*|b| exactly (values exact in binary)
    o = evaluate(rule(abs=0.25, rel=0.5, reduce="last"), {"m": series([3.25])}, {"m": series([2.0])})
    assert o.status == PASS and o.excess == 0.0 and o.upper == 3.25


# -- allowed fraction of failing steps -------------------------------------------------------

@pytest.mark.parametrize("allow,status", [(0.0, FAIL), (0.09, FAIL), (0.1, PASS), (0.5, PASS)])
def test_allowed_failing_fraction(allow, status):
    x = [0.0] * 20
    x[3] = x[11] = 1.0  # 2/20 = 10 % fail
    o = evaluate(rule(max=0.5, allow_fail_fraction=allow), {"m": series(x)}, None)
    assert o.status == status and o.failing == 2 and o.checked == 20
    assert o.step == 3
    pct = f"{allow:.0%}"
    assert o.message == {
        (0.0, FAIL): "2/20 step(s) outside the limit; first at step 3",
        (0.09, FAIL): f"2/20 step(s) outside the limit, {pct} allowed; first at step 3",
    }.get((allow, status), f"2/20 step(s) outside the limit, within the {pct} allowed")


# -- absolute and early bounds ---------------------------------------------------------------

def test_min_max_finite():
    s = {"m": series([0.2, 0.3, 0.4])}
    assert evaluate(rule(min=0.2, max=0.4), s, None).status == PASS
    assert evaluate(rule(min=0.25), s, None).step == 0
    assert evaluate(rule(max=0.35), s, None).step == 2
    inf = {"m": series([0.2, np.inf, 0.4])}
    assert evaluate(rule(finite=True), inf, None).status == FAIL
    assert evaluate(rule(finite=True), inf, None).step == 1
    assert evaluate(rule(min=0.0), inf, None).status == PASS  # +inf is above a lower bound
    nan = {"m": series([0.2, np.nan, 0.4])}
    assert evaluate(rule(min=0.0), nan, None).status == FAIL  # NaN never passes a bound


def test_early_bounds_by_hand():
    vals = [1.0, 3.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 25.0]  # first 20 % = steps 0, 1: median 2
    up = rule(direction="upper", early=Early(factor=10.0, abs=1.0))  # limit 10*2 + 1 = 21
    o = evaluate(up, {"m": series(vals)}, None)
    assert o.status == FAIL and o.step == 9 and o.upper == pytest.approx(21.0)
    assert evaluate(rule(direction="upper", early=Early(factor=10.0, abs=5.0)), {"m": series(vals)}, None).status == PASS
    low = rule(direction="lower", early=Early(factor=4.0, steps=3))  # median(1,3,2)=2 -> limit 0.5
    vals2 = [1.0, 3.0, 2.0, 0.6, 0.4]
    o2 = evaluate(low, {"m": series(vals2)}, None)
    assert o2.status == FAIL and o2.step == 4 and o2.lower == pytest.approx(0.5)


def test_early_bound_is_sign_safe():
    # a metric centred below zero: the upper bound must be above the early median, not below it
    lo, hi = Early(factor=3.0, abs=0.1).bounds(-2.0)
    assert hi == pytest.approx(-2.0 + 2 * 2.0 + 0.1) and lo == pytest.approx(-2.0 - (2 / 3) * 2.0 - 0.1)
    assert lo < -2.0 < hi


def test_early_without_finite_reference_fails_clearly():
    o = evaluate(rule(direction="upper", early=Early(factor=2.0, steps=2)), {"m": series([np.nan, np.nan, 1.0])}, None)
    assert o.status == FAIL and "early reference" in o.message


# -- missing data, short candidates, baselines without the metric ------------------------------

def test_missing_metric_fails_or_skips():
    assert evaluate(rule(max=1.0), {}, None).status == FAIL
    assert evaluate(rule(max=1.0, missing="skip"), {}, None).status == SKIP
    assert evaluate(rule(max=1.0), {"m": series([])}, None).status == FAIL
    # the baseline has it, the candidate does not: always a failure, even for skip rules
    o = evaluate(rule(max=1.0, rel=0.1, missing="skip"), {}, {"m": series([1.0, 1.0])})
    assert o.status == FAIL and "no values in this run" in o.message
    # neither run has it: the rule's missing policy decides
    assert evaluate(rule(rel=0.1, missing="skip"), {}, {"x": series([1.0])}).status == SKIP
    assert evaluate(rule(rel=0.1), {}, {"x": series([1.0])}).status == FAIL


def test_short_candidate_fails_at_first_missing_step():
    o = evaluate(rule(abs=0.1), {"m": series([1.0] * 6)}, {"m": series([1.0] * 10)})
    assert o.status == FAIL and o.step == 6 and "lacks 4" in o.message
    # a window that only covers what both have passes
    assert evaluate(rule(abs=0.1, window=Window(end=5)), {"m": series([1.0] * 6)}, {"m": series([1.0] * 10)}).status == PASS


def test_candidate_longer_than_baseline_compares_common_steps():
    o = evaluate(rule(abs=0.1), {"m": series([1.0] * 10 + [9.0])}, {"m": series([1.0] * 10)})
    assert o.status == PASS and o.checked == 10


def test_baseline_without_the_metric_is_an_error_or_ignored():
    c = {"m": series([1.0, 2.0])}
    assert evaluate(rule(abs=0.1), c, {"other": series([1.0])}).status == ERROR
    o = evaluate(rule(abs=0.1, max=5.0, missing="skip"), c, {"other": series([1.0])})
    assert o.status == PASS and "baseline has no values" in o.message


def test_baseline_rule_without_baseline_skips():
    assert evaluate(rule(abs=0.1), {"m": series([1.0])}, None).status == SKIP
    assert evaluate(rule(abs=0.1, max=0.5), {"m": series([1.0])}, None).status == FAIL  # absolute part still runs


def test_steps_align_by_number_not_position():
    c = {"m": series([1.0, 1.0, 5.0], steps=[0, 10, 20])}
    b = {"m": series([1.0, 5.0, 2.0, 5.0], steps=[0, 5, 10, 20])}
    o = evaluate(rule(abs=0.1), c, b)
    assert o.status == FAIL and o.step == 5 and "lacks 1" in o.message
    o2 = evaluate(rule(abs=0.1, window=Window(start=10)), c, b)  # steps 10 (1 vs 2) and 20 (5 vs 5)
    assert o2.status == FAIL and o2.step == 10 and o2.failing == 1 and o2.checked == 2


def test_series_from_frame_drops_nulls_keeps_nan():
    df = pl.DataFrame({"step": [2, 0, 1, 3], "m": [1.0, None, float("nan"), 4.0]})
    s = Series.from_frame(df, "m")
    assert s.steps.tolist() == [1, 2, 3] and math.isnan(s.values[0]) and s.values[1:].tolist() == [1.0, 4.0]


# -- steps without data (every token masked: token metrics are null there) ----------------------

# Step 3 has no data: the series lacks it, as Series.from_frame drops its null.
NO_DATA_SERIES = {"m": series([1.0, 1.0, 1.0, 1.0, 1.0], steps=[0, 1, 2, 4, 5])}
ALL_STEPS = list(range(6))


@pytest.mark.parametrize("reducer", ["all", "max", "mean", "last", "p95"])
@pytest.mark.parametrize("checks", [{"max": 2.0}, {"finite": True}, {"min": 0.0, "max": 2.0}])
def test_a_step_without_data_is_no_data_not_a_pass(reducer, checks):
    o = evaluate(rule(reduce=reducer, **checks), NO_DATA_SERIES, None, [3], ALL_STEPS)
    assert o.status == NO_DATA and o.failed and o.step == 3 and o.failing == 1 and o.checked == 6
    assert "no data at step 3" in o.message and "no token counts in the loss" in o.message
    # without the information (what a caller that does not know the empty steps sees): a pass on the rest
    assert evaluate(rule(reduce=reducer, **checks), NO_DATA_SERIES, None).status == PASS


def test_allowed_no_data_judges_the_other_steps():
    r = rule(max=2.0, no_data="allow")
    o = evaluate(r, NO_DATA_SERIES, None, [3], ALL_STEPS)
    assert o.status == PASS and o.checked == 5 and "1 step(s) without data left out (first: step 3)" in o.message
    bad = {"m": series([1.0, 1.0, 1.0, 9.0, 1.0], steps=[0, 1, 2, 4, 5])}
    o = evaluate(r, bad, None, [3], ALL_STEPS)
    assert o.status == FAIL and o.step == 4
    # a window of nothing but empty steps has nothing to judge
    o = evaluate(rule(max=2.0, no_data="allow", window=Window(start=3, end=3)), NO_DATA_SERIES, None, [3], ALL_STEPS)
    assert o.status == SKIP and "no data in window" in o.message


def test_no_data_outside_the_window_does_not_count():
    o = evaluate(rule(max=2.0, window=Window(start=4)), NO_DATA_SERIES, None, [3], ALL_STEPS)
    assert o.status == PASS and o.checked == 2
    # the window counts the empty step as a step: "last 3" is steps 3, 4, 5
    o = evaluate(rule(max=2.0, window=Window(last=3)), NO_DATA_SERIES, None, [3], ALL_STEPS)
    assert o.status == NO_DATA and o.checked == 3


def test_no_data_against_a_baseline_is_no_data_not_a_short_run():
    base = {"m": series([1.0] * 6)}
    o = evaluate(rule(abs=0.1), NO_DATA_SERIES, base, [3], ALL_STEPS)
    assert o.status == NO_DATA and o.step == 3


def test_a_run_with_no_data_at_all_fails_where_the_metric_is_absent():
    # every step empty: the metric has no value anywhere, which is not "the run cannot have it"
    o = evaluate(rule(max=1.0, missing="skip"), {"m": series([])}, None, [0, 1], [0, 1])
    assert o.status == NO_DATA and o.failing == 2 and "2 step(s), first 0" in o.message
    assert evaluate(rule(max=1.0, missing="skip", no_data="allow"), {}, None, [0, 1], [0, 1]).status == SKIP
    # some steps have data and the metric still has no value: the run cannot have it (no ref_logp...)
    assert evaluate(rule(max=1.0, missing="skip"), {}, None, [1], [0, 1]).status == SKIP
    assert evaluate(rule(max=1.0), {}, None, [1], [0, 1]).status == FAIL


def test_pattern_rules_report_no_data_of_matched_metrics():
    cand = {"a/x": NO_DATA_SERIES["m"], "a/y": series([0.0] * 6), "a/never": series([])}
    o = evaluate(rule(metric="a/*", finite=True), cand, None, [3], ALL_STEPS)
    assert o.status == NO_DATA and o.metric == "a/x" and "1 of 2 matched metrics fail" in o.message


def test_early_reference_is_the_first_fraction_rounded_up_at_least_one_step():
    # 20 % of 5 steps is 1 step, of 6 steps 1.2 -> 2, of 2 steps 0.4 -> 1; `steps` overrides the fraction
    assert Early(factor=2.0).reference_steps([4, 3, 2, 1, 0]) == [0]
    assert Early(factor=2.0).reference_steps(range(6)) == [0, 1]
    assert Early(factor=2.0).reference_steps([7, 9]) == [7]
    assert Early(factor=2.0, steps=3).reference_steps(range(10)) == [0, 1, 2]
    # the rule: median(step 0) = 1 -> upper limit 2·1 = 2, which step 1's 9 exceeds (the median of
    # two steps, 5, or of every step, 9, would let it pass)
    o = evaluate(rule(direction="upper", early=Early(factor=2.0)), {"m": series([1.0, 9.0, 9.0, 9.0, 9.0])}, None)
    assert o.status == FAIL and o.step == 1 and o.upper == 2.0

# -- pattern rules: which metrics they judge, and which outcome speaks for them -----------------

def test_a_passing_pattern_reports_the_pattern_as_a_whole():
    r = rule(metric="g/*", max=1.0)
    o = evaluate(r, {"g/a": series([0.1, 0.2]), "g/b": series([0.3, 0.4, 0.5]), "h": series([9.0])}, None)
    assert (o.rule, o.status, o.metric, o.checked) == (r, PASS, "g/*", 5)
    assert o.message == "2 matched metric(s) pass"
    # a rule naming one metric reports that metric
    assert evaluate(rule(max=1.0), {"m": series([0.5])}, None).metric == "m"


def test_a_pattern_matching_nothing_fails_unless_missing_is_skip():
    cand = {"h": series([1.0])}
    r = rule(metric="g/*", max=1.0)
    o = evaluate(r, cand, None)
    assert (o.rule, o.status, o.metric) == (r, FAIL, "g/*")
    assert o.message == "no metric matching 'g/*' has values in this run"
    assert evaluate(rule(metric="g/*", max=1.0, missing="skip"), cand, None).status == SKIP


def test_among_failing_metrics_the_earliest_first_failure_speaks():
    cand = {"g/a": series([0.0, 0.0, 0.0, 5.0]), "g/b": series([0.0, 5.0, 0.0, 0.0]), "g/c": series([0.0] * 4)}
    o = evaluate(rule(metric="g/*", max=1.0), cand, None)
    assert (o.status, o.metric, o.step) == (FAIL, "g/b", 1)
    assert o.message == "1/4 step(s) outside the limit; first at step 1 [2 of 3 matched metrics fail: g/a, g/b]"
    # a failure without a step (no value in this run, the baseline has it but the rule does not
    # compare) ranks after one that names its step
    o = evaluate(rule(metric="g/*", max=1.0), {"g/a": series([0.0, 0.0, 5.0]), "g/z": series([])},
                 {"g/z": series([1.0])})
    assert (o.status, o.metric, o.step) == (FAIL, "g/a", 2)


@pytest.mark.parametrize("n_bad,listed", [
    (5, "g/0, g/1, g/2, g/3, g/4]"),
    (6, "g/0, g/1, g/2, g/3, g/4, ...]"),
])
def test_a_failing_pattern_lists_at_most_five_failing_metrics(n_bad, listed):
    cand = {f"g/{i}": series([5.0 if i < n_bad else 0.0]) for i in range(7)}
    o = evaluate(rule(metric="g/*", max=1.0), cand, None)
    assert o.message == f"1/1 step(s) outside the limit; first at step 0 [{n_bad} of 7 matched metrics fail: {listed}"


def test_a_pattern_against_a_baseline_compares_each_metric_and_sees_the_baselines_metrics():
    same = series([1.0, 1.0, 1.0])
    cand, base = {"g/a": same, "g/b": same}, {"g/a": same, "g/b": same}
    r = rule(metric="g/*", abs=0.1)
    o = evaluate(r, cand, base)
    assert (o.status, o.checked) == (PASS, 6)
    assert evaluate(r, {"g/a": same, "g/b": series([1.0, 1.5, 1.0])}, base).metric == "g/b"
    # a metric only the baseline has: this run lost it, a failure
    o = evaluate(r, cand, {**base, "g/c": series([1.0, 1.0])})
    assert (o.status, o.metric, o.step) == (FAIL, "g/c", 0)
    assert o.message.startswith("g/c has no values in this run, the baseline has 2 step(s)")
    # a metric only this run has: the baseline cannot judge it, an error
    o = evaluate(r, {**cand, "g/d": same}, base)
    assert (o.status, o.metric, o.step) == (ERROR, "g/d", None)
    # without a baseline, a comparing pattern rule is skipped
    assert evaluate(r, cand, None).status == SKIP


# -- what the limit and margin columns say ---------------------------------------------------

@pytest.mark.parametrize("lower,upper,finite,text", [
    (0.5, 2.0, False, "[0.5, 2]"),
    (-np.inf, 2.5, True, "≤ 2.5"),
    (0.25, np.inf, False, "≥ 0.25"),
    (-np.inf, np.inf, True, "finite"),
    (-np.inf, np.inf, False, "—"),
])
def test_limit_text_names_the_bounds_that_apply(lower, upper, finite, text):
    from grpolens.check.evaluate import Outcome

    assert Outcome(rule(finite=finite), PASS, "m", value=1.0, lower=lower, upper=upper).limit_text() == text


@pytest.mark.parametrize("value,lower,upper,text", [
    (12.5, 1.0, 10.0, "above by 2.5 (25%)"),  # 2.5 past the upper bound 10
    (10.5, 1.0, 10.0, "above by 0.5 (5%)"),
    (3.0, 4.0, 10.0, "below by 1 (25%)"),
    (5.0, 4.0, 10.0, "headroom 1 (25%)"),  # nearer the lower bound: 1 of 4
    (8.0, 1.0, 10.0, "headroom 2 (20%)"),  # nearer the upper bound: 2 of 10
    (2.0, 1.0, 3.0, "headroom 1 (33%)"),  # as near one as the other: the upper one
    (2.0, -np.inf, 2.0, "headroom 0 (0%)"),  # exactly on the bound
    (-0.5, -np.inf, 0.0, "headroom 0.5"),  # no percentage of a zero bound
    (1.0, 4.9, 1.0, "below by 3.9 (80%)"),  # bounds crossed (max 1, baseline 5 ± 0.1): 3.9 of 4.9
    (1.0, -np.inf, np.inf, ""),  # no bound (a "finite" rule): nothing to measure
    (np.nan, 0.0, 1.0, "not finite"),
    (np.inf, -np.inf, np.inf, "not finite"),
    (None, 0.0, 1.0, ""),
])
def test_margin_text_says_how_far_past_or_inside_the_nearest_bound(value, lower, upper, text):
    from grpolens.check.evaluate import Outcome

    assert Outcome(rule(max=1.0), PASS, "m", value=value, lower=lower, upper=upper).margin_text() == text


def test_series_from_pairs_drops_missing_values_and_sorts_by_step():
    s = Series.from_pairs({3: 0.5, 1: None, 0: 2.0, 2: float("nan")})
    assert s.steps.dtype == np.int64 and s.values.dtype == np.float64
    assert s.steps.tolist() == [0, 2, 3] and s.values[0] == 2.0 and math.isnan(s.values[1]) and s.values[2] == 0.5


def test_steps_read_from_a_frame_are_shown_as_integers():
    s = Series.from_frame(pl.DataFrame({"step": [0, 1, 3], "m": [1.0, 1.0, 1.0]}), "m")
    o = evaluate(rule(max=2.0, window=Window(start=5)), {"m": s}, None)
    assert o.message == "window steps 5: selects no step of 0..3"


# -- the messages of the outcomes that are not a verdict on values -----------------------------

def test_messages_of_rules_that_could_not_judge_say_why():
    c = {"m": series([1.0, 2.0])}
    assert evaluate(rule(abs=0.1), c, None).message == "compares against a baseline; none given"
    o = evaluate(rule(abs=0.1), c, {"other": series([1.0])})
    assert o.message == "the baseline has no values for m (write the golden with these rules, or drop the rule)"
    o = evaluate(rule(abs=0.1, max=5.0, missing="skip"), c, {"other": series([1.0])})
    assert o.message == "2 step(s) within the limit (the baseline has no values for this metric: compared without it)"
    assert evaluate(rule(max=1.0), {}, None).message == "m has no values in this run"
    o = evaluate(rule(abs=0.1), {}, {"m": series([1.0, 1.0], steps=[4, 7])})
    assert (o.status, o.step) == (FAIL, 4)
    assert o.message == "m has no values in this run, the baseline has 2 step(s)"


def test_an_outcome_with_two_notes_gives_both_in_order():
    """A baseline without the metric (missing = "skip": compared without it) and a step without data
    (no_data = "allow": left out): both notes, in that order, in one pair of parentheses."""
    c = {"m": series([0.1, 0.2, 0.3], steps=[0, 1, 3])}
    o = evaluate(rule(abs=0.1, max=1.0, missing="skip", no_data="allow"), c, {"other": series([1.0])}, [2], [0, 1, 2, 3])
    assert (o.status, o.checked, o.baseline) == (PASS, 3, None)
    assert o.message == ("3 step(s) within the limit (the baseline has no values for this metric: compared without it; "
                         "1 step(s) without data left out (first: step 2))")


def test_short_candidate_message_names_the_first_missing_and_the_last_present_step():
    o = evaluate(rule(abs=0.1), {"m": series([1.0] * 6)}, {"m": series([1.0] * 10)})
    assert o.message == ("this run lacks 4 of the 10 step(s) the baseline has in window all steps "
                         "(first missing: step 6; this run's last step: 5)")


def test_early_reference_without_a_finite_value_names_its_steps():
    o = evaluate(rule(direction="upper", early=Early(factor=2.0, steps=3)),
                 {"m": series([np.nan, np.inf, np.nan, 1.0])}, None)
    assert (o.status, o.step) == (FAIL, 0)
    assert o.message == "no finite value in the early reference steps 0..2"


def test_a_run_without_data_at_all_is_no_data_even_against_a_baseline_that_has_the_metric():
    # the rule does not compare, so the baseline's values do not stand in for this run's
    o = evaluate(rule(max=1.0), {}, {"m": series([1.0, 1.0])}, [0, 1], [0, 1])
    assert (o.status, o.step, o.failing, o.checked) == (NO_DATA, 0, 2, 2)
    assert o.message.startswith("no data at 2 step(s), first 0 (2 of 2 in all steps)")


def test_early_bounds_in_both_directions():
    # early median 2: factor 10, abs 1 -> upper 2 + 9·2 + 1 = 21; factor 4 -> lower 2 - (3/4)·2 = 0.5
    up = evaluate(rule(direction="both", early=Early(factor=10.0, abs=1.0)), {"m": series([2.0] * 9 + [25.0])}, None)
    assert (up.status, up.step, up.upper) == (FAIL, 9, pytest.approx(21.0))
    low = evaluate(rule(direction="both", early=Early(factor=4.0, steps=2)), {"m": series([2.0, 2.0, 2.0, 0.4])}, None)
    assert (low.status, low.step, low.lower, low.upper) == (FAIL, 3, pytest.approx(0.5), pytest.approx(8.0))


def test_isolated_steps_outside_a_sustained_rule_are_counted_in_its_message():
    from grpolens.check.rules import Sustained

    # one step of 6 outside (0.15 > 0.05), no window of 4 holds 2: not counted, but said
    o = evaluate(rule(max=0.05, sustained=Sustained(count=2, window=4)), {"m": series([0, 0.15, 0, 0, 0, 0])}, None)
    assert (o.status, o.failing, o.checked) == (PASS, 0, 6)
    assert o.message == ("6 step(s) within the limit (1 isolated step(s) outside the limit not counted: "
                         "sustained: 2 of 4 consecutive steps)")


def test_a_sustained_rule_counts_its_streak_and_names_the_isolated_steps_apart():
    from grpolens.check.rules import Sustained

    # steps 0 and 1 outside (a streak: 2 in the window of steps 0..3), step 6 alone (no window of 4
    # around it holds a second one): 2 counted, 1 isolated, 3 outside in all
    x = [0.15, 0.15, 0, 0, 0, 0, 0.15, 0]
    o = evaluate(rule(max=0.05, sustained=Sustained(count=2, window=4)), {"m": series(x)}, None)
    assert (o.status, o.failing, o.checked, o.step) == (FAIL, 2, 8, 0)
    assert o.message == ("2/8 step(s) outside the limit; first at step 0 (1 isolated step(s) outside the limit "
                         "not counted: sustained: 2 of 4 consecutive steps)")


@pytest.mark.parametrize("x,step", [
    ([0.5, 0.05, 0.9], 1),  # 0.05 above the lower bound 0: the nearest of all to a bound
    ([0.5, 0.97, 0.1], 1),  # 0.03 below the upper bound 1 (step 2 is 0.1 above the lower one)
    ([0.2, 0.5, 0.99], 2),
])
def test_a_passing_rule_shows_the_step_closest_to_either_bound(x, step):
    o = evaluate(rule(min=0.0, max=1.0), {"m": series(x)}, None)
    assert (o.status, o.failing) == (PASS, 0)
    assert (o.step, o.value, o.lower, o.upper) == (step, x[step], 0.0, 1.0)
    # one-sided: the distance to the bound that exists
    assert evaluate(rule(min=0.0), {"m": series([0.5, 0.05, 0.9])}, None).step == 1
    assert evaluate(rule(max=1.0), {"m": series([0.5, 0.97, 0.1])}, None).step == 1


def test_a_reduced_rule_names_the_first_step_beyond_its_bound():
    inf = math.inf
    # mean 0.8333 < 1: fails once (one reduced value), pointing at the first step below 1, not at
    # step 0, which sits exactly on the bound
    o = evaluate(rule(reduce="mean", min=1.0), {"m": series([1.0, 0.5, 1.0])}, None)
    assert (o.status, o.failing, o.checked, o.step) == (FAIL, 1, 3, 1)
    assert o.message == "mean over all steps (3 step(s)) is outside the limit; first step beyond it: 1"
    o = evaluate(rule(reduce="mean", max=1.0), {"m": series([1.0, 1.5])}, None)
    assert (o.status, o.step) == (FAIL, 1)
    # finite = true: the first non-finite step; without it +inf is inside an unbounded rule
    o = evaluate(rule(reduce="max", finite=True), {"m": series([1.0, inf, 2.0])}, None)
    assert (o.status, o.step) == (FAIL, 1)
    o = evaluate(rule(reduce="max"), {"m": series([1.0, inf, 2.0])}, None)
    assert (o.status, o.value, o.message) == (PASS, inf, "max over all steps (3 step(s))")
    # the mean of +inf and -inf is NaN, which no bound passes, while every step is inside: the
    # window's last step is shown
    o = evaluate(rule(reduce="mean"), {"m": series([1.0, inf, -inf, 2.0])}, None)
    assert (o.status, o.failing, o.step) == (FAIL, 1, 3)
