"""ms-swift 4.6.0's rollout correction (``rollout_correction/*``; ``GRPOTrainer.
_compute_rollout_offpolicy_metrics``, ``_apply_rollout_importance_sampling`` and
``_compute_is_correction_metrics``), per loss call on one rank.

With ``m`` the completion mask, ``old`` the training policy's log-probs at generation and ``ro`` the
rollout engine's, ``δ = old − ro`` and ``r = exp(clamp(δ, ±20))`` per token:

* off-policy diagnostics (with ``log_rollout_offpolicy_metrics`` or an IS mode): ``kl`` = Σ −δ·m / Σ m,
  ``k3_kl`` = Σ clamp(k3(clamp(δ, ±20)), ±10)·m / Σ m, ``chi2_token`` = Σ r²·m / Σ m − 1, and over the
  call's rows (every row, fully masked ones too) with ``ℓ_old``/``ℓ_ro`` a row's masked mean:
  ``training_ppl`` = mean e^(−ℓ_old), ``training_log_ppl`` = mean −ℓ_old, ``rollout_ppl``,
  ``rollout_log_ppl`` likewise, ``log_ppl_diff`` = mean (ℓ_ro − ℓ_old) (and its mean absolute value,
  max, min), ``ppl_ratio`` = mean e^(ℓ_ro − ℓ_old), ``chi2_seq`` = mean e^(2·clamp(mean_t δ, ±20)) − 1.
  These are verl's ``rollout_corr`` diagnostics (ms-swift's copy), on one rank's micro-batch;
* IS weights ``w`` (``rollout_importance_sampling_mode``, threshold C): token_truncate min(r, C);
  token_mask r where r ≤ C else 0; sequence_truncate min(ρ, C) on every token; sequence_mask r where
  ρ ≤ C else 0, with ρ = exp(Σ_t clamp(δ, ±20)·m / max(Σ m, 1)) (a geometric mean, where TRL's
  sequence modes take the product). The loss is × w (its KL term too);
* ``is_weight_mean`` = Σ w·m / Σ m; ``ess`` = 1 / max(Σ (w_c / (mean w_c + 1e-8))²·m / Σ m, 1e-10) with
  w_c = clamp(w, 1/C, C); ``clipped_frac``: token modes the token share with r > C (truncate) or
  w = 0 (mask), sequence modes the row share with ρ > C.

Every Σ m is clamped to ≥ 1. ``_compute_loss_and_metrics`` then takes the mean over ranks of each
(``log_ppl_diff_max``/``min``: the max/min over ranks).
"""

from __future__ import annotations

import numpy as np

from grpolens.functional import estimators as est
from grpolens.metrics.batch import TokenBatch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
COLS = ("ro.old", "ro.roll", "ro.lr", "ro.lrc", "ro.k3", "ro.rho2", "ro.w", "ro.wc", "ro.wc2", "ro.clip")
KEYS = ("training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
        "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq")
IS_KEYS = ("is_weight_mean", "ess", "clipped_frac")


def clamped_k3(x: np.ndarray) -> np.ndarray:
    """ms-swift's k3: of x clamped to ±20, itself clamped to ±10."""
    return np.clip(est.k3(est.clip_log_ratio(x)), -10.0, 10.0)


def weights(b: TokenBatch, mode: str, threshold: float, m: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The IS weight of each token (``_apply_rollout_importance_sampling``)."""
    delta = b.old - b.cols["rollout_logp"]
    r = est.bounded_exp(delta)
    if mode == "token_truncate":
        return np.minimum(r, threshold)
    if mode == "token_mask":
        return np.where(r <= threshold, r, 0.0)
    rho = b.broadcast(np.exp(b.seq_sum(np.where(m, est.clip_log_ratio(delta), 0.0)) / np.maximum(n, 1.0)))
    if mode == "sequence_truncate":
        return np.minimum(rho, threshold)
    return r * (rho <= threshold)


def partials(b: TokenBatch, s: dict, m: np.ndarray, n: np.ndarray, w: np.ndarray | None) -> dict[str, np.ndarray]:
    """Per-row sums the rank's values are made of (``w``: the IS weights, None without a mode)."""
    old, ro = b.old, b.cols["rollout_logp"]
    delta = np.where(m, old - ro, 0.0)
    out = {"ro.old": b.seq_sum(np.where(m, old, 0.0)), "ro.roll": b.seq_sum(np.where(m, ro, 0.0)),
           "ro.lr": b.seq_sum(delta), "ro.lrc": b.seq_sum(est.clip_log_ratio(delta)),
           "ro.k3": b.seq_sum(np.where(m, clamped_k3(delta), 0.0)),
           "ro.rho2": b.seq_sum(np.where(m, est.bounded_exp2(delta), 0.0))}
    zero = np.zeros(b.n_seq)
    out.update({"ro.w": zero, "ro.wc": zero, "ro.wc2": zero, "ro.clip": zero})
    if w is not None:
        thr = float(s["rollout_importance_sampling_threshold"])
        wc = np.clip(w, 1.0 / thr, thr)
        mode = s["rollout_importance_sampling_mode"]
        out.update({"ro.w": b.seq_sum(np.where(m, w, 0.0)), "ro.wc": b.seq_sum(np.where(m, wc, 0.0)),
                    "ro.wc2": b.seq_sum(np.where(m, wc * wc, 0.0))})
        if mode == "token_truncate":
            out["ro.clip"] = b.seq_sum((m & (est.bounded_exp(old - ro) > thr)).astype(np.float64))
        elif mode == "token_mask":
            out["ro.clip"] = b.seq_sum((m & (w == 0)).astype(np.float64))
        else:  # the row's geometric-mean ratio above the threshold
            out["ro.clip"] = (np.exp(out["ro.lrc"] / np.maximum(n, 1.0)) > thr).astype(np.float64)
    return out


def rank_values(col, s: dict) -> dict[str, float]:
    """One rank's values for one call: ``col(name)`` gives the call's rows' partials on that rank."""
    n = col("ro.n")  # the completion mask before the off-policy sequence mask
    N = max(n.sum(), 1.0)
    den = np.maximum(n, 1.0)
    l_old, l_ro = col("ro.old") / den, col("ro.roll") / den
    lpd = l_ro - l_old
    out = {
        "training_ppl": np.mean(np.exp(-l_old)), "training_log_ppl": np.mean(-l_old),
        "kl": -col("ro.lr").sum() / N, "k3_kl": col("ro.k3").sum() / N,
        "rollout_ppl": np.mean(np.exp(-l_ro)), "rollout_log_ppl": np.mean(-l_ro),
        "log_ppl_diff": np.mean(lpd), "log_ppl_abs_diff": np.mean(np.abs(lpd)), "log_ppl_diff_max": np.max(lpd),
        "log_ppl_diff_min": np.min(lpd), "ppl_ratio": np.mean(np.exp(lpd)), "chi2_token": col("ro.rho2").sum() / N - 1.0,
        "chi2_seq": np.mean(est.bounded_exp2(col("ro.lr") / den)) - 1.0,
    }
    mode = s["rollout_importance_sampling_mode"]
    if mode is not None:
        mean_c = col("ro.wc").sum() / N
        out["is_weight_mean"] = col("ro.w").sum() / N
        out["ess"] = 1.0 / max(col("ro.wc2").sum() / (mean_c + 1e-8) ** 2 / N, 1e-10)
        out["clipped_frac"] = col("ro.clip").sum() / N if mode.startswith("token") else float(np.mean(col("ro.clip")))
    return {k: float(v) for k, v in out.items()}


def gathered(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' values as ``_compute_loss_and_metrics`` gathers them: nanmean, max/min for the extremes."""
    out = {}
    for k in per_rank[0]:
        v = np.array([r[k] for r in per_rank])
        if k == "log_ppl_diff_max":
            out[k] = float(np.max(v))
        elif k == "log_ppl_diff_min":
            out[k] = float(np.min(v))
        else:
            out[k] = float(np.nanmean(v)) if not np.isnan(v).all() else float("nan")
    return out
