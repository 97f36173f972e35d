"""How a metric's value comes out of the step's per-sequence partials, found from the metric's own
reduction rather than restated: the profile's reduction (:func:`grpolens.metrics.reduce.compute`)
is run as a black box on probed copies of the partial table.

* **linear**: the value is ``Σ_s g_s · x_s`` for one partial column ``x`` (a pooled token mean
  Σx/Σn, TRL's per-micro-batch-slot means, xtuner's per-pack means, verl's seq-mean-token-mean, a
  sum, a fraction: the weights ``g`` depend on the other columns only). Found by probing: the one
  column in which the value is additive and homogeneous, the weights ``g_s`` as the value of the
  unit vectors, and the whole checked by rebuilding the value from them (1e-9 relative) -- a
  reduction that only looks linear is refused, never decomposed wrongly;
* **extremum**: the value is attained by one sequence's max/min column (kept when every other
  sequence is set to the merge rule's neutral value);
* anything else (a standard deviation, a quantile, an exp of a mean) gets a one-line note.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grpolens.metrics.batch import KEY_COLUMNS
from grpolens.metrics.partials import merge_rules
from grpolens.metrics.reduce import StepData, compute
from grpolens.metrics.registry import Metric

#: Relative tolerance of every exactness check (the issue's 1e-9).
RTOL = 1e-9
_KEEP_EXTRA = ("pieces", "run_has_samples", "schedule")


@dataclass
class Linear:
    """value = Σ_s g[s] · seqs[num][s]."""

    num: str
    g: np.ndarray
    #: other partial columns the reduction reads (the candidates for a unit weight)
    others: tuple[str, ...]


@dataclass
class Extremum:
    """value = f(seqs[column][seq]): the step's max/min of a per-sequence extreme."""

    column: str
    which: str
    seq: int


class _Recording(dict):
    """A partial table that remembers which columns a reduction reads."""

    def __init__(self, *a):
        super().__init__(*a)
        self.read: list[str] = []

    def _note(self, k):
        if k not in self.read:
            self.read.append(k)

    def __getitem__(self, k):
        self._note(k)
        return super().__getitem__(k)

    def get(self, k, default=None):
        self._note(k)
        return super().get(k, default)


def _copy(sd: StepData, seqs: dict) -> StepData:
    """A StepData over ``seqs`` sharing nothing a reduction may have cached about the old values
    (only the visitor pieces and the grouping of sequences by key columns carry over)."""
    extra = {k: v for k, v in sd.extra.items()
             if k in _KEEP_EXTRA or (isinstance(k, tuple) and k and k[0] == "_groups")}
    return StepData(sd.step, seqs, sd.cfg, sd.profile, sd.samples, sd.present, extra)


def value(metric: Metric, sd: StepData) -> float | None:
    v = compute(metric, _copy(sd, dict(sd.seqs)))
    return None if v is None or not np.isfinite(v) else float(v)


def reads(metric: Metric, sd: StepData) -> list[str]:
    """The partial columns (not keys) the reduction reads at this step."""
    rec = _Recording(sd.seqs)
    compute(metric, _copy(sd, rec))
    return [c for c in rec.read if c not in KEY_COLUMNS and c in sd.seqs]


def _probe(metric: Metric, sd: StepData, col: str, vec: np.ndarray) -> float | None:
    seqs = dict(sd.seqs)
    seqs[col] = vec
    try:
        v = compute(metric, _copy(sd, seqs))
    except (ValueError, FloatingPointError, ZeroDivisionError, TypeError):
        return None
    return None if v is None else float(v)


def _close(a: float | None, b: float | None, scale: float) -> bool:
    if a is None or b is None:
        return False
    return abs(a - b) <= RTOL * max(scale, abs(a), abs(b)) + 1e-300


def linearize(metric: Metric, sd: StepData, v0: float | None) -> Linear | Extremum | str:
    """The metric's reduction at this step as :class:`Linear`, :class:`Extremum`, or a note
    saying why neither holds."""
    if v0 is None:
        return f"{metric.name} has no value at step {sd.step}"
    if metric.kind == "custom" and metric.source == "samples":
        return "samples"
    cols = reads(metric, sd)
    if not cols:
        return f"{metric.name} is not computed from per-sequence partials"
    n = sd.n_seq
    rng = np.random.default_rng(sd.step)
    u, w = rng.standard_normal(n), rng.standard_normal(n)
    for c in cols:
        if merge_rules().get(c, "sum") != "sum":
            continue
        a, b, ab = _probe(metric, sd, c, u), _probe(metric, sd, c, w), _probe(metric, sd, c, u + w)
        a2 = _probe(metric, sd, c, 2.5 * u)
        if a is None or b is None:
            continue
        scale = abs(a) + abs(b)
        if not (_close(ab, a + b, scale) and _close(a2, 2.5 * a, abs(a))):
            continue
        g = _weights(metric, sd, c)
        if g is None:
            continue
        x = sd.seqs[c]
        rebuilt = float(np.sum(g * x))
        if _close(rebuilt, v0, float(np.sum(np.abs(g * x)))) and _close(float(np.sum(g * u)), a, float(np.sum(np.abs(g * u)))):
            return Linear(c, g, tuple(o for o in cols if o != c))
    ext = _extremum(metric, sd, cols, v0)
    if ext is not None:
        return ext
    return _nonlinear_note(metric)


def _weights(metric: Metric, sd: StepData, col: str) -> np.ndarray | None:
    """g_s = the value with x = the unit vector of sequence s (the reduction being linear in x):
    one probe per sequence, each a run of the reduction itself."""
    n = sd.n_seq
    g = np.empty(n)
    e = np.zeros(n)
    for s in range(n):
        e[s] = 1.0
        v = _probe(metric, sd, col, e)
        e[s] = 0.0
        if v is None:
            # "nothing to average" for this unit alone while the step has a value: a unit the
            # reduction leaves out (den 0 in a seq-mean)
            v = 0.0
        g[s] = v
    return g


def _extremum(metric: Metric, sd: StepData, cols: list[str], v0: float) -> Extremum | None:
    rules = merge_rules()
    for c in cols:
        which = rules.get(c)
        if which not in ("max", "min"):
            continue
        x = sd.seqs[c]
        if not len(x):
            continue
        s = int(np.argmax(x) if which == "max" else np.argmin(x))
        fill = -np.inf if which == "max" else np.inf
        neutral = np.full(len(x), fill)
        neutral[s] = x[s]
        moved = x.copy()
        moved[s] = x[s] + (1.0 if which == "max" else -1.0) * max(1.0, abs(x[s]))
        # the value is the unit's: unchanged without the others, changed when the unit moves
        if _close(_probe(metric, sd, c, neutral), v0, abs(v0)) and not _close(_probe(metric, sd, c, moved), v0, abs(v0)):
            return Extremum(c, which, s)
    return None


def _nonlinear_note(metric: Metric) -> str:
    name = metric.name
    if name.endswith(("/std", "/std_pop", "/seq_std")) or "std" in name.rsplit("/", 1)[-1]:
        return (f"{name} is a standard deviation: not a sum of per-unit terms, so no exact "
                "decomposition; the units with the largest squared deviations are listed instead")
    if any(name.endswith(f"/p{q:02d}") for q in range(101)) or "quantile" in name:
        return f"{name} is a quantile: set by the one unit at that rank, not a sum of terms"
    if name.endswith("/ess"):
        return f"{name} is an effective sample size (a ratio of squared sums): not decomposable exactly"
    return (f"{name}'s reduction is not a sum, mean or fraction of per-token or per-sequence terms "
            "(e.g. the exp of a mean): no exact decomposition")
