"""The compiled per-token loops (grpolens.metrics.kernels) give exactly what the numpy formulas give,
bit for bit: numpy's pairwise summation order per sequence, its NaN and inf, on ragged batches with
the edge cases the loops branch on (all-masked sequences, single tokens, sequences of only NaN
tokens, long sequences past numpy's 128-value blocks, |d| beyond the ±20 clamp). The references
here are the plain numpy bodies the producers had before the kernels (masks, ``np.where``,
``np.add.reduceat``)."""

from __future__ import annotations

import numpy as np
import pytest

from grpolens.functional import estimators as est
from grpolens.metrics import kernels
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.registry import load_families

load_families()

from grpolens.metrics.partials import PRODUCERS  # noqa: E402  (registered by load_families)


def _same(a, b) -> bool:
    """Equal bit for bit (NaN equal to NaN; the sign of a zero counts)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(nan | (a.view(np.int64) == b.view(np.int64))))


def _lengths(rng, n_seq: int) -> np.ndarray:
    lengths = rng.integers(1, 300, n_seq)
    lengths[:6] = [1, 7, 8, 128, 129, 1500]  # numpy's block edges and its split of a long run
    return lengths


def _batch(rng, n_seq=40, nonfinite=0.05, spread=1.0, big=0.0) -> TokenBatch:
    lengths = _lengths(rng, n_seq)
    n = int(lengths.sum())
    sid = np.repeat(np.arange(n_seq), lengths)
    pos = np.concatenate([np.arange(m) for m in lengths])
    logp = -rng.exponential(1.0, n)
    old = logp + rng.normal(0, spread, n)
    ref = logp + rng.normal(0, spread, n)
    if big:
        old[rng.random(n) < big] += rng.choice([-45.0, 45.0, 80.0])  # |d| past the ±20 and ±60 clamps
    adv = np.repeat(rng.normal(0, 1, n_seq), lengths)
    adv[np.repeat(rng.random(n_seq) < 0.2, lengths)] = 0.0  # zero advantages
    mask = rng.random(n) < 0.8
    mask[sid == 2] = False  # an all-masked sequence
    cols = {"logp": logp, "old_logp": old, "ref_logp": ref, "advantage": adv,
            "entropy": rng.exponential(1.0, n), "rollout_logp": old + rng.normal(0, 0.1, n)}
    for k, x in cols.items():
        bad = rng.random(n) < nonfinite
        x[bad] = rng.choice([np.nan, np.inf, -np.inf], int(bad.sum()))
        x[sid == 3] = np.nan  # a sequence of only NaN tokens
    mask[sid == 3] = True
    cols.update(step=np.zeros(n, np.int64), rank=np.zeros(n, np.int64), micro_batch=np.zeros(n, np.int64),
                sample_id=sid.astype(np.int64), pos=pos.astype(np.int64), mask=mask)
    return TokenBatch(cols, {"old_logp", "ref_logp", "advantage", "entropy", "rollout_logp", "logp"})


def _seq_sum(b, x):
    return np.add.reduceat(x, b.starts)


def _count(b, v):
    return _seq_sum(b, v.astype(np.float64))


# ---------------------------------------------------------------------------------------------
# Sums in numpy's order
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sums_are_numpys_reduceat_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    lengths = _lengths(rng, 60)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    x = rng.normal(size=int(lengths.sum())) * 10.0 ** rng.integers(-12, 12, int(lengths.sum()))
    x[starts[1]:starts[1] + lengths[1]] = -0.0  # a sequence of negative zeros stays -0.0
    s, n = kernels.finite_masked_sum(x, np.ones(len(x), bool), starts, lengths.astype(np.int64))
    assert _same(s, np.add.reduceat(x, starts))
    assert np.array_equal(n, lengths)
    # a plain in-order sum differs in the last bits: the test can tell the orders apart
    assert not _same(s, [float(sum(x[a:a + m])) for a, m in zip(starts, lengths)])


# ---------------------------------------------------------------------------------------------
# The producers against their numpy bodies
# ---------------------------------------------------------------------------------------------

def _policy_ref(b: TokenBatch) -> dict[str, np.ndarray]:
    lp, old = b.logp, b.old
    vnew = b.mask & np.isfinite(lp)
    v = vnew & np.isfinite(old)
    n = _count(b, v)
    with np.errstate(all="ignore"):
        d = np.where(v, lp - old, 0.0)
        rm1 = np.expm1(d)
        k3 = rm1 - d
        dc = np.clip(d, -20.0, 20.0)
        k3c, absdev = np.expm1(dc) - dc, np.abs(np.expm1(dc))
    return {
        "policy.new.sum": _seq_sum(b, np.where(vnew, lp, 0.0)), "policy.new.n": _count(b, vnew),
        "policy.n": n, "policy.old.sum": _seq_sum(b, np.where(v, old, 0.0)), "policy.d.sum": _seq_sum(b, d),
        "policy.k3.sum": _seq_sum(b, k3), "policy.k3_c20.sum": _seq_sum(b, k3c),
        "policy.absdev_c20.sum": _seq_sum(b, absdev),
        "policy.k3.max": np.where(n > 0, np.maximum.reduceat(k3, b.starts), -np.inf),
        "policy.d.max": np.maximum.reduceat(np.where(v, d, -np.inf), b.starts),
        "policy.d.min": np.minimum.reduceat(np.where(v, d, np.inf), b.starts),
    }


@pytest.mark.parametrize("seed,big", [(0, 0.0), (1, 0.0), (2, 0.02), (3, 0.3)])
def test_policy_equals_its_numpy_formulas(seed, big):
    b = _batch(np.random.default_rng(seed), big=big)
    got, want = PRODUCERS["policy"].fn(b, {}), _policy_ref(b)
    assert set(got) == set(want)
    for k in want:
        assert _same(got[k], want[k]), k
    if big:  # the clamp branch ran and changed the sums
        assert not _same(got["policy.k3_c20.sum"], got["policy.k3.sum"])


def test_health_and_entropy_equal_their_numpy_formulas():
    b = _batch(np.random.default_rng(4), nonfinite=0.2)
    got = PRODUCERS["health"].fn(b, {})
    assert _same(got["health.masked"], _count(b, b.mask))
    for c in ("logp", "old_logp", "ref_logp", "rollout_logp", "advantage", "entropy"):
        assert _same(got[f"health.nonfinite.{c}"], _count(b, b.mask & ~np.isfinite(b.cols[c]))), c
    h = b.cols["entropy"]
    v = b.mask & np.isfinite(h)
    got = PRODUCERS["entropy"].fn(b, {})
    assert _same(got["entropy.sum"], _seq_sum(b, np.where(v, h, 0.0)))
    assert _same(got["entropy.n"], _count(b, v))
    assert got["entropy.n"][3] == 0 and got["entropy.sum"][3] == 0.0  # the NaN-only sequence


def _sigmoid(z):
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _loss_ref(b: TokenBatch, cfg: dict, w=None, keep=None, phi=None, ec=0.0):
    """The per-token loss as numpy computed it before the kernel (w, keep: the IS weights)."""
    beta = cfg.get("beta", 0.0)
    rv = b.mask & np.isfinite(b.logp) & np.isfinite(b.old)
    v = rv & np.isfinite(b.adv)
    kv = b.mask & np.isfinite(b.logp) & np.isfinite(b.cols["ref_logp"])
    if beta:
        v = v & kv
    a = np.where(rv & np.isfinite(b.adv), b.adv, 0.0)
    with np.errstate(all="ignore"):
        d = np.where(rv, b.logp - b.old, 0.0)
        clamp = cfg.get("log_ratio_clamp")
        c = np.exp(d if clamp is None else np.clip(d, -clamp, clamp))
        lt = cfg["loss_type"]
        if lt == "grpo":
            c1 = c if cfg.get("delta") is None else np.minimum(c, cfg["delta"])
            L = -np.minimum(c1 * a, np.clip(c, 1 - cfg["epsilon"], 1 + cfg["epsilon_high"]) * a)
        elif lt == "cispo":
            L = -np.minimum(c, cfg["epsilon_high"]) * a * np.where(v, b.logp, 0.0)
        elif lt == "vespo":
            L = -np.repeat(phi, b.lengths) * a * np.where(v, b.logp, 0.0)
        else:
            tau = np.where(a > 0, cfg["sapo_temperature_pos"], cfg["sapo_temperature_neg"])
            L = -(4.0 / tau) * _sigmoid(tau * (c - 1.0)) * a
        if w is not None:
            v = v & keep
            L = np.where(v, L * w, 0.0)
        if beta:
            x = np.where(kv, b.cols["ref_logp"] - b.logp, 0.0)
            k = np.expm1(x) - x
            if cfg.get("use_bias_correction_kl"):
                k = k * c
            L = np.where(v, L + beta * k, 0.0)
        if ec:
            L = L - ec * np.where(v, np.nan_to_num(b.cols["entropy"]), 0.0)
    return _seq_sum(b, L), _count(b, v)


_BASE = {"epsilon": 0.2, "epsilon_high": 0.28, "importance_sampling_level": "token", "beta": 0.0, "rollout_is": None}


@pytest.mark.parametrize("cfg", [
    {"loss_type": "grpo"},
    {"loss_type": "grpo", "delta": 1.5, "beta": 0.04},
    {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": True, "log_ratio_clamp": 20.0},
    {"loss_type": "cispo", "epsilon_high": 5.0, "beta": 0.1},
    {"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05},
])
@pytest.mark.parametrize("seed,big", [(5, 0.0), (6, 0.05)])
def test_loss_equals_its_numpy_formulas(cfg, seed, big):
    from grpolens.metrics.loss import loss_partials

    b = _batch(np.random.default_rng(seed), big=big)
    cfg = {**_BASE, **cfg}
    s, n = loss_partials(b, cfg)
    ws, wn = _loss_ref(b, cfg)
    assert _same(s, ws) and _same(n, wn)
    s, n = loss_partials(b, cfg, entropy_coef=0.01)  # Twinkle's entropy bonus, NaN/inf entropies
    ws, wn = _loss_ref(b, cfg, ec=0.01)
    assert _same(s, ws) and _same(n, wn)


def test_loss_with_rollout_weights_and_vespo_equal_their_numpy_formulas(monkeypatch):
    from grpolens.metrics import loss

    rng = np.random.default_rng(8)
    b = _batch(rng)
    w, keep = rng.uniform(0.5, 2.0, b.n), rng.random(b.n) < 0.9
    monkeypatch.setattr(loss, "loss_weights", lambda *a, **k: (w, keep))
    monkeypatch.setattr(loss, "batch_inputs", lambda b: None)
    monkeypatch.setattr(loss, "batch_partials", lambda b, c: None)
    cfg = {**_BASE, "loss_type": "grpo", "beta": 0.04,
           "rollout_is": {"level": "token", "mode": "truncate", "lower": 0.5, "upper": 2.0}}
    s, n = loss.loss_partials(b, cfg)
    ws, wn = _loss_ref(b, cfg, w=w, keep=keep)
    assert _same(s, ws) and _same(n, wn)
    cfg = {**_BASE, "loss_type": "vespo", "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0,
           "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}
    s, n = loss.loss_partials(b, cfg)
    ws, wn = _loss_ref(b, cfg, phi=loss.vespo_phi(b, cfg))
    assert _same(s, ws) and _same(n, wn)


def test_the_kernels_call_the_estimators_formula():
    # k3 from a given expm1 is the one formula, on scalars as on arrays
    x = np.array([-3.0, -1e-9, 0.0, 2.5])
    assert _same([est.k3_of(float(v), float(np.expm1(v))) for v in x], est.k3(x))


def _kl_ref(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    v = b.mask & np.isfinite(b.logp) & np.isfinite(b.cols["ref_logp"])
    rv = b.mask & np.isfinite(b.logp) & np.isfinite(b.old)
    n = _count(b, v)
    with np.errstate(all="ignore"):
        x = np.where(v, b.cols["ref_logp"] - b.logp, 0.0)
        k3 = np.expm1(x) - x
        xm = np.clip(x, -60.0, 60.0)
        d = np.where(rv, b.logp - b.old, 0.0)
        if cfg["importance_sampling_level"] == "token":
            k3c, nc = np.where(rv, k3 * np.exp(d), 0.0), _count(b, v & rv)
        else:
            s = _seq_sum(b, d) / np.maximum(_count(b, rv), 1.0)
            k3c, nc = k3 * np.exp(np.repeat(s, b.lengths)), n
    return {"kl.n": n, "kl.masked": _count(b, b.mask), "kl.k1.sum": -_seq_sum(b, x),
            "kl.k2.sum": _seq_sum(b, 0.5 * x * x), "kl.k3.sum": _seq_sum(b, k3),
            "kl.k3.max": np.where(n > 0, np.maximum.reduceat(k3, b.starts), -np.inf),
            "kl.k3_c60.sum": _seq_sum(b, np.expm1(xm) - xm), "kl.k3c.sum": _seq_sum(b, k3c), "kl.k3c.n": nc}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed,big", [(9, 0.0), (10, 0.05)])
def test_kl_equals_its_numpy_formulas(level, seed, big):
    b = _batch(np.random.default_rng(seed), big=big)
    cfg = {**_BASE, "loss_type": "grpo", "importance_sampling_level": level}
    got, want = PRODUCERS["kl"].fn(b, cfg), _kl_ref(b, cfg)
    assert set(got) == set(want)
    for k in want:
        assert _same(got[k], want[k]), k


def _clip_ref(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    rv = b.mask & np.isfinite(b.logp) & np.isfinite(b.old)
    av = rv & np.isfinite(b.adv)
    a = np.where(av, b.adv, 0.0)
    lo, hi = 1 - cfg["epsilon"], 1 + cfg["epsilon_high"]
    with np.errstate(all="ignore"):
        d = np.where(rv, b.logp - b.old, 0.0)
        r = np.exp(d)
        c = r if cfg["importance_sampling_level"] == "token" else np.exp(
            np.repeat(_seq_sum(b, d) / np.maximum(_count(b, rv), 1.0), b.lengths))
    ct = c if cfg.get("delta") is None else np.minimum(c, cfg["delta"])
    out = {"clip.n": _count(b, rv), "clip.below": _count(b, r < lo), "clip.above": _count(b, r > hi)}
    if cfg["loss_type"] == "cispo":
        out["clip.g.cispo"] = _count(b, (c > cfg["epsilon_high"]) & (a > 0))
    else:
        out["clip.g.low"] = _count(b, (ct < lo) & (a < 0))
        out["clip.g.high"] = _count(b, (ct > hi) & (a > 0))
    out["clip.g.n"] = _count(b, av)
    return out


@pytest.mark.parametrize("cfg", [
    {"loss_type": "grpo"}, {"loss_type": "dapo", "delta": 1.1}, {"loss_type": "cispo", "epsilon_high": 1.5},
    {"loss_type": "grpo", "importance_sampling_level": "sequence_token"},
])
@pytest.mark.parametrize("seed", [11, 12])
def test_clip_counts_equal_their_numpy_formulas(cfg, seed):
    b = _batch(np.random.default_rng(seed), spread=0.3)
    cfg = {**_BASE, **cfg}
    got, want = PRODUCERS["clip"].fn(b, cfg), _clip_ref(b, cfg)
    for k in want:
        assert _same(got[k], want[k]), k
    if cfg["importance_sampling_level"] == "token":  # the test bites (a sequence's mean ratio is rarely clipped)
        assert got["clip.g.low"].sum() + got["clip.g.high"].sum() + got["clip.g.cispo"].sum() > 0


@pytest.mark.parametrize("n_tokens", [0, 1])
def test_an_empty_batch_and_a_single_token(n_tokens):
    # the kernels' loops and buffers at their smallest: no sequence at all, one sequence of one token
    rng = np.random.default_rng(13)
    b = _batch(rng)  # its first sequence is one token long
    cols = {k: v[:n_tokens] for k, v in b.cols.items()}
    cols["mask"] = np.ones(n_tokens, bool)
    small = TokenBatch(cols, b.present)
    cfg = {**_BASE, "loss_type": "grpo", "beta": 0.04, "temperature": 1.0}
    refs = {"policy": _policy_ref, "kl": lambda b: _kl_ref(b, cfg), "clip": lambda b: _clip_ref(b, cfg)}
    for name, ref in refs.items():
        got = PRODUCERS[name].fn(small, cfg)
        for k, want in (ref(small) if n_tokens else {}).items():
            assert _same(got[k], want), (name, k)
        assert all(len(v) == n_tokens for v in got.values()), name
    from grpolens.metrics.loss import loss_partials

    s, n = loss_partials(small, cfg)
    if n_tokens:
        ws, wn = _loss_ref(small, cfg)
        assert _same(s, ws) and _same(n, wn)
    else:
        assert len(s) == len(n) == 0
