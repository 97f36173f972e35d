"""verl 0.9.1: its rollout correction (``rollout_corr/*``: the whole step as one global batch, each
completion once, sequence summaries over every row, its rejection-sampling filters' statistics;
nothing when ``algorithm.rollout_correction`` is unset) and its actor metrics (``actor/*``, verl's
reductions over micro-batches, mini-batches, PPO epochs and data-parallel ranks: see
:mod:`grpolens.metrics.verl_actor`). Checked against verl's own code (``tests/reference``)."""

from grpolens.metrics import verl_actor  # noqa: F401  (registers the actor metrics)
from grpolens.metrics.verl_rollout_corr import verl_summary
from grpolens.metrics.profile import Profile, register_profile
from grpolens.metrics.registry import REGISTRY

#: verl logs its rollout-correction metrics under this prefix
PREFIX = "rollout_corr/"

_ROLLOUT = {
    "rollout_is/raw/fraction_high": "rollout_is_ratio_fraction_high",
    "rollout_is/raw/fraction_low": "rollout_is_ratio_fraction_low",
    "rollout_is/raw/seq_fraction_high": "rollout_is_seq_fraction_high",
    "rollout_is/raw/seq_fraction_low": "rollout_is_seq_fraction_low",
    "rollout_is/applied/mean": "rollout_is_mean",
    "rollout_is/applied/std": "rollout_is_std",
    "rollout_is/applied/min": "rollout_is_min",
    "rollout_is/applied/max": "rollout_is_max",
    "rollout_is/applied/ess": "rollout_is_eff_sample_size",
    "rollout_is/applied/seq_mean": "rollout_is_seq_mean",
    "rollout_is/applied/seq_std": "rollout_is_seq_std",
    "rollout_is/applied/seq_min": "rollout_is_seq_min",
    "rollout_is/applied/seq_max": "rollout_is_seq_max",
    "rollout_is/applied/seq_max_deviation": "rollout_is_seq_max_deviation",
    "rollout_is/zeroed_fraction": "rollout_is_oob_ratio",
    "rollout_is/batch_norm_factor": "rollout_is_batch_norm_factor",
    "mismatch/kl_k1": "kl",
    "mismatch/kl_k3": "k3_kl",
    "mismatch/training_ppl": "training_ppl",
    "mismatch/training_log_ppl": "training_log_ppl",
    "mismatch/rollout_ppl": "rollout_ppl",
    "mismatch/rollout_log_ppl": "rollout_log_ppl",
    "mismatch/log_ppl_diff": "log_ppl_diff",
    "mismatch/log_ppl_abs_diff": "log_ppl_abs_diff",
    "mismatch/log_ppl_diff_max": "log_ppl_diff_max",
    "mismatch/log_ppl_diff_min": "log_ppl_diff_min",
    "mismatch/ppl_ratio": "ppl_ratio",
    "mismatch/chi2_token": "chi2_token",
    "mismatch/chi2_seq": "chi2_seq",
}
# every rejection-filter statistic: rollout_rs/<option>/<stat> -> rollout_rs_<option>_<stat>
_RS = {m: "rollout_rs_" + m[len("rollout_rs/"):].replace("/", "_")
       for m in REGISTRY if m.startswith("rollout_rs/")}

NAMES = {k: PREFIX + v for k, v in {**_ROLLOUT, **_RS}.items()}
# bypass mode: the loss' own rollout correction, per loss call
NAMES.update({f"verl_actor/rollout_corr/{k}": "actor/" + PREFIX + v for k, v in {**_ROLLOUT, **_RS}.items()})
NAMES.update({f"verl_actor/{k}": f"actor/{k}" for k in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl",
                                                         "entropy_loss", "kl_loss", "loss", "entropy")})
# grpolens' own counts (verl logs none): why a KL-Cov / Clip-Cov step has no actor/pg_loss
NAMES.update({f"verl_actor/{k}": f"grpolens/{k}" for k in ("pg_loss_random_calls", "pg_loss_unsure_calls",
                                                             "pg_loss_expected")})
_WHY = (("grpolens/pg_loss_random_calls", "verl's Clip-Cov zeroed a random choice of its candidate tokens "
         "(torch.randperm), which the run does not record"),
        ("grpolens/pg_loss_unsure_calls", "verl's KL-Cov / Clip-Cov choice of tokens is left open by the run (a tie "
         "in an unrecorded row order, or float32 rounding)"))

PROFILE = register_profile(Profile(
    "verl", "verl's rollout_corr and actor keys", reference="verl 0.9.1 (its own code, tests/reference)",
    token_mean="pooled", extrema="over the batch", empty="null",
    names=NAMES, rollout_is_summary=verl_summary,
    settings={"clip_low": "actor_rollout_ref.actor.clip_ratio_low", "clip_high": "actor_rollout_ref.actor.clip_ratio_high",
              "kl_coef": "actor_rollout_ref.actor.kl_loss_coef", "entropy_coef": "actor_rollout_ref.actor.entropy_coeff",
              "learning_rate": "actor_rollout_ref.actor.optim.lr", "max_grad_norm": "actor_rollout_ref.actor.grad_clip",
              "num_iterations": "actor_rollout_ref.actor.ppo_epochs", "num_generations": "actor_rollout_ref.rollout.n",
              "max_completion_length": "data.max_response_length", "temperature": "actor_rollout_ref.rollout.temperature",
              "rollout_is": "algorithm.rollout_correction.rollout_is", "overlong": "reward_model.overlong_buffer.enable",
              "dynamic_sampling": "algorithm.filter_groups.enable"},
    # verl's IS-weight std is sqrt(E[w²] − E[w]²) in float32 (compute_is_metrics): the difference
    # cancels, ~1e-6 absolute on the variance with weights up to the threshold, a few 1e-6 on the
    # std (grpolens, in float64, agrees with verl's code run in float64 to 1e-13)
    float32_floors={f"{p}rollout_corr/rollout_is_std": 1e-5 for p in ("", "actor/")},
    undetermined={"actor/pg_loss": _WHY, "actor/loss": _WHY},
))
