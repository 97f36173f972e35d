"""Completion and prompt lengths, truncation, and tokens seen, from the ``samples`` table.

Over the completions *generated* at the step (all ranks); a step without samples gives null
(TRL: key absent). Two notions of "did not finish" are kept apart because trainers differ:

* ``truncated`` (the samples column): generation stopped without EOS. TRL's
  ``completions/clipped_ratio`` and its ``*_terminated_length`` use this;
* *clipped by length*: ``completion_len >= max_completion_length`` (config). MaxEnt-GRPO's
  ``clipped_frac`` and its ``*_length_terminated`` use this.

Where nothing is left (no completion finished), TRL and MaxEnt-GRPO log 0.0 (TRL averages a
``zeros(1)``); grpolens logs null. ``tokens/seen`` is TRL's ``num_tokens``: the running total of
prompt + completion tokens generated since the first step of the run (pooled: TRL logs the total
at the step's last round). With several generation rounds in a step the trl profile averages the
per-round values of the other metrics TRL logs, as TRL does (see :func:`~grpolens.metrics.rewards.per_round`).
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics.registry import Family, Metric, register, register_family
from grpolens.metrics.rewards import mean, per_round, sample_values

_FAM = "completions"
_S = dict(kind="custom", source="samples")


_REDUCE = {"mean": np.mean, "min": np.min, "max": np.max}


def _extreme(x: np.ndarray, which: str) -> float | None:
    """mean/min/max of ``x``; None when empty."""
    return float(_REDUCE[which](x)) if x.size else None


def lengths(sd) -> np.ndarray | None:
    """Completion lengths of the step's samples (None: no samples)."""
    return sample_values(sd, "completion_len")


def terminated_mask(sd, rule: str) -> np.ndarray | None:
    """Which completions finished: ``eos`` (not ``truncated``) or ``length`` (shorter than
    ``max_completion_length``)."""
    n = lengths(sd)
    if n is None:
        return None
    if rule == "eos":
        t = sample_values(sd, "truncated")
        return None if t is None else t == 0
    return n < sd.cfg["max_completion_length"]


def length_stat(which: str, rule: str | None = None, empty: float | None = None):
    """``fn(sd)``: mean/min/max completion length (of those terminated by ``rule``); ``empty`` when
    the step has lengths but none is left (TRL and MaxEnt-GRPO log 0.0 there)."""
    def fn(sd):
        n = lengths(sd)
        if n is None:
            return None
        if rule is not None:
            keep = terminated_mask(sd, rule)
            if keep is None:
                return None
            n = n[keep]
        v = _extreme(n, which)
        return empty if v is None else v
    return fn


def truncated_frac(sd) -> float | None:
    t = sample_values(sd, "truncated")
    return mean(t)


def clipped_frac(sd) -> float | None:
    keep = terminated_mask(sd, "length")
    return None if keep is None else mean(1.0 - keep)


def tokens_generated(sd) -> float | None:
    n = lengths(sd)
    return None if n is None else float(n.sum())


def prompt_lengths(sd) -> np.ndarray | None:
    p = sample_values(sd, "prompt_len")
    return None if p is None else p[np.isfinite(p)]


def tokens_seen(sd) -> float | None:
    """Prompt + completion tokens of the step; null when any prompt length is unknown."""
    n, p = lengths(sd), sample_values(sd, "prompt_len")
    if n is None or p is None or not np.all(np.isfinite(p)):
        return None
    return float(n.sum() + p.sum())


def _prompt_stat(which: str):
    def fn(sd):
        p = prompt_lengths(sd)
        return None if p is None else _extreme(p, which)
    return fn


_has_max_len = lambda cfg: cfg.get("max_completion_length") is not None  # noqa: E731

for _w in ("mean", "min", "max"):
    register(Metric(
        f"completions/length/{_w}", _FAM, f"{_w.capitalize()} completion length (`completion_len`, tokens "
        "generated, EOS included) over every completion of the step.",
        fn=per_round(length_stat(_w)), requires=("completion_len",), **_S))
register(Metric(
    "completions/truncated_frac", _FAM, "Fraction of the step's completions that stopped at the length limit "
    "without EOS (`truncated`). TRL's `clipped_ratio`.",
    fn=per_round(truncated_frac), requires=("truncated",), **_S))
for _w in ("mean", "min", "max"):
    register(Metric(
        f"completions/terminated_length/{_w}", _FAM, f"{_w.capitalize()} length of the completions that ended "
        "with EOS (not `truncated`); null when none did (TRL logs 0).",
        fn=per_round(length_stat(_w, "eos")), requires=("completion_len", "truncated"), **_S))
register(Metric(
    "completions/clipped_frac", _FAM, "Fraction of the step's completions with `completion_len >= "
    "max_completion_length` (by length, not EOS). MaxEnt-GRPO's `clipped_frac`.",
    fn=clipped_frac, requires=("completion_len",), config=("max_completion_length",), when=_has_max_len, **_S))
for _w in ("mean", "min", "max"):
    register(Metric(
        f"completions/unclipped_length/{_w}", _FAM, f"{_w.capitalize()} length of the completions shorter than "
        "`max_completion_length`; null when none (MaxEnt-GRPO logs 0).",
        fn=length_stat(_w, "length"), requires=("completion_len",),
        config=("max_completion_length",), when=_has_max_len, **_S))
register(Metric(
    "completions/tokens", _FAM, "Completion tokens generated at the step: Σ `completion_len`.",
    fn=tokens_generated, requires=("completion_len",), **_S))
for _w in ("mean", "min", "max"):
    register(Metric(
        f"prompts/length/{_w}", _FAM, f"{_w.capitalize()} prompt length (`prompt_len`) over the step's "
        "completions with a known one (a prompt counts once per completion).",
        fn=_prompt_stat(_w), requires=("prompt_len",), **_S))
register(Metric(
    "tokens/seen", _FAM, "Running total over steps of Σ (`prompt_len` + `completion_len`) of the generated "
    "completions, over the steps recomputed (so `--steps A:B` starts its total at A). A step where a prompt "
    "length is unknown is null and adds nothing. TRL's `num_tokens`.",
    fn=tokens_seen, requires=("prompt_len", "completion_len"), cumulative=True, **_S))


register_family(Family(
    'completions', page='rewards',
    key_metrics=('completions/length/mean', 'completions/truncated_frac'),
    overview=(
        (8, 'completion length', ('^completions?/.*length.*mean', '^lengths?/mean$', '^samples/length/mean$')),
    ),
))
