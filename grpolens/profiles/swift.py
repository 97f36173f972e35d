"""ms-swift 4.6.0's GRPO trainer (``swift rlhf --rlhf_type grpo``): the keys its ``log()`` writes to
``logging.jsonl``, as it computes them, in its logging windows.

A run recorded with ms-swift's settings (``swift_args`` in its config, its own argument names; see
:func:`swift_config`) gets what :mod:`grpolens.metrics.swift_grpo` reproduces: ``loss``, ``kl``,
``clip_ratio/*`` or ``cispo_clip_ratio``, ``entropy/{mean,max,min}`` with ``log_entropy``, and per
generation round ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``rewards/<name>/{mean,std}``
and ``completions/{mean,min,max}_length``/``clipped_ratio``. A configuration it does not reproduce is
refused by name (:data:`grpolens.metrics.swift_grpo._REFUSED`).

When it logs. ms-swift derives from TRL's ``GRPOTrainer`` and logs as TRL does: every metric has a
list that grows during training (loss-side metrics one value per micro-batch slot, every rank's
values already gathered; generation-side ones per generation round), and each ``log()`` writes the
lists' means and clears them, at transformers' logging steps (ms-swift's defaults:
``logging_steps=5``, ``logging_first_step=True``). Unlike TRL it does not drop NaN values
(``sum(values) / len(values)``), and what is left after the last step goes out with the training
summary. The window machinery is TRL's (:mod:`grpolens.profiles.trl`).

Not reproduced, because a run does not hold them: ``grad_norm``, ``learning_rate`` (the optimizer's),
``epoch``, ``global_step/max_steps``, ``elapsed_time``, ``remaining_time``, ``memory(GiB)``,
``train_speed(s/it)`` (the progress callback's wall clock and counters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from grpolens.metrics import swift_grpo, swift_rewards
from grpolens.metrics.profile import Profile, register_profile
from grpolens.metrics.rewards import generation_rounds, per_round
from grpolens.profiles import trl

#: the generation-side keys ms-swift logs under TRL's names, and its own loss-side metrics
NAMES = {
    **{k: trl.NAMES[k] for k in ("rewards/<name>/mean", "rewards/<name>/std", "completions/length/mean",
                                 "completions/length/min", "completions/length/max", "completions/truncated_frac")},
    "swift/loss": "loss",
    "swift/reward": "reward",
    "swift/reward_std": "reward_std",
    "swift/frac_reward_zero_std": "frac_reward_zero_std",
    **{f"swift/{k}": k for k in swift_grpo._DOCS},
}
#: what its trainer logs that a run does not hold (``grpolens parity`` reports them as not compared)
NOT_IN_RUN = ("grad_norm", "learning_rate", "epoch", "global_step/max_steps", "elapsed_time", "remaining_time",
              "memory(GiB)", "train_speed(s/it)", "train_runtime", "train_samples_per_second",
              "train_steps_per_second", "total_flos", "train_loss")


class Rules(trl.Rules):
    """transformers' logging schedule with ms-swift's averaging: NaN values are kept."""

    @property
    def drops_nan(self) -> bool:
        return False

    @classmethod
    def from_settings(cls, s: dict, state: dict | None = None) -> "Rules":
        state = state or {}
        max_steps = s.get("max_steps")
        if isinstance(state.get("max_steps"), int) and state["max_steps"] > 0:
            max_steps = state["max_steps"]
        return cls(strategy="steps", logging_steps=max(float(s["logging_steps"]), 1.0),
                   first_step=bool(s["logging_first_step"]),
                   max_steps=max_steps if isinstance(max_steps, int) and max_steps > 0 else None)


@dataclass
class Context(trl.Context):
    """The swift profile's schedule (``StepData.extra["schedule"]``)."""

    def step_value(self, metric, sd) -> tuple[float | None, int, int]:
        vals = appended(metric, sd)
        finite = [v for v in vals if not math.isnan(v)]
        nans = len(vals) - len(finite)
        if nans or not vals:
            return (float("nan") if nans else None), len(vals), nans
        return sum(finite) / len(finite), len(finite), 0

    def log_view(self, final: pl.DataFrame, raw: pl.DataFrame, metrics: list) -> pl.DataFrame:
        return trl.log_view(final, raw, metrics, self.rules, profile="swift", step_means=("swift/loss",))


def appended(metric, sd) -> list[float]:
    """The values ms-swift appends to ``metric``'s list during the step (None: nothing appended)."""
    from grpolens.metrics import reduce

    name = metric.template or metric.name
    if metric.source == "samples":
        if sd.samples is None:
            return []
        vals = [reduce.compute(metric, r) for r in (generation_rounds(sd) or [sd])]
    elif name == "swift/loss":
        vals = [reduce.compute(metric, sd)]
    elif name == "swift/kl" and (swift_grpo.settings(sd.cfg) or {}).get("kl_in_reward"):  # per generation round
        s = swift_grpo.settings(sd.cfg)
        vals = [swift_rewards.kl_mean(r, s) for r in (generation_rounds(sd) or [sd])] if sd.samples is not None else []
    else:
        vals = swift_grpo.slot_series(sd, name[len("swift/"):])
    return [float(v) for v in vals if v is not None]


def prepare(reader, cfg: dict, overrides: dict | None, config_file) -> tuple[Context, dict]:
    """The swift profile's schedule for a run: its logging steps from ``swift_args`` and each
    completion's generation-round tokens (dapo/cispo's normaliser) from its samples. A run without
    ``swift_args`` gets one row per optimizer step."""
    s = swift_grpo.settings(cfg)
    # a run without ms-swift's settings: one row per optimizer step
    rules = Rules.from_settings(s, trl.read_state(reader.path)) if s is not None else Rules()
    return Context(rules, trl.read_round_tokens(reader.path, {}, rules)), cfg


def swift_config(args: Any) -> dict[str, Any]:
    """The run config for ms-swift's GRPO ``args`` (its ``GRPOConfig``, or a dict of its argument
    names): grpolens' own settings (loss type, clip range, β, group size) and ``swift_args``, the
    ms-swift settings the profile reads, by ms-swift's names."""
    get = (lambda k: args.get(k)) if isinstance(args, dict) else (lambda k: getattr(args, k, None))  # noqa: E731
    o = {k: get(k) for k in swift_grpo.DEFAULTS if get(k) is not None}
    s = {**swift_grpo.DEFAULTS, **o}
    seq = s["importance_sampling_level"] != "token"
    cfg: dict[str, Any] = {
        # FIPO is dapo's objective × its influence weight, which only the swift profile reproduces
        # (as the verl integration records verl's other losses as grpo)
        "loss_type": "gspo" if seq and s["loss_type"] == "grpo" else "dapo" if s["loss_type"] == "fipo" else
                     "grpo" if s["loss_type"] == "real" else s["loss_type"],
        "importance_sampling_level": s["importance_sampling_level"],
        "beta": float(s["beta"]), "epsilon": float(s["epsilon"]),
        "epsilon_high": float(s["epsilon_high"] if s["epsilon_high"] is not None else s["epsilon"]),
        "num_iterations": int(s["num_iterations"]), "num_generations": int(s["num_generations"]),
        "max_completion_length": int(s["max_completion_length"]),
        "gradient_accumulation_steps": int(s["gradient_accumulation_steps"]),
        "sapo_temperature_pos": float(s["tau_pos"]), "sapo_temperature_neg": float(s["tau_neg"]),
        "swift_args": o,
    }
    if s["delta"] is not None:
        cfg["delta"] = float(s["delta"])
    return cfg


PROFILE = register_profile(Profile(
    "swift", "ms-swift's GRPO trainer keys, as its logging.jsonl has them (its logging windows)",
    reference="ms-swift 4.6.0 (its own code, tests/reference)",
    token_mean="pooled",
    extrema="`low_min`/`high_max`: min/max over ranks of each rank's fraction per micro-batch slot, mean over slots",
    empty="each rank's Σ / max(Σ m, 1): 0.0", names=NAMES, per_generation_round=True,
    settings={"clip_low": "epsilon", "clip_high": "epsilon_high", "kl_coef": "beta", "learning_rate": "learning_rate",
              "max_grad_norm": "max_grad_norm", "num_iterations": "num_iterations",
              "num_generations": "num_generations", "max_completion_length": "max_completion_length",
              "temperature": "temperature", "rollout_is": "rollout_importance_sampling_mode",
              "overlong": "overlong_filter", "dynamic_sampling": "dynamic_sample", "reward_weights": "reward_weights"},
    # compute_reward_metrics: a function's std is 0.0 when it scored a single completion of the round
    reductions={"rewards/<name>/std": per_round(swift_rewards.func_std)},
    # ms-swift writes logging.jsonl to its output directory, not into the run: parity needs --log
    # ms-swift's progress callback rounds every float it writes to 8 decimals; its k3 and losses are float32
    float32_floors={"kl": 1e-7, "loss": 1e-6},
    log_schedule=prepare,
))
