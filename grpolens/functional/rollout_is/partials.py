"""Per-sequence rollout-IS partials that merge exactly, and the per-sequence view taken from them.

Every non-linear per-sequence decision (sequence weight, veto, sequence rejection) is taken from
the merged partials by :func:`seq_view`, so it is the same however the data is split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grpolens.functional.jit import kernel
from grpolens.functional.reduceat import segment_sum
from grpolens.functional.rollout_is.config import ISConfig, RSFilter, kept
from grpolens.functional.rollout_is.weights import (LOG_RATIO_BOUND, NONE, TRUNCATE, Inputs, TokenDecisions, _bound,
                                                    applied1, apply_mode, band1, bounded_exp, in_band, mode_code,
                                                    rs_stat, veto_log_band)

#: Partial columns and their merge rules (``ris.t*``: token-level sums over valid tokens).
IS_MERGE = {
    "ris.n": "sum", "ris.undef": "sum", "ris.L": "sum", "ris.bound": "sum", "ris.cat": "sum", "ris.adv": "sum",
    "ris.tw": "sum", "ris.tw2": "sum", "ris.twmax": "max", "ris.twmin": "min",
    "ris.thi": "sum", "ris.tlo": "sum", "ris.tc": "sum", "ris.tc2": "sum",
    "ris.ta": "sum", "ris.ta2": "sum", "ris.tamax": "max", "ris.tamin": "min", "ris.tchg": "sum",
    "ris.tband": "sum", "ris.trej": "sum", "ris.tdrop_adv": "sum", "ris.tmod": "sum",
    "ris.k1": "sum", "ris.k2": "sum", "ris.k3": "sum", "ris.k2max": "max", "ris.k3max": "max",
}


#: the kernel's rows, in order (``ris.n`` and ``ris.undef`` come from the inputs)
_ROWS = ("ris.L", "ris.bound", "ris.cat", "ris.adv", "ris.tw", "ris.tw2", "ris.twmax", "ris.twmin", "ris.thi",
         "ris.tlo", "ris.tc", "ris.tc2", "ris.ta", "ris.ta2", "ris.tamax", "ris.tamin", "ris.tchg", "ris.tband",
         "ris.trej", "ris.tdrop_adv", "ris.tmod", "ris.k1", "ris.k2", "ris.k3", "ris.k2max", "ris.k3max")
_N_ROWS = len(_ROWS)


def sequence_partials(b, x: Inputs, c: ISConfig, t: TokenDecisions | None = None) -> dict[str, np.ndarray]:
    """Per-sequence partials of one batch under config ``c`` (columns of :data:`IS_MERGE`): made
    with :func:`token_decisions` (``t``, when given, is those decisions) by the same pass."""
    if c not in x.partials:
        _decide(x, c)
    return {"ris.n": x.seg.n, "ris.undef": x.undef, **x.partials[c]}


def token_decisions(x: Inputs, c: ISConfig) -> TokenDecisions:
    """The token-level decisions on ``x`` under ``c`` (computed once per inputs and config)."""
    if c not in x.decisions:
        _decide(x, c)
    return x.decisions[c]


def _decide(x: Inputs, c: ISConfig) -> None:
    """One compiled pass over the valid tokens: each token's decisions under ``c`` and their
    per-sequence partials. The transcendental values (the bounded weight, the filters' k3) are
    numpy's, computed before it, so that each is what the formula's numpy code gives."""
    d = x.dv
    w = bounded_exp(d)
    ks = sorted({f.k for f in c.rs})
    stats = np.zeros((3, len(d) if ks else 0))
    for k in ks:
        stats[k - 1] = rs_stat(k, d)
    tf = c.token_filters
    seq_ks = np.array([k in {f.k for f in c.seq_filters} for k in (1, 2, 3)])
    token = c.level == "token"
    mode = mode_code(c) if token else NONE
    rows, a, rej = _partials(
        d, w, x.av, stats, x.seg.starts, x.seg.n.astype(np.int64), mode, _bound(c.lower), _bound(c.upper),
        token and c.masks, _bound(c.mask_lower), _bound(c.mask_upper), token and c.has_band, float(c.lower or 0.0),
        c.veto, *veto_log_band(c), np.array([f.k for f in tf], dtype=np.int64), np.array([f.log_band[0] for f in tf]),
        np.array([f.log_band[1] for f in tf]), seq_ks, LOG_RATIO_BOUND)
    x.decisions[c] = TokenDecisions(w, w if mode == NONE else a, rej)
    x.partials[c] = dict(zip(_ROWS, rows))


@kernel
def _partials(d, w, av, stats, starts, counts, mode, lower, upper, masks, mask_lower, mask_upper, band_stats,
              clip_lower, veto, veto_lo, veto_hi, fk, flo, fhi, seq_ks, bound):
    """Rows of :data:`_ROWS` per sequence; each valid token's applied weight (``mode``: token level
    only, else NONE) and whether a token-level rule rejects it. Sums are numpy's reduceat sums
    (:func:`segment_sum`); where two sums are of the same values (the applied weight is the raw one,
    or the clamped one) one is taken for both. No value here is NaN (a valid token's δ is not, so
    neither is its weight nor its statistic), so max and min need no NaN rule. Each sequence's
    tokens are read through views indexed from 0, which compile without a negative-index test."""
    m, ns = len(d), len(starts)
    changes = mode != NONE
    clamped_is_applied = mode == TRUNCATE and clip_lower == lower  # np.clip(w, lower or 0, upper) is a
    a = np.empty(m if changes else 0)
    rej = np.zeros(m, dtype=np.bool_)
    out = np.zeros((_N_ROWS, ns))
    longest = counts.max() if ns else 0
    # the config's switches as local scalars (a load from an array the loop also stores into could
    # not be hoisted out of it)
    filters, k2, k3 = len(fk) > 0, seq_ks[1], seq_ks[2]
    w2, a2, cw, cw2, dadv = np.empty(longest), np.empty(longest), np.empty(longest), np.empty(longest), np.empty(longest)
    for s in range(ns):
        lo, n = starts[s], counts[s]
        hi = lo + n
        ds, ws, rs, st = d[lo:hi], w[lo:hi], rej[lo:hi], stats[:, lo:hi]
        as_ = a[lo:hi] if changes else a
        nb = ncat = hi_n = lo_n = nchg = nband = nrej = nmod = ndrop = 0
        twmax = tamax = k2max = k3max = -np.inf
        twmin = tamin = np.inf
        for k in range(n):
            dj, wj = ds[k], ws[k]
            nb += abs(dj) > bound
            if veto:
                ncat += dj < veto_lo or dj > veto_hi
            w2[k] = wj * wj
            twmax, twmin = max(twmax, wj), min(twmin, wj)
            r = masks and not band1(wj, mask_lower, mask_upper)
            nband += r
            if filters:
                for f in range(len(fk)):
                    r = r or not kept(fk[f], st[fk[f] - 1, k], flo[f], fhi[f])
            chg = False
            if changes:
                aj = applied1(wj, mode, lower, upper)
                as_[k] = aj
                a2[k] = aj * aj
                tamax, tamin = max(tamax, aj), min(tamin, aj)
                chg = aj != wj
                nchg += chg
                ndrop += r or (chg and aj == 0.0)
            else:
                ndrop += r
            rs[k] = r
            nrej += r
            nmod += r or chg
            if band_stats:
                hi_n += wj > upper
                lo_n += wj < lower
                if not clamped_is_applied:
                    cj = clip_lower if wj < clip_lower else wj  # np.clip(w, lower or 0, upper)
                    cj = upper if cj > upper else cj
                    cw[k], cw2[k] = cj, cj * cj
            if k2:
                k2max = max(k2max, st[1, k])
            if k3:
                k3max = max(k3max, st[2, k])
        o = out[:, s]
        o[0], o[1], o[2], o[3] = segment_sum(d, lo, hi), nb, ncat, segment_sum(av, lo, hi)
        o[4], o[5], o[6], o[7] = segment_sum(w, lo, hi), segment_sum(w2, 0, n), twmax, twmin
        if changes:
            o[12], o[13], o[14], o[15] = segment_sum(a, lo, hi), segment_sum(a2, 0, n), tamax, tamin
        else:
            o[12], o[13], o[14], o[15] = o[4], o[5], o[6], o[7]
        if band_stats:
            o[8], o[9] = hi_n, lo_n
            o[10], o[11] = (o[12], o[13]) if clamped_is_applied else (segment_sum(cw, 0, n), segment_sum(cw2, 0, n))
        if ndrop:  # |A| of the tokens removed or zero-weighted (a rare second look at the sequence)
            avs = av[lo:hi]
            for k in range(n):
                zero = changes and as_[k] == 0.0 and as_[k] != ws[k]
                dadv[k] = avs[k] if rs[k] or zero else 0.0
            o[19] = segment_sum(dadv, 0, n)
        o[16], o[17], o[18], o[20] = nchg, nband, nrej, nmod
        for k in range(3):
            if seq_ks[k]:
                o[21 + k] = segment_sum(stats[k], lo, hi)
        o[24], o[25] = k2max, k3max
    return out, a, rej


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
