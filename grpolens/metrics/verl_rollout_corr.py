"""verl's rollout correction (``compute_rollout_correction_and_rejection_mask``): what it reports for
one batch, and for a step. The verl profile's rollout-IS summary, and the verl actor family's in
bypass mode (per loss call); in the metrics layer because that family reads it (families never
import profiles)."""

from __future__ import annotations

import numpy as np

from grpolens.functional import rollout_is as ris
from grpolens.functional.estimators import LOG_RATIO_BOUND
from grpolens.functional.rollout_is import ISConfig
from grpolens.metrics.rollout_is import RS_VISITOR, mismatch_summary, step_rows, sub_rows


def verl_summary(sd) -> dict[str, float | None]:
    """Newest verl: the whole step as one batch, each sequence once (the driver computes it before
    the mini-batches and PPO epochs); sequence summaries over every row. Nothing when the run's
    trainer had no rollout correction configured (``rollout_metrics`` false)."""
    p = step_rows(sd)
    if p is None or sd.cfg.get("rollout_metrics") is False:
        return {}
    _, first = np.unique(np.asarray(p["sample_id"], dtype=np.int64), return_index=True)
    if len(first) < len(p["sample_id"]):
        p = sub_rows(p, np.sort(first))
    return verl_batch_summary(p, ISConfig.from_cfg(sd.cfg), (sd.extra.get("pieces") or {}).get(RS_VISITOR))


def verl_batch_summary(p: dict, c: ISConfig, rs: dict | None) -> dict[str, float | None]:
    """What verl's ``compute_rollout_correction_and_rejection_mask`` reports for one batch: rows
    ``p`` (IS and mismatch partials, each row once), ``rs`` its rejection filters' statistics
    (:func:`~grpolens.metrics.rollout_is.visitors.rs_summary` of the same rows). verl calls it on
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
        o["applied/max"], o["applied/min"] = f(np.exp(min(X.max(), LOG_RATIO_BOUND))), f(np.exp(X.min()))
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
