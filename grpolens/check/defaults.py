"""The built-in rules: what breaks GRPO runs, with why each threshold is where it is.

They must work without a baseline, on runs of any length and any model, so each per-step bound is
relative to the run's own first steps (``early``: the median of the first 20 % of steps) with an
absolute floor that keeps a near-zero start (KL to the reference and clip fractions are 0 at step
0 of on-policy training) from making the bound absurdly tight. When a baseline is given, the same
rules also bound every step against the baseline at that step (``abs``/``rel``), which catches a
run that is broken from its first step, where a self-relative bound cannot.

Every rule skips (rather than fails) when the run cannot have the metric: no ``ref_logp`` column,
no rollout log-probs, a loss without clipping.

``grpolens check --show-rules`` prints this file's TOML: a starting point for one's own rules.
"""

from __future__ import annotations

from functools import lru_cache

from grpolens.check.rules import RuleSet, parse_rules

DEFAULTS_SOURCE = "built-in defaults"

DEFAULT_RULES_TOML = '''\
# grpolens built-in check rules (`grpolens check --show-rules`).
# Per step ("reduce = all"), each value must stay within its bounds; "early" bounds are relative to
# the median of the run's own first 20 % of steps; abs/rel apply only when --baseline is given.

[[rule]]
name = "entropy collapse"
metric = "entropy"
direction = "lower"
early = { factor = 5.0 }
rel = 0.3
missing = "skip"
why = """A policy whose mean token entropy falls to a fifth of where the run started has stopped \
exploring: the group's completions become identical, advantages vanish and learning stalls. Entropy \
depends on vocabulary, temperature and model, so the bound is relative to the run's own start rather \
than absolute. Against a baseline: at least 70 % of the baseline's entropy at the same step."""

[[rule]]
name = "non-finite tokens"
metric = "health/nonfinite/*"
max = 0
missing = "skip"
why = """Every metric excludes tokens whose log-probs, advantages or entropies are NaN or ±inf, so a \
NaN cannot silently poison a curve; this rule makes sure such tokens are never silently dropped either. \
One non-finite log-prob is already a numerical bug (overflow in the logits, a bad fp16 cast)."""

[[rule]]
name = "finite metrics"
metric = "*"
finite = true
missing = "skip"
why = """No recomputed metric may be NaN or infinite at any step."""
'''


@lru_cache(maxsize=1)
def default_rules() -> RuleSet:
    return parse_rules(DEFAULT_RULES_TOML, source=DEFAULTS_SOURCE)
