"""KL divergence of the current policy to the reference policy.

Per masked token whose ``logp`` and ``ref_logp`` are finite, with ``x = ref_logp − logp``:

    k1 = logp − ref = −x          k2 = ½ (logp − ref)²          k3 = e^x − x − 1

(Schulman's estimators of KL(π_θ‖π_ref) on tokens sampled from π_θ; k3 is the GRPO penalty.)
TRL's *bias-corrected* k3 multiplies k3 by the policy ratio π_θ/π_old -- the token ratio, or under
GSPO (``importance_sampling_level="sequence"``) the sequence ratio broadcast over the tokens
(TRL issue #6586). ``kl/penalty`` is the KL term the loss adds (times β): k3, or the corrected k3
when ``use_bias_correction_kl``; it exists only when β ≠ 0 and is TRL's ``kl``.

``kl/k3_loss_norm`` is k3 reduced the way the configured loss normalises its tokens (MaxEnt-GRPO's
``train/kl``, which also clamps x to ±60), and ``kl/by_length/<bucket>`` the token-weighted k3 of
the sequences whose masked-token count falls in 0–32, 33–64, 65–128, 129–256 or 257+, with
``kl/by_length_tokens/<bucket>`` the tokens behind each value.
"""

from __future__ import annotations

import numpy as np

from grpolens.metrics import reduce
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.functional import estimators as est
from grpolens.metrics.ratios import coef_input
from grpolens.metrics.registry import Family, Metric, register, register_family

#: MaxEnt-GRPO clamps x = ref − logp to ±60 before exp.
MAXENT_CLAMP = 60.0
#: Completion-length buckets (masked tokens per sequence), MaxEnt-GRPO's.
BUCKETS = ((0, 32), (33, 64), (65, 128), (129, 256), (257, None))
BUCKET_LABELS = tuple(f"{lo}-{hi}" if hi is not None else f"{lo}+" for lo, hi in BUCKETS)
_EDGES = np.array([hi for _, hi in BUCKETS[:-1]], dtype=np.float64)
#: Loss types that average per sequence first (k3_loss_norm follows the loss' normalisation).

_MERGE = {
    "kl.n": "sum", "kl.masked": "sum",
    "kl.k1.sum": "sum", "kl.k2.sum": "sum", "kl.k3.sum": "sum", "kl.k3_c60.sum": "sum",
    "kl.k3c.sum": "sum", "kl.k3c.n": "sum", "kl.k3.max": "max",
}


def _kl_inputs(b: TokenBatch) -> tuple[np.ndarray, np.ndarray]:
    from grpolens.metrics import kernels

    def make():
        return kernels.kl_inputs(b.logp, b.cols["ref_logp"], b.mask)
    return b.cached("kl_inputs", make)


def kl_valid(b: TokenBatch) -> np.ndarray:
    """Masked tokens with finite logp and ref_logp."""
    return b.cached("kl_valid", lambda: _kl_inputs(b)[0])


def kl_x(b: TokenBatch) -> np.ndarray:
    """x = ref_logp − logp on :func:`kl_valid` tokens, 0 elsewhere (made with the mask, one pass)."""
    return b.cached("kl_x", lambda: _kl_inputs(b)[1])


def kl_k3(b: TokenBatch) -> np.ndarray:
    """Per-token k3 = e^x − x − 1 (0 off the valid tokens)."""
    return b.cached("kl_k3", lambda: est.k3(kl_x(b)))


def _kl(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    from grpolens.metrics import kernels

    x = kl_x(b)  # 0 off the valid tokens: every estimator below vanishes there, no further masking
    k3 = kl_k3(b)
    # bias correction: × π_θ/π_old per token (tokens whose ratio is defined; a k3 token without
    # one is left out), or × the sequence ratio broadcast over the tokens
    c, c_masked = coef_input(b, cfg)
    sums, counts, k3max, xmax = kernels.kl_sums(kl_valid(b), x, k3, b.mask, b.logp, b.old, c, c_masked,
                                                b.starts, b.lengths)
    n = counts[0]
    k3_sum = sums[2]
    # MaxEnt's ±60 clamp changes nothing unless some |x| exceeds it: skip the second exp then
    k3m_sum = b.seq_sum(est.k3(est.clip_log_ratio(x, MAXENT_CLAMP))) if xmax > MAXENT_CLAMP else k3_sum
    return {
        "kl.n": n,
        "kl.masked": counts[1],
        "kl.k1.sum": est.k1(sums[0]),
        "kl.k2.sum": sums[1],
        "kl.k3.sum": k3_sum,
        "kl.k3.max": k3max,
        "kl.k3_c60.sum": k3m_sum,
        "kl.k3c.sum": sums[3],
        "kl.k3c.n": counts[2],
    }


# Registered by a call, not as a decorator: mutmut skips decorated functions (docs/mutation-testing.md).
producer("kl", merge=_MERGE, requires=("ref_logp",))(_kl)


# ---------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------

def _penalty(sd) -> float | None:
    """TRL's ``kl``: the k3 the loss adds, token-weighted per micro-batch slot in the trl profile."""
    corrected = bool(sd.cfg.get("use_bias_correction_kl"))
    num, den = ("kl.k3c.sum", "kl.k3c.n") if corrected else ("kl.k3.sum", "kl.n")
    return reduce.grouped_ratio(sd, num, den, sd.profile.token_mean)


def k3_loss_norm(sd, clamped: bool = False) -> float | None:
    """k3 normalised like the loss. ``clamped`` (MaxEnt-GRPO's profile): x clamped to ±60, the
    denominators clamped to >= 1 (0.0 where nothing is valid), and the longest sequence as the
    length when max_completion_length is unset (the padded width of its batch)."""
    if not sd.n_seq:
        return None
    s = sd.col("kl.k3_c60.sum" if clamped else "kl.k3.sum")
    n = sd.col("kl.n")
    if not clamped and n.sum() == 0:
        return None  # nothing to average
    length = sd.cfg.get("max_completion_length")
    if not length and clamped:
        length = float(np.max(sd.col("seq_tokens")))
    return reduce.normalise_like_loss(sd.cfg.get("loss_type"), s, n, length, clamp=clamped)


def bucket_of(masked: np.ndarray) -> np.ndarray:
    """Index into :data:`BUCKETS` of each sequence's masked-token count."""
    return np.searchsorted(_EDGES, masked, side="left")


def bucket(k: int, tokens: bool, clamped: bool = False):
    """``fn(sd)``: k3 per token (or the token count) of length bucket ``k``. ``clamped`` (MaxEnt-GRPO's
    profile): max(mask count, 1) tokens per sequence, x clamped to ±60, empty buckets not logged."""
    def fn(sd) -> float | None:
        if not sd.n_seq:
            return None
        m = sd.col("kl.masked")
        if clamped:
            tok = np.maximum(m, 1.0)
            sel = bucket_of(tok) == k
            if not sel.any():
                return None
            t = float(tok[sel].sum())
            return t if tokens else float(sd.col("kl.k3_c60.sum")[sel].sum() / max(t, 1.0))
        sel = bucket_of(m) == k
        t = float(sd.col("kl.n")[sel].sum())
        if tokens:
            return t
        return float(sd.col("kl.k3.sum")[sel].sum() / t) if t > 0 else None
    return fn


_FAM = "kl"
_REF = ("ref_logp",)

register(Metric(
    "kl/k1", _FAM, "k1 estimate of KL(π_θ‖π_ref): Σ (logp − ref_logp) / N (can be negative).",
    kind="token_mean", num="kl.k1.sum", den="kl.n", requires=_REF,
))
register(Metric(
    "kl/k2", _FAM, "k2 estimate of KL(π_θ‖π_ref): Σ ½(logp − ref_logp)² / N.",
    kind="token_mean", num="kl.k2.sum", den="kl.n", requires=_REF,
))
register(Metric(
    "kl/k3", _FAM, "k3 estimate of KL(π_θ‖π_ref): Σ (e^x − x − 1) / N, x = ref_logp − logp.",
    kind="token_mean", num="kl.k3.sum", den="kl.n", requires=_REF,
))
register(Metric(
    "kl/k3_corrected", _FAM,
    "TRL's bias-corrected k3: Σ k3·c / N with c = π_θ/π_old per token, or under sequence-level "
    "importance sampling (GSPO) the sequence ratio exp(mean_t d) broadcast over the tokens.",
    kind="token_mean", num="kl.k3c.sum", den="kl.k3c.n", requires=_REF,
    config=("importance_sampling_level", "loss_type"),
))
register(Metric(
    "kl/penalty", _FAM,
    "The KL the loss adds (β times this per token): kl/k3, or kl/k3_corrected when "
    "use_bias_correction_kl. Only when β ≠ 0. TRL's `kl` (per micro-batch slot, 0.0 for an "
    "all-masked slot, then the mean over slots).",
    kind="custom", fn=_penalty, requires=_REF, when=lambda cfg: cfg.get("beta", 0.0) != 0.0,
    config=("beta", "use_bias_correction_kl", "importance_sampling_level", "loss_type"),
))
register(Metric(
    "kl/k3_loss_norm", _FAM,
    "k3 reduced as the configured loss normalises tokens: grpo/sapo/gspo the mean over all "
    "sequences of their token mean (Σ/max(n,1)); luspo the mean of per-sequence sums; dr_grpo "
    "Σ / (sequences · max_completion_length) (null if unset); the others Σ / N. MaxEnt-GRPO's "
    "`train/kl` (its profile clamps x to ±60, logs 0.0 where nothing is valid and uses the longest "
    "sequence when max_completion_length is unset).",
    kind="custom", fn=k3_loss_norm, requires=_REF, config=("loss_type", "max_completion_length"),
))
for _k, _label in enumerate(BUCKET_LABELS):
    register(Metric(
        f"kl/by_length/{_label}", _FAM,
        f"k3 per token over the sequences with {_label} masked tokens: Σ k3 / Σ tokens of those "
        "sequences (null when none). MaxEnt counts max(masked, 1) tokens per sequence, clamps x to "
        "±60 and omits empty buckets.",
        kind="custom", fn=bucket(_k, tokens=False), requires=_REF,
    ))
    register(Metric(
        f"kl/by_length_tokens/{_label}", _FAM,
        f"Tokens with a finite k3 in the sequences with {_label} masked tokens (the weight of "
        f"kl/by_length/{_label}).",
        kind="custom", fn=bucket(_k, tokens=True), requires=_REF,
    ))


#: The built-in ``grpolens check`` rules over this family (see :mod:`grpolens.check.defaults`).
RULES = '''\
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
'''

register_family(Family(
    'kl', page='policy',
    key_metrics=('kl/k3',),
    overview=(
        (2, 'KL to reference', ('^kl/k3$', '^kl/k1$', '^kl/.*', '^policy/kl')),
    ),
    rules=RULES,
))
