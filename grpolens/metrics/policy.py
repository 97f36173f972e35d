"""Policy ratio: how far the current policy has moved from the behaviour (old) policy.

Per masked token whose ``logp`` and ``old_logp`` are finite, ``d = logp − old_logp`` and the
importance ratio ``r = e^d``. All means are token-weighted over the whole step (every rank and
micro-batch pooled), which is also how Twinkle's ``GRPOMetric`` and xtuner's
``reduced_train_policy_*`` reduce them (global sums, all-reduced):

    policy/logp_mean       Σ logp / N              policy/confidence  exp(policy/logp_mean)
    policy/old_logp_mean   Σ old / N               policy/log_ratio_mean  Σ d / N
    policy/approx_kl       Σ (e^d − d − 1) / N     Schulman's K3 of KL(old‖new): E_old[r − 1 − log r]
    policy/token_kl_max    max_t (e^d − d − 1)     policy/ratio_max / ratio_min   max_t / min_t e^d

Trainer quirks reproduced in their profiles (separate partial columns, never a changed formula):
Twinkle starts its running maxima at 0 (so a step with masked tokens but no usable one logs 0.0);
xtuner clamps d to ±20 before ``exp`` in every ``reduced_train_policy_*`` value and logs 0.0 when
no token is valid.

The per-token ratio quantities this family shares with the clip, KL and loss families (which
tokens have a usable ratio, d, e^d, the GSPO sequence ratio) are in :mod:`grpolens.metrics.ratios`.
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics import reduce
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.functional import estimators as est
from grpolens.metrics.ratios import log_ratio, log_ratio_expm1
from grpolens.metrics.registry import Family, Metric, register, register_family


# ---------------------------------------------------------------------------------------------
# Producer
# ---------------------------------------------------------------------------------------------

_MERGE = {
    "policy.new.sum": "sum", "policy.new.n": "sum",
    "policy.n": "sum", "policy.old.sum": "sum", "policy.d.sum": "sum",
    "policy.k3.sum": "sum", "policy.k3_c20.sum": "sum", "policy.absdev_c20.sum": "sum",
    "policy.k3.max": "max", "policy.d.max": "max", "policy.d.min": "min",
}


@producer("policy", merge=_MERGE)
def _policy(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    # one pass over the tokens (grpolens.metrics.kernels.policy_sums): with d = logp − old on the
    # ratio-valid tokens and 0 elsewhere, the sums of logp (masked, finite), old, d, k3(d) =
    # expm1(d) − d and |e^d − 1|, the counts, and the extrema of k3 and d
    from grpolens.metrics import kernels

    sums, counts, ext = kernels.policy_sums(b.logp, b.old, b.mask, log_ratio_expm1(b), b.starts, b.lengths)
    new_sum, old_sum, d_sum, k3_sum, absdev = sums
    n = b.cached("count:ratio_valid", lambda: counts[1])
    dmax, dmin = ext[1], ext[2]
    if b.n_seq and (dmax.max() > est.LOG_RATIO_BOUND or dmin.min() < -est.LOG_RATIO_BOUND):
        # xtuner's ±20 clamp changes some d: its k3 and |r − 1| from the clamped d
        dc = log_ratio(b, est.LOG_RATIO_BOUND)
        k3c_sum, absdev = b.seq_sum(est.k3(dc)), b.seq_sum(np.abs(np.expm1(dc)))
    else:
        k3c_sum = k3_sum
    return {
        "policy.new.sum": new_sum,
        "policy.new.n": counts[0],
        "policy.n": n,
        "policy.old.sum": old_sum,
        "policy.d.sum": d_sum,
        "policy.k3.sum": k3_sum,
        "policy.k3_c20.sum": k3c_sum,
        "policy.absdev_c20.sum": absdev,
        "policy.k3.max": ext[0],
        "policy.d.max": dmax,
        "policy.d.min": dmin,
    }


# ---------------------------------------------------------------------------------------------
# Reductions (pooled in every profile that logs these)
# ---------------------------------------------------------------------------------------------

def _pooled(sd, num: str, den: str) -> float | None:
    return reduce.grouped_ratio(sd, num, den, "pooled")


def extreme(sd, col: str, which: str) -> float | None:
    if not sd.n_seq:
        return None
    x = sd.col(col)
    v = float(np.max(x) if which == "max" else np.min(x))
    return v if np.isfinite(v) else None


def token_mean(num: str, den: str, sign: float = 1.0):
    """``fn(sd)``: sign · Σ num / Σ den pooled over the step."""
    def fn(sd):
        v = _pooled(sd, num, den)
        return None if v is None else sign * v
    return fn


def _confidence(sd) -> float | None:
    v = _pooled(sd, "policy.new.sum", "policy.new.n")
    return None if v is None else float(np.exp(v))


def ratio_extreme(which: str, clamp: float | None = None):
    """``fn(sd)``: the step's largest/smallest token ratio e^d, d clamped to ±``clamp`` first if given."""
    def fn(sd):
        dx = extreme(sd, f"policy.d.{which}", which)
        if dx is not None and clamp is not None:
            dx = float(np.clip(dx, -clamp, clamp))
        with np.errstate(over="ignore"):
            return None if dx is None else float(np.exp(dx))
    return fn


def token_kl_max(sd) -> float | None:
    return extreme(sd, "policy.k3.max", "max")


_FAM = "policy"
_OLD = ("old_logp",)

register(Metric(
    "policy/logp_mean", _FAM,
    "Mean current-policy log-prob of the masked tokens: Σ logp / N (finite logp).",
    kind="token_mean", num="policy.new.sum", den="policy.new.n",
))
register(Metric(
    "policy/confidence", _FAM,
    "Policy confidence exp(policy/logp_mean): the geometric-mean probability of the sampled tokens.",
    kind="custom", fn=_confidence,
))
register(Metric(
    "policy/old_logp_mean", _FAM,
    "Mean behaviour-policy log-prob Σ old_logp / N over tokens whose ratio is defined "
    "(Twinkle's docs call it the reference policy; it is the old policy).",
    kind="token_mean", num="policy.old.sum", den="policy.n", requires=_OLD,
))
register(Metric(
    "policy/log_ratio_mean", _FAM,
    "Mean log-ratio Σ d / N, d = logp − old_logp.",
    kind="token_mean", num="policy.d.sum", den="policy.n", requires=_OLD,
))
register(Metric(
    "policy/k1", _FAM,
    "k1 estimate of KL(old‖new): Σ (old_logp − logp) / N = −policy/log_ratio_mean "
    "(xtuner's `kl1`, not clamped). xtuner logs 0.0 when no token is valid.",
    kind="custom", fn=token_mean("policy.d.sum", "policy.n", sign=-1.0), requires=_OLD,
))
register(Metric(
    "policy/approx_kl", _FAM,
    "Approximate KL(old‖new), Schulman's K3: Σ (e^d − d − 1) / N. xtuner clamps d to ±20 first "
    "(its profile uses that column; equal unless |d| > 20) and logs 0.0 when no token is valid.",
    kind="custom", fn=token_mean("policy.k3.sum", "policy.n"), requires=_OLD,
))
register(Metric(
    "policy/ratio_abs_dev_mean", _FAM,
    "Mean |r − 1| with r = exp(clamp(d, ±20)) (xtuner's definition, clamp included).",
    kind="custom", fn=token_mean("policy.absdev_c20.sum", "policy.n"), requires=_OLD,
))
register(Metric(
    "policy/token_kl_max", _FAM,
    "Largest per-token K3 e^d − d − 1 in the step (all ranks). Twinkle starts the max at 0.",
    kind="custom", fn=token_kl_max, requires=_OLD,
))
register(Metric(
    "policy/ratio_max", _FAM,
    "Largest token ratio e^d in the step. Twinkle starts the max at 0; xtuner clamps d to ±20 "
    "(so it saturates at e^20) and logs 0.0 when no token is valid.",
    kind="custom", fn=ratio_extreme("max"), requires=_OLD,
))
register(Metric(
    "policy/ratio_min", _FAM,
    "Smallest token ratio e^d in the step (xtuner: d clamped to ±20, 0.0 when no token is valid).",
    kind="custom", fn=ratio_extreme("min"), requires=_OLD,
))


#: The built-in ``grpolens check`` rules over this family (see :mod:`grpolens.check.defaults`).
RULES = '''\
[[rule]]
name = "token KL max"
metric = "policy/token_kl_max"
direction = "upper"
early = { factor = 10.0, abs = 1.0 }
rel = 2.0
abs = 0.5
missing = "skip"
why = """The largest per-token k3 between the current and the behaviour policy: one token whose \
probability moved e-fold or more since it was sampled (k3 > 1 means a ratio above ~3.1 or below \
~0.16) escapes what PPO-style clipping and a mean over thousands of tokens can hide. It is 0 for \
strictly on-policy training and grows with the batch size, hence a floor of 1 and the run's own \
early level as the scale. Against a baseline: at most 3x the baseline's value plus 0.5."""
'''

register_family(Family(
    'policy', page='policy',
    key_metrics=('policy/approx_kl',),
    rules=RULES,
))
