"""Clipping: how often the importance ratio left the trust region the loss allows.

**PPO-style clip (grpo, bnpo, dr_grpo, dapo, luspo, gspo).** With ``c`` the loss' importance weight
(token ratio e^d; GSPO: the sequence ratio s = exp(Σ_t d·v / max(Σ_t v, 1))), and
``c̃ = min(c, delta)`` when ``delta`` is set -- TRL clamps *before* the indicators, so with
``delta ≤ 1 + epsilon_high`` nothing is ever high-clipped:

    low  = 1[c̃ < 1 − epsilon      ∧ A < 0]       high = 1[c̃ > 1 + epsilon_high ∧ A > 0]
    region = low ∨ high   (low and high are disjoint: they need opposite advantage signs)

``clip/low`` etc. are the fraction of valid tokens (ratio and advantage finite); at
``importance_sampling_level="sequence"`` (or ``loss_type="gspo"``) the fraction of sequences with
at least one valid token, Ā being the sequence's mean advantage (Twinkle's ``GSPOMetric``). TRL
counts every sequence of the micro-batch there, fully masked ones included (their ratio is 1);
its profile reproduces that. ``clip/low_min`` / ``clip/high_max`` are the extremes over sequences
of the per-sequence fractions (TRL's ``low_min``/``high_max``: per micro-batch slot, then averaged).

**CISPO.** TRL's ``cispo_clip_ratio`` = fraction with ``c > epsilon_high ∧ A > 0`` (there
``epsilon_high`` is the absolute cap of the weight, e.g. 5.0).

**Unconditional rates** (every loss type; Twinkle's ``CISPOMetric``, xtuner's ``clip_frac_*``): the
token ratio below 1 − epsilon / above 1 + epsilon_high whatever the advantage, no delta.

The indicators are written once in :mod:`grpolens.functional.policy_terms`; per token they are
counted in one compiled pass (:func:`grpolens.metrics.kernels.clip_counts`), per sequence by numpy.
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics import reduce
from grpolens.functional.policy_terms import clipped_cispo, clipped_high, clipped_low
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.metrics.ratios import coef_input, is_level, ratio
from grpolens.metrics.registry import Family, Metric, register, register_family

#: Loss types whose loss clips the ratio PPO-style (TRL logs ``clip_ratio/*`` for these).
PPO_CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "gspo")
_PARTS = ("low", "high", "region", "cispo")

_MERGE = {
    "clip.n": "sum", "clip.below": "sum", "clip.above": "sum", "clip.outside": "sum",
    **{f"clip.g.{p}": "sum" for p in ("n", *_PARTS)},
    **{f"clip.gt.{p}": "sum" for p in ("n", *_PARTS)},
}


_EMPTY = np.empty(0)


def _delta(cfg: dict) -> float:
    return np.inf if cfg.get("delta") is None else float(cfg["delta"])


def _gated(c: np.ndarray, adv: np.ndarray, cfg: dict, reduce_to) -> dict[str, np.ndarray]:
    """The clip indicators for per-sequence weights ``c`` and advantages ``adv``, each passed
    through ``reduce_to`` (a float cast); per token the clip kernel counts the same."""
    lo, hi = 1.0 - cfg["epsilon"], 1.0 + cfg["epsilon_high"]
    lt = cfg["loss_type"]
    out = {}
    if lt in PPO_CLIP_LOSSES:
        out["low"], out["high"] = reduce_to(clipped_low(c, adv, lo, _delta(cfg))), reduce_to(clipped_high(c, adv, hi, _delta(cfg)))
        out["region"] = out["low"] + out["high"]  # disjoint: opposite advantage signs
    if lt == "cispo":
        out["cispo"] = reduce_to(clipped_cispo(c, adv, cfg["epsilon_high"]))
    return out


def _clip(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    from grpolens.metrics import kernels

    lt = cfg["loss_type"]
    ppo, cispo = lt in PPO_CLIP_LOSSES, lt == "cispo"
    seq_level = (ppo or cispo) and is_level(cfg) == "sequence"
    lo, hi = 1.0 - cfg["epsilon"], 1.0 + cfg["epsilon_high"]
    # one pass: the unconditional rates on the raw token ratio r (1 where it is undefined, never
    # outside [1 - eps, 1 + eps_high] since eps >= 0), no advantage gate, no delta; the gated
    # counts of _gated on the token weight (c = r at token level, A = 0 off the valid tokens);
    # at sequence level the sums the sequence weight and mean advantage need
    c, c_masked = coef_input(b, cfg) if (ppo or cispo) and not seq_level else (_EMPTY, True)
    counts, sums = kernels.clip_counts(
        b.logp, b.old, b.adv, b.mask, ratio(b), c, c_masked, lo, hi, _delta(cfg), float(cfg["epsilon_high"]),
        ppo and not seq_level, cispo and not seq_level, seq_level, b.starts, b.lengths)
    nrv, below, above, n = counts[0], counts[1], counts[2], counts[3]
    b.cached("count:ratio_valid", lambda: nrv)
    out: dict[str, np.ndarray] = {
        "clip.n": nrv, "clip.below": below, "clip.above": above, "clip.outside": below + above,  # disjoint
    }
    if not (ppo or cispo):
        z = np.zeros(b.n_seq)
        out.update({f"clip.{g}.{p}": z for g in ("g", "gt") for p in ("n", *_PARTS)})
        return out
    if seq_level:
        # one weight per sequence; Ā = mean advantage of its valid tokens (its own advantage if none)
        with np.errstate(invalid="ignore"):
            abar = np.where(n > 0, sums[0] / np.maximum(n, 1.0), b.seq_first(b.adv))
        slr = b.cached("seq_log_ratio:None", lambda: sums[1] / np.maximum(nrv, 1.0))
        with np.errstate(over="ignore"):
            s = np.exp(slr)
        has = (n > 0).astype(np.float64)
        out["clip.g.n"], out["clip.gt.n"] = has, np.ones(b.n_seq)
        for p, x in _gated(s, abar, cfg, lambda m: m.astype(np.float64)).items():
            out[f"clip.g.{p}"], out[f"clip.gt.{p}"] = x * has, x
    else:
        out["clip.g.n"] = out["clip.gt.n"] = n
        gated = {"low": counts[4], "high": counts[5], "region": counts[4] + counts[5]} if ppo else {"cispo": counts[6]}
        for p, x in gated.items():  # _gated's indicators, counted in the pass
            out[f"clip.g.{p}"] = out[f"clip.gt.{p}"] = x
    z = np.zeros(b.n_seq)
    for p in _PARTS:  # the parts this loss type has no clip for
        out.setdefault(f"clip.g.{p}", z)
        out.setdefault(f"clip.gt.{p}", z)
    return out


# Registered by a call, not as a decorator: mutmut skips decorated functions (docs/mutation-testing.md).
producer("clip", merge=_MERGE)(_clip)


# ---------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------

def _cols(part: str, counted: str) -> tuple[str, str]:
    """``counted``: at sequence level, "g" counts the sequences with a valid token, "gt" every
    sequence (TRL's GSPO counting, used by its profile)."""
    return f"clip.{counted}.{part}", f"clip.{counted}.n"


def fraction(part: str, counted: str = "g"):
    """``fn(sd)``: the clip fraction ``part`` as a token mean under the profile's grouping."""
    def fn(sd) -> float | None:
        num, den = _cols(part, counted)
        return reduce.grouped_ratio(sd, num, den, sd.profile.token_mean)
    return fn


def seq_extreme(part: str, which: str, counted: str = "g"):
    """``fn(sd)``: the extreme per-sequence clip fraction ``part`` (TRL's: per slot, see
    :func:`grpolens.metrics.reduce.seq_fraction_extreme`)."""
    def fn(sd) -> float | None:
        num, den = _cols(part, counted)
        return reduce.seq_fraction_extreme(sd, num, den, which)
    return fn


def _unconditional(col: str):
    def fn(sd) -> float | None:
        return reduce.grouped_ratio(sd, col, "clip.n", "pooled")
    return fn


def _ppo(cfg: dict) -> bool:
    return cfg.get("loss_type") in PPO_CLIP_LOSSES


_FAM = "clip"
_CFG = ("epsilon", "epsilon_high", "delta", "loss_type", "importance_sampling_level")
_UNIT = ("of valid tokens (at sequence level: of sequences with a valid token; TRL: of all "
         "sequences, per micro-batch slot then averaged)")

# The gated metrics are registered before the unconditional ones: under CISPO and SAPO (no PPO
# clip) Twinkle's `train/clip_ratio*` names fall to the unconditional rates (its CISPOMetric),
# otherwise to the gated ones (GRPOMetric / GSPOMetric).
register(Metric(
    "clip/low", _FAM, f"Fraction {_UNIT} with min(c, delta) < 1 − epsilon and A < 0.",
    kind="custom", fn=fraction("low"), when=_ppo, config=_CFG,
))
register(Metric(
    "clip/high", _FAM, f"Fraction {_UNIT} with min(c, delta) > 1 + epsilon_high and A > 0.",
    kind="custom", fn=fraction("high"), when=_ppo, config=_CFG,
))
register(Metric(
    "clip/region", _FAM, f"Fraction {_UNIT} clipped low or high (= clip/low + clip/high).",
    kind="custom", fn=fraction("region"), when=_ppo, config=_CFG,
))
register(Metric(
    "clip/low_min", _FAM,
    "Smallest per-sequence low-clip fraction Σ_t low / Σ_t valid over the step's sequences (at "
    "sequence level the 0/1 indicator). TRL: nanmin per micro-batch slot (fully masked sequences "
    "skipped, or counted as 0 under GSPO), then the mean over slots.",
    kind="custom", fn=seq_extreme("low", "min"), when=_ppo, config=_CFG,
))
register(Metric(
    "clip/high_max", _FAM,
    "Largest per-sequence high-clip fraction over the step's sequences (TRL: nanmax per "
    "micro-batch slot, then the mean over slots).",
    kind="custom", fn=seq_extreme("high", "max"), when=_ppo, config=_CFG,
))
register(Metric(
    "clip/cispo", _FAM,
    f"CISPO: fraction {_UNIT} whose weight c exceeds the cap epsilon_high with A > 0. TRL's "
    "`cispo_clip_ratio`.",
    kind="custom", fn=fraction("cispo"), when=lambda cfg: cfg.get("loss_type") == "cispo", config=_CFG,
))
register(Metric(
    "clip/ratio_below", _FAM,
    "Fraction of tokens with a defined ratio whose e^d < 1 − epsilon, whatever the advantage (no delta). "
    "Twinkle's CISPOMetric `clip_ratio_low`; xtuner's `clip_frac_low` (0.0 when no token is valid).",
    kind="custom", fn=_unconditional("clip.below"), config=("epsilon",),
))
register(Metric(
    "clip/ratio_above", _FAM,
    "Fraction of tokens with a defined ratio whose e^d > 1 + epsilon_high, whatever the advantage.",
    kind="custom", fn=_unconditional("clip.above"), config=("epsilon_high",),
))
register(Metric(
    "clip/ratio_outside", _FAM,
    "Fraction of tokens with a defined ratio whose e^d lies outside [1 − epsilon, 1 + epsilon_high].",
    kind="custom", fn=_unconditional("clip.outside"), config=("epsilon", "epsilon_high"),
))


#: The built-in ``grpolens check`` rules over this family (see :mod:`grpolens.check.defaults`).
RULES = '''\
[[rule]]
name = "clip low rising"
metric = "clip/low"
direction = "upper"
early = { factor = 5.0, abs = 0.05 }
sustained = { count = 2, window = 4 }
rel = 0.5
abs = 0.02
missing = "skip"
why = """Fraction of tokens clipped below 1 - epsilon with a negative advantage. Above a few percent \
the update is mostly clipped away: the policy moves too far per step (learning rate, too many \
epochs per batch, stale rollouts). Rollouts are on-policy at first, so the fraction starts near 0: \
floor 5 points, 5x the early level. Only a sustained rise counts (2 of any 4 consecutive steps): a \
clip fraction is a count over few tokens in a small batch, so one step can jump to 15 % and fall \
back, while a real drift persists; 2 of 4, not 2 in a row, because with TRL's steps_per_generation \
= 2 every other step is on-policy and clips nothing. Against a baseline: 1.5x plus 2 points."""

[[rule]]
name = "clip high rising"
metric = "clip/high"
direction = "upper"
early = { factor = 5.0, abs = 0.05 }
sustained = { count = 2, window = 4 }
rel = 0.5
abs = 0.02
missing = "skip"
why = """Fraction of tokens clipped above 1 + epsilon_high with a positive advantage; as for clip \
low, a sustained rise (2 of any 4 consecutive steps) means over-large steps. DAPO's clip-higher makes this one the first to move."""
'''

register_family(Family(
    'clip', page='policy',
    key_metrics=('clip/region', 'clip/low', 'clip/high'),
    overview=(
        (3, 'clip fraction (low)', ('^clip/low$', '^clip/.*low')),
        (4, 'clip fraction (high)', ('^clip/high$', '^clip/.*high')),
    ),
    rules=RULES,
))
