"""Twinkle (twinkle-kit 0.5.1): ``GRPOMetric`` / ``GSPOMetric`` / ``CISPOMetric`` (global sums over
the step; maxima start at 0; nothing without a masked token), their ×temperature rescale of the
log-probs (from the run's ``temperature``), no ratio/KL/clip value without old log-probs,
``LossMetric`` (``loss``) and ``CompletionRewardMetric`` (``train/<name>_reward``,
``train/<name>_reward_std``, ``train/completion_length``). The rules are in
:mod:`grpolens.metrics.twinkle`; checked against Twinkle's own code (``tests/reference``)."""

import numpy as np

from grpolens.metrics import twinkle as tw
from grpolens.metrics.profile import Profile, register_profile

NAMES = {
    "entropy": "train/entropy",
    "policy/logp_mean": "train/mean_new_logp",
    "policy/confidence": "train/policy_confidence",
    "policy/old_logp_mean": "train/mean_old_logp",
    "policy/log_ratio_mean": "train/logp_diff_mean",
    "policy/approx_kl": "train/approx_kl",
    "policy/token_kl_max": "train/token_kl_max",
    "policy/ratio_max": "train/token_ratio_max",
    # gated metrics first: under CISPO/SAPO (no PPO clip) the names fall to the unconditional rates
    "clip/low": "train/clip_ratio_low",
    "clip/high": "train/clip_ratio_high",
    "clip/region": "train/clip_ratio",
    "clip/ratio_below": "train/clip_ratio_low",
    "clip/ratio_above": "train/clip_ratio_high",
    "clip/ratio_outside": "train/clip_ratio",
    "twinkle/loss": "loss",
    "twinkle/reward/<name>": "train/<name>_reward",
    "twinkle/reward_std/<name>": "train/<name>_reward_std",
    "twinkle/completion_length": "train/completion_length",
}


def _confidence(sd):
    v = tw.mean(sd, "policy.new.sum", "policy.new.n")
    return None if v is None else float(np.exp(v))


PROFILE = register_profile(Profile(
    "twinkle", "Twinkle's GRPO/GSPO/CISPO, loss and reward metrics", reference="twinkle-kit 0.5.1 (its own code, tests/reference)",
    token_mean="pooled", extrema="maxima start at 0", empty="key absent",
    names=NAMES,
    reductions={
        "policy/logp_mean": lambda sd: tw.mean(sd, "policy.new.sum", "policy.new.n"),
        "policy/confidence": _confidence,
        "policy/old_logp_mean": lambda sd: tw.mean(sd, "policy.old.sum", "policy.n"),
        "policy/log_ratio_mean": lambda sd: tw.mean(sd, "policy.d.sum", "policy.n"),
        "policy/approx_kl": lambda sd: tw.nonlinear(sd, "approx_kl"),
        "policy/token_kl_max": lambda sd: tw.nonlinear(sd, "token_kl_max"),
        "policy/ratio_max": lambda sd: tw.nonlinear(sd, "token_ratio_max"),
        **{f"clip/{p}": (lambda sd, p=p: tw.clip_fraction(sd, p, unconditional=False)) for p in ("low", "high", "region")},
        **{f"clip/ratio_{q}": (lambda sd, p=p: tw.clip_fraction(sd, p, unconditional=True))
           for q, p in (("below", "low"), ("above", "high"), ("outside", "region"))},
    },
))
