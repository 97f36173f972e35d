"""verl 0.9.1's registered policy losses (``@register_policy_loss`` in ``verl/trainer/ppo/core_algos.py``)
per token, as :mod:`grpolens.metrics.verl_actor` aggregates them: the loss term ``L``, the
indicators behind ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower`` and the per-token ``ppo_kl``.
The formulas are in :mod:`grpolens.metrics.verl_actor`'s module doc."""

from __future__ import annotations

import numpy as np

from grpolens.errors import UserError
from grpolens.functional.rollout_is import ISConfig, loss_weights
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.rollout_is import batch_inputs, batch_partials

#: the losses whose terms need every token of a loss call (:mod:`grpolens.metrics.verl_cov`)
COV_MODES = ("kl_cov", "clip_cov")


SUPPORTED = "vanilla, gspo, cispo, sapo, gpg, dro, geo_mean, dppo_tv, dppo_kl, kl_cov and clip_cov"


def unsupported(key: str, value, choices: str) -> UserError:
    """A verl setting of the run's config (``verl_actor``) that the verl profile does not know."""
    return UserError(f"config key 'verl_actor.{key}': the verl profile supports {choices}, got {value!r}")


def actor_cfg(cfg: dict) -> dict | None:
    a = cfg.get("verl_actor")
    return a if isinstance(a, dict) else None


def bypass_corr(cfg: dict) -> dict | None:
    """verl's ``algorithm.rollout_correction`` when it sets ``bypass_mode``, else None."""
    corr = (cfg.get("verl_algorithm") or {}).get("rollout_correction")
    return corr if isinstance(corr, dict) and corr.get("bypass_mode") else None


def loss_mode(a: dict) -> str:
    # verl's actor config holds the loss under policy_loss (PolicyLossConfig), as verl_config reads it
    return str(dict(a.get("policy_loss") or {}).get("loss_mode", "vanilla"))


def clip_bounds(a: dict) -> tuple[float, float]:
    """(ε_low, ε_high): verl's ActorConfig defaults clip_ratio_low/high to 0.2 themselves, so
    clip_ratio only stands in for an explicit None."""
    el, eh = a.get("clip_ratio_low", 0.2), a.get("clip_ratio_high", 0.2)
    el = a.get("clip_ratio", 0.2) if el is None else el
    eh = a.get("clip_ratio", 0.2) if eh is None else eh
    return float(el), float(eh)


def is_weight(b: TokenBatch, cfg: dict) -> np.ndarray | None:
    """The rollout IS weight per token verl's driver hands the loss (decoupled mode), None without one."""
    isc = ISConfig.from_cfg(cfg)
    if not (isc.configured and b.has("rollout_logp")) or bypass_corr(cfg) is not None:
        return None
    return loss_weights(b, isc, batch_inputs(b), batch_partials(b, isc))[0]


def sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def policy_terms(b: TokenBatch, a: dict, mode: str, m: np.ndarray, A: np.ndarray, d: np.ndarray, dc: np.ndarray,
                 r: np.ndarray, el: float, eh: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(L, clip, low, ppo_kl per token) of verl's loss ``mode`` on one loss call's rows: ``m`` the
    policy mask, ``A`` the advantage (0 off it), ``d`` = logp − old (0 off it), ``dc`` it clamped to
    ±20, ``r`` = e^dc, ``el``/``eh`` the clip ratios."""
    n = b.count(m)
    low = clip = np.zeros(b.n)
    kl_tok = -dc
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if mode == "vanilla":
            c3 = float(a.get("clip_ratio_c", 3.0))
            l1, l2 = -A * r, -A * np.clip(r, 1 - el, 1 + eh)
            lc = np.maximum(l1, l2)
            l3 = -A * c3
            L = np.where(A < 0, np.minimum(l3, lc), lc)
            clip = (l2 > l1).astype(np.float64)
            low = ((lc > l3) & (A < 0)).astype(np.float64)
        elif mode == "reinforce":  # compute_policy_loss_reinforce: no ratio, no clipping, ppo_kl unclamped
            L = -A * np.where(m, b.logp, 0.0)
            kl_tok = -d
        elif mode == "gspo":
            s = np.exp(np.minimum(b.broadcast(b.seq_sum(d) / np.maximum(n, 1.0)), 10.0))
            l1, l2 = -A * s, -A * np.clip(s, 1 - el, 1 + eh)
            L = np.maximum(l1, l2)
            clip = (l2 > l1).astype(np.float64)
            kl_tok = -d
        elif mode == "cispo":
            rc = np.clip(r, 1 - el, 1 + eh)
            L = -rc * A * np.where(m, b.logp, 0.0)
            clip = (r != rc).astype(np.float64)
        elif mode == "sapo":
            tau = np.where(A > 0, float(a.get("tau_pos", 1.0)), float(a.get("tau_neg", 1.05)))
            L = -(4.0 / tau) * sigmoid(tau * (r - 1.0)) * A
        elif mode == "gpg":  # compute_policy_loss_gpg: −logp·A, no ratio, no metrics of its own
            L = -A * np.where(m, b.logp, 0.0)
        elif mode == "dro":  # compute_policy_loss_dro: −(logp·A − β/2·d²), ppo_kl unclamped
            beta = (a.get("policy_loss") or {}).get("dro_beta")
            if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not beta > 0:
                raise unsupported("policy_loss.dro_beta", beta, "a positive number (verl requires one for dro)")
            L = -(np.where(m, b.logp, 0.0) * A - 0.5 * float(beta) * d * d)
            kl_tok = -d
        elif mode == "geo_mean":  # compute_policy_loss_geo_mean (GMPO): one term per row, see _geo_mean_row
            L = np.zeros(b.n)
            clipped = (d != np.clip(d, -float(el), float(eh))) & m
            clip = (clipped & (A > 0)).astype(np.float64)
            low = (clipped & (A < 0)).astype(np.float64)
            kl_tok = -d
        elif mode in ("dppo_tv", "dppo_kl"):  # DPPO: a divergence trust region instead of the ratio clip
            c3 = float(a.get("clip_ratio_c", 3.0))  # the ratio's truncation (verl's TIS in place of dual clip)
            p, q = np.exp(np.where(m, b.logp, 0.0)), np.exp(np.where(m, b.old, 0.0))
            if mode == "dppo_tv":
                ok_pos, ok_neg = p - q <= eh, p - q >= -el
            else:  # the sampled token's binary KL(old ‖ new), only against moves away from the old policy
                bkl = q * (np.where(m, b.old, 0.0) - np.where(m, b.logp, 0.0)) + (1 - q) * np.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
                ok_pos, ok_neg = (bkl <= eh) | (p <= q), (bkl <= el) | (p >= q)
            valid = np.where(A > 0, ok_pos, ok_neg)
            L = -A * np.minimum(r, c3) * np.where(m, b.logp, 0.0) * valid
            clip = (~valid).astype(np.float64)
            low = ((r > c3) & valid).astype(np.float64)
        elif mode == "kl_cov":  # before the penalty on the call's top-k tokens (verl_cov): −A·e^d, ratio unclamped
            L = -A * np.exp(d)
            kl_tok = np.abs(d)  # verl's kl_cov logs ppo_kl = mm|d|
        elif mode == "clip_cov":  # before verl zeroes some tokens (verl_cov): PPO's clip on e^d, unclamped
            re = np.exp(d)
            l1, l2 = -A * re, -A * np.clip(re, 1 - el, 1 + eh)
            L = np.maximum(l1, l2)
            clip = (l2 > l1).astype(np.float64)  # clipped by the ratio: never a candidate to be zeroed
            kl_tok = -d
        else:
            raise unsupported("policy_loss.loss_mode", mode, SUPPORTED)
    return L, clip, low, kl_tok


def geo_mean_row(b: TokenBatch, m: np.ndarray, A: np.ndarray, d: np.ndarray, el: float, eh: float,
                  w: np.ndarray | None) -> np.ndarray:
    """GMPO's term of each row (see the module doc; Ā the row's masked mean advantage), × the geometric
    mean of its rollout IS weights exp(Σ_t ln(w + 1e-10)·m / (T + 1e-8)) when verl applies them."""
    sg = np.sign(A)
    dmin = sg * np.minimum(sg * d, sg * np.clip(d, -el, eh))
    T = b.count(m)
    ratio = np.exp(b.seq_sum(np.where(m, dmin, 0.0)) / (T + 1e-8))
    row = -(b.seq_sum(A) / (T + 1e-8)) * ratio
    if w is not None:
        row = row * np.exp(b.seq_sum(np.where(m, np.log(w + 1e-10), 0.0)) / (T + 1e-8))
    return row
