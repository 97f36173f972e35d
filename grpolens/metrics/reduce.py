"""From one step's per-sequence partials to metric values, under each profile's aggregation rule.

The same partial sums give every trainer's number; only the grouping differs:

``pooled``     Σ num / Σ den over the whole step (every token of every rank and micro-batch
               weighs the same). grpolens' default, Twinkle's and verl's global-batch rule.
``trl_slot``   TRL >= 1.9: per micro-batch *slot* (one loss call on all ranks together)
               Σ num / max(Σ den, 1), then the plain mean over the step's slots.
``pack_mean``  xtuner: per pack (rank, micro_batch) Σ num / (Σ den + 1e-8), then the mean over
               packs that had a valid token.

Values are plain Python floats or ``None`` ("nothing to average"), never a made-up 0, except
where a profile reproduces a trainer that logs 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpolens.metrics.profile import Profile
from grpolens.metrics.registry import Metric

#: The profile of a StepData built without one: canonical names, pooled token means.
CANONICAL = Profile("grpolens", "canonical names, exact pooled values", canonical=True)


@dataclass
class StepData:
    """Everything a step's metrics are computed from."""

    step: int
    seqs: dict[str, np.ndarray]
    cfg: dict
    profile: Profile = CANONICAL
    samples: Any = None  # polars.DataFrame of samples generated at this step, or None
    present: set[str] = field(default_factory=set)  # token columns present in the run
    extra: dict[str, Any] = field(default_factory=dict)  # step-level partials (histograms, ...)

    @property
    def n_seq(self) -> int:
        return len(self.seqs.get("sample_id", ()))

    def col(self, name: str) -> np.ndarray:
        c = self.seqs.get(name)
        return np.zeros(self.n_seq) if c is None else c

    def groups(self, by: tuple[str, ...]) -> tuple[np.ndarray, int]:
        """Integer group ids of each sequence for a grouping, and the number of groups."""
        key = ("_groups",) + by
        if key not in self.extra:
            if self.n_seq == 0:
                self.extra[key] = (np.zeros(0, dtype=np.int64), 0)
            else:
                # np.unique(axis=0)'s inverse (rows numbered in lexicographic order) from one
                # lexsort: unique over rows sorts a structured view, several times slower
                cols = [self.seqs[k] for k in by]
                order = np.lexsort(cols[::-1])
                new = np.zeros(self.n_seq, dtype=bool)
                new[0] = True
                for c in cols:
                    c = c[order]
                    new[1:] |= c[1:] != c[:-1]
                inv = np.empty(self.n_seq, dtype=np.int64)
                inv[order] = np.cumsum(new) - 1
                self.extra[key] = (inv, int(inv.max()) + 1)
        return self.extra[key]


def _f(x) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if np.isnan(x) else x


def grouped_ratio(sd: StepData, num: str, den: str, rule: str) -> float | None:
    s, c = sd.col(num), sd.col(den)
    if rule == "pooled":
        tot = c.sum()
        return _f(s.sum() / tot) if tot > 0 else None
    if rule == "trl_slot":
        g, n = sd.groups(("micro_batch",))
        if n == 0:
            return None
        gs, gc = np.bincount(g, s), np.bincount(g, c)  # every group id occurs: n bins
        return _f(np.mean(gs / np.maximum(gc, 1.0)))
    if rule == "pack_mean":
        g, n = sd.groups(("rank", "micro_batch"))
        if n == 0:
            return None
        gs, gc = np.bincount(g, s), np.bincount(g, c)
        valid = gc > 0
        return _f(np.mean(gs[valid] / (gc[valid] + 1e-8))) if valid.any() else None
    raise ValueError(f"unknown grouping rule {rule!r}")


def seq_fraction_extreme(sd: StepData, num: str, den: str, which: str) -> float | None:
    """The smallest/largest per-sequence fraction num/den over the sequences with den > 0. The same
    under every grouping rule: the trl profile, whose rule is per slot, calls it on one slot at a
    time (its log schedule's ``appended``), where the extreme over the slot is this."""
    s, c = sd.col(num), sd.col(den)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(c > 0, s / np.where(c > 0, c, 1.0), np.nan)
    pick = np.nanmin if which == "min" else np.nanmax
    if not np.isfinite(frac).any():
        return None
    return _f(pick(frac))


def compute(metric: Metric, sd: StepData) -> float | None:
    """The value of ``metric`` at one step under ``sd.profile``: the profile's own reduction of
    the metric if it has one, else the family's; then the profile's value for "nothing to average"."""
    prof = sd.profile
    key = metric.template or metric.name
    own = prof.reductions.get(key)
    if own is not None:
        value = own(sd) if metric.template is None else own(sd, column=metric.column)
    else:
        value = _family_value(metric, sd)
    if value is None and key in prof.zero_when_empty and (sd.n_seq or not prof.zero_needs_sequences):
        return 0.0
    return value


def _family_value(metric: Metric, sd: StepData) -> float | None:
    kind = metric.kind
    rule = sd.profile.token_mean
    if kind == "custom":
        return metric.fn(sd)
    if kind == "token_mean":  # the profile's grouping (registry.KINDS has no other grouped kind)
        return grouped_ratio(sd, metric.num, metric.den, rule)
    if sd.n_seq == 0:
        return None
    x = sd.col(metric.num)
    if kind == "max":
        v = np.max(x)
        return None if v == -np.inf else _f(v)  # every sequence without a valid token
    if kind == "min":
        v = np.min(x)
        return None if v == np.inf else _f(v)
    if kind == "sum":
        return _f(x.sum())
    if kind == "seq_mean":
        c = sd.col(metric.den)
        ok = c > 0
        return _f(np.mean(x[ok] / c[ok])) if ok.any() else None
    if kind in ("seq_frac_min", "seq_frac_max"):
        return seq_fraction_extreme(sd, metric.num, metric.den, kind[-3:])
    raise ValueError(f"metric {metric.name}: unknown kind {kind!r}")


#: Loss types that average each sequence's token mean (the others pool tokens, or use a constant).
SEQ_MEAN_LOSSES = ("grpo", "sapo", "gspo")


def normalise_like_loss(loss_type: str, s: np.ndarray, n: np.ndarray, length: float | None,
                        clamp: bool = False) -> float | None:
    """Per-sequence sums ``s`` over ``n`` tokens, normalised the way ``loss_type`` normalises its loss.

    grpo/sapo/gspo: mean over sequences of s/max(n, 1); luspo: mean of s; dr_grpo: Σ s over
    (sequences × ``length``, the constant max_completion_length; None without one); the token-mean
    types (dapo, bnpo, cispo): Σ s / Σ n, with Σ n clamped to >= 1 when ``clamp`` (MaxEnt does).
    """
    if loss_type in SEQ_MEAN_LOSSES:
        return float(np.mean(s / np.maximum(n, 1.0)))
    if loss_type == "luspo":
        return float(np.mean(s))
    if loss_type == "dr_grpo":
        return float(s.sum() / (len(s) * max(float(length), 1.0))) if length else None
    return float(s.sum() / max(n.sum(), 1.0)) if clamp else float(s.sum() / n.sum())
