"""The built-in rules: what breaks GRPO runs, with why each threshold is where it is.

They must work without a baseline, on runs of any length and any model, so each per-step bound is
relative to the run's own first steps (``early``: the median of the first 20 % of steps) with an
absolute floor that keeps a near-zero start (KL to the reference and clip fractions are 0 at step
0 of on-policy training) from making the bound absurdly tight. When a baseline is given, the same
rules also bound every step against the baseline at that step (``abs``/``rel``), which catches a
run that is broken from its first step, where a self-relative bound cannot.

Every rule skips (rather than fails) when the run cannot have the metric: no ``ref_logp`` column,
no rollout log-probs, a loss without clipping.

Each family declares its rules next to its formulas (``Family.rules`` in ``grpolens/metrics/<family>.py``);
this module puts them together with the general ones. ``grpolens check RUN --show-rules`` prints the
result: a starting point for one's own rules. :func:`grpolens.check.rules.default_rules` parses it.
"""

from __future__ import annotations

DEFAULTS_SOURCE = "built-in defaults"

#: What precedes the rules in ``--show-rules``.
HEADER = '''\
# grpolens built-in check rules (`grpolens check RUN --show-rules`).
# Per step ("reduce = all"), each value must stay within its bounds; "early" bounds are relative to
# the median of the run's own first 20 % of steps; abs/rel apply only when --baseline is given.
'''

#: Rules over every metric, whatever its family.
GENERAL_RULES = '''\
[[rule]]
name = "finite metrics"
metric = "*"
finite = true
missing = "skip"
why = """No recomputed metric may be NaN or infinite at any step."""
'''


def _assemble() -> str:
    """The header, each family's rules (declared next to its formulas), then the general rules."""
    from grpolens.metrics.registry import FAMILIES, load_families

    load_families()
    parts = [HEADER] + [f.rules for f in FAMILIES.values() if f.rules] + [GENERAL_RULES]
    return "\n".join(p.rstrip("\n") + "\n" for p in parts)


DEFAULT_RULES_TOML = _assemble()
