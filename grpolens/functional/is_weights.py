"""Rollout importance sampling (IS): weights, rejection and veto -- the one implementation.

The trainer's behaviour policy π_train (``old_logp``; ``logp`` where the trainer had none) and the
inference engine π_rollout (``rollout_logp``) disagree. Per token ``δ = log π_train − log π_rollout``.
Everything below follows the reference (xtuner's port of verl's mismatch helper); the metrics, the
``--is-weights`` output and ``grpolens sweep`` all call these functions, so they cannot disagree.

Levels -- the log-weight X and the raw weight ``w = exp(clip(X, −20, 20))`` (the ±20 safety bound)::

    token       X_t = δ_t
    sequence    X_b = Σ_t δ_t            (every token of the sequence gets the same weight)
    geometric   X_b = Σ_t δ_t / T_b

Modes -- the applied weight ``a`` and which tokens leave the loss::

    none            a = w
    truncate        a = clip(w, lower, upper)          (two-sided: the xtuner reference)
    truncate_upper  a = min(w, upper)                  (verl TIS, TRL *_truncate without clip_min)
    mask            a = w; reject outside [mask_lower, mask_upper]
    both            mask, then truncate
    icepop          a = w inside [lower, upper], else 0; nothing rejected (verl IcePop, TRL *_mask)

Veto: a sequence with any token whose *raw* ratio e^δ is outside [veto_lower, veto_upper] is
rejected whole. Rejection filters (verl ``rollout_rs``) on ``δs = clip(δ, ±20)``: k1 = −δs,
k2 = δs²/2, k3 = e^δs − 1 − δs, per token (``token_kX``) or per sequence as a sum, a mean or a
max (``seq_sum_kX``, ``seq_mean_kX``, ``seq_max_kX``); k1 keeps ``log lower ≤ stat ≤ log upper``
(note: a band on π_rollout/π_train, the inverse of the IS ratio), k2/k3 keep ``stat ≤ upper``.

Valid tokens: ``mask`` (before the trainer's own rejection, when the run records it:
``rollout_rejected``) and δ not NaN. ±inf log-ratios stay in: their weight saturates at e^±20 and
the veto catches them, which is what a trainer does with them. A sequence holding both +inf and
−inf has no defined Σδ and is left out whole; both kinds are counted as *undefined* tokens.

Per-sequence partials (:func:`sequence_partials`) are sums, counts and extrema that merge
exactly; every non-linear per-sequence decision (sequence weight, veto, sequence rejection) is
taken from the merged partials by :func:`seq_view`, so it is the same however the data is split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

SAFETY_BOUND = 20.0
LEVELS = ("token", "sequence", "geometric")
MODES = ("none", "truncate", "truncate_upper", "mask", "both", "icepop")


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RSFilter:
    """One verl rejection filter, e.g. ``token_k1`` with band [0.5, 2] or ``seq_max_k3`` ≤ 3."""

    option: str
    lower: float | None
    upper: float

    @property
    def k(self) -> int:
        return int(self.option[-1])

    @property
    def scope(self) -> str:
        """``token``, ``sum``, ``mean`` or ``max``."""
        return "token" if self.option.startswith("token") else self.option.split("_")[1]

    @property
    def log_band(self) -> tuple[float, float]:
        """The bounds the statistic is compared with (log space for k1)."""
        if self.k == 1:
            return float(np.log(self.lower)), float(np.log(self.upper))
        return 0.0, float(self.upper)

    def keep(self, stat: np.ndarray) -> np.ndarray:
        lo, hi = self.log_band
        with np.errstate(invalid="ignore"):
            return (stat >= lo) & (stat <= hi) if self.k == 1 else stat <= hi


@dataclass(frozen=True)
class ISConfig:
    """A normalised ``rollout_is`` config (see :func:`grpolens.run.config.normalize_rollout_is`).

    ``configured`` is False for the analysis default used when a run has no ``rollout_is``:
    token level, nothing changed, no thresholds (raw-weight statistics only).
    """

    level: str = "token"
    mode: str = "none"
    lower: float | None = None
    upper: float | None = None
    mask_lower: float | None = None
    mask_upper: float | None = None
    veto_lower: float | None = None
    veto_upper: float | None = None
    rs: tuple[RSFilter, ...] = field(default_factory=tuple)
    configured: bool = False
    #: verl's ``rollout_is_batch_normalize``: the applied weights divided by their batch mean (a
    #: factor over the trainer's batch, applied where the trainer's batch is known: the verl profile)
    batch_normalize: bool = False

    @classmethod
    def from_cfg(cls, cfg: dict | None) -> "ISConfig":
        """From a checked config (the whole config, or its ``rollout_is`` mapping)."""
        # A checked whole config always holds the ``rollout_is`` key and its mapping never does.
        # (Telling them apart by ``level``/``mode`` read a user's own top-level ``mode`` key as the
        # IS settings.)
        ris = cfg.get("rollout_is") if isinstance(cfg, dict) and "rollout_is" in cfg else cfg
        if not ris:
            return cls()
        rs = tuple(RSFilter(f["option"], f.get("lower"), float(f["upper"])) for f in ris.get("rs") or ())
        keys = ("level", "mode", "lower", "upper", "mask_lower", "mask_upper", "veto_lower", "veto_upper")
        return cls(**{k: ris.get(k) for k in keys if ris.get(k) is not None}, rs=rs, configured=True,
                   batch_normalize=bool(ris.get("batch_normalize", False)))

    @property
    def has_band(self) -> bool:
        return self.upper is not None

    @property
    def masks(self) -> bool:
        return self.mode in ("mask", "both")

    @property
    def truncates(self) -> bool:
        return self.mode in ("truncate", "truncate_upper", "both")

    @property
    def zeroes(self) -> bool:
        return self.mode == "icepop"

    @property
    def veto(self) -> bool:
        return (self.veto_lower is not None and self.veto_lower > 0) or self.veto_upper is not None

    @property
    def token_filters(self) -> tuple[RSFilter, ...]:
        return tuple(f for f in self.rs if f.scope == "token")

    @property
    def seq_filters(self) -> tuple[RSFilter, ...]:
        return tuple(f for f in self.rs if f.scope != "token")


# ---------------------------------------------------------------------------------------------
# Per-token primitives
# ---------------------------------------------------------------------------------------------

def bounded_exp(x: np.ndarray) -> np.ndarray:
    """exp(clip(x, −20, 20)): the reference's overflow guard (NaN stays NaN)."""
    return np.exp(np.clip(x, -SAFETY_BOUND, SAFETY_BOUND))


def in_band(w: np.ndarray, lower: float | None, upper: float | None) -> np.ndarray:
    """lower ≤ w ≤ upper (an unset bound is open; NaN is outside)."""
    with np.errstate(invalid="ignore"):
        keep = ~np.isnan(w)
        if lower is not None:
            keep &= w >= lower
        if upper is not None:
            keep &= w <= upper
    return keep


def apply_mode(w: np.ndarray, c: ISConfig) -> np.ndarray:
    """The applied weight of raw weights ``w`` under the mode (rejection is separate)."""
    if c.mode in ("truncate", "both"):
        return np.clip(w, c.lower if c.lower is not None else -np.inf, c.upper)
    if c.mode == "truncate_upper":
        return np.minimum(w, c.upper)
    if c.mode == "icepop":
        return np.where(in_band(w, c.lower, c.upper), w, 0.0)
    return w


def catastrophic(delta: np.ndarray, c: ISConfig) -> np.ndarray:
    """Raw (unbounded) token ratio e^δ outside the veto band; a lower bound of 0 disables that side."""
    out = np.zeros(delta.shape, dtype=bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        if c.veto_lower is not None and c.veto_lower > 0:
            out |= delta < np.log(c.veto_lower)
        if c.veto_upper is not None:
            out |= delta > np.log(c.veto_upper)
    return out


def rs_stat(k: int, delta: np.ndarray) -> np.ndarray:
    """verl's per-token divergence statistic k1/k2/k3 of the bounded log-ratio."""
    ds = np.clip(delta, -SAFETY_BOUND, SAFETY_BOUND)
    if k == 1:
        return -ds
    if k == 2:
        return 0.5 * ds * ds
    return np.expm1(ds) - ds


class Segments:
    """Per-sequence reductions over a subset of each sequence's tokens, the values given for those
    tokens only (compressed once, so that every reduction is one ``reduceat`` without masking)."""

    def __init__(self, b, keep: np.ndarray):
        self.idx = np.flatnonzero(keep)
        self.n = b.count(keep)
        counts = self.n.astype(np.int64)
        self.starts = np.cumsum(counts) - counts
        self.empty = counts == 0

    def _reduce(self, op, x: np.ndarray, identity: float) -> np.ndarray:
        out = np.full(len(self.starts), identity)
        inside = self.starts < len(x)  # empty sequences at the end start past the last token
        if inside.any():
            out[inside] = op.reduceat(x, self.starts[inside], dtype=np.float64)
            out[self.empty] = identity  # reduceat gives an empty segment the next token's value
        return out

    def sum(self, x: np.ndarray) -> np.ndarray:
        return self._reduce(np.add, x, 0.0)

    def max(self, x: np.ndarray) -> np.ndarray:
        return self._reduce(np.maximum, x, -np.inf)

    def min(self, x: np.ndarray) -> np.ndarray:
        return self._reduce(np.minimum, x, np.inf)


@dataclass
class Inputs:
    """The per-token inputs of one batch: the valid tokens; ``dv``/``av`` are δ and |A| on the
    valid tokens only (|A| is 0 where the advantage is not finite)."""

    valid: np.ndarray
    seg: Segments
    dv: np.ndarray
    av: np.ndarray
    #: :func:`token_decisions` under each config, made once: the producer's partials, the loss
    #: weights and the IS visitors of a batch all ask for the same ones
    decisions: dict = field(default_factory=dict, repr=False, compare=False)


def inputs(b) -> Inputs:
    """δ and the valid set of a :class:`~grpolens.metrics.batch.TokenBatch` (needs ``rollout_logp``)."""
    with np.errstate(invalid="ignore"):
        delta = b.old - b.cols["rollout_logp"]
    # the mask the trainer's rollout correction saw: before its own rejection (``rollout_rejected``)
    valid = b.pre_rejection_mask & ~np.isnan(delta)
    pinf, ninf = valid & (delta == np.inf), valid & (delta == -np.inf)
    if pinf.any() and ninf.any():
        both = b.seq_any(pinf) & b.seq_any(ninf)
        if both.any():
            valid &= ~b.broadcast(both)
    seg = Segments(b, valid)
    adv = b.adv[seg.idx]
    return Inputs(valid, seg, delta[seg.idx], np.where(np.isfinite(adv), np.abs(adv), 0.0))


@dataclass
class TokenDecisions:
    """Token-level quantities on the valid tokens; ``rej``/``drop``/``mod`` count only token-level
    rules (sequence-level rules -- veto, sequence/geometric bands, sequence filters -- come from
    :func:`seq_view`)."""

    w: np.ndarray      # token raw weight exp(clip δ)
    a: np.ndarray      # token applied weight (level token; = w otherwise)
    cat: np.ndarray    # catastrophic tokens (veto)
    band: np.ndarray   # rejected by the mask band (level token)
    rej: np.ndarray    # rejected by a token-level rule (band or token filter)
    chg: np.ndarray    # weight changed by truncation/zeroing (level token)
    drop: np.ndarray   # rejected or weight zeroed
    mod: np.ndarray    # rejected or weight changed


def token_decisions(x: Inputs, c: ISConfig) -> TokenDecisions:
    """The token-level decisions on ``x`` under ``c`` (computed once per inputs and config)."""
    t = x.decisions.get(c)
    if t is None:
        t = x.decisions[c] = _token_decisions(x, c)
    return t


def _token_decisions(x: Inputs, c: ISConfig) -> TokenDecisions:
    d = x.dv
    w = bounded_exp(d)
    none = np.zeros(len(d), dtype=bool)
    if c.level == "token":
        a = apply_mode(w, c)
        band = ~in_band(w, c.mask_lower, c.mask_upper) if c.masks else none
        chg = a != w
    else:
        a, band, chg = w, none, none
    rej = band
    for f in c.token_filters:
        rej = rej | ~f.keep(rs_stat(f.k, d))
    cat = catastrophic(d, c) if c.veto else none
    zero = chg & (a == 0)
    return TokenDecisions(w, a, cat, band, rej, chg, rej | zero, rej | chg)


# ---------------------------------------------------------------------------------------------
# Per-sequence partials (mergeable) and the per-sequence view
# ---------------------------------------------------------------------------------------------

#: Partial columns and their merge rules (``ris.t*``: token-level sums over valid tokens).
IS_MERGE = {
    "ris.n": "sum", "ris.undef": "sum", "ris.L": "sum", "ris.bound": "sum", "ris.cat": "sum", "ris.adv": "sum",
    "ris.tw": "sum", "ris.tw2": "sum", "ris.twmax": "max", "ris.twmin": "min",
    "ris.thi": "sum", "ris.tlo": "sum", "ris.tc": "sum", "ris.tc2": "sum",
    "ris.ta": "sum", "ris.ta2": "sum", "ris.tamax": "max", "ris.tamin": "min", "ris.tchg": "sum",
    "ris.tband": "sum", "ris.trej": "sum", "ris.tdrop_adv": "sum", "ris.tmod": "sum",
    "ris.k1": "sum", "ris.k2": "sum", "ris.k3": "sum", "ris.k2max": "max", "ris.k3max": "max",
}


def sequence_partials(b, x: Inputs, c: ISConfig, t: TokenDecisions | None = None) -> dict[str, np.ndarray]:
    """Per-sequence partials of one batch under config ``c`` (columns of :data:`IS_MERGE`)."""
    s, d = x.seg, x.dv
    t = t or token_decisions(x, c)
    zeros = np.zeros(len(s.n))
    out = {
        "ris.n": s.n, "ris.undef": b.count(b.pre_rejection_mask) - s.n, "ris.L": s.sum(d),
        "ris.bound": s.sum(np.abs(d) > SAFETY_BOUND), "ris.cat": s.sum(t.cat) if c.veto else zeros,
        "ris.adv": s.sum(x.av),
        "ris.tw": s.sum(t.w), "ris.tw2": s.sum(t.w * t.w), "ris.twmax": s.max(t.w), "ris.twmin": s.min(t.w),
        "ris.thi": zeros, "ris.tlo": zeros, "ris.tc": zeros, "ris.tc2": zeros,
    }
    if c.level == "token" and c.has_band:
        cw = np.clip(t.w, c.lower or 0.0, c.upper)
        out["ris.thi"] = s.sum(t.w > c.upper)
        if c.lower is not None:
            out["ris.tlo"] = s.sum(t.w < c.lower)
        out["ris.tc"], out["ris.tc2"] = s.sum(cw), s.sum(cw * cw)
    same = t.a is t.w
    out.update({
        "ris.ta": out["ris.tw"] if same else s.sum(t.a), "ris.ta2": out["ris.tw2"] if same else s.sum(t.a * t.a),
        "ris.tamax": out["ris.twmax"] if same else s.max(t.a), "ris.tamin": out["ris.twmin"] if same else s.min(t.a),
        "ris.tchg": s.sum(t.chg) if t.chg.any() else zeros, "ris.tband": s.sum(t.band) if t.band.any() else zeros,
        "ris.trej": s.sum(t.rej) if t.rej.any() else zeros,
        "ris.tdrop_adv": s.sum(np.where(t.drop, x.av, 0.0)) if t.drop.any() else zeros,
        "ris.tmod": s.sum(t.mod) if t.mod.any() else zeros,
    })
    ks = {f.k for f in c.seq_filters}
    for k in (1, 2, 3):
        st = rs_stat(k, d) if k in ks else None
        out[f"ris.k{k}"] = s.sum(st) if st is not None else zeros
        if k > 1:
            out[f"ris.k{k}max"] = s.max(st) if st is not None else np.full(len(zeros), -np.inf)
    return out


def _col(p: dict, name: str) -> np.ndarray:
    """A partial column as float64. Merged partials hold no nulls: a sequence whose shard had no
    ``rollout_logp`` gets each column's neutral value (:func:`grpolens.metrics.partials.merge_arrays`),
    and the completions table passes only the sequences that have IS partials."""
    return np.asarray(p[name], dtype=np.float64)


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


@dataclass
class SeqView:
    """Per-sequence decisions and summaries taken from merged partials (one entry per sequence)."""

    n: np.ndarray          # valid tokens
    X: np.ndarray | None   # level log-weight (sequence/geometric), unclamped
    w: np.ndarray          # level raw weight (sequence/geometric; token: per-sequence mean of w)
    a: np.ndarray          # applied weight (sequence/geometric; token: per-sequence mean of a)
    vetoed: np.ndarray
    band_rej: np.ndarray   # sequence rejected by the mask band (sequence/geometric level)
    rs_rej: np.ndarray     # sequence rejected by a sequence filter
    seq_rej: np.ndarray    # any of the three
    rejected: np.ndarray   # tokens removed from the loss mask
    dropped_adv: np.ndarray  # |A| of the tokens removed or zero-weighted
    modified: np.ndarray   # tokens removed or re-weighted
    changed: np.ndarray    # tokens whose weight truncation/zeroing changed
    rs_value: dict[str, np.ndarray]  # sequence filter option -> its per-sequence statistic


def rs_row_value(p: dict, f: RSFilter) -> np.ndarray:
    """The per-sequence statistic of a sequence filter (0 for a sequence without valid tokens)."""
    n = _col(p, "ris.n")
    if f.scope == "sum":
        return _col(p, f"ris.k{f.k}")
    if f.scope == "mean":
        return np.nan_to_num(_div(_col(p, f"ris.k{f.k}"), n))
    m = _col(p, f"ris.k{f.k}max")
    return np.where(n > 0, m, 0.0)


def seq_view(p: dict, c: ISConfig) -> SeqView:
    n = _col(p, "ris.n")
    L = _col(p, "ris.L")
    none = np.zeros(len(n), dtype=bool)
    if c.level == "token":
        X = None
        w, a = _div(_col(p, "ris.tw"), n), _div(_col(p, "ris.ta"), n)
        band_rej = seq_chg = seq_zero = none
    else:
        X = L if c.level == "sequence" else np.nan_to_num(_div(L, n))
        w = bounded_exp(X)
        a = apply_mode(w, c)
        band_rej = ~in_band(w, c.mask_lower, c.mask_upper) if c.masks else none
        seq_chg = a != w
        seq_zero = seq_chg & (a == 0)
    rs_rej = none.copy()
    rs_value = {}
    for f in c.seq_filters:
        rs_value[f.option] = val = rs_row_value(p, f)
        rs_rej |= ~f.keep(val)
    vetoed = _col(p, "ris.cat") > 0
    seq_rej = vetoed | band_rej | rs_rej
    gone = seq_rej | seq_zero
    return SeqView(
        n=n, X=X, w=w, a=a, vetoed=vetoed, band_rej=band_rej, rs_rej=rs_rej, seq_rej=seq_rej,
        rejected=np.where(seq_rej, n, _col(p, "ris.trej")),
        dropped_adv=np.where(gone, _col(p, "ris.adv"), _col(p, "ris.tdrop_adv")),
        modified=np.where(seq_rej | seq_chg, n, _col(p, "ris.tmod")),
        changed=np.where(seq_chg, n, 0.0) if c.level != "token" else _col(p, "ris.tchg"),
        rs_value=rs_value,
    )


# ---------------------------------------------------------------------------------------------
# Step summary (canonical metrics, pooled over whatever partial rows are given)
# ---------------------------------------------------------------------------------------------

def _f(x) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if np.isnan(x) else x


def _mean(x) -> float | None:
    """Mean of per-sequence flags; only called with the sequences that have a valid token, of
    which a step with N > 0 has at least one."""
    return _f(np.mean(x))


def _moments(s1: float, s2: float, n: float) -> tuple[float | None, float | None, float | None]:
    """Token-weighted mean, population std and ESS fraction (Σw)²/(N·Σw²) from sums over n > 0
    tokens (:func:`summarize` returns before any moment of a step without a valid token)."""
    m = s1 / n
    std = float(np.sqrt(max(0.0, s2 / n - m * m)))
    ess = s1 * s1 / (n * s2) if s2 > 0 else None
    return _f(m), _f(std), _f(ess)


def _seq_stats(s: np.ndarray, lower, upper, prefix: str, out: dict, fractions: bool = True,
               undefined: float | None = None) -> None:
    """Summaries of per-sequence values ``s`` (valid sequences only). ``undefined`` is what a std
    of one value and a fraction without its bound report: null canonically, 0.0 where a trainer
    logs 0 (the xtuner and verl profiles)."""
    if len(s) == 0:
        return
    out[f"{prefix}seq_mean"] = _f(s.mean())
    out[f"{prefix}seq_std"] = _f(s.std(ddof=1)) if len(s) > 1 else undefined
    out[f"{prefix}seq_min"] = _f(s.min())
    out[f"{prefix}seq_max"] = _f(s.max())
    out[f"{prefix}seq_max_deviation"] = _f(np.abs(s - 1.0).max())
    if fractions and upper is not None:
        out[f"{prefix}seq_fraction_high"] = _f(np.mean(s > upper))
        out[f"{prefix}seq_fraction_low"] = _f(np.mean(s < lower)) if lower is not None else undefined


def summarize(p: dict, c: ISConfig, view: SeqView | None = None) -> dict[str, float | None]:
    """Canonical step metrics (keys without the ``rollout_is/`` prefix) from per-sequence partials.

    Token fractions are over valid tokens, sequence fractions over sequences with a valid token;
    ``None`` where there is nothing to average.
    """
    sv = view or seq_view(p, c)
    n = sv.n
    N = float(n.sum())
    ok = n > 0
    out: dict[str, float | None] = {"valid_tokens": N, "undefined_tokens": float(_col(p, "ris.undef").sum())}
    if N == 0:
        return out
    U, Lo = c.upper, c.lower
    if c.level == "token":
        raw1, raw2 = _col(p, "ris.tw").sum(), _col(p, "ris.tw2").sum()
        raw_max, raw_min = _col(p, "ris.twmax")[ok].max(), _col(p, "ris.twmin")[ok].min()
        app1, app2 = _col(p, "ris.ta").sum(), _col(p, "ris.ta2").sum()
        app_max, app_min = _col(p, "ris.tamax")[ok].max(), _col(p, "ris.tamin")[ok].min()
        bound = _col(p, "ris.bound").sum()
    else:
        raw1, raw2 = (n * sv.w).sum(), (n * sv.w * sv.w).sum()
        raw_max, raw_min = sv.w[ok].max(), sv.w[ok].min()
        app1, app2 = (n * sv.a).sum(), (n * sv.a * sv.a).sum()
        app_max, app_min = sv.a[ok].max(), sv.a[ok].min()
        bound = (n * (np.abs(sv.X) > SAFETY_BOUND)).sum()
    out["raw/mean"], out["raw/std"], out["raw/ess"] = _moments(raw1, raw2, N)
    out["raw/max"], out["raw/min"] = _f(raw_max), _f(raw_min)
    out["applied/mean"], out["applied/std"], out["applied/ess"] = _moments(app1, app2, N)
    out["applied/max"], out["applied/min"] = _f(app_max), _f(app_min)
    out["safety_bound_fraction"] = _f(bound / N)
    _seq_stats(sv.w[ok], Lo, U, "raw/", out)
    _seq_stats(sv.a[ok], Lo, U, "applied/", out, fractions=False)
    if c.has_band:
        if c.level == "token":
            hi, lo = _col(p, "ris.thi").sum(), _col(p, "ris.tlo").sum()
            c1, c2 = _col(p, "ris.tc").sum(), _col(p, "ris.tc2").sum()
        else:
            with np.errstate(divide="ignore"):
                hi = (n * (sv.X > np.log(U))).sum()
                lo = (n * (sv.X < np.log(Lo))).sum() if Lo is not None else 0.0
            cw = np.clip(sv.w, Lo or 0.0, U)
            c1, c2 = (n * cw).sum(), (n * cw * cw).sum()
        out["raw/fraction_high"] = _f(hi / N)
        out["raw/fraction_low"] = _f(lo / N) if Lo is not None else None
        _, out["clamped/std"], out["clamped/ess"] = _moments(c1, c2, N)
    if c.truncates:
        out["truncated_fraction"] = _f(sv.changed.sum() / N)
    if c.zeroes:
        out["zeroed_fraction"] = _f(sv.changed.sum() / N)
    if c.masks:
        if c.level == "token":
            tb = _col(p, "ris.tband")
            out["mask/token_fraction"] = _f(tb.sum() / N)
            out["mask/seq_fraction"] = _mean(tb[ok] > 0)
        else:
            out["mask/token_fraction"] = _f((n * sv.band_rej).sum() / N)
            out["mask/seq_fraction"] = _mean(sv.band_rej[ok])
    out["veto/seq_fraction"] = _mean(sv.vetoed[ok])
    out["veto/catastrophic_token_fraction"] = _f(_col(p, "ris.cat").sum() / N)
    out["rejected/token_fraction"] = _f(sv.rejected.sum() / N)
    out["rejected/seq_fraction"] = _mean(sv.rejected[ok] > 0)
    out["modified/token_fraction"] = _f(sv.modified.sum() / N)
    out["modified/seq_fraction"] = _mean(sv.modified[ok] > 0)
    out["kept_tokens"] = _f(N - sv.rejected.sum())
    adv = _col(p, "ris.adv").sum()
    out["loss_mass_removed"] = _f(sv.dropped_adv.sum() / adv) if adv > 0 else None
    return out


# ---------------------------------------------------------------------------------------------
# Per-token outputs (``--is-weights``)
# ---------------------------------------------------------------------------------------------

def _decisions(b, c: ISConfig, x: Inputs, partials: dict | None) -> tuple[TokenDecisions, SeqView]:
    t = token_decisions(x, c)
    return t, seq_view(partials if partials is not None else sequence_partials(b, x, c, t), c)


def valid_token_weights(b, c: ISConfig, x: Inputs, partials: dict | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw weight, applied weight and kept-in-the-loss flag of each valid token (``x.seg.idx`` order).

    The decisions are the ones the metrics count (same partials, same :func:`seq_view`); pass
    ``partials`` when the batch's :func:`sequence_partials` under ``c`` are already at hand.
    """
    t, sv = _decisions(b, c, x, partials)
    seq_of = np.repeat(np.arange(len(sv.n)), sv.n.astype(np.int64))  # sequence of each valid token
    if c.level == "token":
        raw, app = t.w, t.a
    else:
        raw, app = sv.w[seq_of], sv.a[seq_of]
    return raw, app, ~t.rej & ~sv.seq_rej[seq_of]


def token_weights(b, c: ISConfig, x: Inputs | None = None, partials: dict | None = None) -> dict[str, np.ndarray]:
    """Per-token ``valid``, raw weight, applied weight and the modified loss mask (``is_mask``) of a
    batch, one entry per row; weights are NaN and ``is_mask`` False where the token is not valid."""
    x = x or inputs(b)
    raw_v, app_v, keep_v = valid_token_weights(b, c, x, partials)
    idx = x.seg.idx
    raw, app, keep = np.full(b.n, np.nan), np.full(b.n, np.nan), np.zeros(b.n, dtype=bool)
    raw[idx], app[idx], keep[idx] = raw_v, app_v, keep_v
    return {"valid": x.valid, "is_weight_raw": raw, "is_weight": app, "is_mask": keep}


def loss_weights(b, c: ISConfig, x: Inputs | None = None, partials: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the factor the trainer multiplies the policy loss by, and whether the token stays in
    the loss mask -- the decisions of :func:`valid_token_weights` (the ones the metrics count).

    Mode ``none`` changes no weight (factor 1). A masked token without a defined δ counts as δ = 0,
    as TRL's ``nan_to_num`` does: at token level it gets the mode applied to weight 1, at sequence
    levels its sequence's weight (its δ is not in Σδ); only sequence-level rules remove it.
    """
    x = x or inputs(b)
    t, sv = _decisions(b, c, x, partials)
    keep = ~b.broadcast(sv.seq_rej)
    keep[x.seg.idx] &= ~t.rej
    if c.mode == "none":
        return np.ones(b.n), keep
    if c.level == "token":
        a = np.full(b.n, apply_mode(np.ones(1), c)[0])
        a[x.seg.idx] = t.a
    else:
        a = b.broadcast(sv.a)
    return a, keep
