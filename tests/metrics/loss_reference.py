"""The loss family's independent reference: each variant's per-token loss and TRL's reductions, in
numpy, written from TRL's and the papers' formulas (shared by the loss tests of tests/metrics/)."""

import numpy as np
import pyarrow as pa

DEFAULTS = {"epsilon": 0.2, "epsilon_high": None, "delta": None, "beta": 0.0, "use_bias_correction_kl": False,
            "importance_sampling_level": "token", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05,
            "max_completion_length": None, "log_ratio_clamp": None,
            "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}


def ref_vespo_phi(c, cfg):
    """TRL 1.16's ``get_gamma_weights`` on one padded call, per row: ℓ = Σ_t clamp(logp − old, ±20)·M,
    plus with TRL's vLLM IS correction Σ_t clamp(ln ratio, ln 1e-8, 20) over every padded position
    (the ratio of :func:`ref_is_weight`: 1 off the mask), clamped to [ln 1e-8, 20], (k, λ) by the row's
    advantage >= 0, φ = exp(λ + kℓ − λe^ℓ), NaN/inf → 0."""
    cfg = {**DEFAULTS, **cfg}
    with np.errstate(all="ignore"):
        rv = c.mask & np.isfinite(c.logp) & np.isfinite(c.old)
        ell = np.where(rv, np.clip(c.logp - c.old, -20, 20), 0.0).sum(1)
        if cfg.get("rollout_is"):
            ratio, _ = ref_is_weight(c, cfg["rollout_is"])
            ell = ell + np.clip(np.log(ratio), np.log(1e-8), 20.0).sum(1)
        ell = np.clip(ell, np.log(1e-8), 20.0)
        pos = c.advantages >= 0
        k = np.where(pos, cfg["vespo_k_pos"], cfg["vespo_k_neg"])
        lam = np.maximum(np.where(pos, cfg["vespo_lambda_pos"], cfg["vespo_lambda_neg"]), 1e-4)
        phi = np.exp(lam + k * ell - lam * np.exp(ell))
    return np.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def ref_is_weight(c, ris):
    """(factor, keep) on the padded arrays: the rollout IS weight the trainer multiplies the policy
    loss by, and the tokens it leaves in the loss. TRL (trl-notes §5): d = nan_to_num((old − sampling)·M),
    token ratio e^d or sequence ratio e^(Σ_t d); *_truncate clamps to [clip_min, clip_max], *_mask
    zeroes ratios outside it. grpolens' documented additions: the exponent is bounded at ±20, and
    a sequence holding both +inf and −inf δ (no defined Σδ) counts as δ = 0. The canonical
    ``{"mode": "mask"}`` (xtuner) keeps the weight and removes the tokens outside [lower, upper]."""
    if "vllm_importance_sampling_mode" in ris:
        level, kind = ris["vllm_importance_sampling_mode"].split("_")
        lo, hi = ris.get("vllm_importance_sampling_clip_min"), ris.get("vllm_importance_sampling_clip_max", 3.0)
    else:
        level, kind, lo, hi = ris["level"], {"mask": "reject"}.get(ris["mode"], ris["mode"]), ris.get("lower"), ris.get("upper")
    with np.errstate(all="ignore"):
        d = c.old - c.rollout
        d = np.where(c.mask & ~np.isnan(d), d, 0.0)
        d[(d == np.inf).any(1) & (d == -np.inf).any(1)] = 0.0
        x = d if level == "token" else d.sum(1, keepdims=True) * np.ones_like(d)
        w = np.exp(np.clip(x, -20, 20))
        inside = (w <= (hi if hi is not None else np.inf)) & (w >= (lo if lo is not None else 0.0))
    keep = np.ones(w.shape, dtype=bool)
    if kind == "none":
        return np.ones_like(w), keep
    if kind == "truncate":
        return np.clip(w, lo if lo is not None else 0.0, hi), keep
    if kind == "mask":
        return np.where(inside, w, 0.0), keep
    return w, inside  # reject


def ref_token_loss(c, cfg):
    """(L, v) on the padded (B, T) arrays of one loss call."""
    cfg = {**DEFAULTS, **cfg}
    lt, beta = cfg["loss_type"], cfg["beta"]
    eps_lo = cfg["epsilon"]
    eps_hi = cfg["epsilon_high"] if cfg["epsilon_high"] is not None else eps_lo
    level = cfg["importance_sampling_level"]
    if lt == "gspo" and level == "token":
        level = "sequence"
    with np.errstate(all="ignore"):
        rv = c.mask & np.isfinite(c.logp) & np.isfinite(c.old)
        v = rv & np.isfinite(c.adv_tok)
        if beta:
            v &= np.isfinite(c.ref)
        d = np.where(rv, c.logp - c.old, 0.0)
        if cfg["log_ratio_clamp"] is not None:
            d = np.clip(d, -cfg["log_ratio_clamp"], cfg["log_ratio_clamp"])
        if level == "token":
            coef = np.exp(d)
        else:
            coef = np.exp(d.sum(1, keepdims=True) / np.maximum(rv.sum(1, keepdims=True), 1)) * np.ones_like(d)
        A = c.adv_tok
        if lt == "cispo":
            L = -np.minimum(coef, eps_hi) * A * c.logp
        elif lt == "sapo":
            tau = np.where(A > 0, cfg["sapo_temperature_pos"], cfg["sapo_temperature_neg"])
            L = -(4 / tau) / (1 + np.exp(-tau * (coef - 1))) * A
        elif lt == "vespo":
            L = -ref_vespo_phi(c, cfg)[:, None] * A * c.logp
        else:
            c1 = coef if cfg["delta"] is None else np.minimum(coef, cfg["delta"])
            c2 = np.clip(coef, 1 - eps_lo, 1 + eps_hi)
            L = -np.minimum(c1 * A, c2 * A)
        if cfg.get("rollout_is") and lt != "vespo":  # the IS weight multiplies the policy term, before + β·kl
            factor, keep = ref_is_weight(c, cfg["rollout_is"])
            v &= keep
            L = L * factor
        if beta:
            x = c.ref - c.logp
            kl = np.exp(x) - x - 1
            if cfg["use_bias_correction_kl"]:
                kl = kl * coef
            L = L + beta * kl
        return np.where(v, L, 0.0), v


def ref_pooled(calls, step, cfg):
    s, n = [], []
    for c in calls:
        if c.step == step:
            L, v = ref_token_loss(c, cfg)
            s += list(L.sum(1))
            n += list(v.sum(1))
    s, n = np.array(s), np.array(n, dtype=float)
    if n.sum() == 0:
        return None
    lt = cfg["loss_type"]
    if lt in ("grpo", "sapo", "gspo"):
        return np.mean(s / np.maximum(n, 1))
    if lt == "luspo":
        return np.mean(s)
    if lt == "dr_grpo":
        return s.sum() / (len(s) * cfg["max_completion_length"]) if cfg.get("max_completion_length") else None
    return s.sum() / n.sum()


def ref_trl(calls, step, cfg):
    """TRL's logged loss: Σ over a rank's micro-batches of _compute_loss' value, mean over ranks."""
    lt = cfg["loss_type"]
    cs = [c for c in calls if c.step == step]
    ranks = sorted({c.rank for c in cs})
    N = sum(ref_token_loss(c, cfg)[1].sum() for c in cs)  # num_items_in_batch: the generation batch (S = G)
    per_rank = []
    for r in ranks:
        mine = [c for c in cs if c.rank == r]
        G = len(mine)
        total = 0.0
        for c in mine:
            L, v = ref_token_loss(c, cfg)
            B = L.shape[0]
            if lt in ("grpo", "sapo", "gspo"):
                val = np.mean(L.sum(1) / np.maximum(v.sum(1), 1)) / G
            elif lt == "bnpo":
                val = L.sum() / max(v.sum(), 1) / G
            elif lt == "dr_grpo":
                val = L.sum() / (B * cfg["max_completion_length"]) / G
            elif lt == "luspo":
                val = np.mean(L.sum(1)) / G
            else:  # dapo, cispo, vespo
                val = L.sum() / (max(N, 1) / len(ranks))
            total += val
        per_rank.append(total)
    return float(np.mean(per_rank))


def round_samples(calls, rounds: dict[int, int], at_step: int | None = None) -> dict[int, pa.Table]:
    """Samples tables (one per step) giving each completion the round ``rounds[sample_id]``; each
    completion is listed at the step of its first loss call (or at ``at_step``)."""
    import pyarrow as pa

    rows: dict[int, dict[int, tuple[int, int]]] = {}
    for c in calls:
        for sid, n in zip(c.sample_ids.tolist(), c.lengths.tolist()):
            if not any(sid in r for r in rows.values()):
                rows.setdefault(c.step if at_step is None else at_step, {})[sid] = (c.rank, n)
    out = {}
    for step, r in rows.items():
        sids = sorted(r)
        out[step] = pa.table({
            "step": pa.array([step] * len(sids), pa.int64()), "rank": pa.array([r[s][0] for s in sids], pa.int32()),
            "sample_id": pa.array(sids, pa.int64()), "group_id": pa.array(sids, pa.int64()),
            "completion_len": pa.array([r[s][1] for s in sids], pa.int32()),
            "truncated": pa.array([False] * len(sids), pa.bool_()),
            "generation": pa.array([rounds[s] for s in sids], pa.int64())})
    return out
