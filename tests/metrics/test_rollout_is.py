"""Rollout IS and mismatch metrics against an independent reference on padded arrays.

The reference below re-implements the published algorithm (xtuner's port of verl's mismatch
helper, newest verl, TRL's vLLM correction) token by token on padded (B, T) loss calls, in plain
numpy, without grpolens' partials; runs are written with the plain pyarrow writer of refdata.
"""

import json
import re
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

import grpolens
from grpolens.errors import UserError
from grpolens.run import format as fmt
from grpolens.run.config import check_config
from grpolens.run.format import CONFIG_DEFAULTS
from tests.refdata import LossCall, approx, f32, random_calls, shift_logprobs, write_run

S = 20.0


# ---------------------------------------------------------------------------------------------
# Reference (padded arrays)
# ---------------------------------------------------------------------------------------------

def _old(c):
    return c.old if c.old is not None else c.logp


def ref_call(c: LossCall, cfg: dict) -> dict:
    """Per-token arrays of one loss call under a canonical rollout_is config."""
    level, mode = cfg["level"], cfg["mode"]
    lo, hi = cfg["lower"], cfg["upper"]
    with np.errstate(invalid="ignore", over="ignore"):
        d = _old(c) - c.rollout
    V = c.mask & c.valid & ~np.isnan(d)
    mixed = (V & (d == np.inf)).any(1) & (V & (d == -np.inf)).any(1)
    V &= ~mixed[:, None]
    dz = np.where(V, d, 0.0)
    n = V.sum(1)
    L = dz.sum(1)
    B, T = d.shape
    if level == "token":
        X = dz
    elif level == "sequence":
        X = np.repeat(L[:, None], T, 1)
    else:
        X = np.repeat(np.where(n > 0, L / np.maximum(n, 1), 0.0)[:, None], T, 1)
    w = np.exp(np.clip(X, -S, S))
    if mode in ("truncate", "both"):
        a = np.clip(w, lo if lo is not None else 0.0, hi)
    elif mode == "truncate_upper":
        a = np.minimum(w, hi)
    elif mode == "icepop":
        a = np.where((w <= hi) & (w >= (lo if lo is not None else 0.0)), w, 0.0)
    else:
        a = w.copy()
    band = np.ones((B, T), bool)
    if mode in ("mask", "both"):
        ml, mu = cfg["mask_lower"], cfg["mask_upper"]
        band = (w <= mu) & (w >= (ml if ml is not None else 0.0))
    cat = np.zeros((B, T), bool)
    vl, vu = cfg["veto_lower"], cfg["veto_upper"]
    with np.errstate(divide="ignore", invalid="ignore"):
        if vl:
            cat |= d < np.log(vl)
        if vu is not None:
            cat |= d > np.log(vu)
    cat &= V
    vetoed = cat.any(1)
    rs_keep = np.ones((B, T), bool)
    ds = np.clip(dz, -S, S)
    for f in cfg["rs"]:
        k = int(f["option"][-1])
        stat = {1: -ds, 2: 0.5 * ds ** 2, 3: np.exp(ds) - 1 - ds}[k]
        if f["option"].startswith("token"):
            v = stat
        elif "_sum_" in f["option"]:
            v = np.repeat(np.where(V, stat, 0).sum(1)[:, None], T, 1)
        elif "_mean_" in f["option"]:
            v = np.repeat((np.where(V, stat, 0).sum(1) / np.maximum(n, 1))[:, None], T, 1)
        else:
            v = np.repeat(np.where(n > 0, np.where(V, stat, -np.inf).max(1), 0.0)[:, None], T, 1)
        if k == 1:
            rs_keep &= (v >= np.log(f["lower"])) & (v <= np.log(f["upper"]))
        else:
            rs_keep &= v <= f["upper"]
    rej = V & (~band | ~rs_keep | vetoed[:, None])
    chg = V & (a != w)
    A = np.where(np.isfinite(c.adv_tok), np.abs(c.adv_tok), 0.0)
    return dict(V=V, n=n, X=X, w=w, a=a, band=V & ~band, cat=cat, vetoed=vetoed, rej=rej, chg=chg,
                zero=chg & (a == 0), A=A, keep=V & ~rej)


def _stats(x):
    N = len(x)
    m = x.mean()
    s2 = (x * x).sum()
    return m, np.sqrt(max(0.0, (x * x).mean() - m * m)), (x.sum() ** 2 / (N * s2) if s2 > 0 else None)


def ref_canonical(calls, step, cfg) -> dict:
    """grpolens' default profile: pooled over the step's valid tokens / sequences."""
    rs = [ref_call(c, cfg) for c in calls if c.step == step]
    cat = lambda k: np.concatenate([r[k][r["V"]] for r in rs])  # noqa: E731
    rows = lambda k: np.concatenate([r[k] for r in rs])  # noqa: E731
    V = [r["V"] for r in rs]
    N = sum(v.sum() for v in V)
    out = {"valid_tokens": float(N)}
    if N == 0:
        return out
    w, a, X = cat("w"), cat("a"), cat("X")
    U, Lo = cfg["upper"], cfg["lower"]
    out["raw/mean"], out["raw/std"], out["raw/ess"] = _stats(w)
    out["raw/max"], out["raw/min"] = w.max(), w.min()
    out["applied/mean"], out["applied/std"], out["applied/ess"] = _stats(a)
    out["applied/max"], out["applied/min"] = a.max(), a.min()
    out["safety_bound_fraction"] = np.mean(np.abs(X) > S)
    n = rows("n")
    okrows = n > 0
    s_raw = np.concatenate([np.where(r["V"], r["w"], 0).sum(1) / np.maximum(r["n"], 1) for r in rs])[okrows]
    s_app = np.concatenate([np.where(r["V"], r["a"], 0).sum(1) / np.maximum(r["n"], 1) for r in rs])[okrows]
    for pre, s in (("raw/", s_raw), ("applied/", s_app)):
        out[pre + "seq_mean"] = s.mean()
        out[pre + "seq_std"] = s.std(ddof=1) if len(s) > 1 else None
        out[pre + "seq_min"], out[pre + "seq_max"] = s.min(), s.max()
        out[pre + "seq_max_deviation"] = np.abs(s - 1).max()
    if U is not None:
        out["raw/seq_fraction_high"] = np.mean(s_raw > U)
        out["raw/seq_fraction_low"] = np.mean(s_raw < Lo) if Lo is not None else None
        with np.errstate(divide="ignore"):
            out["raw/fraction_high"] = np.mean(X > np.log(U))
            out["raw/fraction_low"] = np.mean(X < np.log(Lo)) if Lo is not None else None
        _, out["clamped/std"], out["clamped/ess"] = _stats(np.clip(w, Lo or 0.0, U))
    mode = cfg["mode"]
    if mode in ("truncate", "truncate_upper", "both"):
        out["truncated_fraction"] = cat("chg").mean()
    if mode == "icepop":
        out["zeroed_fraction"] = cat("chg").mean()
    rowany = lambda k: np.concatenate([(r[k] & r["V"]).any(1) for r in rs])[okrows]  # noqa: E731
    if mode in ("mask", "both"):
        out["mask/token_fraction"] = cat("band").mean()
        out["mask/seq_fraction"] = rowany("band").mean()
    out["veto/seq_fraction"] = rows("vetoed")[okrows].mean()
    out["veto/catastrophic_token_fraction"] = cat("cat").mean()
    out["rejected/token_fraction"] = cat("rej").mean()
    out["rejected/seq_fraction"] = rowany("rej").mean()
    mod = [r["rej"] | r["chg"] for r in rs]
    out["modified/token_fraction"] = np.concatenate([m[r["V"]] for m, r in zip(mod, rs)]).mean()
    out["modified/seq_fraction"] = np.concatenate([(m & r["V"]).any(1) for m, r in zip(mod, rs)])[okrows].mean()
    out["kept_tokens"] = float(sum(r["keep"].sum() for r in rs))
    A = cat("A")
    drop = np.concatenate([(r["rej"] | r["zero"])[r["V"]] for r in rs])
    out["loss_mass_removed"] = (A * drop).sum() / A.sum() if A.sum() > 0 else None
    return out


def ref_mismatch(calls, step) -> dict:
    """Mismatch metrics: masked finite tokens; row statistics over sequences with a token."""
    ks = {k: [] for k in ("d", "nf", "lo", "lr", "L", "absmax")}
    for c in calls:
        if c.step != step:
            continue
        old = _old(c)
        F = c.mask & c.valid & np.isfinite(old) & np.isfinite(c.rollout)
        d = np.where(F, old - np.where(F, c.rollout, 0), 0.0)
        nf = F.sum(1)
        ks["d"].append(d[F])
        ks["nf"].append(nf)
        ks["lo"].append(np.where(F, old, 0).sum(1) / np.maximum(nf, 1))
        ks["lr"].append(np.where(F, c.rollout, 0).sum(1) / np.maximum(nf, 1))
        ks["L"].append(d.sum(1))
    d = np.concatenate(ks["d"])
    if len(d) == 0:
        return {}
    ok = np.concatenate(ks["nf"]) > 0
    lo, lr, L = (np.concatenate(ks[k])[ok] for k in ("lo", "lr", "L"))
    diff = lr - lo
    return {"kl_k1": np.mean(-d), "kl_k3": np.mean(np.exp(d) - d - 1), "abs_logp_diff": np.abs(d).mean(),
            "abs_logp_diff_max": np.abs(d).max(), "training_ppl": np.exp(-lo).mean(), "training_log_ppl": (-lo).mean(),
            "rollout_ppl": np.exp(-lr).mean(), "rollout_log_ppl": (-lr).mean(), "log_ppl_diff": diff.mean(),
            "log_ppl_abs_diff": np.abs(diff).mean(), "log_ppl_diff_max": diff.max(), "log_ppl_diff_min": diff.min(),
            "ppl_ratio": np.exp(diff).mean(), "chi2_token": np.mean(np.exp(2 * np.clip(d, -S, S))) - 1,
            "chi2_seq": np.mean(np.exp(2 * np.clip(L, -S, S))) - 1, "delta_median": np.quantile(d, 0.5, method="lower"),
            "delta_iqr": (np.quantile(d, 0.75, method="lower"), np.quantile(d, 0.25, method="lower"))}


def close(got, want, rel=1e-7, abs_=1e-10):
    if want is None or (isinstance(want, float) and np.isnan(want)):
        return got is None
    return got is not None and abs(got - want) <= abs_ + rel * abs(want)


def within_histogram_bound(got, want) -> bool:
    """grpolens.functional.histogram's stated bound: within 0.5 % of the exact lower order
    statistic, or |got| < 1e-6 when that statistic is below 1e-6 in magnitude."""
    if isinstance(want, tuple):  # an IQR: (q75, q25), each end within the bound
        return got is not None and abs(got - (want[0] - want[1])) <= 0.005 * (abs(want[0]) + abs(want[1])) + 2e-6
    return got is not None and (abs(got - want) <= 0.005 * abs(want) or (abs(want) < 1e-6 and abs(got) < 1e-6))


def check(df, step, ref, prefix):
    row = df.filter(pl.col("step") == step).row(0, named=True)
    ok = lambda k, v: (within_histogram_bound if k in ("delta_median", "delta_iqr") else close)(row.get(prefix + k), v)  # noqa: E731
    bad = {k: (row.get(prefix + k), v) for k, v in ref.items() if not ok(k, v)}
    assert not bad, bad


def norm(ris):
    return check_config({**CONFIG_DEFAULTS, "rollout_is": ris})["rollout_is"]


# ---------------------------------------------------------------------------------------------
# Canonical profile: every level × mode × veto combination
# ---------------------------------------------------------------------------------------------

BANDS = {"token": (0.9, 1.1), "sequence": (0.75, 1.3), "geometric": (0.95, 1.05)}
MODES = ("none", "truncate", "truncate_upper", "mask", "both", "icepop")


@pytest.mark.parametrize("level", list(BANDS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("veto", [None, (0.8, 1.25)])
def test_levels_modes_veto(tmp_path, level, mode, veto):
    rng = np.random.default_rng(list(BANDS).index(level) * 100 + MODES.index(mode) * 2 + (veto is None))
    calls = random_calls(rng, spread=0.45)
    lo, hi = BANDS[level]
    ris = {"level": level, "mode": mode, "threshold": [lo, hi]}
    if veto:
        ris["veto_threshold"] = list(veto)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    got = grpolens.recompute(run, write=False)
    cfg = norm(ris)
    for step in (0, 1):
        check(got, step, ref_canonical(calls, step, cfg), "rollout_is/")
    # something actually happened in the interesting combinations
    if mode in ("mask", "both") or veto:
        assert got["rollout_is/rejected/token_fraction"].max() > 0
    if mode in ("truncate", "truncate_upper", "both"):
        assert got["rollout_is/truncated_fraction"].max() > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_nonfinite_and_beyond_bound(tmp_path, seed):
    rng = np.random.default_rng(seed)
    calls = random_calls(rng, nonfinite=0.1, spread=0.3)
    # exponents beyond ±20: per-token and per-sequence
    calls[0].rollout[0, :] = f32(calls[0].logp[0, :] - 30.0)
    shift_logprobs(calls[1], 30.0)  # room below 0 for a rollout log-prob 25 above the old one
    calls[1].rollout[3, :] = f32(_old(calls[1])[3, :] + 25.0)
    calls[2].rollout[0, 0] = -np.inf  # δ = +inf
    for level in ("token", "sequence", "geometric"):
        ris = {"level": level, "mode": "both", "threshold": [0.5, 2.0], "veto_threshold": [1e-3, 1e3]}
        run = write_run(tmp_path / f"run-{level}", calls, config={"rollout_is": ris})
        got = grpolens.recompute(run, write=False)
        for step in (0, 1):
            check(got, step, ref_canonical(calls, step, norm(ris)), "rollout_is/")
            check(got, step, ref_mismatch(calls, step), "mismatch/")
        assert got["rollout_is/safety_bound_fraction"].max() > 0
        assert got["rollout_is/undefined_tokens"].max() > 0


def test_mismatch_metrics(tmp_path):
    rng = np.random.default_rng(5)
    calls = random_calls(rng, spread=0.3)
    got = grpolens.recompute(write_run(tmp_path / "run", calls), write=False)
    for step in (0, 1):
        check(got, step, ref_mismatch(calls, step), "mismatch/")
    # no rollout_is config: the raw (token-level) weights are still described
    check(got, 0, {k: v for k, v in ref_canonical(calls, 0, norm({"level": "token"})).items()
                   if k.startswith(("raw/mean", "raw/max", "raw/min", "raw/ess", "applied/mean"))}, "rollout_is/")
    assert "rollout_is/veto/seq_fraction" not in got.columns


def test_rejection_filters(tmp_path):
    rng = np.random.default_rng(7)
    calls = random_calls(rng, spread=0.3)
    ris = {"level": "token", "mode": "truncate_upper", "threshold": 2.0,
           "rs": "token_k1,seq_sum_k2,seq_mean_k3,seq_max_k2", "rs_threshold": "0.9_1.1,0.05,0.004,0.02"}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    got = grpolens.recompute(run, write=False)
    cfg = norm(ris)
    for step in (0, 1):
        check(got, step, ref_canonical(calls, step, cfg), "rollout_is/")
    assert 0 < got["rollout_is/rejected/token_fraction"].max() < 1
    # per-filter verl metrics: masked fractions against the reference
    for step in (0, 1):
        rs = [ref_call(c, {**cfg, "rs": [f]}) for c in calls if c.step == step for f in cfg["rs"][:1]]
        frac = sum(r["rej"].sum() for r in rs) / sum(r["V"].sum() for r in rs)
        assert close(got.filter(pl.col("step") == step)["rollout_rs/token_k1/masked_fraction"][0], frac)
    verl = grpolens.recompute(run, profile="verl", write=False)
    assert "rollout_corr/rollout_rs_seq_max_k2_seq_max" in verl.columns
    assert "rollout_corr/rollout_rs_masked_fraction" in verl.columns


def test_all_masked_and_empty(tmp_path):
    rng = np.random.default_rng(3)
    calls = random_calls(rng)
    for c in calls:
        c.mask[:] = False
    ris = {"level": "sequence", "mode": "both", "threshold": [0.5, 2.0], "veto_threshold": [1e-4, 1e4]}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    got = grpolens.recompute(run, write=False)
    assert got["rollout_is/valid_tokens"].to_list() == [0.0, 0.0]
    for c in ("rollout_is/raw/mean", "rollout_is/veto/seq_fraction", "mismatch/kl_k1", "rollout_is/applied/ess"):
        assert got[c].to_list() == [None, None], c
    xt = grpolens.recompute(run, profile="xtuner", write=False)  # xtuner's merger logs 0.0 with no valid pack
    assert xt["mismatch/rollout_is_mean"].to_list() == [0.0, 0.0]
    assert xt["mismatch/mismatch_kl"].to_list() == [0.0, 0.0]
    vl = grpolens.recompute(run, profile="verl", write=False)  # verl raises; grpolens reports null
    assert vl["rollout_corr/kl"].to_list() == [None, None]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_at_the_smallest_upper_bound_every_weight_is_capped_and_the_ess_is_one(tmp_path, level):
    """Hand-worked: with the upper bound at exp(-20), the smallest weight there is, truncation caps
    every weight at it, so the applied and clamped weights are all equal: std 0, ESS fraction
    (Σw)²/(N·Σw²) = 1. (Far below that bound, now refused, w² underflowed and the ESS was null.)"""
    U = float(np.exp(-20.0))
    rng = np.random.default_rng(5)
    calls = random_calls(rng, all_masked_row=False)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"level": level, "mode": "truncate", "upper": U}})
    got = grpolens.recompute(run, write=False)
    assert got.height == 2 and (got["rollout_is/valid_tokens"] > 0).all()
    for c in ("rollout_is/applied/ess", "rollout_is/clamped/ess"):
        assert got[c].to_list() == [pytest.approx(1.0, rel=1e-12)] * 2, c
    assert got["rollout_is/applied/max"].to_list() == got["rollout_is/applied/min"].to_list() == [pytest.approx(U)] * 2


def test_step_mixing_shards_with_and_without_rollout_logprobs(tmp_path):
    # rank 1 recorded no rollout_logp: validate accepts it (an optional column, checked per file),
    # and its sequences have no IS or mismatch partials, so each step's rollout_is/* and mismatch/*
    # are those of rank 0's tokens alone (a piece without the partials adds nothing to a sum, -inf
    # to a max, +inf to a min)
    from grpolens.run.validate import validate_run

    rng = np.random.default_rng(12)
    calls = random_calls(rng, spread=0.45, nonfinite=0.05)
    for c in calls:
        if c.rank == 1:
            c.rollout = None
    ris = {"level": "token", "mode": "both", "threshold": [0.9, 1.1], "veto_threshold": [0.5, 2.0]}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    assert validate_run(run).errors == []
    got = grpolens.recompute(run, write=False)
    own = [c for c in calls if c.rank == 0]
    for step in (0, 1):
        check(got, step, ref_canonical(own, step, norm(ris)), "rollout_is/")
        check(got, step, ref_mismatch(own, step), "mismatch/")
    assert got["rollout_is/rejected/token_fraction"].max() > 0


@pytest.mark.parametrize("profile", [None, "verl", "verl-batch-normalize", "xtuner", "trl"])
def test_step_without_rollout_logprobs_has_null_is_metrics(tmp_path, profile):
    # no rank recorded rollout_logp at step 1: the step has no IS or mismatch partials at all, its
    # rollout_is/* and mismatch/* are null (no IS histogram for it), and step 0 is as without it.
    # verl's batch normalisation reads the step's IS summary from the policy loss, which a step
    # without rollout log-probs still has
    rng = np.random.default_rng(14)
    calls = random_calls(rng, spread=0.3)
    for c in calls:
        if c.step == 1:
            c.rollout = None
    ris = {"level": "token", "mode": "truncate", "threshold": [0.8, 1.25]}
    if profile == "verl-batch-normalize":
        profile, ris = "verl", {"rollout_is": "token", "rollout_is_threshold": 1.25, "rollout_is_batch_normalize": True}
    if profile == "trl":
        ris = {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": 0.8,
               "vllm_importance_sampling_clip_max": 1.25}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    got = grpolens.recompute(run, profile=profile, write=False) if profile else grpolens.recompute(run)
    names = [n for n in got.columns if n.startswith(("rollout_is/", "mismatch/", "rollout_corr/", "sampling/"))]
    assert names
    step0, step1 = (got.filter(pl.col("step") == s).row(0, named=True) for s in (0, 1))
    assert all(step1[n] is None for n in names), {n: step1[n] for n in names if step1[n] is not None}
    assert any(step0[n] is not None for n in names)
    if profile is None:
        check(got, 0, ref_canonical([c for c in calls if c.step == 0], 0, norm(ris)), "rollout_is/")
        hist = pl.read_parquet(run / "grpolens" / "is_hist.parquet")
        assert hist["step"].unique().to_list() == [0]


def test_single_token(tmp_path):
    c = random_calls(np.random.default_rng(0), steps=(0,), ranks=1, micro_batches=1, batch=1, max_len=3,
                     all_masked_row=False, zero_adv=False)[0]
    c.lengths[:] = 1
    c.mask[:] = [[True, False, False]]
    c.old[0, 0], c.rollout[0, 0] = -1.0, -1.5  # w = e^0.5
    ris = {"level": "token", "mode": "truncate", "threshold": [0.5, 1.5]}
    run = write_run(tmp_path / "run", [c], config={"rollout_is": ris})
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["rollout_is/raw/mean"] == pytest.approx(np.exp(0.5))
    assert got["rollout_is/applied/mean"] == pytest.approx(1.5)
    assert got["rollout_is/raw/std"] == 0 and got["rollout_is/raw/ess"] == pytest.approx(1.0)
    assert got["rollout_is/raw/seq_std"] is None
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    assert xt["mismatch/rollout_is_std"] == 0.0 and xt["mismatch/rollout_is_seq_std"] == 0.0
    assert xt["mismatch/rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_hand_worked(tmp_path):
    # one call, two sequences, token level, truncate [0.5, 2], veto [0.1, 10]:
    #   seq A: δ = [ln 3, 0, ln 0.25]   w = [3, 1, 0.25] -> a = [2, 1, 0.5]
    #   seq B: δ = [ln 20]              w = [20] -> vetoed (20 > 10), a = [2]
    # raw mean = (3 + 1 + .25 + 20) / 4 = 6.0625; applied mean = (2 + 1 + .5 + 2) / 4 = 1.375
    # truncated 3/4, rejected 1/4 tokens and 1/2 sequences, modified 3/4 (the w = 1 token is untouched)
    c = random_calls(np.random.default_rng(0), steps=(0,), ranks=1, micro_batches=1, batch=2, max_len=3,
                     all_masked_row=False, zero_adv=False, single_token=False)[0]
    c.lengths[:] = [3, 1]
    c.mask[:] = [[True, True, True], [True, False, False]]
    c.old[:] = -2.0
    c.rollout[:] = -2.0 - np.log([[3, 1, 0.25], [20, 1, 1]])
    c.advantages[:] = [1.0, -2.0]
    ris = {"level": "token", "mode": "truncate", "threshold": [0.5, 2.0], "veto_threshold": [0.1, 10]}
    got = grpolens.recompute(write_run(tmp_path / "run", [c], config={"rollout_is": ris}), write=False).row(0, named=True)
    assert got["rollout_is/raw/mean"] == pytest.approx(6.0625, rel=1e-6)
    assert got["rollout_is/applied/mean"] == pytest.approx(1.375, rel=1e-6)
    assert got["rollout_is/truncated_fraction"] == pytest.approx(0.75)
    assert got["rollout_is/rejected/token_fraction"] == pytest.approx(0.25)
    assert got["rollout_is/rejected/seq_fraction"] == pytest.approx(0.5)
    assert got["rollout_is/modified/token_fraction"] == pytest.approx(0.75)
    assert got["rollout_is/veto/seq_fraction"] == pytest.approx(0.5)
    assert got["rollout_is/loss_mass_removed"] == pytest.approx(2.0 / 5.0)  # |A|: 1+1+1 kept, 2 vetoed


# ---------------------------------------------------------------------------------------------
# Trainer profiles
# ---------------------------------------------------------------------------------------------

def mm_(x, m):
    return (np.where(m, x, 0) * m).sum() / (m.sum() + 1e-8)


def xtuner_pack_ref(c: LossCall, cfg: dict, level: str) -> tuple[dict, dict]:
    """xtuner's compute_mismatch_metrics (pack = one row) and compute_is_metrics on one pack."""
    old, roll = _old(c), c.rollout
    m = (c.mask & c.valid).astype(float)
    valid = m.any()
    mm = {}
    if valid:
        lo, lr = mm_(old, m), mm_(roll, m)
        d = old - roll
        mm = {"mismatch_training_ppl": np.exp(-lo), "mismatch_training_log_ppl": -lo, "mismatch_kl": mm_(roll - old, m),
              "mismatch_k3_kl": mm_(np.exp(d) - d - 1, m), "mismatch_rollout_ppl": np.exp(-lr),
              "mismatch_rollout_log_ppl": -lr, "mismatch_log_ppl_diff": lr - lo, "mismatch_log_ppl_abs_diff": abs(lr - lo),
              "mismatch_log_ppl_diff_max": lr - lo, "mismatch_log_ppl_diff_min": lr - lo,
              "mismatch_ppl_ratio": np.exp(lr - lo), "mismatch_logprob_abs_diff": mm_(np.abs(d), m)}
    if not valid:
        return mm, {}
    U, Lo = cfg["upper"], cfg["lower"]
    d = np.where(m > 0, old - roll, 0.0)
    rowsum = (d * m).sum(1)
    rowmean = rowsum / (m.sum(1) + 1e-8)
    X = {"token": d, "sequence": rowsum[:, None], "geometric": rowmean[:, None]}[level]
    w = np.broadcast_to(np.exp(np.clip(X, -S, S)), d.shape)
    seq_valid = m.sum(1) > 0
    vl, vu = cfg["veto_lower"], cfg["veto_upper"]
    with np.errstate(divide="ignore"):
        cat = ((d < np.log(vl)) | (d > np.log(vu))) & (m > 0)
    o = {"rollout_is_veto_fraction": (cat.any(1) & seq_valid).sum() / (seq_valid.sum() + 1e-8),
         "rollout_is_catastrophic_token_fraction": mm_(cat.astype(float), m)}
    if level == "token":
        o["rollout_is_mean"] = mm_(w, m)
        o["rollout_is_ratio_fraction_high"], o["rollout_is_ratio_fraction_low"] = mm_(w > U, m), mm_(w < Lo, m)
        o["rollout_is_max"], o["rollout_is_min"] = w[m > 0].max(), w[m > 0].min()
    else:
        o["rollout_is_max"], o["rollout_is_min"] = np.exp(min(X.max(), S)), np.exp(X.min())
        o["rollout_is_mean"] = mm_(w, m)
        hi_, lo_ = X > np.log(U), X < np.log(Lo)
        if level == "sequence":
            o["rollout_is_ratio_fraction_high"], o["rollout_is_ratio_fraction_low"] = hi_.mean(), lo_.mean()
        else:
            o["rollout_is_ratio_fraction_high"] = mm_(np.broadcast_to(hi_, m.shape), m)
            o["rollout_is_ratio_fraction_low"] = mm_(np.broadcast_to(lo_, m.shape), m)
    wc = np.clip(w, Lo, U)
    if m.sum() > 1:
        o["rollout_is_std"] = np.sqrt(max(0.0, mm_(wc ** 2, m) - mm_(wc, m) ** 2))
    else:
        o["rollout_is_std"] = 0.0
    o["rollout_is_eff_sample_size"] = 1.0 / mm_((wc / (mm_(wc, m) + 1e-8)) ** 2, m)
    s = ((w * m).sum(1) / (m.sum(1) + 1e-8))[seq_valid]
    o["rollout_is_seq_mean"], o["rollout_is_seq_std"] = s.mean(), s.std(ddof=1) if len(s) > 1 else 0.0
    o["rollout_is_seq_max"], o["rollout_is_seq_min"] = s.max(), s.min()
    o["rollout_is_seq_max_deviation"] = np.abs(s - 1).max()
    o["rollout_is_seq_fraction_high"], o["rollout_is_seq_fraction_low"] = (s > U).mean(), (s < Lo).mean()
    keep = (w >= cfg["mask_lower"]) & (w <= cfg["mask_upper"])
    o["rollout_is_masked_fraction"] = mm_(1 - keep, m)
    if level == "token":
        o["rollout_is_seq_masked_fraction"] = ((((1 - keep) * m).sum(1)) > 0).mean()
    else:
        o["rollout_is_seq_masked_fraction"] = (1 - keep[:, 0]).mean()
    return mm, o


def xtuner_merge(dicts: list[dict]) -> dict:
    valid = [d for d in dicts if d]
    keys = set().union(*[d.keys() for d in valid]) if valid else set()
    out = {}
    for k in keys:
        vals = [d[k] for d in valid]
        out[k] = max(vals) if "max" in k else min(vals) if "min" in k else sum(vals) / len(valid)
    return out


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_xtuner_profile(tmp_path, level):
    rng = np.random.default_rng(11)
    # rollout log-probs 0.4 nats from the old ones (σ): weights beyond the band and the veto occur
    calls = random_calls(rng, spread=1.2, ranks=2, micro_batches=3)
    calls[2].mask[:] = False  # an invalid pack: dropped by the merger
    xt = {"rollout_is_level": level, "rollout_is_mode": "both", "rollout_is_threshold": [1.3, 0.8],
          "rollout_is_mask_threshold": [1.2, 0.85], "rollout_is_veto_threshold": [1.6, 0.6]}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": xt})
    got = grpolens.recompute(run, profile="xtuner", write=False)
    cfg = norm(xt)
    assert cfg["mask_upper"] == 1.2 and cfg["upper"] == 1.3 and cfg["veto_lower"] == 0.6
    for step in (0, 1):
        packs = [xtuner_pack_ref(c, cfg, level) for c in calls if c.step == step]
        ref = {**xtuner_merge([p[0] for p in packs]), **xtuner_merge([p[1] for p in packs])}
        row = got.filter(pl.col("step") == step).row(0, named=True)
        # rel 1e-5: the reference's masked means carry a +1e-8 guard, which the variance (a
        # difference of two means) amplifies; grpolens divides exactly. A pack whose clamped
        # weights are all equal has variance 0, which the guard leaves at ~1e-9: its std reads
        # ~3e-5 in the reference, 0 in grpolens (abs 1e-5 on the mean over packs)
        tol = lambda k: {"abs_": 1e-5} if k == "rollout_is_std" else {}  # noqa: E731
        bad = {k: (row.get("mismatch/" + k), v) for k, v in ref.items()
               if not close(row.get("mismatch/" + k), v, rel=1e-5, **tol(k))}
        assert not bad, bad
        assert set("mismatch/" + k for k in ref) == set(c for c in got.columns if c.startswith("mismatch/"))
        # the data reach every threshold: the fractions compared above are not all 0
        for k in ("rollout_is_veto_fraction", "rollout_is_catastrophic_token_fraction", "rollout_is_ratio_fraction_high",
                  "rollout_is_ratio_fraction_low", "rollout_is_masked_fraction"):
            assert 0 < ref[k] < 1, (k, ref[k])


def test_xtuner_disabled_without_threshold(tmp_path):
    calls = random_calls(np.random.default_rng(2))
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"rollout_is_veto_threshold": [20, 0]}})
    got = grpolens.recompute(run, profile="xtuner", write=False)
    assert "mismatch/rollout_is_veto_fraction" not in got.columns  # xtuner ignores a lone veto
    assert "mismatch/mismatch_kl" in got.columns


def verl_ref(calls, step, cfg) -> dict:
    """Newest verl on the global batch (all rows of the step), applied-weight IS statistics."""
    rs = [(c, ref_call(c, cfg)) for c in calls if c.step == step]
    U, Lo, level = cfg["upper"], cfg["lower"], cfg["level"]
    m = [r["V"].astype(float) for _, r in rs]
    Mtot = sum(x.sum() for x in m)
    gmm = lambda xs: sum((x * mm).sum() for x, mm in zip(xs, m)) / (Mtot + 1e-8)  # noqa: E731
    raw = [np.where(r["V"], r["w"], 0) for _, r in rs]
    app = [np.where(r["V"], r["a"], 0) for _, r in rs]
    o = {"rollout_is_mean": gmm(app)}
    rowmean = lambda xs: np.concatenate([(x * mm).sum(1) / (mm.sum(1) + 1e-8) for x, mm in zip(xs, m)])  # noqa: E731
    if level == "token":
        o["rollout_is_max"] = max(a[mm > 0].max() for a, mm in zip(app, m) if mm.any())
        o["rollout_is_min"] = min(a[mm > 0].min() for a, mm in zip(app, m) if mm.any())
        o["rollout_is_ratio_fraction_high"] = gmm([w > U for w in raw])
        o["rollout_is_ratio_fraction_low"] = gmm([w < Lo for w in raw])
    else:
        L = np.concatenate([np.where(r["V"], _old(c) - c.rollout, 0).sum(1) for c, r in rs])
        o["rollout_is_max"], o["rollout_is_min"] = np.exp(min(L.max(), S)), np.exp(L.min())
        o["rollout_is_ratio_fraction_high"], o["rollout_is_ratio_fraction_low"] = (L > np.log(U)).mean(), (L < np.log(Lo)).mean()
    wc = [np.clip(a, 0, U) for a in app]
    o["rollout_is_std"] = np.sqrt(max(0.0, gmm([x ** 2 for x in wc]) - gmm(wc) ** 2)) if Mtot > 1 else 0.0
    mean_c = gmm(wc)
    o["rollout_is_eff_sample_size"] = 1.0 / gmm([(x / (mean_c + 1e-8)) ** 2 for x in wc])
    s = rowmean(app)
    o["rollout_is_seq_mean"], o["rollout_is_seq_std"] = s.mean(), s.std(ddof=1)
    o["rollout_is_seq_max"], o["rollout_is_seq_min"] = s.max(), s.min()
    o["rollout_is_seq_max_deviation"] = np.abs(s - 1).max()
    sr = rowmean(raw)
    o["rollout_is_seq_fraction_high"], o["rollout_is_seq_fraction_low"] = (sr > U).mean(), (sr < Lo).mean()
    o["rollout_is_oob_ratio"] = gmm([(w < Lo) | (w > U) for w in raw])
    # off-policy metrics over every row (an empty row: mean log-prob 0)
    F = [(c.mask & c.valid).astype(float) for c, _ in rs]
    lo = np.concatenate([mm_r(_old(c), f) for (c, _), f in zip(rs, F)])
    lr = np.concatenate([mm_r(c.rollout, f) for (c, _), f in zip(rs, F)])
    d = lr - lo
    Ls = np.concatenate([np.where(f > 0, _old(c) - c.rollout, 0).sum(1) for (c, _), f in zip(rs, F)])
    Ft = sum(f.sum() for f in F)
    tok = lambda g: sum((np.where(f > 0, g(c), 0)).sum() for (c, _), f in zip(rs, F)) / Ft  # noqa: E731
    o.update({"training_ppl": np.exp(-lo).mean(), "training_log_ppl": (-lo).mean(), "rollout_ppl": np.exp(-lr).mean(),
              "rollout_log_ppl": (-lr).mean(), "log_ppl_diff": d.mean(), "log_ppl_abs_diff": np.abs(d).mean(),
              "log_ppl_diff_max": d.max(), "log_ppl_diff_min": d.min(), "ppl_ratio": np.exp(d).mean(),
              "kl": tok(lambda c: c.rollout - _old(c)), "k3_kl": tok(lambda c: np.exp(_old(c) - c.rollout) - (_old(c) - c.rollout) - 1),
              "chi2_token": tok(lambda c: np.exp(2 * np.clip(_old(c) - c.rollout, -S, S))) - 1,
              "chi2_seq": np.exp(2 * np.clip(Ls, -S, S)).mean() - 1})
    return o


def mm_r(x, m):
    return (np.where(m > 0, x, 0) * m).sum(1) / (m.sum(1) + 1e-8)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_profile(tmp_path, level):
    rng = np.random.default_rng(13)
    calls = random_calls(rng, spread=0.3)
    band = "0.9_1.1" if level == "token" else "0.75_1.3"
    verl = {"rollout_is": level, "rollout_is_threshold": band}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": verl})
    got = grpolens.recompute(run, profile="verl", write=False)
    cfg = norm(verl)
    assert cfg["mode"] == "icepop"
    for step in (0, 1):
        ref = verl_ref(calls, step, cfg)
        row = got.filter(pl.col("step") == step).row(0, named=True)
        bad = {k: (row.get("rollout_corr/" + k), v) for k, v in ref.items() if not close(row.get("rollout_corr/" + k), v, rel=1e-6)}
        assert not bad, bad
    # TIS (a float threshold): upper cap only; lower = 1/U for the fraction metrics
    tis = norm({"rollout_is": "token", "rollout_is_threshold": 1.05})
    assert tis["mode"] == "truncate_upper" and tis["lower"] == pytest.approx(1 / 1.05)
    run2 = write_run(tmp_path / "run2", calls, config={"rollout_is": {"rollout_is": "token", "rollout_is_threshold": 1.05}})
    got2 = grpolens.recompute(run2, profile="verl", write=False)
    for step in (0, 1):
        ref = verl_ref(calls, step, tis)
        ref.pop("rollout_is_oob_ratio")
        row = got2.filter(pl.col("step") == step).row(0, named=True)
        bad = {k: (row.get("rollout_corr/" + k), v) for k, v in ref.items() if not close(row.get("rollout_corr/" + k), v, rel=1e-6)}
        assert not bad, bad
    assert got2["rollout_corr/rollout_is_max"].max() <= 1.05


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_profile(tmp_path, mode):
    rng = np.random.default_rng(17)
    calls = random_calls(rng, spread=0.3, ranks=3)
    trl = {"vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": 0.9,
           "vllm_importance_sampling_clip_max": 1.1}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": trl})
    got = grpolens.recompute(run, profile="trl", write=False)
    level, _, kind = mode.partition("_")
    for step in (0, 1):
        dmeans, dmax, rmin, rmean, rmax = [], [], [], [], []
        for rank in range(3):
            cs = [c for c in calls if c.step == step and c.rank == rank]
            d = np.concatenate([np.abs(_old(c) - c.rollout)[c.mask & c.valid] for c in cs])
            dmeans.append(d.mean() if len(d) else 0.0)
            dmax.append(d.max())
            ratios = []
            for c in cs:
                m = c.mask & c.valid
                dd = np.where(m, _old(c) - c.rollout, 0.0)
                r = np.exp(dd) if level == "token" else np.exp(dd.sum(1))
                r = np.clip(r, 0.9, 1.1) if kind == "truncate" else np.where((r >= 0.9) & (r <= 1.1), r, 0.0)
                ratios.append(r[m] if level == "token" else r)
            r = np.concatenate(ratios)
            rmin.append(r.min())
            rmean.append(r.mean())
            rmax.append(r.max())
        row = got.filter(pl.col("step") == step).row(0, named=True)
        assert close(row["sampling/sampling_logp_difference/mean"], np.mean(dmeans))
        assert close(row["sampling/sampling_logp_difference/max"], max(dmax))
        assert close(row["sampling/importance_sampling_ratio/min"], min(rmin))
        assert close(row["sampling/importance_sampling_ratio/mean"], np.mean(rmean))
        assert close(row["sampling/importance_sampling_ratio/max"], max(rmax))


# ---------------------------------------------------------------------------------------------
# Public verl fixtures (verl-xtuner-notes §2, §6.7): exact numbers
# ---------------------------------------------------------------------------------------------

def one_call(tmp_path, old, rollout, mask=None, adv=None, config=None, name="run"):
    old, rollout = np.asarray(old, float), np.asarray(rollout, float)
    # verl's fixtures are written with log-probs above 0, which a run may not hold: every log-prob
    # goes down by the same whole number (the differences, all these fixtures are about, unchanged)
    both = np.concatenate([old.ravel(), rollout.ravel()])
    top = np.max(both[np.isfinite(both)], initial=-np.inf)
    shift = float(np.ceil(top)) + 1.0 if top > 0 else 0.0
    old, rollout = old - shift, rollout - shift
    B, T = old.shape
    c = LossCall(0, 0, 0, np.arange(B), np.full(B, T), f32(old - 1.0), np.ones((B, T), bool) if mask is None else mask,
                 f32(np.ones(B) if adv is None else adv), old=f32(old), rollout=f32(rollout),
                 token_ids=np.zeros((B, T), int))
    return write_run(tmp_path / name, [c], config={"rollout_is": config} if config else None), c


def weights_of(run):
    from grpolens.analysis.is_weights import is_weight_writer

    grpolens.recompute(run, write=False, extra_visitors=[is_weight_writer(run)])
    return pl.read_parquet(run / "grpolens" / "is_weights" / "step=00000000" / "rank=00000.parquet")


def test_fixture_icepop_triplet(tmp_path):
    # raw weights [0.4, 0.8, 6.0], "0.5_5.0": weights [0, 0.8, 0], mask unchanged,
    # oob 2/3, std 0.3771236, ESS 1/3
    run, _ = one_call(tmp_path, [[0.0, 0.0, 0.0]], [-np.log([0.4, 0.8, 6.0])],
                      config={"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"})
    w = weights_of(run)
    assert np.allclose(w["is_weight"].to_numpy(), [0.0, 0.8, 0.0], atol=1e-6)
    assert w["is_mask"].to_list() == [True, True, True]
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 3, abs=1e-6)
    assert v["rollout_corr/rollout_is_std"] == pytest.approx(0.3771236, abs=1e-6)
    assert v["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1 / 3, abs=1e-6)


def test_icepop_weight_exactly_on_a_band_bound_is_kept(tmp_path):
    # old = rollout: weight exactly 1.0. Band [0.5, 1.0]: 1.0 is on the upper bound, kept; band
    # [1.0, 2.0]: on the lower bound, kept. A weight just above 1 (rollout one float32 step lower)
    # is outside [0.5, 1.0] and zeroed.
    below = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    old, rollout = [[-1.0, -1.0, -1.0]], [[-1.0, -1.0, below]]
    for band, want in (("0.5_1.0", [1.0, 1.0, 0.0]), ("1.0_2.0", None)):
        run, _ = one_call(tmp_path, old, rollout, config={"rollout_is": "token", "rollout_is_threshold": band},
                          name=band)
        w = weights_of(run)["is_weight"].to_numpy()
        if want is None:
            above = float(np.exp(np.float64(np.float32(-1.0)) - np.float64(np.float32(below))))
            want = [1.0, 1.0, above]
        assert w.tolist() == pytest.approx(want, abs=0, rel=1e-12), band


def test_fixture_icepop_loss(tmp_path):
    # old = −1, rollout = [−0.5, −3.5, −0.8], A = [1, −1, 2], "0.5_5.0":
    # weights [0.60653067, 0, 0.81873075], loss = mean(w·(−A)) over all three tokens, oob 1/3
    run, _ = one_call(tmp_path, [[-1.0, -1.0, -1.0]], [[-0.5, -3.5, -0.8]],
                      config={"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"})
    w = weights_of(run)["is_weight"].to_numpy()
    assert np.allclose(w, [0.60653067, 0.0, 0.81873075], atol=1e-6)
    assert np.mean(w * -np.array([1.0, -1.0, 2.0])) == pytest.approx(-(0.60653067 + 2 * 0.81873075) / 3, abs=1e-6)
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(1 / 3, abs=1e-6)


def test_fixture_mask_mode_k1(tmp_path):
    # constant rows δ = −1 (r ≈ 0.368) and +0.5 (r ≈ 1.649); token TIS U = 2 + token_k1 "0.5_2.0":
    # weights untouched by the filter, row 0 rejected whole, row 1 kept, masked fraction 0.5
    old = np.zeros((2, 5))
    rollout = np.array([[1.0] * 5, [-0.5] * 5])
    run, _ = one_call(tmp_path, old, rollout, config={"rollout_is": "token", "rollout_is_threshold": 2.0,
                                                     "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"})
    w = weights_of(run).sort(["sample_id", "pos"])
    assert w["is_weight"][0] == pytest.approx(0.368, abs=0.01) and w["is_weight"][5] == pytest.approx(1.649, abs=0.01)
    assert w["is_mask"].to_list() == [False] * 5 + [True] * 5
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5, abs=0.01)


def test_fixture_veto(tmp_path):
    # rollout log-prob +15 above the old one at [0, 2] (r ≈ 3e-7), veto 1e-4: row 0 rejected whole,
    # row 1 kept, row 0's weights still positive, 0 < veto fraction ≤ 1
    rng = np.random.default_rng(0)
    old = rng.normal(-1.0, 0.3, size=(2, 5))
    rollout = old + rng.normal(0, 0.01, size=(2, 5))
    rollout[0, 2] = old[0, 2] + 15.0
    run, _ = one_call(tmp_path, old, rollout, config={"level": "token", "mode": "truncate", "threshold": [0.5, 2.0],
                                                     "veto_lower": 1e-4})
    w = weights_of(run).sort(["sample_id", "pos"])
    m = w["is_mask"].to_numpy().reshape(2, 5)
    assert m[0].sum() == 0 and m[1].sum() > 0
    assert (w["is_weight"].to_numpy()[:5] > 0).all()
    g = grpolens.recompute(run, write=False).row(0, named=True)
    assert 0 < g["rollout_is/veto/seq_fraction"] <= 1


def test_fixture_seq_fraction_high_raw(tmp_path):
    # raw [[1, 6], [0.9, 1.1]], U = 2: seq_fraction_high from raw weights = 0.5 (verl)
    run, _ = one_call(tmp_path, np.zeros((2, 2)), -np.log([[1.0, 6.0], [0.9, 1.1]]),
                      config={"rollout_is": "token", "rollout_is_threshold": 2.0})
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_is_seq_fraction_high"] == pytest.approx(0.5)


def test_fixture_k1_inversion(tmp_path):
    # verl's k1 band is on π_rollout/π_train: "0.8_1.5" keeps IS ratios in [1/1.5, 1/0.8] = [0.667, 1.25]
    ratios = np.array([[0.6, 0.7, 1.2, 1.3]])
    run, _ = one_call(tmp_path, np.zeros((1, 4)), -np.log(ratios).reshape(1, 4),
                      config={"rs": "token_k1", "rs_threshold": "0.8_1.5"})
    assert weights_of(run)["is_mask"].to_list() == [False, True, True, False]


def test_rejection_filter_statistic_exactly_on_its_bound_is_kept(tmp_path):
    # verl keeps log lower <= k1 <= log upper and k2/k3 <= upper (its fraction_high counts
    # stat > up, fraction_low k1 < log lower). k1 = -δ: δ = 0 gives k1 = -0.0, exactly on log 1.0 = 0
    # as an upper bound ("0.5_1.0") and as a lower bound ("1.0_2.0"); a rollout log-prob one float32
    # step below / above the old one puts k1 just below / above 0.
    below = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    above = float(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    old, rollout = [[-1.0, -1.0, -1.0]], [[-1.0, below, above]]  # k1 = [-0.0, < 0, > 0]
    for band, kept in (("0.5_1.0", [True, True, False]), ("1.0_2.0", [True, False, True])):
        run, _ = one_call(tmp_path, old, rollout, config={"rs": "token_k1", "rs_threshold": band}, name=band)
        assert weights_of(run)["is_mask"].to_list() == kept, band
    # k2 = δ²/2: δ = 0.5 (old -1.0, rollout -1.5, exact in float32) gives exactly 0.125; one float32
    # step further gives more
    further = float(np.nextafter(np.float32(-1.5), np.float32(-2.0)))
    run, _ = one_call(tmp_path, [[-1.0, -1.0]], [[-1.5, further]], config={"rs": "token_k2", "rs_threshold": "0.125"},
                      name="k2")
    assert weights_of(run)["is_mask"].to_list() == [True, False]


def test_rejection_statistics_use_the_bounded_log_ratio(tmp_path):
    # the filters see δs = clip(δ, ±20): δ = -21 and +21 both give k2 = 20²/2 = 200, kept under an
    # upper bound of 210 (the unbounded 21²/2 = 220.5 would be rejected)
    run, _ = one_call(tmp_path, [[-22.0, -1.0]], [[-1.0, -22.0]], config={"rs": "token_k2", "rs_threshold": "210"})
    assert weights_of(run)["is_mask"].to_list() == [True, True]


# ---------------------------------------------------------------------------------------------
# --is-weights output equals the reference weights
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("level,mode", [("token", "both"), ("sequence", "icepop"), ("geometric", "truncate")])
def test_is_weights_output(tmp_path, level, mode):
    rng = np.random.default_rng(23)
    calls = random_calls(rng, spread=0.3, nonfinite=0.05)
    lo, hi = BANDS[level]
    ris = {"level": level, "mode": mode, "threshold": [lo, hi], "veto_threshold": [0.7, 1.4],
           "rs": "seq_max_k2", "rs_threshold": 0.05}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    from grpolens.cli import main

    main(["recompute", str(run), "--is-weights", "-q"])
    cfg = norm(ris)
    root = run / "grpolens" / "is_weights"
    assert json.loads((root / "config.json").read_text())["mode"] == mode
    for c in calls:
        r = ref_call(c, cfg)
        t = pl.read_parquet(root / f"step={c.step:08d}" / f"rank={c.rank:05d}.parquet")
        t = t.filter(pl.col("micro_batch") == c.micro_batch).sort(["sample_id", "pos"])
        rows = np.nonzero(c.valid)
        assert t["valid"].to_list() == r["V"][rows].tolist()
        v = r["V"][rows]
        np.testing.assert_allclose(t["is_weight_raw"].to_numpy()[v], r["w"][rows][v], rtol=1e-12)
        np.testing.assert_allclose(t["is_weight"].to_numpy()[v], r["a"][rows][v], rtol=1e-12)
        assert t["is_weight"].null_count() == (~v).sum()
        assert t["is_mask"].to_list() == r["keep"][rows].tolist()
    # the IS-weight histogram of every step sits next to metrics.parquet
    h = pl.read_parquet(run / "grpolens" / "is_hist.parquet")
    n_valid = sum(ref_call(c, cfg)["V"].sum() for c in calls if c.step == 0)
    assert h.filter((pl.col("step") == 0) & (pl.col("kind") == "raw"))["count"].sum() == n_valid
    assert h.filter((pl.col("step") == 0) & (pl.col("kind") == "applied"))["count"].sum() == n_valid


def test_is_weights_of_a_run_whose_later_rank_has_no_rollout_logprobs_say_so(tmp_path, capsys):
    """Rank 1 recorded no rollout_logp: rank 0's weights are written, and one line says which shards
    have none (the first shard has the column, so the command's early check passes)."""
    calls = random_calls(np.random.default_rng(5), spread=0.3)
    for c in calls:
        if c.rank == 1:
            c.rollout = None
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"level": "token", "mode": "truncate",
                                                                    "threshold": [0.5, 2.0]}})
    from grpolens.cli import main

    main(["recompute", str(run), "--is-weights", "-q"])
    root = run / "grpolens" / "is_weights"
    written = sorted(str(f.relative_to(root)) for f in root.rglob("*.parquet"))
    assert written == [f"step={s:08d}/rank=00000.parquet" for s in sorted({c.step for c in calls})]
    rank1 = sorted(str(s.path) for s in fmt.list_shards(run, fmt.TOKENS) if s.rank == 1)
    err = capsys.readouterr().err
    assert err.strip() == (f"warning: --is-weights: {len(rank1)} token shard(s) have no rollout_logp values, so "
                           f"their tokens have no IS weights (first: {rank1[0]})")


def test_is_hist_counts_weights_beyond_the_safety_bound_in_its_end_bins(tmp_path):
    # raw weights e^-30, e^0.5, e^30: bounded to e^∓20, the two extremes land in the lowest and the
    # highest bin (both are [e^-20, ...) and [..., e^20]), not outside the histogram; mode none: the
    # applied histogram is the same
    run, _ = one_call(tmp_path, [[-1.0, -1.0, -1.0]], [[29.0, -1.5, -31.0]], config={"level": "token", "mode": "none"})
    grpolens.recompute(run)
    h = pl.read_parquet(run / "grpolens" / "is_hist.parquet")
    for kind in ("raw", "applied"):
        k = h.filter((pl.col("kind") == kind) & (pl.col("hi") > 0)).sort("lo")
        assert k["lo"][0] == pytest.approx(np.exp(-20.0)) and k["hi"][-1] == pytest.approx(np.exp(20.0))
        inside = (k["lo"] <= np.exp(0.5)) & (k["hi"] > np.exp(0.5))
        assert (k["count"][0], k["count"][-1], k.filter(inside)["count"].to_list(), k["count"].sum()) == (1, 1, [1], 3)


def test_is_weights_follow_out(tmp_path):
    """With --out the weights go below it (OUT/is_weights/), the same files as without, none under RUN."""
    calls = random_calls(np.random.default_rng(5), spread=0.3)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"level": "token", "mode": "truncate", "threshold": [0.5, 2.0]}})
    from grpolens.cli import main

    main(["recompute", str(run), "--is-weights", "-q", "--out", str(tmp_path / "out")])
    got = tmp_path / "out" / "is_weights"
    assert not (run / "grpolens" / "is_weights").exists()
    main(["recompute", str(run), "--is-weights", "-q", "--full"])
    want = run / "grpolens" / "is_weights"
    names = sorted(p.relative_to(want).as_posix() for p in want.rglob("*") if p.is_file())
    assert "config.json" in names and len(names) > 1
    assert names == sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file())
    for n in names:
        if n.endswith(".parquet"):
            assert pl.read_parquet(got / n).equals(pl.read_parquet(want / n)), n


def test_is_weights_needs_rollout(tmp_path):
    from grpolens.analysis.is_weights import is_weight_writer

    run = write_run(tmp_path / "run", random_calls(np.random.default_rng(0), rollout=False))
    with pytest.raises(UserError, match="rollout_logp"):
        is_weight_writer(run)


# ---------------------------------------------------------------------------------------------
# Constant-offset diagnosis
# ---------------------------------------------------------------------------------------------

def test_constant_offset_diagnosis(tmp_path):
    rng = np.random.default_rng(29)
    calls = random_calls(rng, spread=0.03)
    for c in calls:
        shift_logprobs(c, 1.0)  # room below 0 for the raised rollout log-probs
        if c.step == 1:  # top-p 0.9 renormalisation: every rollout log-prob raised by −log S
            c.rollout = f32(c.rollout - np.log(rng.uniform(0.88, 0.93, size=c.rollout.shape)))
    res = grpolens.recompute(write_run(tmp_path / "run", calls), write=False, result=True)
    df = res.metrics
    assert df["mismatch/constant_offset"].to_list() == [0.0, 1.0]
    ref = ref_mismatch(calls, 1)
    assert within_histogram_bound(df["mismatch/delta_median"][1], ref["delta_median"])
    assert within_histogram_bound(df["mismatch/delta_iqr"][1], ref["delta_iqr"])
    assert any("constant train–rollout offset at step(s) 1" in n and "top-p" in n for n in res.notes)


@pytest.mark.parametrize("delta,agreement,quartiles,flag", [
    # δ = 0 is on neither side: 4 of 7 tokens share the median's sign, below 75 %: no offset
    ([-0.5, 0.0, 0.0, 0.3, 0.3, 0.3, 2.0], 4 / 7, (0.0, 0.3), 0.0),      # median 0.3
    ([0.5, 0.0, 0.0, -0.3, -0.3, -0.3, -2.0], 4 / 7, (-0.3, 0.0), 0.0),  # median -0.3
    ([-0.5, 0.3, 0.3, 0.3], 0.75, (-0.5, 0.3), 1.0),                     # exactly 75 % on its side
    ([-0.5, 0.0, 0.0, 0.3], 0.0, (-0.5, 0.0), 0.0),                      # median 0: no side agrees
])
def test_delta_sign_agreement_counts_the_median_side_only(tmp_path, delta, agreement, quartiles, flag):
    # one row; δ = old − rollout with old = −1. Quantiles are lower ones (sorted δ at floor(q·(n−1))).
    d = np.array([delta])
    run, _ = one_call(tmp_path, np.full(d.shape, -1.0), -1.0 - d)
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["mismatch/delta_sign_agreement"] == agreement
    assert got["mismatch/constant_offset"] == flag
    assert within_histogram_bound(got["mismatch/delta_median"], np.quantile(d, 0.5, method="lower"))
    q25, q75 = quartiles
    assert within_histogram_bound(got["mismatch/delta_iqr"], (q75, q25))


def test_sequence_filters_reduce_their_statistic_as_named(tmp_path):
    # k2 = δ²/2 per token. Row A: δ = [0.5, 0.5, 0.5] -> k2 sum 0.375, mean 0.125, max 0.125;
    # row B: δ = [1, 0, 0] -> sum 0.5, mean 1/6, max 0.5; row C: δ = [0.5, 0, 0] -> sum = max = 0.125,
    # mean 1/24. Each filter rejects its rows whole.
    old = np.full((3, 3), -1.0)
    rollout = old - np.array([[0.5, 0.5, 0.5], [1.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    for option, bound, kept in (("seq_sum_k2", "0.3", [False, False, True]),
                                ("seq_mean_k2", "0.15", [True, False, True]),
                                ("seq_max_k2", "0.3", [True, False, True])):
        run, _ = one_call(tmp_path, old, rollout, config={"rs": option, "rs_threshold": bound}, name=option)
        mask = weights_of(run).sort(["sample_id", "pos"])["is_mask"].to_numpy().reshape(3, 3)
        assert mask.all(1).tolist() == kept and (mask.any(1) == mask.all(1)).all(), option


def test_sequence_filters_use_their_own_statistic(tmp_path):
    # rows δ = A [-1, -1], B [1, 0], C [0.1, 0.1]; per token k1 = -δ, k2 = δ²/2, k3 = e^δ - 1 - δ:
    # δ = -1: k1 1, k2 0.5, k3 e^-1 = 0.368; δ = 1: k1 -1, k2 0.5, k3 e - 2 = 0.718; δ = 0.1: k3 0.0052.
    # seq_mean_k1 keeps log 0.5 <= mean k1 <= log 2 (±0.693): A's mean 1 is out, B's -0.5 and C's -0.1 in.
    # seq_max_k2 <= 0.6: every row (max 0.5, 0.5, 0.005); k3's maxima would put B out (0.718).
    # seq_sum_k3 <= 0.6: A (0.736) and B (0.718) out, C (0.0103) in; k2's sums would keep B (0.5).
    old = np.full((3, 2), -2.0)
    rollout = old - np.array([[-1.0, -1.0], [1.0, 0.0], [0.1, 0.1]])
    for option, bound, kept in (("seq_mean_k1", "0.5_2.0", [False, True, True]),
                                ("seq_max_k2", "0.6", [True, True, True]),
                                ("seq_sum_k3", "0.6", [False, False, True])):
        run, _ = one_call(tmp_path, old, rollout, config={"rs": option, "rs_threshold": bound}, name=option)
        mask = weights_of(run).sort(["sample_id", "pos"])["is_mask"].to_numpy().reshape(3, 2)
        assert mask.all(1).tolist() == kept and (mask.any(1) == mask.all(1)).all(), option


def test_veto_ratio_exactly_on_its_bound_is_kept(tmp_path):
    # the veto rejects a sequence with a raw ratio e^δ strictly outside [veto_lower, veto_upper]:
    # δ = 0 (ratio 1) is exactly on a bound of 1.0 and kept; one float32 step of the rollout
    # log-prob below / above the old one gives δ just above / below 0. One token per sequence.
    below = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    above = float(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    old, rollout = [[-1.0], [-1.0], [-1.0]], [[-1.0], [below], [above]]  # δ = [0, > 0, < 0]
    for side, kept in (("veto_lower", [True, True, False]), ("veto_upper", [True, False, True])):
        run, _ = one_call(tmp_path, old, rollout, config={"level": "token", "mode": "none", side: 1.0}, name=side)
        assert weights_of(run).sort("sample_id")["is_mask"].to_list() == kept, side


def _partials(**cols):
    """Merged per-sequence IS partials, every column 0 except those given (max columns -inf)."""
    from grpolens.functional.rollout_is import IS_MERGE

    n = len(next(iter(cols.values())))
    base = {k: np.full(n, -np.inf if rule == "max" else np.inf if rule == "min" else 0.0) for k, rule in IS_MERGE.items()}
    return {**base, **{k: np.asarray(v, float) for k, v in cols.items()}}


#: docs/metrics.md: the share-of-the-band metrics, computed only with an upper bound
BAND_METRICS = {"raw/fraction_high", "raw/fraction_low", "raw/seq_fraction_high", "raw/seq_fraction_low",
                "clamped/std", "clamped/ess"}
MASK_METRICS = {"mask/token_fraction", "mask/seq_fraction"}


@pytest.mark.parametrize("ris,absent", [
    ({"level": "token", "mode": "truncate", "threshold": [0.5, 2.0]}, MASK_METRICS | {"zeroed_fraction"}),
    ({"level": "token", "mode": "both", "upper": 2.0, "mask_threshold": [0.2, 5.0]}, {"zeroed_fraction"}),
    ({"level": "sequence", "mode": "icepop", "threshold": [0.5, 2.0]}, MASK_METRICS | {"truncated_fraction"}),
    ({"level": "geometric", "mode": "mask", "threshold": [0.5, 2.0]}, {"truncated_fraction", "zeroed_fraction"}),
    ({"level": "token", "veto_threshold": [1e-4, 1e4]}, BAND_METRICS | MASK_METRICS | {"truncated_fraction", "zeroed_fraction"}),
])
def test_canonical_summary_holds_exactly_the_documented_metrics(ris, absent):
    # every rollout_is/* metric docs/metrics.md lists, but those that do not apply to the config
    # (the band's without an upper bound, a mode's own fractions; batch_norm_factor is the verl
    # profile's), and nothing else: the applied weights' sequence summary has no band fractions
    from grpolens.functional.rollout_is import ISConfig, summarize

    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `rollout_is/([^`]+)` \|", docs, flags=re.M))
    assert {"raw/mean", "applied/seq_mean", "loss_mass_removed"} <= documented
    p = _partials(**{"ris.n": [2, 1], "ris.L": [0.4, -0.2], "ris.tw": [2.2, 0.8], "ris.tw2": [2.6, 0.64],
                     "ris.ta": [2.0, 0.8], "ris.ta2": [2.0, 0.64], "ris.adv": [2.0, 1.0]})
    got = summarize(p, ISConfig.from_cfg(norm(ris)))
    assert set(got) == documented - absent - {"batch_norm_factor"}


def test_a_summary_value_that_is_not_a_number_is_reported_as_null():
    # the IS and mismatch summaries of every profile report their values through is_weights._f: a
    # NaN (nothing to average) is reported as null, never as NaN
    from grpolens.functional.rollout_is import _f

    assert _f(np.float64(np.nan)) is None and _f(float("nan")) is None and _f(None) is None
    assert _f(np.float64(2.5)) == 2.5 and type(_f(np.float32(0.5))) is float


def test_sequence_max_filter_on_one_token_and_on_no_token():
    # seq_max_k2 <= 0.3: a sequence whose one valid token has k2 = 0.5 is rejected; a sequence
    # without a valid token (its max is the empty max, -inf) has statistic 0 and is not.
    from grpolens.functional.rollout_is import ISConfig, seq_view

    c = ISConfig.from_cfg(norm({"rs": "seq_max_k2", "rs_threshold": "0.3"}))
    p = _partials(**{"ris.n": [1, 0, 2], "ris.k2max": [0.5, -np.inf, 0.2]})
    sv = seq_view(p, c)
    assert sv.rs_rej.tolist() == [True, False, False]
    assert sv.rs_value["seq_max_k2"].tolist() == [0.5, 0.0, 0.2]


def test_weights_of_one_sequence_below_one(tmp_path):
    # one sequence, raw weights e^δ = [0.5, 0.25] (Σw² = 0.3125 < 1): mean 0.375, ESS (Σw)²/(N·Σw²)
    # = 0.5625 / 0.625 = 0.9; the sequence statistics are those of its one mean weight, and a
    # standard deviation of one value is undefined.
    run, _ = one_call(tmp_path, [[0.0, 0.0]], [-np.log([0.5, 0.25])])
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["rollout_is/raw/mean"] == pytest.approx(0.375, rel=1e-6)
    assert got["rollout_is/raw/ess"] == pytest.approx(0.9, rel=1e-6)
    assert got["rollout_is/raw/seq_mean"] == pytest.approx(0.375, rel=1e-6)
    assert got["rollout_is/raw/seq_max_deviation"] == pytest.approx(0.625, rel=1e-6)
    assert got["rollout_is/raw/seq_std"] is None


def test_sequence_mean_weight_exactly_on_a_band_bound_is_inside(tmp_path):
    # token weights [1, 1, e, e] (δ = 0 and 1), sequence mean weights [1, e]: 1.0 is exactly on the
    # upper bound of "0.5_1.0" and on the lower bound of "1.0_2.0", and counted in neither fraction,
    # of tokens or of sequences.
    old, rollout = [[-1.0, -1.0], [-1.0, -1.0]], [[-1.0, -1.0], [-2.0, -2.0]]
    for band, key, want in (("0.5_1.0", "fraction_high", 0.5), ("1.0_2.0", "fraction_low", 0.0)):
        run, _ = one_call(tmp_path, old, rollout, config={"rollout_is": "token", "rollout_is_threshold": band},
                          name=band)
        got = grpolens.recompute(run, write=False).row(0, named=True)
        assert (got[f"rollout_is/raw/seq_{key}"], got[f"rollout_is/raw/{key}"]) == (want, want), band


def test_verl_seq_std_of_one_sequence_is_zero(tmp_path):
    # verl: ``seq_mean_weights.std() if seq_mean_weights.numel() > 1 else 0.0``; a batch of one sequence
    run, _ = one_call(tmp_path, [[0.0, 0.0]], [-np.log([0.5, 0.25])], config={"rollout_is": "token", "rollout_is_threshold": 2.0})
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_is_seq_std"] == 0.0
    assert v["rollout_corr/rollout_is_seq_mean"] == pytest.approx(0.375, rel=1e-6)


def test_trl_truncate_without_clip_min_caps_only(tmp_path):
    # TRL's token_truncate without vllm_importance_sampling_clip_min: min(w, clip_max), no lower
    # bound. Raw weights [1, e] (δ = 0, 1), clip_max 2: applied [1, 2].
    run, _ = one_call(tmp_path, [[-1.0, -1.0]], [[-1.0, -2.0]],
                      config={"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0})
    assert weights_of(run).sort("pos")["is_weight"].to_list() == [1.0, 2.0]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_sampling_metrics_count_each_completion_once_and_log_an_empty_rank_as_zero(tmp_path, level):
    """TRL computes ``sampling/*`` once per generated completion, on each rank: a completion trained
    on in two loss calls counts once. A rank without a completion token logs 0.0 (the
    ``numel() > 0`` guards of ``GRPOTrainer._generate_and_score_completions``), and the gather
    takes it: into the mean over ranks, and into ``nanmin`` at token level (at sequence level the
    empty completion's ratio is e^0 = 1).

    rank 0: completion 0 (δ = 0.1, −0.2, 0.3) in two loss calls, completion 1 of one token (δ = 0.5:
    the step's largest |δ| and ratio); rank 1: every token masked; rank 2: one token (δ = −0.4)."""
    roll = -1.0
    deltas = {0: [0.1, -0.2, 0.3], 1: [0.5], 2: [0.0, 0.0], 3: [-0.4]}

    def call(rank, mb, ids, masked=True):
        T = max(len(deltas[i]) for i in ids)
        lengths = np.array([len(deltas[i]) for i in ids])
        old = np.full((len(ids), T), roll)
        for r, i in enumerate(ids):
            old[r, :lengths[r]] += deltas[i]
        mask = (np.arange(T)[None, :] < lengths[:, None]) & masked
        return LossCall(0, rank, mb, np.array(ids), lengths, f32(old), mask, f32(np.ones(len(ids))), old=f32(old),
                        rollout=f32(np.full(old.shape, roll)))

    calls = [call(0, 0, [0, 1]), call(0, 1, [0]), call(1, 0, [2], masked=False), call(2, 0, [3])]
    cfg = {"vllm_importance_sampling_mode": f"{level}_truncate", "vllm_importance_sampling_clip_min": 0.5,
           "vllm_importance_sampling_clip_max": 2.0}
    row = grpolens.recompute(write_run(tmp_path / "run", calls, config={"rollout_is": cfg}), profile="trl",
                             write=False).row(0, named=True)
    # δ as written (float32 log-probs), each completion once
    d = {i: (np.float32(roll + np.float32(x)) - np.float32(roll)).astype(np.float64)
         for i, x in ((i, np.array(v)) for i, v in deltas.items())}
    per_rank = {0: np.concatenate([d[0], d[1]]), 1: np.array([]), 2: d[3]}
    means = [np.abs(x).mean() if len(x) else 0.0 for x in per_rank.values()]
    assert close(row["sampling/sampling_logp_difference/mean"], np.mean(means))
    assert close(row["sampling/sampling_logp_difference/max"], abs(d[1][0]))
    if level == "token":
        ratios = {r: np.exp(x) for r, x in per_rank.items()}  # all inside [0.5, 2]
    else:
        ratios = {0: np.exp([d[0].sum(), d[1].sum()]), 1: np.array([1.0]), 2: np.exp(d[3])}
    stat = lambda fn: [fn(x) if len(x) else 0.0 for x in ratios.values()]  # noqa: E731
    assert close(row["sampling/importance_sampling_ratio/min"], min(stat(np.min)))
    assert close(row["sampling/importance_sampling_ratio/mean"], np.mean(stat(np.mean)))
    assert close(row["sampling/importance_sampling_ratio/max"], np.exp(d[1][0]))
    if level == "token":
        assert row["sampling/importance_sampling_ratio/min"] == 0.0


def test_verl_weight_statistics_of_one_and_of_two_tokens(tmp_path):
    # verl TIS (threshold 2.0: w' = clamp(w, 0, 2)), the whole step one batch. One token of δ = −20:
    # std 0 (verl's Σm > 1 guard), ESS 1/mm((w/(mm(w) + 1e-8))²) = ((w + 1e-8)/w)² with w = e^−20
    # (the guard dominates a vanishing weight). Two tokens of weights 1 and 1/2: mean 3/4, population
    # std 1/4, ESS (3/4)²/((1 + 1/4)/2) = 0.9.
    verl = {"rollout_is": "token", "rollout_is_threshold": 2.0}
    one, _ = one_call(tmp_path, [[-21.0]], [[-1.0]], config=verl, name="one")
    two, c = one_call(tmp_path, [[-1.0, -1.0 - np.log(2.0)]], [[-1.0, -1.0]], config=verl, name="two")
    r1 = grpolens.recompute(one, profile="verl", write=False).row(0, named=True)
    w = np.exp(-20.0)
    assert close(r1["rollout_corr/rollout_is_mean"], w)
    assert r1["rollout_corr/rollout_is_std"] == 0.0
    assert close(r1["rollout_corr/rollout_is_eff_sample_size"], ((w + 1e-8) / w) ** 2, rel=1e-6)
    r2 = grpolens.recompute(two, profile="verl", write=False).row(0, named=True)
    ws = np.exp(c.old[0] - c.rollout[0])  # the float32 log-probs as written: 1 and ~1/2
    m = ws.mean()
    assert close(r2["rollout_corr/rollout_is_mean"], m)
    assert close(r2["rollout_corr/rollout_is_std"], np.sqrt((ws * ws).mean() - m * m), rel=1e-6)
    assert close(r2["rollout_corr/rollout_is_eff_sample_size"], 1 / ((ws / (m + 1e-8)) ** 2).mean(), rel=1e-6)
    assert r2["rollout_corr/rollout_is_std"] == pytest.approx(0.25, rel=1e-6)


@pytest.mark.parametrize("band,high,low", [("0.5_1.0", 1 / 3, 0.0), ("1.0_2.0", 0.0, 1 / 3)])
def test_verl_sequence_weight_exactly_on_a_band_bound_is_inside(tmp_path, band, high, low):
    # sequence level, rows δ = [0, 0] (L = 0, raw weights 1, their mean s = 1), [0.5, 0] (L = 0.5,
    # s = (e^0.5 + 1)/2) and [−0.25, −0.25] (L = −0.5, s = e^−0.25): the first row sits exactly on a
    # bound of 1.0 (log 1 = 0) and is inside it, for the log-space ratio fractions and for the seq
    # fractions of the rows' mean raw weight; the others are beyond 1.0 and inside [0.5, 2]
    run, _ = one_call(tmp_path, [[-1.0, -1.0], [-0.5, -1.0], [-1.25, -1.25]], [[-1.0, -1.0]] * 3,
                      config={"rollout_is": "sequence", "rollout_is_threshold": band})
    row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert row["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(high)
    assert row["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(low)
    assert row["rollout_corr/rollout_is_seq_fraction_high"] == pytest.approx(high)
    assert row["rollout_corr/rollout_is_seq_fraction_low"] == pytest.approx(low)


def test_verl_profile_of_a_band_without_lower_bound_and_of_every_weight_zeroed(tmp_path):
    # a run configured with grpolens' own keys and no lower bound (verl's float threshold always
    # sets 1/U): under the verl profile the low fractions are 0.0, nothing below a bound not set
    old, roll = [[-1.0, -1.0], [-1.6, -1.2]], [[-1.0, -1.0]] * 2
    for level in ("token", "sequence"):
        run, _ = one_call(tmp_path, old, roll, name=level,
                          config={"level": level, "mode": "truncate_upper", "upper": 2.0})
        row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
        assert row["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0
        assert row["rollout_corr/rollout_is_seq_fraction_low"] == 0.0
        assert row["rollout_corr/rollout_is_mean"] is not None
    # IcePop zeroing every token: applied weights all 0, so Σw² = 0 and verl's ESS 1/mm(ŵ²) divides
    # by zero (a ZeroDivisionError in verl): null here, never inf
    run, _ = one_call(tmp_path, [[-0.5, -0.5]], [[-1.0, -1.0]], name="zeroed",
                      config={"rollout_is": "token", "rollout_is_threshold": "0.5_1.2"})
    row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert row["rollout_corr/rollout_is_mean"] == 0.0
    assert row["rollout_corr/rollout_is_eff_sample_size"] is None
    # with batch normalisation: a mean of 0 is not above 1e-8, so verl leaves the weights as they are (factor 1.0)
    run, _ = one_call(tmp_path, [[-0.5, -0.5]], [[-1.0, -1.0]], name="zeroed_bn",
                      config={"rollout_is": "token", "rollout_is_threshold": "0.5_1.2", "rollout_is_batch_normalize": True})
    assert grpolens.recompute(run, profile="verl", write=False)["rollout_corr/rollout_is_batch_norm_factor"][0] == 1.0
    # configured without an IS band (rejection filters only): the mismatch and rollout_rs metrics, no IS statistic
    run, _ = one_call(tmp_path, old, roll, name="rs",
                      config={"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"})
    row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert row["rollout_corr/rollout_is_mean"] is None and row["rollout_corr/rollout_rs_masked_fraction"] is not None


def test_xtuner_pack_of_one_token_reports_its_mismatch(tmp_path):
    # xtuner's compute_mismatch_metrics treats the pack as one row, whatever its number of tokens:
    # one valid token, log π_train = -1, log π_rollout = -1.5 (δ = 0.5): training log-PPL 1,
    # rollout log-PPL 1.5, k1 = mean(log π_rollout − log π_train) = -0.5, k3 = e^0.5 − 0.5 − 1,
    # log-PPL difference lr − lo = -0.5
    run, _ = one_call(tmp_path, [[-1.0]], [[-1.5]], config={"rollout_is_threshold": [2.0, 0.5]})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    want = {"mismatch_training_log_ppl": 1.0, "mismatch_training_ppl": np.e, "mismatch_rollout_log_ppl": 1.5,
            "mismatch_rollout_ppl": np.exp(1.5), "mismatch_kl": -0.5, "mismatch_k3_kl": np.exp(0.5) - 1.5,
            "mismatch_log_ppl_diff": -0.5, "mismatch_log_ppl_abs_diff": 0.5, "mismatch_log_ppl_diff_max": -0.5,
            "mismatch_log_ppl_diff_min": -0.5, "mismatch_ppl_ratio": np.exp(-0.5), "mismatch_logprob_abs_diff": 0.5}
    assert {k: xt["mismatch/" + k] for k in want} == pytest.approx(want, rel=1e-6)


def test_xtuner_without_an_is_threshold_logs_only_the_mismatch(tmp_path):
    # xtuner computes no IS weight metrics without rollout_is_threshold (a lone veto, written the
    # canonical way so that the config keeps it): its mismatch metrics only
    run, _ = one_call(tmp_path, [[-1.0, -1.0]], [[-1.5, -1.2]], config={"veto_upper": 10.0})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    assert xt["mismatch/mismatch_kl"] == pytest.approx(-0.35, rel=1e-6)
    assert all(v is None for k, v in xt.items() if k.startswith("mismatch/rollout_is_")), xt


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_xtuner_pack_without_a_lower_bound(tmp_path, level):
    # a config with an upper bound only (xtuner itself always has both; grpolens' canonical config
    # may not), one pack: row A δ = [1, 1], row B δ = [-1]. Sequence level X = [2, -1], geometric
    # X = [1, -1]; upper 2: no row is below a missing lower bound, and the clamp for the spread
    # has no floor: w' = min(e^X, 2), token-weighted over the pack's 3 tokens.
    run, _ = one_call(tmp_path, [[-1.0, -1.0], [-1.0, -1.0]], [[-2.0, -2.0], [0.0, -9.0]],
                      mask=np.array([[True, True], [True, False]]),
                      config={"level": level, "mode": "truncate", "upper": 2.0})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    X = np.array([2.0, -1.0]) if level == "sequence" else np.array([1.0, -1.0])
    n = np.array([2, 1])
    wc = np.minimum(np.exp(X), 2.0)
    mean, sq = (n * wc).sum() / 3, (n * wc * wc).sum() / 3
    assert xt["mismatch/rollout_is_ratio_fraction_low"] == 0.0
    high = 0.5 if level == "sequence" else 2 / 3  # sequence level: a share of rows; geometric: of tokens
    assert xt["mismatch/rollout_is_ratio_fraction_high"] == pytest.approx(high)
    assert xt["mismatch/rollout_is_std"] == pytest.approx(np.sqrt(sq - mean ** 2), rel=1e-6)
    assert xt["mismatch/rollout_is_seq_fraction_low"] == 0.0


def test_sequence_holding_both_infinite_log_ratios_is_left_out_whole(tmp_path):
    # row A: δ = [+inf, -inf, 0.1] has no defined Σδ: its three tokens are undefined; row B's lone
    # +inf stays in (weight e^20); row C's third token is masked out, so neither valid nor undefined
    old = [[-1.0, -np.inf, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    rollout = [[-np.inf, -1.0, -1.1], [-np.inf, -1.0, -1.0], [-1.2, -1.3, -1.1]]
    mask = np.array([[True, True, True], [True, True, True], [True, True, False]])
    run, _ = one_call(tmp_path, old, rollout, mask=mask, config={"level": "token", "mode": "none"})
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert (got["rollout_is/valid_tokens"], got["rollout_is/undefined_tokens"]) == (5.0, 3.0)
    w = weights_of(run).sort(["sample_id", "pos"])
    assert w["valid"].to_list() == [False] * 3 + [True] * 3 + [True, True, False]


def test_loss_mass_removed_counts_a_non_finite_advantage_as_zero(tmp_path):
    # one token per sequence, veto_upper 10: sequence 0 (w = 20, |A| = 2) is vetoed; sequence 1's
    # advantage is NaN (|A| counted as 0), sequence 2's is 1: removed mass 2 / (2 + 0 + 1)
    run, _ = one_call(tmp_path, [[-1.0], [-1.0], [-1.0]], [[-1.0 - np.log(20.0)], [-1.0], [-1.0]],
                      adv=[2.0, np.nan, 1.0], config={"level": "token", "mode": "none", "veto_upper": 10.0})
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["rollout_is/veto/seq_fraction"] == pytest.approx(1 / 3)
    assert got["rollout_is/loss_mass_removed"] == pytest.approx(2 / 3)


def test_log_weight_exactly_on_the_safety_bound_is_not_beyond_it(tmp_path):
    # the ±20 bound counts |X| > 20. δ rows [20, 0], [10, 10], [21, 0]: at token level only the 21
    # is beyond (1 of 6 tokens); at sequence level X = Σδ = [20, 20, 21], only the last sequence
    # (2 of 6 tokens); at geometric level X = [10, 10, 10.5], none
    old, rollout = np.zeros((3, 2)), -np.array([[20.0, 0.0], [10.0, 10.0], [21.0, 0.0]])
    for level, want in (("token", 1 / 6), ("sequence", 2 / 6), ("geometric", 0.0)):
        run, _ = one_call(tmp_path, old, rollout, config={"level": level, "mode": "none"}, name=level)
        got = grpolens.recompute(run, write=False).row(0, named=True)
        assert got["rollout_is/safety_bound_fraction"] == pytest.approx(want), level


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_xtuner_row_weight_exactly_on_a_band_bound_is_inside(tmp_path, level):
    # xtuner counts X > log upper and X < log lower (strictly): rows with δ = 0 everywhere have
    # X = 0 = log 1.0, exactly on the upper bound of [0.5, 1.0] and on the lower bound of
    # [1.0, 2.0]; the other row (δ = 1) is above both bands
    old, rollout = [[-1.0, -1.0], [-1.0, -1.0]], [[-1.0, -1.0], [-2.0, -2.0]]
    for band, key, want in (([1.0, 0.5], "rollout_is_ratio_fraction_high", 0.5),
                            ([2.0, 1.0], "rollout_is_ratio_fraction_low", 0.0)):
        run, _ = one_call(tmp_path, old, rollout, name=f"{level}-{band[1]}",
                          config={"rollout_is_level": level, "rollout_is_mode": "truncate", "rollout_is_threshold": band})
        xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
        assert xt["mismatch/" + key] == want, band


def test_xtuner_clamped_spread_of_a_two_token_pack(tmp_path):
    # xtuner: std of the clamped weights when the pack has more than one token. Weights 0.5 and
    # 0.25 inside [0.1, 2]: population std 0.125; ESS = mean² / mean of squares = 0.140625 / 0.15625
    run, _ = one_call(tmp_path, [[0.0, 0.0]], [-np.log([0.5, 0.25])], config={"rollout_is_threshold": [2.0, 0.1]})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    assert xt["mismatch/rollout_is_std"] == pytest.approx(0.125, rel=1e-6)
    assert xt["mismatch/rollout_is_eff_sample_size"] == pytest.approx(0.9, rel=1e-6)


def test_xtuner_ess_of_vanishing_weights_keeps_the_reference_guard(tmp_path):
    # xtuner's ESS divides the weights by (mean + 1e-8) before squaring: for one token of weight
    # w = e^-20 (lower bound 0, so nothing clamps it up) that is ((w + 1e-8) / w)², about 34, not 1
    run, _ = one_call(tmp_path, [[-21.0]], [[-1.0]], config={"rollout_is_threshold": [2.0, 0.0]})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    w = np.exp(-20.0)
    assert xt["mismatch/rollout_is_eff_sample_size"] == pytest.approx(((w + 1e-8) / w) ** 2, rel=1e-6)


def test_sequence_log_weight_exactly_on_a_band_bound_is_inside(tmp_path):
    # sequence level, δ rows [0.5, -0.5] (X = 0, exactly log 1.0) and [-0.25, -0.25] (X = -0.5):
    # the token fractions count X > log upper and X < log lower strictly
    old, rollout = np.zeros((2, 2)), -np.array([[0.5, -0.5], [-0.25, -0.25]])
    for band, key, want in (([0.5, 1.0], "fraction_high", 0.0), ([1.0, 2.0], "fraction_low", 0.5)):
        run, _ = one_call(tmp_path, old, rollout, config={"level": "sequence", "mode": "truncate", "threshold": band},
                          name=f"band-{band[0]}")
        got = grpolens.recompute(run, write=False).row(0, named=True)
        assert got[f"rollout_is/raw/{key}"] == want, band
    # no lower bound: no fraction_low, and the clamped weights are clip(w, 0, upper) = [1, e^-0.5]
    # per token: population std (1 - e^-0.5) / 2
    run, _ = one_call(tmp_path, old, rollout, config={"level": "sequence", "mode": "truncate_upper", "upper": 2.0},
                      name="upper-only")
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["rollout_is/raw/fraction_low"] is None
    assert got["rollout_is/clamped/std"] == pytest.approx((1 - np.exp(-0.5)) / 2, rel=1e-6)


def test_a_configs_own_top_level_mode_or_level_key_is_not_read_as_the_is_settings():
    """A run config may hold keys of the user's own (``mode: "train"``); only ``rollout_is`` holds
    the IS settings, configured or not."""
    from grpolens.functional.rollout_is import ISConfig

    band = {"level": "token", "mode": "truncate", "threshold": [0.5, 2.0]}
    configured = check_config({**CONFIG_DEFAULTS, "rollout_is": band})
    for extra in ({"mode": "train"}, {"level": "sequence"}, {"mode": "train", "level": "sequence"}):
        got = ISConfig.from_cfg(check_config({**CONFIG_DEFAULTS, "rollout_is": band, **extra}))
        assert (got.level, got.mode, got.lower, got.upper, got.configured) == ("token", "truncate", 0.5, 2.0, True)
        assert got == ISConfig.from_cfg(configured)
        assert ISConfig.from_cfg(check_config({**CONFIG_DEFAULTS, **extra})) == ISConfig()
    # the mapping alone still reads as itself
    assert ISConfig.from_cfg(configured["rollout_is"]) == ISConfig.from_cfg(configured)
