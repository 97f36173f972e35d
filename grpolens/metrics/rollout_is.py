"""Rollout importance sampling and train–inference mismatch (family ``rollout_is``).

Formulas live in :mod:`grpolens.functional.is_weights` (weights, modes, veto, rejection filters) and in the
``mismatch`` producer below (KL, perplexities, χ²); this module registers the partials, the step
summaries and the metrics. The per-step visitors (exact Δ quantiles, rejection-filter partials,
IS-weight histograms, the ``--is-weights`` writer) are in :mod:`grpolens.metrics.rollout_is_visitors`;
the constant-offset note of ``recompute`` in :mod:`grpolens.analysis.offset`.

Aggregation per profile (names change, and the grouping each trainer uses; never a formula):

``grpolens``  pooled over the step: token fractions over valid tokens, sequence summaries over
              sequences with a valid token; ``None`` when there is nothing to average.
``xtuner``    the reference's per-*pack* (rank, micro_batch) values -- the mismatch metrics treat a
              pack as one row -- then the mean over valid packs, max/min for keys naming max/min,
              0.0 when no pack is valid (as ``merge_rollout_is_metrics``).
``verl``      newest verl: one computation over the global batch (the step); sequence summaries
              over *all* rows (an empty row counts as 0), IS statistics on applied weights.
``trl``       ``sampling/*``: per rank (each completion once), then the plain mean over ranks
              (min/max for the extremes); sequence modes average over sequences.
"""

from __future__ import annotations

import numpy as np

from grpolens.functional import is_weights as ris
from grpolens.metrics.batch import TokenBatch
from grpolens.run.config import RS_OPTIONS
from grpolens.metrics.partials import producer
from grpolens.metrics.registry import Family, Metric, register, register_family
from grpolens.functional.is_weights import ISConfig, SAFETY_BOUND

FAMILY = "rollout_is"
REQ = ("rollout_logp",)

#: constant-offset diagnosis: |median Δ| at least this many nats, and at least this share of
#: tokens on the median's side of 0 (bf16 noise is symmetric around 0; a temperature or
#: truncated-support mismatch shifts almost every token the same way)
OFFSET_MIN_NATS = 0.01
OFFSET_MIN_AGREEMENT = 0.75

#: the visitors (:mod:`grpolens.metrics.rollout_is_visitors`) whose per-step pieces the summaries read
DELTA_VISITOR = "rollout_is.delta"
RS_VISITOR = "rollout_is.rs"


def batch_inputs(b: TokenBatch) -> ris.Inputs:
    """δ and valid tokens of a batch, computed once and shared by every visitor of the pass."""
    x = b.__dict__.get("_rollout_is_inputs")
    if x is None:
        x = b.__dict__["_rollout_is_inputs"] = ris.inputs(b)
    return x


def batch_partials(b: TokenBatch, c: ISConfig) -> dict[str, np.ndarray]:
    """The batch's IS partials under ``c`` (the producer's, when it ran with the same config)."""
    hit = b.__dict__.get("_rollout_is_partials")
    if hit is not None and hit[0] == c:
        return hit[1]
    p = ris.sequence_partials(b, batch_inputs(b), c)
    b.__dict__["_rollout_is_partials"] = (c, p)
    return p


def batch_token_weights(b: TokenBatch, c: ISConfig) -> dict[str, np.ndarray]:
    return ris.token_weights(b, c, batch_inputs(b), batch_partials(b, c))


def batch_valid_weights(b: TokenBatch, c: ISConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return ris.valid_token_weights(b, c, batch_inputs(b), batch_partials(b, c))


# ---------------------------------------------------------------------------------------------
# Producers
# ---------------------------------------------------------------------------------------------

@producer("rollout_is", merge=ris.IS_MERGE, requires=REQ, families=(FAMILY,))
def _is_partials(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    return batch_partials(b, ISConfig.from_cfg(cfg))


MM_MERGE = {"mm.n": "sum", "mm.old": "sum", "mm.roll": "sum", "mm.d": "sum", "mm.absd": "sum",
            "mm.absdmax": "max", "mm.k3": "sum", "mm.chi": "sum"}


def _mismatch_partials(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    """Over masked tokens (before the trainer's rejection: :attr:`TokenBatch.pre_rejection_mask`) whose two log-probs are finite: Σ log π_train, Σ log π_rollout, Σδ, Σ|δ|,
    max|δ|, Σ(e^δ − δ − 1) (k3, unbounded as in the reference) and Σ e^(2·clip(δ, ±20)) (χ²)."""
    old, roll = b.old, b.cols["rollout_logp"]
    s = ris.Segments(b, b.pre_rejection_mask & np.isfinite(old) & np.isfinite(roll))
    o, r = old[s.idx], roll[s.idx]
    d = o - r
    ad = np.abs(d)
    with np.errstate(over="ignore"):
        k3 = np.expm1(d) - d
    return {"mm.n": s.n, "mm.old": s.sum(o), "mm.roll": s.sum(r), "mm.d": s.sum(d), "mm.absd": s.sum(ad),
            "mm.absdmax": s.max(ad), "mm.k3": s.sum(k3),
            "mm.chi": s.sum(np.exp(2.0 * np.clip(d, -SAFETY_BOUND, SAFETY_BOUND)))}


# Registered by a call, not as a decorator: mutmut skips decorated functions (docs/mutation-testing.md).
producer("mismatch", merge=MM_MERGE, requires=REQ, families=(FAMILY,))(_mismatch_partials)


# ---------------------------------------------------------------------------------------------
# Step summaries per profile
# ---------------------------------------------------------------------------------------------

def _seqs(sd) -> dict[str, np.ndarray] | None:
    return sd.seqs if "ris.n" in sd.seqs and "mm.n" in sd.seqs else None


def mismatch_rows(p: dict, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-row mean log-probs (0 for a row without tokens, like the reference's masked mean)."""
    nf = ris._col(p, "mm.n")
    lo = np.nan_to_num(ris._div(ris._col(p, "mm.old"), nf))
    lr = np.nan_to_num(ris._div(ris._col(p, "mm.roll"), nf))
    return {"nf": nf, "lo": lo, "lr": lr, "d": lr - lo}


def mismatch_summary(p: dict, all_rows: bool = False) -> dict[str, float | None]:
    """Mismatch metrics over token rows ``p`` (one row per sequence, or per pack): KL k1/k3, |δ|,
    perplexities, log-PPL differences, χ². Row statistics over rows with a token, or every row
    (``all_rows``: verl, where an empty row has PPL 1 and difference 0)."""
    r = mismatch_rows(p)
    nf = r["nf"]
    N = nf.sum()
    if N == 0:
        return {}
    sel = np.ones(len(nf), dtype=bool) if all_rows else nf > 0
    lo, lr, d = r["lo"][sel], r["lr"][sel], r["d"][sel]
    f = ris._f
    seq_d = ris._col(p, "mm.d")[sel]
    with np.errstate(over="ignore"):
        return {
            "mismatch/kl_k1": f(-ris._col(p, "mm.d").sum() / N), "mismatch/kl_k3": f(ris._col(p, "mm.k3").sum() / N),
            "mismatch/abs_logp_diff": f(ris._col(p, "mm.absd").sum() / N),
            "mismatch/abs_logp_diff_max": f(ris._col(p, "mm.absdmax")[nf > 0].max()),
            "mismatch/training_ppl": f(np.exp(-lo).mean()), "mismatch/training_log_ppl": f((-lo).mean()),
            "mismatch/rollout_ppl": f(np.exp(-lr).mean()), "mismatch/rollout_log_ppl": f((-lr).mean()),
            "mismatch/log_ppl_diff": f(d.mean()), "mismatch/log_ppl_abs_diff": f(np.abs(d).mean()),
            "mismatch/log_ppl_diff_max": f(d.max()), "mismatch/log_ppl_diff_min": f(d.min()),
            "mismatch/ppl_ratio": f(np.exp(d).mean()),
            "mismatch/chi2_token": f(ris._col(p, "mm.chi").sum() / N - 1.0),
            "mismatch/chi2_seq": f(np.exp(2.0 * np.clip(seq_d, -SAFETY_BOUND, SAFETY_BOUND)).mean() - 1.0),
        }


def canonical_summary(sd) -> dict[str, float | None]:
    p = _seqs(sd)
    if p is None:
        return {}
    c = ISConfig.from_cfg(sd.cfg)
    out = {f"rollout_is/{k}": v for k, v in ris.summarize(p, c).items()}
    out.update(mismatch_summary(p))
    pieces = sd.extra.get("pieces") or {}
    dq = pieces.get(DELTA_VISITOR)
    if dq and dq.get("n"):
        out.update({"mismatch/delta_median": dq["median"], "mismatch/delta_iqr": dq["iqr"],
                    "mismatch/delta_sign_agreement": dq["agreement"], "mismatch/constant_offset": dq["flag"]})
    out.update(pieces.get(RS_VISITOR) or {})
    return out


def _sub(p: dict, idx: np.ndarray) -> dict[str, np.ndarray]:
    return {k: np.asarray(v)[idx] for k, v in p.items()}


def xtuner_pack(p: dict, c: ISConfig) -> tuple[dict, dict]:
    """The reference's values for one pack: (mismatch dict or {} if invalid, IS dict or {})."""
    f = ris._f
    mm: dict[str, float | None] = {}
    nf = ris._col(p, "mm.n").sum()
    if nf > 0:  # the pack is one row: token means over the whole pack
        lo, lr = ris._col(p, "mm.old").sum() / nf, ris._col(p, "mm.roll").sum() / nf
        d = lr - lo
        mm = {"mismatch/training_ppl": f(np.exp(-lo)), "mismatch/training_log_ppl": f(-lo),
              "mismatch/rollout_ppl": f(np.exp(-lr)), "mismatch/rollout_log_ppl": f(-lr),
              "mismatch/kl_k1": f(-ris._col(p, "mm.d").sum() / nf), "mismatch/kl_k3": f(ris._col(p, "mm.k3").sum() / nf),
              "mismatch/log_ppl_diff": f(d), "mismatch/log_ppl_abs_diff": f(abs(d)),
              "mismatch/log_ppl_diff_max": f(d), "mismatch/log_ppl_diff_min": f(d),
              "mismatch/ppl_ratio": f(np.exp(d)), "mismatch/abs_logp_diff": f(ris._col(p, "mm.absd").sum() / nf)}
    if not (c.configured and c.has_band):
        return mm, {}
    sv = ris.seq_view(p, c)
    n = sv.n
    N = n.sum()
    if N == 0:
        return mm, {}
    col = lambda name: ris._col(p, name)  # noqa: E731
    ok = n > 0
    U, Lo = c.upper, c.lower
    logU = np.log(U)
    with np.errstate(divide="ignore"):
        logLo = np.log(Lo) if Lo is not None else -np.inf
    o: dict[str, float | None] = {
        "veto/seq_fraction": f(np.sum(sv.vetoed & ok) / ok.sum()),
        "veto/catastrophic_token_fraction": f(col("ris.cat").sum() / N),
    }
    if c.level == "token":
        w_sum = col("ris.tw").sum()
        o["raw/max"], o["raw/min"] = f(col("ris.twmax")[ok].max()), f(col("ris.twmin")[ok].min())
        o["raw/fraction_high"], o["raw/fraction_low"] = f(col("ris.thi").sum() / N), f(col("ris.tlo").sum() / N)
        c1, c2 = col("ris.tc").sum(), col("ris.tc2").sum()
    else:
        X = sv.X  # every row of the pack, empty ones included (their X is 0)
        w_sum = (n * sv.w).sum()
        o["raw/max"], o["raw/min"] = f(np.exp(min(X.max(), SAFETY_BOUND))), f(np.exp(X.min()))
        if c.level == "sequence":
            o["raw/fraction_high"], o["raw/fraction_low"] = f(np.mean(X > logU)), f(np.mean(X < logLo))
        else:
            o["raw/fraction_high"], o["raw/fraction_low"] = f((n * (X > logU)).sum() / N), f((n * (X < logLo)).sum() / N)
        cw = np.clip(sv.w, Lo or 0.0, U)
        c1, c2 = (n * cw).sum(), (n * cw * cw).sum()
    o["raw/mean"] = f(w_sum / N)
    m = c1 / N
    o["clamped/std"] = float(np.sqrt(max(0.0, c2 / N - m * m))) if N > 1 else 0.0
    o["clamped/ess"] = f(1.0 / ((c2 / N) / (m + 1e-8) ** 2))
    ris._seq_stats(sv.w[ok], Lo, U, "raw/", o, undefined=0.0)
    if c.masks:
        if c.level == "token":
            o["mask/token_fraction"] = f(col("ris.tband").sum() / N)
            o["mask/seq_fraction"] = f(np.mean(col("ris.tband") > 0))  # over every row of the pack
        else:
            o["mask/token_fraction"] = f((n * sv.band_rej).sum() / N)
            o["mask/seq_fraction"] = f(np.mean(sv.band_rej))
    return mm, {f"rollout_is/{k}": v for k, v in o.items()}


def xtuner_summary(sd) -> dict[str, float | None]:
    p = _seqs(sd)
    if p is None:
        return {}
    c = ISConfig.from_cfg(sd.cfg)
    g, ng = sd.groups(("rank", "micro_batch"))
    mms, iss = [], []
    for k in range(ng):
        mm, o = xtuner_pack(_sub(p, g == k), c)
        mms.append(mm)
        iss.append(o)
    out: dict[str, float | None] = {}
    # what the profile logs of each part, and how packs merge: by its names (max/min/mean)
    logged = sd.profile.names
    mm_keys = {k: v for k, v in logged.items() if k.startswith("mismatch/")}
    is_keys = {k: v for k, v in logged.items() if k.startswith("rollout_is/")}
    for packs, keys in ((mms, mm_keys), (iss, is_keys if c.configured and c.has_band else {})):
        valid = [d for d in packs if d]
        for key, name in keys.items():
            vals = [d[key] for d in valid if d.get(key) is not None]
            if not valid:
                out[key] = 0.0
            elif "max" in name:  # each valid pack holds a finite value for every max/min key
                out[key] = max(vals)
            elif "min" in name:
                out[key] = min(vals)
            else:
                out[key] = sum(vals) / len(valid)
    return out


def verl_summary(sd) -> dict[str, float | None]:
    """Newest verl: the whole step as one batch, each sequence once (the driver computes it before
    the mini-batches and PPO epochs); sequence summaries over every row. Nothing when the run's
    trainer had no rollout correction configured (``rollout_metrics`` false)."""
    p = _seqs(sd)
    if p is None or sd.cfg.get("rollout_metrics") is False:
        return {}
    _, first = np.unique(np.asarray(p["sample_id"], dtype=np.int64), return_index=True)
    if len(first) < len(p["sample_id"]):
        p = _sub(p, np.sort(first))
    return verl_batch_summary(p, ISConfig.from_cfg(sd.cfg), (sd.extra.get("pieces") or {}).get(RS_VISITOR))


def verl_batch_summary(p: dict, c: ISConfig, rs: dict | None) -> dict[str, float | None]:
    """What verl's ``compute_rollout_correction_and_rejection_mask`` reports for one batch: rows
    ``p`` (IS and mismatch partials, each row once), ``rs`` its rejection filters' statistics
    (:func:`~grpolens.metrics.rollout_is_visitors.rs_summary` of the same rows). verl calls it on
    the driver over the whole step, and in bypass mode inside the loss once per micro-batch
    (:mod:`grpolens.metrics.verl_actor`)."""
    out = mismatch_summary(p, all_rows=True)
    out.pop("mismatch/abs_logp_diff", None)
    out.pop("mismatch/abs_logp_diff_max", None)
    out.update(rs or {})
    if not (c.configured and c.has_band):
        return out
    sv = ris.seq_view(p, c)
    n = sv.n
    N = n.sum()
    if N == 0:
        return out
    f = ris._f
    col = lambda name: ris._col(p, name)  # noqa: E731
    ok = n > 0
    U, Lo = c.upper, c.lower
    o: dict[str, float | None] = {}
    if c.level == "token":
        a1, a2 = col("ris.ta").sum(), col("ris.ta2").sum()
        o["applied/max"], o["applied/min"] = f(col("ris.tamax")[ok].max()), f(col("ris.tamin")[ok].min())
        o["raw/fraction_high"], o["raw/fraction_low"] = f(col("ris.thi").sum() / N), f(col("ris.tlo").sum() / N)
        s_app, s_raw = np.where(ok, sv.a, 0.0), np.where(ok, sv.w, 0.0)
    else:
        X = sv.X
        a1, a2 = (n * sv.a).sum(), (n * sv.a * sv.a).sum()
        o["applied/max"], o["applied/min"] = f(np.exp(min(X.max(), SAFETY_BOUND))), f(np.exp(X.min()))
        with np.errstate(divide="ignore"):
            o["raw/fraction_high"] = f(np.mean(X > np.log(U)))
            o["raw/fraction_low"] = f(np.mean(X < np.log(Lo))) if Lo is not None else 0.0
        s_app, s_raw = np.where(ok, sv.a, 0.0), np.where(ok, sv.w, 0.0)  # an empty row's masked mean is 0
    m = a1 / N
    o["applied/mean"] = f(m)
    o["applied/std"] = float(np.sqrt(max(0.0, a2 / N - m * m))) if N > 1 else 0.0
    o["applied/ess"] = f(1.0 / ((a2 / N) / (m + 1e-8) ** 2)) if a2 > 0 else None
    ris._seq_stats(s_app, Lo, U, "applied/", o, fractions=False, undefined=0.0)
    o["raw/seq_fraction_high"] = f(np.mean(s_raw > U))
    o["raw/seq_fraction_low"] = f(np.mean(s_raw < Lo)) if Lo is not None else 0.0
    if c.zeroes:
        o["zeroed_fraction"] = f(sv.changed.sum() / N)
    if c.batch_normalize:
        # the applied weights' mean over the batch (token level: over its tokens; sequence level:
        # over its sequences with a token), 1.0 when not above 1e-8 (verl then leaves them as they are)
        bn = m if c.level == "token" else (sv.a[ok].mean() if ok.any() else 0.0)
        o["batch_norm_factor"] = f(bn) if bn > 1e-8 else 1.0
    out.update({f"rollout_is/{k}": v for k, v in o.items()})
    return out


#: what :func:`verl_batch_summary` can report besides its rejection filters' ``rollout_rs/*``
VERL_KEYS = tuple(f"rollout_is/{k}" for k in (
    "raw/fraction_high", "raw/fraction_low", "raw/seq_fraction_high", "raw/seq_fraction_low", "applied/mean",
    "applied/std", "applied/min", "applied/max", "applied/ess", "applied/seq_mean", "applied/seq_std",
    "applied/seq_min", "applied/seq_max", "applied/seq_max_deviation", "zeroed_fraction", "batch_norm_factor")) + tuple(
    f"mismatch/{k}" for k in ("kl_k1", "kl_k3", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl",
                              "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
                              "chi2_token", "chi2_seq"))


def trl_summary(sd) -> dict[str, float | None]:
    """TRL ``sampling/*``: per rank over its completions (each once), then across ranks."""
    p = _seqs(sd)
    c = ISConfig.from_cfg(sd.cfg)
    if p is None or not c.configured:
        return {}
    keys = np.stack([np.asarray(p["rank"], dtype=np.int64), np.asarray(p["sample_id"], dtype=np.int64)], axis=1)
    _, first = np.unique(keys, axis=0, return_index=True)
    p = _sub(p, np.sort(first))
    sv = ris.seq_view(p, c)
    ranks = np.asarray(p["rank"])
    nf, absd, absdmax = ris._col(p, "mm.n"), ris._col(p, "mm.absd"), ris._col(p, "mm.absdmax")
    # a rank without a token logs 0.0 for each (TRL's ``numel() > 0`` guards), and the gather over
    # ranks takes that 0.0 (into the mean, and into ``nanmin``)
    means, maxes, rmin, rmean, rmax = [], [], [], [], []
    for r in np.unique(ranks):
        s = ranks == r
        has = nf[s] > 0
        means.append(absd[s].sum() / nf[s].sum() if has.any() else 0.0)
        maxes.append(absdmax[s][has].max() if has.any() else 0.0)
        n = sv.n[s]
        if c.level == "token":
            ok = n > 0
            if ok.any():
                rmin.append(ris._col(p, "ris.tamin")[s][ok].min())
                rmax.append(ris._col(p, "ris.tamax")[s][ok].max())
                rmean.append(ris._col(p, "ris.ta")[s].sum() / n.sum())
            else:
                rmin.append(0.0)
                rmax.append(0.0)
                rmean.append(0.0)
        else:  # one ratio per completion, empty ones included (their log-ratio sum is 0)
            a = sv.a[s]
            rmin.append(a.min())
            rmax.append(a.max())
            rmean.append(a.mean())
    f = ris._f
    return {  # one entry per rank in each list: the partials of a step have at least one row
        "mismatch/abs_logp_diff": f(np.mean(means)), "mismatch/abs_logp_diff_max": f(max(maxes)),
        "rollout_is/applied/min": f(min(rmin)), "rollout_is/applied/mean": f(np.mean(rmean)),
        "rollout_is/applied/max": f(max(rmax)),
    }


def step_summary(sd) -> dict[str, float | None]:
    """All of this family's values for a step under ``sd.profile`` (its ``rollout_is_summary``, or
    the canonical one; computed once per step)."""
    key = ("rollout_is", sd.profile.name)
    if key not in sd.extra:
        sd.extra[key] = (sd.profile.rollout_is_summary or canonical_summary)(sd)
    return sd.extra[key]


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

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
