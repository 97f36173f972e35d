"""The built-in rules: what breaks GRPO runs, with why each threshold is where it is.

They must work without a baseline, on runs of any length and any model, so each per-step bound is
relative to the run's own first steps (``early``: the median of the first 20 % of steps) with an
absolute floor that keeps a near-zero start (KL to the reference and clip fractions are 0 at step
0 of on-policy training) from making the bound absurdly tight. When a baseline is given, the same
rules also bound every step against the baseline at that step (``abs``/``rel``), which catches a
run that is broken from its first step, where a self-relative bound cannot.

Every rule skips (rather than fails) when the run cannot have the metric: no ``ref_logp`` column,
no rollout log-probs, a loss without clipping.

``grpolens check RUN --show-rules`` prints this file's TOML: a starting point for one's own rules.
This module is data only; :func:`grpolens.check.rules.default_rules` parses it.
"""

from __future__ import annotations

DEFAULTS_SOURCE = "built-in defaults"

DEFAULT_RULES_TOML = '''\
# grpolens built-in check rules (`grpolens check RUN --show-rules`).
# Per step ("reduce = all"), each value must stay within its bounds; "early" bounds are relative to
# the median of the run's own first 20 % of steps; abs/rel apply only when --baseline is given.

[[rule]]
name = "KL to reference"
metric = "kl/k3"
direction = "upper"
early = { factor = 10.0, abs = 0.05 }
rel = 1.0
abs = 0.005
missing = "skip"
why = """The KL penalty (or, with beta = 0, nothing) keeps the policy near its reference; a jump of \
the mean k3 KL is the first sign of a blow-up (a bad batch, a learning-rate or loss-scale bug, a \
reference model loaded wrong). The floor of 0.05 nats/token matters because KL starts at 0 when the \
reference is the initial policy; the 10x factor lets a long run's KL grow the way it normally does. \
Against a baseline: at most twice the baseline's KL at the same step, plus 0.005."""

[[rule]]
name = "token KL max"
metric = "policy/token_kl_max"
direction = "upper"
early = { factor = 10.0, abs = 1.0 }
rel = 2.0
abs = 0.5
missing = "skip"
why = """The largest per-token k3 between the current and the behaviour policy: one token whose \
probability moved e-fold or more since it was sampled (k3 > 1 means a ratio above ~3.1 or below \
~0.16) escapes what PPO-style clipping and a mean over thousands of tokens can hide. It is 0 for \
strictly on-policy training and grows with the batch size, hence a floor of 1 and the run's own \
early level as the scale. Against a baseline: at most 3x the baseline's value plus 0.5."""

[[rule]]
name = "clip low rising"
metric = "clip/low"
direction = "upper"
early = { factor = 5.0, abs = 0.05 }
rel = 0.5
abs = 0.02
missing = "skip"
why = """Fraction of tokens clipped below 1 - epsilon with a negative advantage. Above a few percent \
the update is mostly clipped away: the policy moves too far per step (learning rate, too many \
epochs per batch, stale rollouts). Rollouts are on-policy at first, so the fraction starts near 0: \
floor 5 points, 5x the early level. Against a baseline: 1.5x plus 2 points."""

[[rule]]
name = "clip high rising"
metric = "clip/high"
direction = "upper"
early = { factor = 5.0, abs = 0.05 }
rel = 0.5
abs = 0.02
missing = "skip"
why = """Fraction of tokens clipped above 1 + epsilon_high with a positive advantage; as for clip \
low, a rise means over-large steps. DAPO's clip-higher makes this one the first to move."""

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
name = "mismatch KL"
metric = "mismatch/kl_k3"
direction = "upper"
early = { factor = 3.0, abs = 0.001 }
rel = 1.0
abs = 0.0005
missing = "skip"
why = """k3 KL between the trainer's and the inference engine's log-probs of the same tokens. For a \
fixed model, engine and precision it is a small constant (~1e-3 nats/token for bf16 engines); \
tripling means the stack changed: an engine upgrade, a precision or kernel change, sampling \
settings (temperature, top-p) applied on one side only. Against a baseline: at most twice the \
baseline's value plus 0.0005."""

[[rule]]
name = "veto fraction"
metric = "rollout_is/veto/seq_fraction"
direction = "upper"
early = { factor = 10.0, abs = 0.05 }
rel = 1.0
abs = 0.05
missing = "skip"
why = """Share of sequences the rollout-IS veto throws away: a token whose trainer and engine \
probabilities differ by the veto factor (1e4 by default, about 9 nats). Engine and trainer then \
disagree about tokens, not about rounding; every vetoed sequence is lost training data. The floor \
of 5 % keeps a single vetoed sequence in a small CI batch from failing the build."""

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
