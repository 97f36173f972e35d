"""The rollout IS reference the rollout-IS tests share.

It re-implements the published algorithm (xtuner's port of verl's mismatch helper, newest verl,
TRL's vLLM correction) token by token on padded (B, T) loss calls, in plain numpy, without
grpolens' partials; runs are written with the plain pyarrow writer of refdata. Also the helpers
that write a one-call run and read its ``--is-weights`` output.
"""

import numpy as np
import polars as pl

import grpolens
from grpolens.run.config import check_config
from grpolens.run.format import CONFIG_DEFAULTS

from tests.refdata import LossCall, f32, write_run


S = 20.0


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


BANDS = {"token": (0.9, 1.1), "sequence": (0.75, 1.3), "geometric": (0.95, 1.05)}


MODES = ("none", "truncate", "truncate_upper", "mask", "both", "icepop")


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


def _partials(**cols):
    """Merged per-sequence IS partials, every column 0 except those given (max columns -inf)."""
    from grpolens.functional.rollout_is import IS_MERGE

    n = len(next(iter(cols.values())))
    base = {k: np.full(n, -np.inf if rule == "max" else np.inf if rule == "min" else 0.0) for k, rule in IS_MERGE.items()}
    return {**base, **{k: np.asarray(v, float) for k, v in cols.items()}}
