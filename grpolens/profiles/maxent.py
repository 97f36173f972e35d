"""MaxEnt-GRPO (``7266e31`` / ``01b0177``): pooled values under its ``train/`` keys; it logs 0.0 where
there is nothing to average, clamps the KL log-ratio to ±60 and counts max(mask, 1) tokens per
sequence in its length buckets."""

from functools import partial

from grpolens.metrics import completions, kl, rewards
from grpolens.metrics.profile import Profile, register_profile
from grpolens.metrics.rewards import QUANTILES, mean, per_round, quantile_key, stat_of, std_population

_Q = [quantile_key(q) for q in QUANTILES]

NAMES = {
    "entropy": "train/policy_entropy",
    "reward/mean": "train/reward",
    "reward/std_pop": "train/reward_std",
    **{f"reward/{k}": f"train/reward_{k}" for k in _Q},
    "advantage/frac_zero_groups": "train/frac_reward_zero_std",
    "rewards/<name>/mean": "train/rewards/<name>/mean",
    "rewards/<name>/std_pop": "train/rewards/<name>/std",
    **{f"rewards/<name>/{k}": f"train/rewards/<name>/{k}" for k in _Q},
    **{f"completions/length/{w}": f"train/completions/{w}_length_sampled" for w in ("mean", "min", "max")},
    "completions/clipped_frac": "train/completions/clipped_frac",
    **{f"completions/unclipped_length/{w}": f"train/completions/{w}_length_terminated" for w in ("mean", "min", "max")},
    **{f"diversity/{d}{m}": f"train/completions/diversity/{d}{m}"
       for d in ("distinct_1", "distinct_2", "jaccard") for m in ("", "_micro")},
    "kl/k3_loss_norm": "train/kl",
    **{f"kl/by_length{t}/{b}": f"train/kl_per_token_bucket{t}/{b}" for b in kl.BUCKET_LABELS for t in ("", "_tokens")},
}

REDUCTIONS = {
    # 0.0 where the column is there but nothing is left to average
    "reward/mean": per_round(stat_of(mean, "reward", empty=0.0)),
    "reward/std_pop": stat_of(std_population, "reward", empty=0.0),
    # its _fraction_zero_std_groups: non-empty groups count, a NaN advantage makes a group non-zero
    "advantage/frac_zero_groups": partial(rewards.frac_zero_advantage_groups, empty=0.0, nonfinite_not_zero=True),
    "rewards/<name>/mean": per_round(stat_of(mean, empty=0.0)),
    "rewards/<name>/std_pop": stat_of(std_population, empty=0.0),
    **{f"completions/unclipped_length/{w}": completions.length_stat(w, "length", empty=0.0) for w in ("mean", "min", "max")},
    # x clamped to ±60, denominators clamped to >= 1
    "kl/k3_loss_norm": partial(kl.k3_loss_norm, clamped=True),
    **{f"kl/by_length/{b}": kl.bucket(i, tokens=False, clamped=True) for i, b in enumerate(kl.BUCKET_LABELS)},
    **{f"kl/by_length_tokens/{b}": kl.bucket(i, tokens=True, clamped=True) for i, b in enumerate(kl.BUCKET_LABELS)},
}

PROFILE = register_profile(Profile(
    "maxent", "MaxEnt-GRPO's train/ keys", reference="MaxEnt-GRPO `7266e31` / `01b0177`",
    token_mean="pooled", extrema="—", empty="MaxEnt's 0.0 where it logs one",
    names=NAMES, reductions=REDUCTIONS,
))
