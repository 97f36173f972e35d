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
    # the likeliest numerator first (kl/k3 -> kl.k3.sum): only the order of the tries, each is checked
    import difflib

    tail = metric.name.rsplit("/", 1)[-1]
    cols = sorted(cols, key=lambda c: -difflib.SequenceMatcher(None, tail, c).ratio())
    for c in cols:
        if merge_rules().get(c, "sum") != "sum":
            continue
        a, b, ab = _probe(metric, sd, c, u), _probe(metric, sd, c, w), _probe(metric, sd, c, u + w)
        a2 = _probe(metric, sd, c, 2.5 * u)
        if a is None or b is None:
            continue
        scale = abs(a) + abs(b)
        if a == 0 and b == 0:  # the value does not depend on this column
            continue
        if not (_close(ab, a + b, scale) and _close(a2, 2.5 * a, abs(a))):
            continue
        g = _weights(metric, sd, c, cols)
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


def _weights(metric: Metric, sd: StepData, col: str, others: list[str]) -> np.ndarray | None:
    """g_s = the value with x = the unit vector of sequence s (the reduction being linear in x).

    Fewer probes first: the weights of every reduction grpolens knows are alike across all
    sequences (a pooled mean, a sum) or within a loss call (TRL's slots, xtuner's packs), so those
    hypotheses are tried first, one probe per class (x = the class's indicator), and kept only when
    they rebuild the value at random inputs; otherwise one probe per sequence."""
    n = sd.n_seq
    x = sd.seqs[col]
    rng = np.random.default_rng(n)
    u = rng.standard_normal(n)
    want = [(x, compute_value(metric, sd, col, x)), (u, _probe(metric, sd, col, u))]
    for by in ((), ("rank", "micro_batch")):
        if by and not all(k in sd.seqs for k in by):
            continue
        if by:
            keys = np.stack([np.asarray(sd.seqs[k], dtype=np.int64) for k in by], axis=1)
            _, cls = np.unique(keys, axis=0, return_inverse=True)
            cls = cls.reshape(-1)
        else:
            cls = np.zeros(n, dtype=np.int64)
        k = int(cls.max()) + 1 if n else 0
        if k > n // 2 and by:
            break  # no saving over one probe per sequence
        g_cls = np.empty(k)
        for c in range(k):
            member = cls == c
            v = _probe(metric, sd, col, member.astype(np.float64))
            g_cls[c] = (v or 0.0) / member.sum()
        g = g_cls[cls]
        if all(v is not None and _close(float(np.sum(g * vec)), v, float(np.sum(np.abs(g * vec)))) for vec, v in want):
            return g
    g = np.empty(n)
    e = np.zeros(n)
    for s in range(n):
        e[s] = 1.0
        v = _probe(metric, sd, col, e)
        e[s] = 0.0
        # None: "nothing to average" for this unit alone while the step has a value (a unit the
        # reduction leaves out: den 0 in a seq-mean)
        g[s] = 0.0 if v is None else v
    return g


def compute_value(metric: Metric, sd: StepData, col: str, x: np.ndarray) -> float | None:
    return _probe(metric, sd, col, x)


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
        return f"{name} is a standard deviation: not a sum of per-unit terms, so no exact decomposition"
    if any(name.endswith(f"/p{q:02d}") for q in range(101)) or "quantile" in name:
        return f"{name} is a quantile: set by the one unit at that rank, not a sum of terms, so no exact decomposition"
    if name.endswith("/ess"):
        return f"{name} is an effective sample size (a ratio of squared sums): not decomposable exactly"
    return (f"{name}'s reduction is not a sum, mean or fraction of per-token or per-sequence terms "
            "(e.g. the exp of a mean): no exact decomposition")


# ---------------------------------------------------------------------------------------------
# Metrics of the samples table (rewards, lengths): the same probing over the step's sample rows
# ---------------------------------------------------------------------------------------------

#: Numeric sample columns a samples metric may be linear in (rewards are ``reward/<name>`` too).
SAMPLE_NUMERIC = ("reward", "completion_len", "prompt_len", "advantage", "truncated")


def _with_samples(sd: StepData, df) -> StepData:
    extra = {k: v for k, v in sd.extra.items() if k in _KEEP_EXTRA}
    return StepData(sd.step, sd.seqs, sd.cfg, sd.profile, df, sd.present, extra)


def _probe_samples(metric: Metric, sd: StepData, col: str, vec: np.ndarray) -> float | None:
    import polars as pl

    try:
        v = compute(metric, _with_samples(sd, sd.samples.with_columns(pl.Series(col, vec, dtype=pl.Float64))))
    except Exception:  # noqa: BLE001 - a probe the reduction cannot take means "not linear in this column"
        return None
    return None if v is None else float(v)


def linearize_samples(metric: Metric, sd: StepData, v0: float | None) -> Linear | str:
    """:func:`linearize` for a metric of the step's samples: ``g`` per sample row."""
    if v0 is None:
        return f"{metric.name} has no value at step {sd.step}"
    df = sd.samples
    if df is None or df.height == 0:
        return f"{metric.name}: step {sd.step} has no samples"
    cols = [c for c in df.columns if c in SAMPLE_NUMERIC or c.startswith("reward/")]
    if metric.column:  # a template's own column first (rewards/<name>/mean)
        cols = [metric.column] + [c for c in cols if c != metric.column]
    rng = np.random.default_rng(sd.step)
    n = df.height
    for c in cols:
        x = df[c].cast(float).fill_null(float("nan")).to_numpy().astype(np.float64)
        ok = np.isfinite(x)
        u, w = np.where(ok, rng.standard_normal(n), x), np.where(ok, rng.standard_normal(n), x)
        a, b = _probe_samples(metric, sd, c, u), _probe_samples(metric, sd, c, w)
        if a is None or b is None:
            continue
        if a == 0 and b == 0:  # the value does not depend on this column
            continue
        ab, a2 = _probe_samples(metric, sd, c, np.where(ok, u + w, x)), _probe_samples(metric, sd, c, np.where(ok, 2.5 * u, x))
        if not (_close(ab, a + b, abs(a) + abs(b)) and _close(a2, 2.5 * a, abs(a))):
            continue
        g = np.zeros(n)
        for s in np.flatnonzero(ok):
            e = np.where(ok, 0.0, x)
            e[s] = 1.0
            g[s] = _probe_samples(metric, sd, c, e) or 0.0
        terms = np.where(ok, g * np.where(ok, x, 0.0), 0.0)
        if _close(float(terms.sum()), v0, float(np.abs(terms).sum())):
            return Linear(c, g, ())
    return _nonlinear_note(metric)


def sample_column(metric: Metric, df) -> str | None:
    """The samples column a samples metric is about: a template's own column, else the first
    numeric sample column it requires, else ``completion_len`` for the length metrics."""
    if metric.column and metric.column in df.columns:
        return metric.column
    for c in metric.requires:
        if c in df.columns and (c in SAMPLE_NUMERIC or c.startswith("reward/")):
            return c
    return "completion_len" if "length" in metric.name and "completion_len" in df.columns else None


def samples_answer(metric: Metric, df, v0: float, step: int, shown: str) -> tuple[str, dict | None] | None:
    """What can be said of a samples metric that is no sum: the row attaining an extremum, the row
    at a quantile, the rows with the largest squared deviations of a standard deviation."""
    col = sample_column(metric, df)
    if col is None or df.height == 0:
        return None
    x = df[col].cast(float).fill_null(float("nan")).to_numpy().astype(np.float64)
    sid = df["sample_id"].to_numpy()
    ok = np.flatnonzero(np.isfinite(x))
    if not len(ok):
        return None
    name = metric.name
    for which, pick in (("max", np.argmax), ("min", np.argmin)):
        r = ok[pick(x[ok])]
        if x[r] == v0:
            unit = {"step": step, "sample_id": int(sid[r]), "column": col, "value": float(x[r])}
            return f"{shown} is the step's {which}imum of {col}, attained by sample {sid[r]} ({col} {x[r]:.6g})", unit
    if "std" in name.rsplit("/", 1)[-1]:
        dev = (x[ok] - x[ok].mean()) ** 2
        top = ok[np.argsort(-dev, kind="stable")[:3]]
        total = dev.sum()
        parts = [f"sample {sid[r]} ({col} {x[r]:.4g}, {100 * (x[r] - x[ok].mean()) ** 2 / total:.0f} %)" for r in top] if total else []
        if parts:
            return (f"{shown} is a standard deviation, not a sum of terms; the largest squared deviations from "
                    f"the step's mean {x[ok].mean():.4g}: " + ", ".join(parts)), None
    if any(name.endswith(f"/p{q:02d}") for q in range(101)):
        near = ok[np.argmin(np.abs(x[ok] - v0))]
        return (f"{shown} is a quantile, not a sum of terms: the completion at it is sample {sid[near]} "
                f"({col} {x[near]:.4g})"), None
    return None
