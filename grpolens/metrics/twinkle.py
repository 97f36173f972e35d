"""Twinkle's own quantities (twinkle-kit 0.5.1): partials and reductions the ``twinkle`` profile
(``grpolens/profiles/twinkle.py``) uses.

**Temperature.** Twinkle's ``GRPOMetric(temperature=T)`` multiplies the current and old log-probs
by ``T`` before every statistic ("to recover T=1 log-probs", which it does not: T·log softmax(z/T)
≠ log softmax(z)). The profile applies the same ×T to the stored log-probs, from the run's
``temperature``: the means scale linearly; ``approx_kl``, ``token_kl_max``, ``token_ratio_max``
and the clip rates are recomputed on T·d (partials below, only when T ≠ 1). Entropy is not scaled.

**On-policy.** Without old log-probs Twinkle logs no ratio, KL or clip value.

**Clip rates** by the metric class that goes with the loss: ``GRPOMetric`` (token ratio, gated by
the advantage's sign), ``GSPOMetric`` (sequence-level loss: geometric-mean ratio and mean advantage
per sequence with a token), ``CISPOMetric`` (cispo and sapo: no gate), all over every masked token
(or sequence) of the step, all ranks.

**loss** (``LossMetric``): the mean over every forward (loss call) of every rank of the loss the
configured Twinkle loss returned for it, entropy bonus included, as Twinkle prints it (4 decimals).
Per forward, with L the per-token loss (``log_ratio_clamp`` 20 on d) + β·k3(ref) − entropy_coef·H:
grpo/gspo/sapo the mean over its sequences of Σ L / max(n, 1); bnpo Σ L / max(Σ n, 1); cispo
Σ L / Σ n with Twinkle's CISPO weight −min(r, 1 + epsilon)·A·logp — **capped at 1 + epsilon, not
1 + epsilon_high**, while ``CISPOMetric`` counts r > 1 + epsilon_high (a Twinkle quirk,
https://github.com/modelscope/twinkle/blob/main/src/twinkle/loss/grpo.py); dr_grpo
Σ L / (sequences · max_completion_length); ``ppo_token_mean``/``ppo`` (PPOLoss) Σ L / max(Σ n, 1)
or the grpo mean.

**Rewards** (``CompletionRewardMetric``): ``train/<name>_reward`` the mean of each reward function's
values over the step's completions, ``train/<name>_reward_std`` their sample standard deviation (0
for a single completion), ``train/completion_length`` the mean completion length.
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.functional import estimators as est
from grpolens.metrics.ratios import adv_masked, adv_valid, count, is_level, log_ratio, ratio_valid
from grpolens.metrics.registry import Family, register_family, PLACEHOLDER, Metric, register

_COLS = ("tw.k3.sum", "tw.k3.max", "tw.r.max", "tw.g.n", "tw.g.low", "tw.g.high", "tw.below", "tw.above")
_MERGE = {c: "sum" for c in _COLS} | {"tw.k3.max": "max", "tw.r.max": "max"}


def temperature(cfg: dict) -> float:
    # config.check_config sets it (default 1.0) and refuses a value that is not > 0
    return float(cfg["temperature"])


def scaled(cfg: dict) -> bool:
    return temperature(cfg) != 1.0


@producer("twinkle_kit", merge=_MERGE)
def _twinkle(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    """Twinkle's nonlinear statistics on T·d (only computed when T ≠ 1; zeros otherwise)."""
    if not scaled(cfg) or b.n_seq == 0:
        return {c: np.zeros(b.n_seq) for c in _COLS}
    T = temperature(cfg)
    v = ratio_valid(b)
    d = T * log_ratio(b)  # 0 off the valid tokens
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.exp(d)
        k3 = est.k3(d)
    n = count(b, "ratio_valid", ratio_valid)
    eps, eph = cfg["epsilon"], cfg["epsilon_high"]
    out = {"tw.k3.sum": b.seq_sum(k3), "tw.k3.max": np.maximum.reduceat(np.where(v, k3, 0.0), b.starts),
           "tw.r.max": np.maximum.reduceat(np.where(v, r, 0.0), b.starts),
           "tw.below": b.count(v & (r < 1 - eps)), "tw.above": b.count(v & (r > 1 + eph))}
    av = adv_valid(b)
    adv = adv_masked(b)
    if is_level(cfg) == "sequence":
        na = b.count(av)
        with np.errstate(over="ignore", invalid="ignore"):
            s = np.exp(b.seq_sum(np.where(av, d, 0.0)) / np.maximum(na, 1.0))
        abar = b.seq_sum(adv) / np.maximum(na, 1.0)
        has = (na > 0).astype(np.float64)
        out.update({"tw.g.n": has, "tw.g.low": has * ((s < 1 - eps) & (abar < 0)),
                    "tw.g.high": has * ((s > 1 + eph) & (abar > 0))})
    else:
        out.update({"tw.g.n": b.count(av), "tw.g.low": b.count(av & (r < 1 - eps) & (adv < 0)),
                    "tw.g.high": b.count(av & (r > 1 + eph) & (adv > 0))})
    return out


# ---------------------------------------------------------------------------------------------
# Reductions the twinkle profile uses for the policy and clip metrics
# ---------------------------------------------------------------------------------------------

def _ratio(sd, num: str, den: str) -> float | None:
    tot = sd.col(den).sum()
    return float(sd.col(num).sum() / tot) if tot > 0 else None


def mean(sd, num: str, den: str) -> float | None:
    """A linear token mean of log-probs, ×T (Twinkle rescales each log-prob)."""
    v = _ratio(sd, num, den)
    return None if v is None else temperature(sd.cfg) * v


def nonlinear(sd, which: str) -> float | None:
    """approx_kl, token_kl_max or token_ratio_max on T·d; the maxima start at 0."""
    if "old_logp" not in sd.present or not sd.col("policy.new.n").sum() > 0:
        return None  # a step without sequences too (its count is 0): the maxima below are over one or more
    t = scaled(sd.cfg)
    if which == "approx_kl":
        return _ratio(sd, "tw.k3.sum" if t else "policy.k3.sum", "policy.n")
    col = {"token_kl_max": "tw.k3.max" if t else "policy.k3.max", "token_ratio_max": "tw.r.max" if t else None}[which]
    if col is None:  # T = 1: e^ of the stored largest d (e^-inf = 0 where no token has a ratio)
        with np.errstate(over="ignore"):
            v = float(np.exp(np.max(sd.col("policy.d.max"))))
    else:
        v = float(np.max(sd.col(col)))
    # every column here is >= 0 where a sequence has a valid token (e^x, K3 = expm1(x) - x >= 0 in
    # floating point); -inf (no valid token anywhere) and NaN become Twinkle's starting 0
    return v if v >= 0 else 0.0


def clip_fraction(sd, part: str, unconditional: bool) -> float | None:
    """Twinkle's clip rates: none without old log-probs; on T·d when T ≠ 1."""
    if "old_logp" not in sd.present:
        return None
    t = scaled(sd.cfg)
    if unconditional:
        num = {"low": "tw.below" if t else "clip.below", "high": "tw.above" if t else "clip.above"}
        den = "clip.n"
        if part == "region":
            tot = sd.col(den).sum()
            return float((sd.col(num["low"]).sum() + sd.col(num["high"]).sum()) / tot) if tot > 0 else None
        return _ratio(sd, num[part], den)
    if not t:
        return _ratio(sd, f"clip.g.{part}", "clip.g.n")
    if part == "region":
        tot = sd.col("tw.g.n").sum()
        return float((sd.col("tw.g.low").sum() + sd.col("tw.g.high").sum()) / tot) if tot > 0 else None
    return _ratio(sd, f"tw.g.{part}", "tw.g.n")


# ---------------------------------------------------------------------------------------------
# LossMetric and CompletionRewardMetric
# ---------------------------------------------------------------------------------------------

def _loss(sd) -> float | None:
    if "tw_loss.sum" not in sd.seqs:  # a step without sequences has no partial column
        return None
    lt = sd.cfg["loss_type"]
    s, n = sd.col("tw_loss.sum"), sd.col("tw_loss.n")
    g, _ = sd.groups(("rank", "micro_batch"))  # every call id in 0..n-1 occurs in g
    rows = np.bincount(g).astype(np.float64)
    ssum, nsum = np.bincount(g, s), np.bincount(g, n)
    if lt in ("grpo", "gspo", "sapo"):
        per = np.bincount(g, s / np.maximum(n, 1.0)) / rows
    elif lt in ("bnpo", "dapo"):
        per = ssum / np.maximum(nsum, 1.0)
    elif lt == "cispo":
        with np.errstate(invalid="ignore", divide="ignore"):
            per = ssum / nsum
    elif lt == "dr_grpo":
        length = sd.cfg.get("max_completion_length") or 1024  # DRGRPOLoss' default
        per = ssum / (rows * float(length))
    else:
        return None
    return float(np.mean(per))


# The engine calls a samples metric only at a step with a samples shard (sd.samples is not None).

def _reward(sd, column: str, stat: str) -> float | None:
    df = sd.samples
    if df.height == 0 or column not in df.columns:
        return None
    col = df[column]
    if col.null_count():  # nulls are dropped, NaN kept (drop_nulls is a polars query: only when needed)
        col = col.drop_nulls()
    x = col.to_numpy().astype(np.float64)
    if stat == "mean":
        return float(x.mean()) if len(x) else -1.0  # Twinkle's _mean of nothing
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def _completion_length(sd) -> float | None:
    df = sd.samples
    if df.height == 0:
        return None
    return float(df["completion_len"].cast(float).mean())


register(Metric(
    "twinkle/loss", "twinkle_kit",
    "Twinkle's LossMetric: the mean over every forward of every rank of the loss Twinkle's loss class "
    "returned (its per-forward aggregation, β·k3 and the entropy bonus −entropy_coef·H included; CISPO "
    "capped at 1 + epsilon).",
    kind="custom", fn=_loss, config=("loss_type", "epsilon", "epsilon_high", "beta", "entropy_coef",
                                     "max_completion_length", "log_ratio_clamp"),
    when=lambda cfg: cfg.get("loss_type") in ("grpo", "gspo", "sapo", "bnpo", "dapo",
                                                                          "cispo", "dr_grpo"),
))
register(Metric(
    f"twinkle/reward/{PLACEHOLDER}", "twinkle_kit",
    "Twinkle's CompletionRewardMetric: mean of the reward function's values over the step's completions.",
    kind="custom", fn=lambda sd, column: _reward(sd, column, "mean"), source="samples", per_column="reward/",
))
register(Metric(
    f"twinkle/reward_std/{PLACEHOLDER}", "twinkle_kit",
    "Twinkle's CompletionRewardMetric: sample standard deviation (n − 1) of the reward function's values "
    "over the step's completions, 0 for one completion.",
    kind="custom", fn=lambda sd, column: _reward(sd, column, "std"), source="samples", per_column="reward/",
))
register(Metric(
    "twinkle/completion_length", "twinkle_kit",
    "Twinkle's CompletionRewardMetric: mean completion length (tokens) over the step's completions.",
    kind="custom", fn=_completion_length, source="samples",
))


@producer("twinkle_loss", merge={"tw_loss.sum": "sum", "tw_loss.n": "sum"}, families=("twinkle_kit",))
def _twinkle_loss(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    """Per sequence Σ L and its tokens, L as Twinkle's loss classes compute it (see the module doc)."""
    from grpolens.metrics.loss import loss_partials

    c = {**cfg, "log_ratio_clamp": est.LOG_RATIO_BOUND, "delta": None, "rollout_is": None, "use_bias_correction_kl": False}
    if c["loss_type"] == "cispo":
        c["epsilon_high"] = 1.0 + cfg["epsilon"]  # CISPOLoss caps the weight at 1 + epsilon
    if c["loss_type"] not in ("grpo", "gspo", "sapo", "bnpo", "dapo", "cispo", "dr_grpo"):
        return {"tw_loss.sum": np.zeros(b.n_seq), "tw_loss.n": np.zeros(b.n_seq)}
    # L − entropy_coef·H on the valid tokens (np.nan_to_num of H: NaN 0, ±inf ±max)
    s, n = loss_partials(b, c, entropy_coef=float(cfg.get("entropy_coef") or 0.0))
    return {"tw_loss.sum": s, "tw_loss.n": n}


register_family(Family("twinkle_kit", page="policy"))
