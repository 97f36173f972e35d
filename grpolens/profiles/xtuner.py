"""xtuner's RL trainer: per-pack (rank, micro-batch) token means Σ / (Σ m + 1e-8), averaged over packs
with a valid token; its train-policy values with the log-ratio clamped to ±20 and 0.0 when no token
is valid; its rollout-IS module's ``mismatch/`` keys, merged over packs."""

from grpolens.metrics import policy, rollout_is
from grpolens.metrics.profile import Profile, register_profile

#: xtuner's rollout-IS module logs under this prefix
PREFIX = "mismatch/"

_ROLLOUT = {
    "rollout_is/raw/mean": "rollout_is_mean",
    "rollout_is/raw/min": "rollout_is_min",
    "rollout_is/raw/max": "rollout_is_max",
    "rollout_is/raw/fraction_high": "rollout_is_ratio_fraction_high",
    "rollout_is/raw/fraction_low": "rollout_is_ratio_fraction_low",
    "rollout_is/raw/seq_mean": "rollout_is_seq_mean",
    "rollout_is/raw/seq_std": "rollout_is_seq_std",
    "rollout_is/raw/seq_min": "rollout_is_seq_min",
    "rollout_is/raw/seq_max": "rollout_is_seq_max",
    "rollout_is/raw/seq_max_deviation": "rollout_is_seq_max_deviation",
    "rollout_is/raw/seq_fraction_high": "rollout_is_seq_fraction_high",
    "rollout_is/raw/seq_fraction_low": "rollout_is_seq_fraction_low",
    "rollout_is/clamped/std": "rollout_is_std",
    "rollout_is/clamped/ess": "rollout_is_eff_sample_size",
    "rollout_is/mask/token_fraction": "rollout_is_masked_fraction",
    "rollout_is/mask/seq_fraction": "rollout_is_seq_masked_fraction",
    "rollout_is/veto/seq_fraction": "rollout_is_veto_fraction",
    "rollout_is/veto/catastrophic_token_fraction": "rollout_is_catastrophic_token_fraction",
    "mismatch/kl_k1": "mismatch_kl",
    "mismatch/kl_k3": "mismatch_k3_kl",
    "mismatch/abs_logp_diff": "mismatch_logprob_abs_diff",
    "mismatch/training_ppl": "mismatch_training_ppl",
    "mismatch/training_log_ppl": "mismatch_training_log_ppl",
    "mismatch/rollout_ppl": "mismatch_rollout_ppl",
    "mismatch/rollout_log_ppl": "mismatch_rollout_log_ppl",
    "mismatch/log_ppl_diff": "mismatch_log_ppl_diff",
    "mismatch/log_ppl_abs_diff": "mismatch_log_ppl_abs_diff",
    "mismatch/log_ppl_diff_max": "mismatch_log_ppl_diff_max",
    "mismatch/log_ppl_diff_min": "mismatch_log_ppl_diff_min",
    "mismatch/ppl_ratio": "mismatch_ppl_ratio",
}

_POLICY = {
    "policy/k1": "reduced_train_policy_kl1",
    "policy/approx_kl": "reduced_train_policy_kl3",
    "policy/ratio_abs_dev_mean": "reduced_train_policy_ratio_abs_dev_mean",
    "policy/ratio_max": "reduced_train_policy_ratio_max",
    "policy/ratio_min": "reduced_train_policy_ratio_min",
    "clip/ratio_below": "reduced_train_policy_clip_frac_low",
    "clip/ratio_above": "reduced_train_policy_clip_frac_high",
}

NAMES = {**_POLICY, **{k: PREFIX + v for k, v in _ROLLOUT.items()}}

PROFILE = register_profile(Profile(
    "xtuner", "xtuner's train-policy and rollout-IS keys", reference="xtuner's rollout-IS module",
    token_mean="pack_mean", extrema="max/min over packs", empty="valid = false",
    names=NAMES,
    reductions={
        # log-ratio clamped to ±20 before k3 and before the ratio extremes
        "policy/approx_kl": policy.token_mean("policy.k3_c20.sum", "policy.n"),
        "policy/ratio_max": policy.ratio_extreme("max", clamp=policy.XTUNER_CLAMP),
        "policy/ratio_min": policy.ratio_extreme("min", clamp=policy.XTUNER_CLAMP),
    },
    # its train-policy values are 0.0 when no token of the step is valid
    zero_when_empty=frozenset(_POLICY), zero_needs_sequences=True,
    rollout_is_summary=rollout_is.xtuner_summary,
))
