"""Evaluate one rule on per-step metric series: PASS, FAIL, NO DATA, SKIP or ERROR, with the numbers.

Every check of a rule becomes a bound, so a rule's verdict at a point (a step, or the reduced
window) is just ``lower ≤ x ≤ upper`` (and finite when asked). NaN never passes a bound: a metric
that went NaN fails whatever rule looks at it.

A step with no token in the loss (every token masked) has no value for any token metric: it is
null, not a number that could pass. Such a step in a rule's window makes the outcome NO DATA,
which fails like a regression unless the rule says ``no_data = "allow"`` (then the step is left
out and the rest of the window is judged). Without this, a rule would pass on nothing.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from grpolens.check.rules import Rule, reduce_values

PASS, FAIL, NO_DATA, SKIP, ERROR = "PASS", "FAIL", "NO DATA", "SKIP", "ERROR"
STATUSES = (PASS, FAIL, NO_DATA, SKIP, ERROR)
_SEVERITY = {SKIP: 0, PASS: 1, FAIL: 2, NO_DATA: 2, ERROR: 3}


@dataclass(frozen=True)
class Series:
    """A metric's values by step, nulls dropped (NaN and ±inf kept: they are findings)."""

    steps: np.ndarray  # int64, increasing
    values: np.ndarray  # float64

    @classmethod
    def from_frame(cls, df, column: str) -> "Series":
        import polars as pl

        sub = df.select(pl.col("step").cast(pl.Int64), pl.col(column).cast(pl.Float64)).drop_nulls().sort("step")
        return cls(sub["step"].to_numpy().astype(np.int64), sub[column].to_numpy().astype(np.float64))

    @classmethod
    def from_pairs(cls, pairs: Mapping[int, float | None]) -> "Series":
        items = sorted((int(s), float(v)) for s, v in pairs.items() if v is not None)
        return cls(np.array([s for s, _ in items], np.int64), np.array([v for _, v in items], np.float64))

    def __len__(self) -> int:
        return int(self.steps.size)

    def at(self, steps: list[int]) -> np.ndarray:
        """Values at ``steps`` (all of which must be present)."""
        idx = np.searchsorted(self.steps, steps)
        return self.values[idx]

    def has(self, steps: list[int]) -> list[int]:
        """The subset of ``steps`` this series lacks."""
        present = set(self.steps.tolist())
        return [s for s in steps if s not in present]


@dataclass
class Outcome:
    rule: Rule
    status: str
    metric: str
    value: float | None = None  # the value judged (at ``step`` for per-step rules)
    baseline: float | None = None  # the baseline's value there, when compared
    lower: float = -np.inf  # the bounds the value had to stay within
    upper: float = np.inf
    step: int | None = None  # first failing step (per-step rules: the step shown)
    failing: int = 0  # steps outside the bounds (per-step rules)
    checked: int = 0  # steps looked at
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status in (FAIL, NO_DATA, ERROR)

    @property
    def excess(self) -> float | None:
        """How far the value lies past its bound (> 0 outside, <= 0 inside: minus the headroom)."""
        if self.value is None:
            return None
        if not np.isfinite(self.value):
            return float("inf")
        return float(max(self.lower - self.value, self.value - self.upper))

    def limit_text(self) -> str:
        lo, hi = np.isfinite(self.lower), np.isfinite(self.upper)
        if lo and hi:
            return f"[{_num(self.lower)}, {_num(self.upper)}]"
        if hi:
            return f"≤ {_num(self.upper)}"
        if lo:
            return f"≥ {_num(self.lower)}"
        return "finite" if self.rule.finite else "—"

    def margin_text(self) -> str:
        """``+0.034 (+283%)`` past the nearest bound for a failure, the headroom otherwise."""
        ex = self.excess
        if ex is None or ex == -np.inf:  # no bound, only "finite" (a value that is not finite has ex = inf)
            return ""
        if not np.isfinite(ex):
            return "not finite"
        # Past the upper bound, or inside and nearer it: the upper one (below the lower bound, the
        # upper is farther away). With a finite ex, the bound picked is finite.
        bound = self.upper if self.value > self.upper or self.upper - self.value <= self.value - self.lower else self.lower
        rel = f" ({abs(ex) / abs(bound):.0%})" if bound != 0 else ""
        if ex > 0:
            return f"{'above' if self.value > self.upper else 'below'} by {_num(ex)}{rel}"
        return f"headroom {_num(-ex)}{rel}"


def _num(v: float) -> str:
    from grpolens.text import format_value

    return format_value(float(v))


def matched_metrics(rule: Rule, candidate: Mapping[str, Series], baseline: Mapping[str, Series] | None) -> list[str]:
    names = set(candidate) | (set(baseline) if baseline is not None and rule.compares else set())
    if rule.is_glob:
        return sorted(fnmatch.filter(names, rule.metric))
    return [rule.metric]


def evaluate(rule: Rule, candidate: Mapping[str, Series], baseline: Mapping[str, Series] | None,
             no_data: Sequence[int] = (), all_steps: Sequence[int] | None = None) -> Outcome:
    """Judge ``rule`` on the candidate's series (and the baseline's, when one is given).

    ``no_data``: the candidate's steps without a token in the loss (where token metrics are null);
    ``all_steps``: every step the candidate has (default: ``no_data`` plus the series' steps).
    """
    nd = _NoData(frozenset(int(s) for s in no_data), all_steps)
    if not rule.is_glob:
        return _evaluate_one(rule, rule.metric, candidate.get(rule.metric), None if baseline is None
                             else baseline.get(rule.metric), baseline is not None, nd)
    outcomes = []
    for m in matched_metrics(rule, candidate, baseline):
        c = candidate.get(m)
        b = baseline.get(m) if baseline is not None else None
        if not c and not b:
            continue  # the run cannot have this metric (e.g. no ref_logp column): not this pattern's business
        outcomes.append(_evaluate_one(rule, m, c, b, baseline is not None, nd))
    if not outcomes:
        status = SKIP if rule.missing == "skip" else FAIL
        return Outcome(rule, status, rule.metric, message=f"no metric matching {rule.metric!r} has values in this run")
    # The worst outcome speaks for the pattern; among failures, the earliest first failing step.
    worst = max(outcomes, key=lambda o: (_SEVERITY[o.status], -(o.step if o.step is not None else 1 << 62)))
    bad = [o.metric for o in outcomes if o.failed]
    if bad:
        worst.message += f" [{len(bad)} of {len(outcomes)} matched metrics fail: {', '.join(bad[:5])}" \
                         f"{', ...' if len(bad) > 5 else ''}]"
    elif worst.status == PASS:  # nothing to single out: the pattern passed as a whole
        return Outcome(rule, PASS, rule.metric, checked=sum(o.checked for o in outcomes),
                       message=f"{len(outcomes)} matched metric(s) pass")
    return worst


@dataclass(frozen=True)
class _NoData:
    """The candidate's steps without data, and whether the whole run is such steps."""

    steps: frozenset[int]
    all_steps: Sequence[int] | None

    @property
    def whole_run(self) -> bool:
        """No step has data: a metric with no value at all may be one the run would have had."""
        return bool(self.steps) and (self.all_steps is None or set(self.all_steps) <= self.steps)

    def gaps(self, c: Series, steps: Sequence[int]) -> list[int]:
        """``steps`` without data at which the metric has no value."""
        have = set(c.steps.tolist())
        return [s for s in steps if s in self.steps and s not in have]


def _no_data_outcome(out: Outcome, gaps: list[int], of: int) -> Outcome:
    out.status, out.step, out.failing, out.checked = NO_DATA, gaps[0], len(gaps), of
    where = f"step {gaps[0]}" if len(gaps) == 1 else f"{len(gaps)} step(s), first {gaps[0]}"
    out.message = (f"no data at {where} ({len(gaps)} of {of} in {out.rule.window.describe()}): no token counts "
                   f"in the loss, so {out.metric} has no value")
    return out


def _evaluate_one(rule: Rule, metric: str, c: Series | None, b: Series | None, has_baseline: bool,
                  nd: _NoData = _NoData(frozenset(), None)) -> Outcome:
    out = Outcome(rule, PASS, metric)
    compare = rule.compares and has_baseline
    notes = []
    if rule.compares and not has_baseline and not rule.absolute:
        out.status, out.message = SKIP, "compares against a baseline; none given"
        return out
    if compare and not b:
        if not c:
            compare = False  # neither has it: the rule's missing policy decides below
        elif rule.missing == "skip":
            compare = False
            notes.append("the baseline has no values for this metric: compared without it")
        else:
            out.status = ERROR
            out.message = f"the baseline has no values for {metric} (write the golden with these rules, or drop the rule)"
            return out
    if not c and nd.whole_run and not (compare and b):
        steps = sorted(nd.steps)
        if rule.no_data == "allow":
            out.status, out.message = SKIP, f"no data: no step of this run has a token in the loss ({len(steps)} step(s))"
            return out
        return _no_data_outcome(out, steps, len(steps))
    if not c:
        if compare:
            out.status = FAIL
            out.message = f"{metric} has no values in this run, the baseline has {len(b)} step(s)"
            out.step = int(b.steps[0])
        else:
            out.status = SKIP if rule.missing == "skip" else FAIL
            out.message = f"{metric} has no values in this run"
        return out

    # Steps without data belong to the run's axis (the window counts them), with no value.
    axis = b.steps.tolist() if compare else sorted(set(c.steps.tolist()) | nd.steps)
    window = rule.window.select(axis)
    if not window:
        out.status = FAIL
        out.message = f"window {rule.window.describe()} selects no step of {axis[0]}..{axis[-1]}"
        return out
    gaps = nd.gaps(c, window)
    if gaps:
        if rule.no_data != "allow":
            return _no_data_outcome(out, gaps, len(window))
        notes.append(f"{len(gaps)} step(s) without data left out (first: step {gaps[0]})")
        window = [s for s in window if s not in set(gaps)]
        if not window:
            out.status = SKIP
            out.message = f"no data in window {rule.window.describe()}: {notes[-1]}"
            return out
    absent = c.has(window)
    if absent:
        out.status, out.step = FAIL, absent[0]
        out.message = (f"this run lacks {len(absent)} of the {len(window)} step(s) the baseline has in window "
                       f"{rule.window.describe()} (first missing: step {absent[0]}; this run's last step: "
                       f"{int(c.steps[-1])})")
        return out

    x = c.at(window)
    lo = np.full(len(window), -np.inf)
    hi = np.full(len(window), np.inf)
    if rule.min is not None:
        lo[:] = rule.min
    if rule.max is not None:
        hi[:] = np.minimum(hi, rule.max)
    if rule.early is not None:
        ref_steps = rule.early.reference_steps(c.steps.tolist())
        ref = c.at(ref_steps)
        ref = ref[np.isfinite(ref)]
        if ref.size == 0:
            out.status, out.step = FAIL, ref_steps[0]
            out.message = f"no finite value in the early reference steps {ref_steps[0]}..{ref_steps[-1]}"
            return out
        e_lo, e_hi = rule.early.bounds(float(np.median(ref)))
        if rule.direction in ("upper", "both"):
            hi = np.minimum(hi, e_hi)
        if rule.direction in ("lower", "both"):
            lo = np.maximum(lo, e_lo)
    bvals = b.at(window) if compare else None

    if rule.reduce == "all":
        if compare:
            tol = (rule.abs or 0.0) + (rule.rel or 0.0) * np.abs(bvals)
            if rule.direction in ("upper", "both"):
                hi = np.minimum(hi, bvals + tol)
            if rule.direction in ("lower", "both"):
                lo = np.maximum(lo, bvals - tol)
        ok = (x >= lo) & (x <= hi) & (np.isfinite(x) | ~np.asarray(rule.finite))
        isolated = 0
        if rule.sustained is not None:
            counted = rule.sustained.qualifying(~ok, np.isfinite(x))
            isolated = int((~ok).sum() - counted.sum())
            ok = ~counted
        bad = np.flatnonzero(~ok)
        out.checked, out.failing = len(window), int(bad.size)
        if bad.size:
            i = int(bad[0])
        else:  # show the step closest to its bound
            with np.errstate(invalid="ignore"):
                i = int(np.argmax(np.maximum(lo - x, x - hi)))
        out.value, out.step = float(x[i]), int(window[i])
        out.lower, out.upper = float(lo[i]), float(hi[i])
        out.baseline = float(bvals[i]) if compare else None
        frac = bad.size / len(window)
        if frac > rule.allow_fail_fraction:  # with none allowed, any failing step
            out.status = FAIL
            allowed = f", {rule.allow_fail_fraction:.0%} allowed" if rule.allow_fail_fraction else ""
            out.message = f"{bad.size}/{len(window)} step(s) outside the limit{allowed}; first at step {out.step}"
        else:  # out.step is already the first failing step, if any
            out.message = (f"{bad.size}/{len(window)} step(s) outside the limit, within the "
                           f"{rule.allow_fail_fraction:.0%} allowed" if bad.size else f"{len(window)} step(s) within the limit")
        if isolated:
            out.message += (f" ({isolated} isolated step(s) outside the limit not counted: "
                            f"{rule.sustained.describe()})")
    else:
        v = reduce_values(rule.reduce, x)
        lo1, hi1 = float(lo.max()), float(hi.min())  # constant bounds: min/max/early
        if compare:
            bv = reduce_values(rule.reduce, bvals)
            tol = (rule.abs or 0.0) + (rule.rel or 0.0) * abs(bv)
            if rule.direction in ("upper", "both"):
                hi1 = min(hi1, bv + tol)
            if rule.direction in ("lower", "both"):
                lo1 = max(lo1, bv - tol)
            out.baseline = bv
        out.value, out.lower, out.upper, out.checked = v, lo1, hi1, len(window)
        passed = lo1 <= v <= hi1 and (np.isfinite(v) or not rule.finite)
        if not passed:
            out.status, out.failing = FAIL, 1
            # Point at the first step whose own value breaks the reduced bound: where to look first.
            stepwise = ~((x >= lo1) & (x <= hi1) & (np.isfinite(x) | ~np.asarray(rule.finite)))
            where = np.flatnonzero(stepwise)
            out.step = int(window[where[0]]) if where.size else int(window[-1])
            out.message = f"{rule.reduce} over {rule.window.describe()} ({len(window)} step(s)) is outside the limit; " \
                          f"first step beyond it: {out.step}"
        else:
            out.message = f"{rule.reduce} over {rule.window.describe()} ({len(window)} step(s))"
    if notes:
        out.message += " (" + "; ".join(notes) + ")"
    return out
