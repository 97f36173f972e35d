"""OpenRLHF's PPO/GRPO actor (``openrlhf/trainer/ray/ppo_actor.py``, ``openrlhf/models/loss.py``,
``openrlhf/trainer/ppo_trainer.py``; main of August 2026): the keys its wandb/TensorBoard logger
writes (``train/<status key>``) for what grpolens can recompute exactly.

How OpenRLHF reduces them. Each micro-batch's ``ppo_clip_ratio`` (``masked_mean(surr2 < surr1)``),
``ppo_kl`` (``masked_mean(old_logp − logp)``) and ``vllm_kl`` (``masked_mean(rollout_logp − old_logp)``)
is a token mean over the micro-batch's action mask; ``ppo_train`` weighs it by the micro-batch's
action tokens, all-reduces numerator and tokens over ranks and averages the micro-batches of the
step (every epoch) by their tokens again: Σ x / Σ tokens over the whole step, grpolens' pooled
token mean. The ``rollout/*`` statistics are over every completion generated for the step.

Not reproduced, so not named here: ``policy_loss``, ``entropy_loss`` and ``kl`` (normalised per
micro-batch by the optimizer-step window's global token count × dp_size, then token-weighted
again, and ``kl`` clamped to ±10 per token), ``logprobs_diff`` (a token mean with ``kl.use_loss``,
a mean of per-sample means without), ``group_reward_std`` and ``return``.
"""

from grpolens.metrics import clip
from grpolens.metrics.profile import Profile, register_profile
from grpolens.metrics.rewards import stat_of, std_sample

NAMES = {
    # actor, per training step (token-weighted over micro-batches, ranks and epochs)
    "clip/region": "train/ppo_clip_ratio",
    "policy/k1": "train/ppo_kl",
    "mismatch/kl_k1": "train/vllm_kl",
    # rollout statistics (ppo_trainer._compute_rollout_stats: every generated completion)
    "reward/mean": "train/rollout/reward_mean",
    "reward/std": "train/rollout/reward_std",
    "completions/length/mean": "train/rollout/response_length_mean",
    "completions/truncated_frac": "train/rollout/truncated_rate",
    "samples/count": "train/rollout/num_samples",
}


def _token_level_clip_ratio(sd):
    """``masked_mean(surr2 < surr1)``: for A > 0 the ratio above 1 + ε_high, for A < 0 below 1 − ε
    (its PPO ratio exp(clamp(d, ±20)) is on the same side of both bounds as e^d). Under GSPO its
    sequence ratio is broadcast over the tokens and averaged token-weighted, which grpolens' clip
    partials (one indicator per sequence) do not give: nothing there."""
    if sd.cfg.get("importance_sampling_level", "token") != "token":
        return None
    return clip.fraction("region")(sd)


PROFILE = register_profile(Profile(
    "openrlhf", "OpenRLHF's PPO/GRPO actor and rollout keys",
    reference="OpenRLHF main (2026-08, `ppo_actor.ppo_train`)",
    token_mean="pooled", extrema="—", empty="0.0 for a one-sample reward std",
    names=NAMES,
    settings={"clip_low": "--eps_clip_low_high", "clip_high": "--eps_clip_low_high", "kl_coef": "--init_kl_coef",
              "entropy_coef": "--entropy_loss_coef", "learning_rate": "--actor_learning_rate", "max_grad_norm": "--max_norm",
              "num_iterations": "--max_epochs", "num_generations": "--n_samples_per_prompt",
              "max_completion_length": "--generate_max_len", "temperature": "--temperature",
              "dynamic_sampling": "--dynamic_filtering"},
    reductions={
        "clip/region": _token_level_clip_ratio,
        # torch.std (÷(n−1)) over the step's rewards, 0.0 for a single one
        "reward/std": stat_of(std_sample, "reward", empty=0.0),
    },
))
