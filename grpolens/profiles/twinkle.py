"""Twinkle's ``GRPOMetric`` / ``GSPOMetric`` / ``CISPOMetric`` (at temperature 1): global sums over
the step; its running maxima start at 0 and it logs nothing at a step without a masked token."""

from grpolens.metrics import policy
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
}


def running_max(fn):
    """Twinkle's maxima start at 0, and nothing is logged when the step has no masked token. The
    maxima it takes (e^d, K3 = expm1(d) - d, finite or None) are never below 0, so starting at 0
    shows only when there is no value at all."""
    def wrapped(sd):
        if not sd.col("policy.new.n").sum() > 0:
            return None
        value = fn(sd)
        return value if value is not None else 0.0
    return wrapped


PROFILE = register_profile(Profile(
    "twinkle", "Twinkle's GRPO/GSPO/CISPO metrics", reference="Twinkle `GRPOMetric` at temperature 1",
    token_mean="pooled", extrema="maxima start at 0", empty="key absent",
    names=NAMES,
    reductions={"policy/token_kl_max": running_max(policy.token_kl_max),
                "policy/ratio_max": running_max(policy.ratio_extreme("max"))},
))
