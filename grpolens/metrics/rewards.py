"""Rewards, prompt groups and advantages, from the ``samples`` table (one row per completion).

Every value here is over the completions *generated* at the step (all ranks together: TRL and
MaxEnt-GRPO gather before they log). A step without samples gives null, which is TRL's "key
absent at this step". Rewards that are null, NaN or ±inf are excluded from every statistic and
counted (``reward/nonfinite``, ``rewards/<name>/nonfinite``). Two standard deviations are kept
apart because trainers disagree:

* *sample* std, ÷(n−1) (Bessel; null for fewer than 2 values): TRL's ``nanstd``;
* *population* std, ÷n (0 for one value): MaxEnt-GRPO's ``_mean_std``.

Quantiles use numpy's ``linear`` method (Hyndman–Fan type 7) on float64, which is MaxEnt-GRPO's
``_quantile_stats``; its keys are ``f"p{int(q*100):02d}"`` (:func:`quantile_key`), so q=1 is
``p100`` and a q like 0.29 would read ``p28``.

Trainer profiles reproduce what the trainer logs when nothing is left to average: MaxEnt-GRPO logs
0.0 for the mean, the population std and the zero-advantage fraction; TRL and grpolens log null.

Generation rounds. A step may hold several generation rounds (TRL with ``steps_per_generation <
gradient_accumulation_steps``); TRL computes these metrics once per round and logs the mean of the
rounds' values (NaN ones dropped). With the samples column ``generation`` the trl profile does the
same (:func:`per_round`); without it, and in the default profile, the step's completions are pooled.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Callable

import numpy as np

from grpolens.run.format import REWARD_PREFIX
from grpolens.metrics.partials import producer
from grpolens.metrics.registry import PLACEHOLDER, Family, Metric, register, register_family

QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
#: TRL's ``torch.isclose(std, 0)``: |std| <= atol + rtol·0.
ZERO_STD_ATOL = 1e-8
#: MaxEnt-GRPO's zero-advantage test: |a| < 1e-8 for every advantage of the group.
ZERO_ADV_TOL = 1e-8


def quantile_key(q: float) -> str:
    """MaxEnt-GRPO's key for quantile ``q``, truncation included (0.29 -> ``p28``)."""
    return f"p{int(q * 100):02d}"


# -- per-step sample columns (cached in the step's StepData) ----------------------------------

def sample_values(sd, column: str) -> np.ndarray | None:
    """float64 values of a samples column, null -> NaN; None when the step has no samples or the
    column is absent from them."""
    key = ("samples", column)
    if key not in sd.extra:
        df = sd.samples
        if df is None or df.height == 0 or column not in df.columns:
            sd.extra[key] = None
        else:
            import polars as pl

            # a float Series gives its nulls to numpy as NaN; Series.fill_null would be a polars
            # query of its own (~1 ms each, for a few hundred values, dozens of times a step)
            sd.extra[key] = df[column].cast(pl.Float64).to_numpy().astype(np.float64)
    return sd.extra[key]


def finite_values(sd, column: str) -> np.ndarray | None:
    x = sample_values(sd, column)
    return None if x is None else x[np.isfinite(x)]


def group_index(sd) -> tuple[np.ndarray, int] | None:
    """Dense group index of each sample (by ``group_id``) and the number of groups."""
    key = ("samples", "_group_index")
    if key not in sd.extra:
        df = sd.samples
        if df is None or df.height == 0 or "group_id" not in df.columns:
            sd.extra[key] = None
        else:  # the integer ids themselves: ids beyond 2**53 (hashes) must not merge through float64
            _, inv = np.unique(df["group_id"].to_numpy(), return_inverse=True)  # 1-D in, 1-D out
            sd.extra[key] = (inv, int(inv.max()) + 1)
    return sd.extra[key]


# -- generation rounds ------------------------------------------------------------------------

def generation_rounds(sd) -> list | None:
    """One StepData per generation round of the step (its samples only), in round order; None when
    the profile pools rounds, or the step's samples have no complete ``generation`` column."""
    key = ("samples", "_rounds")
    if key not in sd.extra:
        df = sd.samples
        rounds = None
        if (sd.profile.per_generation_round and df is not None and df.height and "generation" in df.columns
                and df["generation"].null_count() == 0):
            rounds = [replace(sd, samples=part, extra={})
                      for _, part in sorted(df.partition_by("generation", as_dict=True).items())]
        sd.extra[key] = rounds
    return sd.extra[key]


def per_round(fn: Callable) -> Callable:
    """``fn(sd, ...)`` as the trainer logs it: computed per generation round and averaged over the
    step's rounds, values that are None or NaN dropped (TRL's ``log()``); ``fn`` itself when
    :func:`generation_rounds` is None."""
    @functools.wraps(fn)
    def wrapped(sd, *args, **kw):
        rounds = generation_rounds(sd)
        if rounds is None:
            return fn(sd, *args, **kw)
        vals = [v for r in rounds if (v := fn(r, *args, **kw)) is not None and not math.isnan(v)]
        return sum(vals) / len(vals) if vals else None
    return wrapped


# -- statistics (one definition each) ---------------------------------------------------------

def mean(x: np.ndarray | None) -> float | None:
    return float(np.mean(x)) if x is not None and x.size else None


def std_sample(x: np.ndarray | None) -> float | None:
    return float(np.std(x, ddof=1)) if x is not None and x.size > 1 else None


def std_population(x: np.ndarray | None) -> float | None:
    return float(np.std(x, ddof=0)) if x is not None and x.size else None


def quantiles(x: np.ndarray | None, qs) -> list[float] | None:
    """The quantiles ``qs`` of ``x`` (one partition of ``x`` for all of them, each value the same
    as alone); None when ``x`` is None or empty."""
    if x is None or not x.size:
        return None
    return [float(t) for t in np.quantile(x, qs, method="linear")]


def quantile_of(q: float, column: str | None = None) -> Callable:
    """fn(sd[, column]): quantile ``q`` of the finite values of a samples column. The step's
    :data:`QUANTILES` of the column are computed together, once, by the first of their metrics."""
    def fn(sd, column: str = column):
        key = ("samples", "_quantiles", column)
        if key not in sd.extra:
            v = quantiles(finite_values(sd, column), QUANTILES)
            sd.extra[key] = None if v is None else dict(zip(QUANTILES, v))
        got = sd.extra[key]
        return None if got is None else got[q]
    return fn


def nonfinite_count(sd, column: str) -> float | None:
    x = sample_values(sd, column)
    return None if x is None else float(np.count_nonzero(~np.isfinite(x)))


# -- groups -----------------------------------------------------------------------------------

def frac_reward_zero_std(sd) -> float | None:
    """TRL: the fraction of completions whose group's reward std is zero (``isclose(σ, 0)``).

    σ is the sample std of the group's finite rewards (NaN, hence not zero, with fewer than two),
    or of the whole step's rewards under ``scale_rewards="batch"``; with ``num_generations=1`` TRL
    sets σ = 0. Every completion of the group counts, unscorable ones too."""
    r = sample_values(sd, "reward")
    gi = group_index(sd)
    if r is None or gi is None:
        return None
    inv, n_groups = gi
    ok = np.isfinite(r)
    if sd.cfg.get("scale_rewards") == "batch":
        if r.size == 1:  # TRL: zeros_like when the batch holds one completion
            return 1.0
        s = std_sample(r[ok])
        return float(s is not None and s <= ZERO_STD_ATOL)
    if sd.cfg.get("num_generations") == 1:  # TRL: zeros_like, no std of one value
        return 1.0
    n = np.bincount(inv, weights=ok, minlength=n_groups)
    s1 = np.bincount(inv, weights=np.where(ok, r, 0.0), minlength=n_groups)
    mu = s1 / np.maximum(n, 1)
    dev = np.where(ok, r - mu[inv], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.bincount(inv, weights=dev * dev, minlength=n_groups) / (n - 1)
    zero = (n > 1) & (np.sqrt(np.where(n > 1, var, 0.0)) <= ZERO_STD_ATOL)
    return float(np.mean(zero[inv]))


# The rewards family reads this column (advantage/frac_zero_groups), so ``--only rewards`` must run it.
@producer("advantage", merge={"advantage.seq": "first"}, families=("rewards",))
def _seq_advantage(b, cfg: dict) -> dict[str, np.ndarray]:
    """Each sequence's advantage (its first token's): the token-level fallback for a samples table
    without an ``advantage`` column."""
    return {"advantage.seq": b.cols["advantage"][b.starts].astype(np.float64) if b.n_seq else np.zeros(0)}


def sample_advantages(sd) -> tuple[np.ndarray, np.ndarray] | None:
    """(one advantage per samples row, which rows have one): the samples' ``advantage`` column
    (every row; null -> NaN), or else the token-level advantage of the sample's sequence at this
    step (rows without token rows here have none); None when neither exists."""
    a = sample_values(sd, "advantage")
    if a is not None:
        return a, np.ones(len(a), dtype=bool)
    tok_ids, tok_adv = sd.seqs.get("sample_id"), sd.seqs.get("advantage.seq")
    if sd.samples is None or sd.samples.height == 0 or tok_ids is None or tok_adv is None or not len(tok_ids):
        return None
    uniq, first = np.unique(tok_ids, return_index=True)  # a sample reused within the step: any copy
    sids = sd.samples["sample_id"].to_numpy()
    pos = np.minimum(np.searchsorted(uniq, sids), len(uniq) - 1)
    found = uniq[pos] == sids
    out = np.full(len(sids), np.nan)
    out[found] = tok_adv[first[pos[found]]]
    return out, found


def frac_zero_advantage_groups(sd, empty: float | None = None, nonfinite_not_zero: bool = False) -> float | None:
    """The fraction of prompt groups all of whose advantages satisfy |a| < 1e-8, over the samples'
    advantages or, without that column, the token-level ones (:func:`sample_advantages`).

    By default over the finite advantages, groups without one not counted (``empty`` if none).
    ``nonfinite_not_zero`` is MaxEnt-GRPO's rule (``_fraction_zero_std_groups``): every group with a
    completion counts and a NaN or ±inf advantage makes it non-zero (``abs(nan) < 1e-8`` is false).
    Samples with no advantage at all are left out."""
    got = sample_advantages(sd)
    gi = group_index(sd)
    if got is None or gi is None:
        return empty
    (a, known), (inv, n_groups) = got, gi
    if nonfinite_not_zero:
        has = np.bincount(inv, weights=known, minlength=n_groups) > 0
        big = np.bincount(inv, weights=known & ~(np.abs(a) < ZERO_ADV_TOL), minlength=n_groups) > 0
    else:
        ok = known & np.isfinite(a)
        has = np.bincount(inv, weights=ok, minlength=n_groups) > 0
        big = np.bincount(inv, weights=ok & (np.abs(np.where(ok, a, 0.0)) >= ZERO_ADV_TOL), minlength=n_groups) > 0
    if not has.any():
        return empty
    return float(np.count_nonzero(has & ~big) / np.count_nonzero(has))


def _n_samples(sd) -> float | None:
    return float(sd.samples.height) if sd.samples is not None else None


def _n_groups(sd) -> float | None:
    gi = group_index(sd)
    return float(gi[1]) if gi is not None else (0.0 if sd.samples is not None else None)


# -- registry ---------------------------------------------------------------------------------

def stat_of(stat: Callable, column: str | None = None, empty: float | None = None) -> Callable:
    """fn(sd[, column]) applying ``stat`` to the finite values of a samples column; ``empty`` when
    the column is there but ``stat`` has nothing to average (MaxEnt-GRPO logs 0.0)."""
    def fn(sd, column: str = column):
        x = finite_values(sd, column)
        if x is None:  # no samples, or the column is absent: nothing was logged
            return None
        v = stat(x)
        return empty if v is None else v
    return fn


_FAM = "rewards"
_S = dict(kind="custom", source="samples")

register(Metric(
    "reward/mean", _FAM, "Mean total (weighted) reward `reward` over the step's completions with a finite reward.",
    fn=per_round(stat_of(mean, "reward")), requires=("reward",), **_S))
register(Metric(
    "reward/std", _FAM, "Sample standard deviation (÷(n−1), Bessel) of the finite total rewards over the whole "
    "step (not per group); null with fewer than 2. TRL's `nanstd`.",
    fn=per_round(stat_of(std_sample, "reward")), requires=("reward",), **_S))
register(Metric(
    "reward/std_pop", _FAM, "Population standard deviation (÷n) of the finite total rewards over the step; "
    "0 for one value. MaxEnt-GRPO's `reward_std`.",
    fn=stat_of(std_population, "reward"), requires=("reward",), **_S))
for _q in QUANTILES:
    _k = quantile_key(_q)
    register(Metric(
        f"reward/{_k}", _FAM, f"Quantile q={_q:g} of the finite total rewards, linear interpolation "
        "(numpy `linear`, type 7); null when none.",
        fn=quantile_of(_q, "reward"), requires=("reward",), **_S))
register(Metric(
    "reward/count", _FAM, "Completions of the step with a finite total reward (those the reward statistics use).",
    fn=lambda sd: None if (x := finite_values(sd, "reward")) is None else float(x.size), requires=("reward",), **_S))
register(Metric(
    "reward/nonfinite", _FAM, "Completions whose total reward is null (unscorable), NaN or ±inf: excluded from "
    "every reward statistic.",
    fn=lambda sd: nonfinite_count(sd, "reward"), requires=("reward",), **_S))
register(Metric(
    "reward/frac_zero_std", _FAM, "Fraction of completions whose prompt group has zero reward std, "
    "`isclose(σ, 0)` (|σ| ≤ 1e-8), σ = sample std of the group's finite rewards (not zero with fewer than 2); "
    "σ of the whole step under `scale_rewards=batch`; every completion zero with `num_generations=1`. "
    "Equals the fraction of groups when groups have equal size. TRL's rule.",
    fn=per_round(frac_reward_zero_std), requires=("reward",), config=("scale_rewards", "num_generations"), **_S))
register(Metric(
    "advantage/frac_zero_groups", _FAM, "Fraction of prompt groups whose finite advantages all satisfy "
    "|a| < 1e-8 (groups with no finite advantage not counted). The samples' `advantage` column, or "
    "without it each completion's token-level advantage at the step. MaxEnt-GRPO's "
    "`frac_reward_zero_std` (its rule: every group with a completion counts, a non-finite advantage "
    "makes the group non-zero, 0.0 when there is no group): by advantages, so it equals "
    "`reward/frac_zero_std` only when advantages are group-centred.",
    fn=frac_zero_advantage_groups, requires=("advantage",), **_S))
register(Metric(
    "samples/count", _FAM, "Completions generated at the step (rows of the samples table, all ranks).",
    fn=_n_samples, **_S))
register(Metric(
    "samples/groups", _FAM, "Prompt groups generated at the step (distinct `group_id`).",
    fn=_n_groups, **_S))
for _name, _fn, _doc in (
    ("mean", mean, "Mean"),
    ("std", std_sample, "Sample standard deviation (÷(n−1); null with fewer than 2)"),
    ("min", lambda x: float(np.min(x)) if x is not None and x.size else None, "Minimum"),
    ("max", lambda x: float(np.max(x)) if x is not None and x.size else None, "Maximum"),
):
    register(Metric(
        f"advantage/{_name}", _FAM, f"{_doc} of the completions' finite advantages (samples table, one per completion).",
        fn=stat_of(_fn, "advantage"), requires=("advantage",), **_S))

# Per reward function: one column ``reward/<name>`` each (raw, unweighted), templates expanded per run.
_N = PLACEHOLDER
_P = dict(per_column=REWARD_PREFIX, requires=(f"{REWARD_PREFIX}{_N}",), **_S)
_F = f"`{REWARD_PREFIX}{_N}`"  # how docs name the column
register(Metric(
    f"rewards/{_N}/mean", _FAM, f"Mean of the finite raw (unweighted) values of {_F}, one column per "
    "reward function (completions it did not score are excluded). TRL `nanmean`.",
    fn=per_round(stat_of(mean)), **_P))
register(Metric(
    f"rewards/{_N}/std", _FAM, f"Sample std (÷(n−1)) of the finite raw values of {_F}; null with "
    "fewer than 2. TRL `nanstd`.",
    fn=per_round(stat_of(std_sample)), **_P))
register(Metric(
    f"rewards/{_N}/std_pop", _FAM, f"Population std (÷n) of the finite raw values of {_F}. "
    "MaxEnt-GRPO's per-reward `std`.",
    fn=stat_of(std_population), **_P))
for _q in QUANTILES:
    _k = quantile_key(_q)
    register(Metric(
        f"rewards/{_N}/{_k}", _FAM, f"Quantile q={_q:g} of the finite raw values of {_F} "
        "(numpy `linear`).",
        fn=quantile_of(_q), **_P))
register(Metric(
    f"rewards/{_N}/nonfinite", _FAM, f"Completions whose {_F} is null, NaN or ±inf "
    "(excluded from its statistics).",
    fn=lambda sd, column: nonfinite_count(sd, column), **_P))


register_family(Family(
    'rewards', page='rewards',
    key_metrics=('reward/mean', 'reward/std', 'reward/frac_zero_std'),
    overview=(
        (1, 'reward', ('^rewards?/mean$', '^reward$', '^rewards?/total/mean$', '^samples/reward/mean$')),
    ),
))
