"""OpenRLHF 0.11.2's PPO/GRPO actor (``openrlhf/trainer/ray/ppo_actor.py``, ``openrlhf/models/loss.py``,
``openrlhf/trainer/ppo_trainer.py``): the keys its wandb/TensorBoard logger writes
(``train/<status key>``) for what a run holds.

A run recorded with OpenRLHF's settings (``openrlhf_args`` in its config, written by
:func:`grpolens.integrations.openrlhf.openrlhf_config`) gets every value ``ppo_train`` reduces from
the batches: the loss terms with the optimizer-step window's normaliser, the token- and
sample-weighted status and the rollout statistics (:mod:`grpolens.metrics.openrlhf_actor`), and
only the keys OpenRLHF logs for those settings. A run without them gets the token means and rollout
statistics that need no OpenRLHF setting.

Not reproduced, because a run does not hold them: ``actor_lr`` and ``actor_grad_norm`` (the
optimizer's), ``timing/*`` (wall clock), ``score`` and the reward function's ``extra_logs`` (what a
remote reward or agent returns beside the reward), ``dynamic_filtering_pass_rate`` (the groups
dropped before training), the critic's keys (``gae``) and ``train/global_step`` (the logger's counter).
"""

from grpolens.metrics import clip, openrlhf_actor  # noqa: F401  (openrlhf_actor registers the actor metrics)
from grpolens.metrics.profile import Profile, register_profile
from grpolens.metrics.reduce import _family_value
from grpolens.metrics.registry import REGISTRY
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
NAMES.update({f"openrlhf/{k}": f"train/{k}" for k in (*openrlhf_actor._ACTOR_DOCS, *openrlhf_actor._SAMPLE_DOCS)
              if k not in ("ppo_clip_ratio", "ppo_kl", "vllm_kl")})


def _with_settings(name: str, fallback):
    """The run's OpenRLHF settings decide (GSPO's broadcast clip indicator, ``vllm_kl`` only with
    the IS correction on); without them, ``fallback`` (a canonical metric's name: its family's value)."""
    def fn(sd):
        if openrlhf_actor.settings(sd.cfg) is not None:
            return openrlhf_actor._values(sd).get(name)
        return fallback(sd) if callable(fallback) else _family_value(REGISTRY[fallback], sd)
    return fn


def _token_level_clip_ratio(sd):
    """``masked_mean(surr2 < surr1)``: for A > 0 the ratio above 1 + ε_high, for A < 0 below 1 − ε.
    Without OpenRLHF's settings, GSPO's sequence ratio broadcast over the tokens is not in the clip
    partials (one indicator per sequence): nothing there."""
    if sd.cfg.get("importance_sampling_level", "token") != "token":
        return None
    return clip.fraction("region")(sd)


PROFILE = register_profile(Profile(
    "openrlhf", "OpenRLHF's PPO/GRPO actor and rollout keys",
    reference="OpenRLHF 0.11.2 (its own code, tests/reference)",
    token_mean="pooled", extrema="—", empty="0.0 for a one-sample reward std",
    names=NAMES,
    # OpenRLHF 0.11.2's command-line flags (cli/train_ppo_ray.py)
    settings={"clip_low": "--actor.eps_clip_low_high", "clip_high": "--actor.eps_clip_low_high",
              "kl_coef": "--algo.kl.init_coef", "entropy_coef": "--actor.entropy_coef",
              "learning_rate": "--actor.adam.lr", "max_grad_norm": "--actor.max_norm",
              "num_iterations": "--train.max_epochs", "num_generations": "--rollout.n_samples_per_prompt",
              "max_completion_length": "--rollout.max_new_tokens", "temperature": "--rollout.temperature",
              "dynamic_sampling": "--algo.dynamic_filtering_enable"},
    reductions={
        "clip/region": _with_settings("ppo_clip_ratio", _token_level_clip_ratio),
        "policy/k1": _with_settings("ppo_kl", "policy/k1"),
        "mismatch/kl_k1": _with_settings("vllm_kl", "mismatch/kl_k1"),
        # torch.std (÷(n−1)) over the step's rewards, 0.0 for a single one
        "reward/std": stat_of(std_sample, "reward", empty=0.0),
    },
))
