"""Checking and normalising the algorithm config that metrics depend on.

The config comes from the run's manifest, then ``--config FILE``, then ``--set key=value``. Every
bad value is reported with the key that holds it, e.g. ``config key 'epsilon': must be a number
>= 0, got 'abc'``.
"""

from __future__ import annotations

from typing import Any

from grpolens.errors import UserError

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "gspo", "cispo", "sapo", "luspo")
IS_LEVELS = ("token", "sequence", "sequence_token")
SCALE_REWARDS = ("group", "batch", "none")


def _bad(key: str, why: str, value: Any) -> UserError:
    return UserError(f"config key {key!r}: {why}, got {value!r}")


def _number(cfg: dict, key: str, *, minimum: float | None = None, strict: bool = False, allow_none: bool = False) -> None:
    v = cfg.get(key)
    if v is None:
        if allow_none:
            return
        raise _bad(key, "must be set", v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise _bad(key, "must be a number", cfg.get(key)) from None
    v = float(v)
    if v != v:
        raise _bad(key, "must not be NaN", v)
    if minimum is not None and (v <= minimum if strict else v < minimum):
        raise _bad(key, f"must be {'>' if strict else '>='} {minimum}", cfg.get(key))
    cfg[key] = v


def _int(cfg: dict, key: str, *, minimum: int = 1, allow_none: bool = True) -> None:
    v = cfg.get(key)
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < minimum:
        raise _bad(key, f"must be an integer >= {minimum}", v)
    cfg[key] = int(v)


def check_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validate and normalise a resolved config (returns a new dict).

    Normalisations: ``epsilon_high`` None -> ``epsilon``; ``loss_type`` lower-cased;
    ``scale_rewards`` True/False -> "group"/"none"; ``rollout_is`` thresholds to ``{lower, upper}``.
    """
    cfg = dict(cfg)
    lt = cfg.get("loss_type")
    if not isinstance(lt, str) or lt.lower() not in LOSS_TYPES:
        raise _bad("loss_type", f"must be one of {', '.join(LOSS_TYPES)}", lt)
    cfg["loss_type"] = lt.lower()
    _number(cfg, "epsilon", minimum=0.0)
    if cfg.get("epsilon_high") is None:
        cfg["epsilon_high"] = cfg["epsilon"]
    _number(cfg, "epsilon_high", minimum=0.0)
    _number(cfg, "delta", minimum=0.0, strict=True, allow_none=True)
    _number(cfg, "beta", minimum=0.0)
    _number(cfg, "temperature", minimum=0.0, strict=True)
    _number(cfg, "sapo_temperature_pos", minimum=0.0, strict=True)
    _number(cfg, "sapo_temperature_neg", minimum=0.0, strict=True)
    lvl = cfg.get("importance_sampling_level")
    if lvl not in IS_LEVELS:
        raise _bad("importance_sampling_level", f"must be one of {', '.join(IS_LEVELS)}", lvl)
    for k in ("max_completion_length", "num_generations", "gradient_accumulation_steps", "steps_per_generation", "num_iterations"):
        _int(cfg, k)
    sr = cfg.get("scale_rewards")
    if sr is True:
        sr = "group"
    elif sr is False:
        sr = "none"
    if sr not in SCALE_REWARDS:
        raise _bad("scale_rewards", f"must be one of {', '.join(SCALE_REWARDS)} (or true/false)", cfg.get("scale_rewards"))
    cfg["scale_rewards"] = sr
    if not isinstance(cfg.get("use_bias_correction_kl"), bool):
        raise _bad("use_bias_correction_kl", "must be true or false", cfg.get("use_bias_correction_kl"))
    rw = cfg.get("reward_weights")
    if rw is not None and not (isinstance(rw, (list, dict))):
        raise _bad("reward_weights", "must be a list of numbers or an object name -> weight", rw)
    return cfg
