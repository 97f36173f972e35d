"""The rollout-IS family's metrics (their docs and when they apply), the family itself and its
default ``grpolens check`` rules. Every value comes from :func:`~grpolens.metrics.rollout_is.summary.step_summary`."""

from __future__ import annotations

from grpolens.functional.rollout_is import ISConfig, RS_OPTIONS
from grpolens.metrics.registry import Family, Metric, register, register_family
from grpolens.metrics.rollout_is.inputs import FAMILY, REQ
from grpolens.metrics.rollout_is.offset import OFFSET_MIN_AGREEMENT, OFFSET_MIN_NATS
from grpolens.metrics.rollout_is.summary import step_summary


def _value(name: str):
    def fn(sd):
        return step_summary(sd).get(name)
    fn.__name__ = f"rollout_is[{name}]"
    return fn


def _isc(cfg: dict) -> ISConfig:
    return ISConfig.from_cfg(cfg)


WHEN = {
    None: None,
    "configured": lambda cfg: _isc(cfg).configured,
    "band": lambda cfg: _isc(cfg).has_band,
    "truncate": lambda cfg: _isc(cfg).truncates,
    "icepop": lambda cfg: _isc(cfg).zeroes,
    "mask": lambda cfg: _isc(cfg).masks,
    "batch_normalize": lambda cfg: _isc(cfg).batch_normalize,
}

_IS_BAND = "lower, upper"
IS_METRICS: list[tuple[str, str, str | None]] = [
    # (key, doc, when)
    ("valid_tokens", "Masked tokens with a defined log-ratio δ = log π_train − log π_rollout (the tokens every IS statistic is over).", None),
    ("undefined_tokens", "Masked tokens left out: δ is NaN (a NaN log-prob), or the sequence holds both +inf and −inf δ.", None),
    ("safety_bound_fraction", "Share of valid tokens whose level log-weight |X| exceeded the ±20 safety bound (weight saturated at e^±20).", None),
    ("raw/mean", "Raw IS weight w = exp(clip(X, ±20)) at the configured level (token X = δ, sequence X = Σδ, geometric X = mean δ), token-weighted mean.", None),
    ("raw/std", "Population std of the raw weights, token-weighted.", None),
    ("raw/min", "Smallest raw weight over valid tokens (xtuner, sequence/geometric level: exp(min X) over every row of a pack, unbounded).", None),
    ("raw/max", "Largest raw weight over valid tokens (xtuner, sequence/geometric level: exp(min(max X, 20)) over every row of a pack).", None),
    ("raw/ess", "Effective sample size of the raw weights as a fraction: (Σw)² / (N·Σw²), in (0, 1].", None),
    ("raw/fraction_high", "Share of valid tokens whose unbounded level weight exceeds `upper` (sequence level in xtuner/verl: share of rows).", "band"),
    ("raw/fraction_low", "Share of valid tokens whose unbounded level weight is below `lower`.", "band"),
    ("raw/seq_mean", "Mean over sequences with a valid token of s_b = the sequence's mean raw weight.", None),
    ("raw/seq_std", "Unbiased std of s_b over sequences (null for fewer than two; xtuner logs 0).", None),
    ("raw/seq_min", "Smallest s_b.", None),
    ("raw/seq_max", "Largest s_b.", None),
    ("raw/seq_max_deviation", "max_b |s_b − 1|: the sequence whose weights are furthest from on-policy.", None),
    ("raw/seq_fraction_high", "Share of sequences with s_b > upper (verl: over every row, an empty row's s_b = 0).", "band"),
    ("raw/seq_fraction_low", "Share of sequences with s_b < lower.", "band"),
    ("clamped/std", "Population std of the raw weights clamped to [lower, upper], token-weighted (the reference's overflow-safe spread; xtuner: 0 when a pack has one token).", "band"),
    ("clamped/ess", "ESS fraction of the raw weights clamped to [lower, upper]: (Σw')² / (N·Σw'²).", "band"),
    ("applied/mean", "Applied weight a (after truncation or IcePop zeroing; rejected tokens keep theirs), token-weighted mean. TRL: per-rank mean (sequence modes: over completions), then mean over ranks.", None),
    ("applied/std", "Population std of the applied weights, token-weighted (verl: 0 for a single token).", None),
    ("applied/min", "Smallest applied weight (verl, sequence level: exp(min Σδ) over every row).", None),
    ("applied/max", "Largest applied weight (verl, sequence level: exp(min(max Σδ, 20)) over every row).", None),
    ("applied/ess", "ESS fraction of the applied weights: (Σa)² / (N·Σa²).", None),
    ("applied/seq_mean", "Mean over sequences of the sequence's mean applied weight (verl: over every row).", None),
    ("applied/seq_std", "Unbiased std of the per-sequence mean applied weight.", None),
    ("applied/seq_min", "Smallest per-sequence mean applied weight.", None),
    ("applied/seq_max", "Largest per-sequence mean applied weight.", None),
    ("applied/seq_max_deviation", "max_b |mean applied weight − 1|.", None),
    ("truncated_fraction", "Share of valid tokens whose weight truncation changed.", "truncate"),
    ("zeroed_fraction", "Share of valid tokens whose weight IcePop set to 0 (raw weight outside [lower, upper]).", "icepop"),
    ("batch_norm_factor", "Under verl's rollout_is_batch_normalize: the batch mean of the applied weights (token level: over valid tokens; sequence level: over sequences with a token), which divides them; 1.0 when not above 1e-8 (verl profile only).", "batch_normalize"),
    ("mask/token_fraction", "Share of valid tokens rejected by the mask band [mask_lower, mask_upper] (mask/both modes).", "mask"),
    ("mask/seq_fraction", "Share of sequences with a token rejected by the mask band (xtuner: over every row of a pack).", "mask"),
    ("veto/seq_fraction", "Share of sequences vetoed: some token's raw ratio e^δ is outside [veto_lower, veto_upper].", "configured"),
    ("veto/catastrophic_token_fraction", "Share of valid tokens whose raw ratio is outside the veto band.", "configured"),
    ("rejected/token_fraction", "Share of valid tokens removed from the loss mask (mask band, veto, rejection filters).", "configured"),
    ("rejected/seq_fraction", "Share of sequences with at least one removed token.", "configured"),
    ("modified/token_fraction", "Share of valid tokens removed from the loss or re-weighted by truncation/zeroing.", "configured"),
    ("modified/seq_fraction", "Share of sequences with at least one modified token.", "configured"),
    ("kept_tokens", "Valid tokens still in the loss mask after rejection.", "configured"),
    ("loss_mass_removed", "Share of the advantage mass removed: Σ|A| over removed or zero-weighted tokens / Σ|A| over valid tokens.", "configured"),
]

MISMATCH_METRICS: list[tuple[str, str]] = [
    ("kl_k1", "k1 estimate of KL(π_rollout‖π_train): mean over masked finite tokens of log π_rollout − log π_train (may be negative)."),
    ("kl_k3", "k3 estimate: mean of e^δ − δ − 1, δ = log π_train − log π_rollout (unbounded, as the reference)."),
    ("abs_logp_diff", "Mean |δ| over masked finite tokens. TRL: per rank, then the plain mean over ranks."),
    ("abs_logp_diff_max", "Largest |δ|."),
    ("training_ppl", "Mean over sequences of exp(−mean log π_train) (xtuner: per pack; verl: every row, an empty row counts 1)."),
    ("training_log_ppl", "Mean over sequences of −mean log π_train."),
    ("rollout_ppl", "Mean over sequences of exp(−mean log π_rollout)."),
    ("rollout_log_ppl", "Mean over sequences of −mean log π_rollout."),
    ("log_ppl_diff", "Mean over sequences of d_b = mean log π_rollout − mean log π_train (= log(train PPL / rollout PPL))."),
    ("log_ppl_abs_diff", "Mean over sequences of |d_b|."),
    ("log_ppl_diff_max", "Largest d_b."),
    ("log_ppl_diff_min", "Smallest d_b."),
    ("ppl_ratio", "Mean over sequences of exp(d_b) = train PPL / rollout PPL (a mean of ratios, as the reference)."),
    ("chi2_token", "χ² divergence per token: mean of e^(2·clip(δ, ±20)) − 1."),
    ("chi2_seq", "χ² per sequence: mean over sequences of e^(2·clip(Σδ, ±20)) − 1."),
    ("delta_median", "Median of δ over the step's masked finite tokens, from a mergeable log-binned histogram: within 0.5 % of the exact lower median (|δ| < 1e-6 reads 0)."),
    ("delta_iqr", "Interquartile range of δ (the spread the median is judged against), each quartile within 0.5 % like the median."),
    ("delta_sign_agreement", "Share of tokens whose δ has the sign of the median δ."),
    ("constant_offset", f"1 when the engines differ by a near-constant offset: |median δ| ≥ {OFFSET_MIN_NATS} nats and ≥ {OFFSET_MIN_AGREEMENT:.0%} of tokens on its side (temperature or top-p/top-k renormalisation mismatch), else 0."),
]

RS_STATS = {
    "mean": "token-weighted mean of the statistic (sequence filters: of the row value)",
    "max": "largest value (token filters: over tokens; sequence filters: over rows)",
    "min": "smallest value",
    "fraction_high": "share above the upper bound (tokens, or rows for sequence filters)",
    "fraction_low": "share below the lower bound (k1 only; 0 for k2/k3)",
    "std": "population std of the statistic clamped to its band, token-weighted",
    "seq_mean": "mean over rows of the row value (token filters: the row's mean statistic)",
    "seq_std": "unbiased std over rows of the row value",
    "seq_max": "largest row value",
    "seq_min": "smallest row value",
    "seq_max_deviation": "largest |row value|",
    "seq_fraction_high": "share of rows whose value is above the upper bound",
    "seq_fraction_low": "share of rows whose value is below the lower bound (k1 only)",
    "masked_fraction": "share of valid tokens this filter rejects",
    "seq_masked_fraction": "share of rows with a token this filter rejects",
}

for _key, _doc, _when in IS_METRICS:
    _name = f"rollout_is/{_key}"
    register(Metric(_name, FAMILY, _doc, kind="custom", fn=_value(_name), requires=REQ, config=("rollout_is",),
                    when=WHEN[_when]))
for _key, _doc in MISMATCH_METRICS:
    _name = f"mismatch/{_key}"
    register(Metric(_name, FAMILY, _doc, kind="custom", fn=_value(_name), requires=REQ))
for _key, _doc in (("masked_fraction", "Share of valid tokens rejected by the rejection filters together (verl rollout_rs)."),
                   ("seq_masked_fraction", "Share of all sequences (empty ones too, as verl) with a token rejected by the filters.")):
    _name = f"rollout_rs/{_key}"
    register(Metric(_name, FAMILY, _doc, kind="custom", fn=_value(_name), requires=REQ, config=("rollout_is",),
                    when=lambda cfg: bool(_isc(cfg).rs)))
for _opt in RS_OPTIONS:
    for _stat, _what in RS_STATS.items():
        if _stat == "seq_fraction_low" and not _opt.endswith("k1"):
            continue
        _name = f"rollout_rs/{_opt}/{_stat}"
        register(Metric(_name, FAMILY, f"Rejection filter {_opt}: {_what}.", kind="custom", fn=_value(_name),
                        requires=REQ, config=("rollout_is",),
                        when=lambda cfg, o=_opt: any(f.option == o for f in _isc(cfg).rs)))


#: The built-in ``grpolens check`` rules over this family (see :mod:`grpolens.check.defaults`).
RULES = '''\
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
'''

register_family(Family(
    'rollout_is', page='mismatch',
    key_metrics=('mismatch/kl_k1', 'mismatch/abs_logp_diff', 'rollout_is/veto/seq_fraction', 'rollout_is/rejected/token_fraction'),
    overview=(
        (6, 'mismatch KL (train vs rollout)', ('^mismatch/k3$', '^mismatch/.*k3', '^mismatch/kl', '^rollout_is/.*kl', '^mismatch/')),
        (7, 'veto fraction', ('veto.*frac', 'veto', 'masked_frac')),
    ),
    rules=RULES,
))
