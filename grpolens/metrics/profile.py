"""What a trainer profile is, and the registry of profiles.

A :class:`Profile` says how one trainer logs the metrics grpolens computes: under which names, with
which grouping of token means, and where it reduces or adjusts a value its own way. The formulas
stay in the family modules (:mod:`grpolens.metrics`); each trainer's profile is an instance in its
own module, ``grpolens/profiles/<trainer>.py``, which imports the families it adjusts (never the
reverse) and registers itself with :func:`register_profile`. ``--profile`` choices, their help and
``docs/profiles.md`` come from :data:`PROFILES`.

The metrics layer only reads a profile's fields: :func:`grpolens.metrics.reduce.compute` applies
``reductions`` and ``zero_when_empty``, :func:`grpolens.metrics.reduce.grouped_ratio` the
``token_mean`` grouping, the reward family ``per_generation_round``, the rollout-IS family
``rollout_is_summary``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

#: Token-mean groupings (see :mod:`grpolens.metrics.reduce`).
TOKEN_MEAN_RULES = ("pooled", "trl_slot", "pack_mean")

#: The training settings a diagnosis may tell a user to change, by grpolens' name, with what each
#: is; a profile's ``settings`` maps them to the trainer's own keys.
SETTINGS = {
    "clip_low": "the lower clip bound of the policy ratio (1 − ε)",
    "clip_high": "the upper clip bound of the policy ratio (1 + ε_high, clip-higher)",
    "kl_coef": "the KL-to-reference coefficient (β)",
    "entropy_coef": "the entropy bonus coefficient",
    "learning_rate": "the policy's learning rate",
    "max_grad_norm": "the gradient-norm clip",
    "num_iterations": "optimisation passes over each generation (PPO epochs)",
    "num_generations": "completions per prompt (group size)",
    "max_completion_length": "the completion length limit",
    "temperature": "the sampling temperature (the engine's and the trainer's must agree)",
    "rollout_is": "the rollout importance-sampling correction (train–inference mismatch)",
    "overlong": "the treatment of truncated completions (masking or an overlong penalty)",
    "dynamic_sampling": "filtering of groups whose completions all get the same reward",
    "reward_weights": "the weights of the reward functions",
}


@dataclass(frozen=True)
class Profile:
    #: the ``--profile`` value
    name: str
    #: one line for ``--profile`` help and the profiles page: the trainer and what is reproduced
    title: str
    #: the trainer version(s) or source the profile was checked against
    reference: str = "—"
    #: grouping of token means: pooled over the step, per micro-batch slot (TRL), per pack (xtuner)
    token_mean: str = "pooled"
    #: how the profile's extrema and "nothing to average" read (documentation only)
    extrema: str = "over the step"
    empty: str = "null"
    #: canonical metric name (template names included) -> the trainer's name; the metrics a profile
    #: logs are exactly the keys of this table (the default profile logs every metric by its own name)
    names: Mapping[str, str] = field(default_factory=dict)
    #: canonical metric name -> ``fn(sd) -> float | None``: the trainer's own reduction of a metric
    #: from the same per-sequence partials (its grouping, clamp or counting), replacing the family's
    reductions: Mapping[str, Callable[[Any], float | None]] = field(default_factory=dict)
    #: metrics the trainer logs as 0.0 where grpolens has nothing to average (null)
    zero_when_empty: frozenset[str] = frozenset()
    #: ... only at steps that have sequences (xtuner's merger), or at every step (MaxEnt-GRPO)
    zero_needs_sequences: bool = False
    #: generation-side metrics computed once per generation round and averaged over rounds (TRL)
    per_generation_round: bool = False
    #: metrics the trainer logs only at steps with a generation (null at the others, if the run has samples)
    generation_only: frozenset[str] = frozenset()
    #: ``fn(sd) -> {canonical name: value}``: the trainer's rollout-IS / mismatch step summary
    #: (None: the canonical one)
    rollout_is_summary: Callable[[Any], dict] | None = None
    #: the log file the trainer's integration writes inside the run (``grpolens parity``'s default)
    log_file: str | None = None
    #: trainer name -> absolute floor where the trainer's own float32 arithmetic is the larger error
    float32_floors: Mapping[str, float] = field(default_factory=dict)
    #: every name is the canonical one (the default profile)
    canonical: bool = False
    #: the trainer's logging schedule, when it does not log every step (TRL's logging windows):
    #: ``fn(reader, cfg, overrides, config_file) -> (schedule, cfg)``; ``schedule.step_value(metric,
    #: sd)`` gives (the step's value, values appended, NaN values appended), ``schedule.hidden`` the
    #: suffixes of the per-step count columns, ``schedule.log_view(final, raw, metrics)`` the rows the
    #: trainer logged; recompute keeps the per-step rows with ``per_step=True``
    log_schedule: Callable[..., tuple[Any, dict]] | None = None
    #: a training setting, by grpolens' name for it (:data:`SETTINGS`) -> the trainer's own config
    #: key (``"clip_high"`` -> TRL's ``epsilon_high``, verl's ``actor_rollout_ref.actor.clip_ratio_high``):
    #: how ``grpolens doctor``'s suggestions name what to change
    settings: Mapping[str, str] = field(default_factory=dict)
    #: a logged name -> ``(column, why)`` pairs: where the recompute leaves the value empty because
    #: the run does not determine it (verl's Clip-Cov draws the tokens it zeroes), a column of the
    #: recompute counts the cases at that step; ``grpolens parity`` then says why instead of failing
    undetermined: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def __post_init__(self):
        if self.token_mean not in TOKEN_MEAN_RULES:
            raise ValueError(f"profile {self.name}: unknown token_mean {self.token_mean!r}")
        unknown = sorted(set(self.settings) - set(SETTINGS))
        if unknown:
            raise ValueError(f"profile {self.name}: unknown setting {unknown[0]!r}; known: {', '.join(SETTINGS)}")


#: name -> profile, in registration order (built-ins first; see :mod:`grpolens.plugins`)
PROFILES: dict[str, Profile] = {}


def register_profile(profile: Profile) -> Profile:
    if profile.name in PROFILES and PROFILES[profile.name] is not profile:
        raise ValueError(f"profile {profile.name} registered twice")
    PROFILES[profile.name] = profile
    return profile


def get_profile(name: str) -> Profile:
    """The registered profile ``name``; a KeyError naming the choices otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}") from None
