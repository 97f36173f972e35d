"""TRL's ``GRPOTrainer`` (>= 1.9, checked on 1.16): its logged keys and how it reduces them.

Token means per micro-batch *slot* (one loss call on all ranks) Σ / max(Σ m, 1), then the mean over
slots; generation-side values once per generation round, averaged over the step's rounds, and only
at steps with a generation; at sequence level the clip fractions count every sequence (GSPO).
"""

from functools import partial

from grpolens.metrics import clip, lengths, loss, rollout_is
from grpolens.metrics.profile import Profile, register_profile
from grpolens.metrics.rewards import per_round

NAMES = {
    "entropy": "entropy",
    "reward/mean": "reward",
    "reward/std": "reward_std",
    "reward/frac_zero_std": "frac_reward_zero_std",
    "rewards/<name>/mean": "rewards/<name>/mean",
    "rewards/<name>/std": "rewards/<name>/std",
    "completions/length/mean": "completions/mean_length",
    "completions/length/min": "completions/min_length",
    "completions/length/max": "completions/max_length",
    "completions/truncated_frac": "completions/clipped_ratio",
    "completions/terminated_length/mean": "completions/mean_terminated_length",
    "completions/terminated_length/min": "completions/min_terminated_length",
    "completions/terminated_length/max": "completions/max_terminated_length",
    "tokens/seen": "num_tokens",
    "kl/penalty": "kl",
    "clip/low": "clip_ratio/low_mean",
    "clip/high": "clip_ratio/high_mean",
    "clip/region": "clip_ratio/region_mean",
    "clip/low_min": "clip_ratio/low_min",
    "clip/high_max": "clip_ratio/high_max",
    "clip/cispo": "cispo_clip_ratio",
    "loss": "loss",
    "rollout_is/applied/mean": "sampling/importance_sampling_ratio/mean",
    "rollout_is/applied/min": "sampling/importance_sampling_ratio/min",
    "rollout_is/applied/max": "sampling/importance_sampling_ratio/max",
    "mismatch/abs_logp_diff": "sampling/sampling_logp_difference/mean",
    "mismatch/abs_logp_diff_max": "sampling/sampling_logp_difference/max",
}

REDUCTIONS = {
    # at sequence level TRL counts every sequence, fully masked ones too ("gt" partial columns)
    **{f"clip/{p}": clip.fraction(p, counted="gt") for p in ("low", "high", "region", "cispo")},
    "clip/low_min": clip.seq_extreme("low", "min", counted="gt"),
    "clip/high_max": clip.seq_extreme("high", "max", counted="gt"),
    # TRL logs 0 for a round where no completion ended with EOS
    **{f"completions/terminated_length/{w}": per_round(lengths.length_stat(w, "eos", empty=0.0))
       for w in ("mean", "min", "max")},
    # the loss each call returns, summed over a rank's calls, mean over ranks
    "loss": partial(loss.loss_value, per_call=True),
}

PROFILE = register_profile(Profile(
    "trl", "TRL's GRPOTrainer keys, as TRL would have logged them", reference="TRL >= 1.9 (checked on 1.16)",
    token_mean="trl_slot",
    extrema="`low_min`/`high_max`: per-sequence fractions, nanmin/nanmax per slot, mean over slots",
    empty="0.0 for a slot, as TRL logs",
    names=NAMES, reductions=REDUCTIONS, per_generation_round=True,
    generation_only=frozenset(k for k in NAMES if k.startswith(("rollout_is/", "mismatch/"))),
    rollout_is_summary=rollout_is.trl_summary,
    log_file="trl_log.jsonl",
    # TRL computes the k3 term exp(ref − logp) − (ref − logp) − 1 in float32, which cancels to ~1e-8
    # absolute near 0, and its loss is a float32 sum of O(1) terms (rounding ~1e-7..1e-6)
    float32_floors={"kl": 1e-7, "loss": 1e-6},
))
