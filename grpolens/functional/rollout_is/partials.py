"""Per-sequence rollout-IS partials that merge exactly, and the per-sequence view taken from them.

Every non-linear per-sequence decision (sequence weight, veto, sequence rejection) is taken from
the merged partials by :func:`seq_view`, so it is the same however the data is split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grpolens.functional.rollout_is.config import ISConfig, RSFilter
from grpolens.functional.rollout_is.weights import (LOG_RATIO_BOUND, Inputs, TokenDecisions, apply_mode, bounded_exp,
                                                    in_band, rs_stat, token_decisions)

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
        "ris.bound": s.sum(np.abs(d) > LOG_RATIO_BOUND), "ris.cat": s.sum(t.cat) if c.veto else zeros,
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
