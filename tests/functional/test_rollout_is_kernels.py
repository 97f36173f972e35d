"""The rollout-IS kernels (valid tokens, decisions and partials in one pass, the mismatch's kept
tokens and sums) against the same quantities written plainly in numpy, one operation per pass as
the package computed them before: every column bit for bit, under every level, mode, veto and
rejection filter, on ragged random batches with NaN, ±inf (both in one sequence), non-finite
advantages, all-masked and one-token sequences, and an empty batch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from grpolens.functional import estimators as est
from grpolens.functional import rollout_is as ris
from grpolens.functional.rollout_is.mismatch import finite_pairs
from grpolens.metrics.batch import TokenBatch


def _batch(seed: int, n_seq: int = 60) -> TokenBatch:
    rng = np.random.default_rng(seed)
    lengths = rng.choice([1, 2, 3, 7, 8, 9, 50, 129, 300], size=n_seq)
    lengths[7 % n_seq] = 8
    n = int(lengths.sum())
    old = rng.normal(-1.0, 1.0, n)
    roll = old - rng.normal(0.0, 0.3, n) * rng.choice([1.0, 1e-3, 30.0], size=n, p=[0.8, 0.1, 0.1])
    pick = rng.random(n)
    roll[pick > 0.95] = old[pick > 0.95]  # δ = 0: weight exactly 1, on the bounds of the (1, 1) band below
    roll[pick < 0.01] = np.nan
    roll[(pick >= 0.01) & (pick < 0.02)] = np.inf   # δ = -inf
    old[(pick >= 0.02) & (pick < 0.03)] = np.inf    # δ = +inf (or NaN against +inf)
    adv = rng.normal(size=n)
    adv[rng.random(n) < 0.02] = np.nan
    adv[rng.random(n) < 0.02] = -np.inf
    adv[rng.random(n) < 0.05] = -0.0
    mask = rng.random(n) < 0.9
    seq = np.repeat(np.arange(n_seq), lengths)
    mask[np.isin(seq, [0, 5])] = False  # all-masked sequences
    if n_seq > 7:  # sequence 7: +inf and -inf δ together
        f7 = int(np.cumsum(lengths)[6])
        old[f7], roll[f7], old[f7 + 1], roll[f7 + 1] = np.inf, 0.0, -np.inf, 0.0
        mask[f7:f7 + 2] = True
    cols = {"step": np.zeros(n, np.int64), "rank": np.zeros(n, np.int64), "micro_batch": np.zeros(n, np.int64),
            "sample_id": seq.astype(np.int64), "pos": np.concatenate([np.arange(k) for k in lengths]).astype(np.int64),
            "logp": old.copy(), "old_logp": old, "rollout_logp": roll, "advantage": adv, "mask": mask}
    return TokenBatch(cols, {"logp", "old_logp", "rollout_logp", "advantage"})


def _plain_inputs(b):
    with np.errstate(invalid="ignore"):
        delta = b.old - b.cols["rollout_logp"]
    valid = b.pre_rejection_mask & ~np.isnan(delta)
    both = b.seq_any(valid & (delta == np.inf)) & b.seq_any(valid & (delta == -np.inf))
    valid &= ~b.broadcast(both)
    idx = np.flatnonzero(valid)
    adv = b.adv[idx]
    return valid, idx, b.count(valid), delta[idx], np.where(np.isfinite(adv), np.abs(adv), 0.0)


def _plain_partials(b, c):
    valid, _, n, d, av = _plain_inputs(b)
    s = ris.Segments(b, valid)
    w = est.bounded_exp(d)
    tok = c.level == "token"
    a = ris.apply_mode(w, c) if tok else w
    a = np.clip(w, c.lower if c.lower is not None else -np.inf, c.upper) if tok and c.mode in ("truncate", "both") else a
    band = ~ris.in_band(w, c.mask_lower, c.mask_upper) if tok and c.masks else np.zeros(len(d), bool)
    chg = a != w
    rej = band.copy()
    for f in c.token_filters:
        rej |= ~f.keep(ris.rs_stat(f.k, d))
    with np.errstate(divide="ignore", invalid="ignore"):
        cat = np.zeros(len(d), bool)
        if c.veto_lower is not None and c.veto_lower > 0:
            cat |= d < np.log(c.veto_lower)
        if c.veto_upper is not None:
            cat |= d > np.log(c.veto_upper)
    drop, mod = rej | (chg & (a == 0)), rej | chg
    out = {"ris.n": n, "ris.undef": b.count(b.pre_rejection_mask) - n, "ris.L": s.sum(d),
           "ris.bound": s.sum(np.abs(d) > est.LOG_RATIO_BOUND), "ris.cat": s.sum(cat), "ris.adv": s.sum(av),
           "ris.tw": s.sum(w), "ris.tw2": s.sum(w * w), "ris.twmax": s.max(w), "ris.twmin": s.min(w),
           "ris.ta": s.sum(a), "ris.ta2": s.sum(a * a), "ris.tamax": s.max(a), "ris.tamin": s.min(a),
           "ris.tchg": s.sum(chg), "ris.tband": s.sum(band), "ris.trej": s.sum(rej),
           "ris.tdrop_adv": s.sum(np.where(drop, av, 0.0)), "ris.tmod": s.sum(mod)}
    zeros = np.zeros(b.n_seq)
    out.update({"ris.thi": zeros, "ris.tlo": zeros, "ris.tc": zeros, "ris.tc2": zeros})
    if tok and c.has_band:
        cw = np.clip(w, c.lower or 0.0, c.upper)
        out.update({"ris.thi": s.sum(w > c.upper), "ris.tc": s.sum(cw), "ris.tc2": s.sum(cw * cw),
                    "ris.tlo": s.sum(w < c.lower) if c.lower is not None else zeros})
    ks = {f.k for f in c.seq_filters}
    for k in (1, 2, 3):
        st = ris.rs_stat(k, d)
        out[f"ris.k{k}"] = s.sum(st) if k in ks else zeros
        if k > 1:
            out[f"ris.k{k}max"] = s.max(st) if k in ks else np.full(b.n_seq, -np.inf)
    return out, w, a, rej


def _same(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return x.shape == y.shape and np.array_equal(x, y, equal_nan=True) and np.array_equal(np.signbit(x), np.signbit(y))


CONFIGS = [
    dict(level=lv, mode=md, lower=lo, upper=2.0 if lo != 1.0 else 1.0, mask_lower=lo, mask_upper=2.0 if lo != 1.0 else 1.0,
         veto_lower=vl, veto_upper=vu, rs=rs)
    for lv, md, lo, (vl, vu), rs in itertools.product(
        ("token", "sequence", "geometric"), ("none", "truncate", "truncate_upper", "mask", "both", "icepop"),
        (0.5, None, 1.0), ((1e-4, 1e4), (None, None), (0.0, 50.0)),
        ((), ({"option": "token_k1", "lower": 0.8, "upper": 1.25}, {"option": "seq_max_k3", "upper": 0.5},
              {"option": "seq_sum_k2", "upper": 3.0}, {"option": "token_k3", "upper": 0.2},
              {"option": "seq_mean_k1", "lower": 0.9, "upper": 1.1})))
]


@pytest.mark.parametrize("seed", [0, 1])
def test_inputs_are_the_plain_numpy_valid_tokens(seed):
    b = _batch(seed)
    x = ris.inputs(b)
    valid, idx, n, d, av = _plain_inputs(b)
    assert np.array_equal(x.valid, valid) and np.array_equal(x.seg.idx, idx)
    assert _same(x.seg.n, n) and _same(x.dv, d) and _same(x.av, av)
    assert _same(x.undef, b.count(b.pre_rejection_mask) - n)
    assert n[7] == 0 and x.undef[7] > 0  # the sequence with both infinities is left out whole


@pytest.mark.parametrize("seed", [0, 1])
def test_partials_and_decisions_are_the_plain_numpy_ones_to_the_last_bit(seed):
    b = _batch(seed)
    for cfg in CONFIGS:
        c = ris.ISConfig.from_cfg(cfg)
        x = ris.inputs(b)
        got = ris.sequence_partials(b, x, c)
        want, w, a, rej = _plain_partials(b, c)
        assert set(got) == set(ris.IS_MERGE) == set(want)
        bad = [k for k in want if not _same(got[k], want[k])]
        assert not bad, (cfg, bad)
        t = ris.token_decisions(x, c)
        assert _same(t.w, w) and _same(t.a, a) and np.array_equal(t.rej, rej), cfg


def test_apply_mode_and_in_band_are_the_clip_and_band_formulas():
    w = np.array([0.0, 0.25, 0.5, 1.0, 2.0, 2.5, np.inf, np.nan, np.nextafter(0.5, 0), np.nextafter(2.0, 3)])
    for lo in (0.5, None):
        for mode in ris.MODES:
            c = ris.ISConfig(mode=mode, lower=lo, upper=2.0)
            lower = lo if lo is not None else -np.inf
            want = {"truncate": np.clip(w, lower, 2.0), "both": np.clip(w, lower, 2.0), "truncate_upper": np.minimum(w, 2.0),
                    "icepop": np.where((w >= lower) & (w <= 2.0), w, 0.0)}.get(mode, w)
            assert _same(ris.apply_mode(w, c), want), (mode, lo)
        with np.errstate(invalid="ignore"):
            assert np.array_equal(ris.in_band(w, lo, 2.0), ~np.isnan(w) & (w >= (lo if lo is not None else -np.inf)) & (w <= 2.0))
    assert np.array_equal(ris.in_band(w, None, None), ~np.isnan(w))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_mismatch_tokens_and_sums_are_the_plain_numpy_ones(seed):
    b = _batch(seed)
    old, roll = b.old, b.cols["rollout_logp"]
    keep = b.pre_rejection_mask & np.isfinite(old) & np.isfinite(roll)
    s = ris.Segments(b, keep)
    o, r = old[s.idx], roll[s.idx]
    d = o - r
    got_s, go, gr, gd, sums = finite_pairs(b)
    assert np.array_equal(got_s.idx, s.idx) and _same(got_s.n, s.n) and _same(go, o) and _same(gr, r) and _same(gd, d)
    want = {"old": s.sum(o), "roll": s.sum(r), "d": s.sum(d), "absd": s.sum(np.abs(d)), "absdmax": s.max(np.abs(d))}
    assert all(_same(sums[k], want[k]) for k in want), [k for k in want if not _same(sums[k], want[k])]


def test_an_empty_batch():
    b = _batch(0, n_seq=3)
    e = TokenBatch({k: v[:0] for k, v in b.cols.items()}, b.present)
    x = ris.inputs(e)
    assert len(x.dv) == 0 and len(x.seg.n) == 0
    p = ris.sequence_partials(e, x, ris.ISConfig.from_cfg(CONFIGS[-1]))
    assert all(len(v) == 0 for v in p.values())
    _, _, _, d, sums = finite_pairs(e)
    assert len(d) == 0 and all(len(v) == 0 for v in sums.values())
