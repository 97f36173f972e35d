"""The rollout-IS family's canonical step summary, the mismatch summary every profile's own
summary reuses, and the per-step cache of whichever summary the profile asks for."""

from __future__ import annotations

import numpy as np

from grpolens.functional import rollout_is as ris
from grpolens.functional import estimators as est
from grpolens.functional.rollout_is import ISConfig
from grpolens.metrics.rollout_is.inputs import DELTA_VISITOR, RS_VISITOR


def step_rows(sd) -> dict[str, np.ndarray] | None:
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
            "mismatch/chi2_seq": f(est.bounded_exp2(seq_d).mean() - 1.0),
        }


def canonical_summary(sd) -> dict[str, float | None]:
    p = step_rows(sd)
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


def sub_rows(p: dict, idx: np.ndarray) -> dict[str, np.ndarray]:
    return {k: np.asarray(v)[idx] for k, v in p.items()}


def step_summary(sd) -> dict[str, float | None]:
    """All of this family's values for a step under ``sd.profile`` (its ``rollout_is_summary``, or
    the canonical one; computed once per step)."""
    key = ("rollout_is", sd.profile.name)
    if key not in sd.extra:
        sd.extra[key] = (sd.profile.rollout_is_summary or canonical_summary)(sd)
    return sd.extra[key]
