"""The canonical rollout-IS step summary, pooled over whatever per-sequence partial rows are given."""

from __future__ import annotations

import numpy as np

from grpolens.functional.rollout_is.config import ISConfig
from grpolens.functional.rollout_is.partials import SeqView, _col, seq_view
from grpolens.functional.estimators import LOG_RATIO_BOUND


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
        bound = (n * (np.abs(sv.X) > LOG_RATIO_BOUND)).sum()
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
