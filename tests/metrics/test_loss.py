"""Loss family: every variant against a numpy reference written from TRL's / the papers' formulas."""

import numpy as np
import pytest

import grpolens
from tests.refdata import approx, f32, random_calls, write_run

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


CASES = [
    {"loss_type": "grpo"},
    {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": True, "delta": 1.3},
    {"loss_type": "dapo", "epsilon_high": 0.28},
    {"loss_type": "dapo", "beta": 0.04, "importance_sampling_level": "sequence"},
    {"loss_type": "bnpo", "beta": 0.1},
    {"loss_type": "dr_grpo", "max_completion_length": 12, "beta": 0.04, "use_bias_correction_kl": True},
    {"loss_type": "gspo", "epsilon": 3e-3, "epsilon_high": 4e-3, "beta": 0.04, "use_bias_correction_kl": True},
    {"loss_type": "cispo", "epsilon_high": 1.5},
    {"loss_type": "cispo", "epsilon_high": 5.0, "beta": 0.02},
    {"loss_type": "sapo"},
    {"loss_type": "sapo", "sapo_temperature_pos": 0.7, "sapo_temperature_neg": 2.0, "beta": 0.04},
    {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    {"loss_type": "luspo", "beta": 0.04},
    {"loss_type": "grpo", "log_ratio_clamp": 0.3, "importance_sampling_level": "sequence"},
    {"loss_type": "dapo", "importance_sampling_level": "sequence_token", "delta": 1.2},
    {"loss_type": "vespo"},
    {"loss_type": "vespo", "beta": 0.04, "vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 4.0,
     "vespo_lambda_neg": 0.0},
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_variants(tmp_path, cfg):
    rng = np.random.default_rng(21)
    calls = random_calls(rng, nonfinite=0.05, spread=0.5, batch=5, max_len=12)
    run = write_run(tmp_path / "run", calls, config=cfg)
    got = grpolens.recompute(run, write=False)
    trl = grpolens.recompute(run, profile="trl", write=False)
    for step in (0, 1):
        want = ref_pooled(calls, step, cfg)
        assert approx(got.filter(got["step"] == step)["loss"][0], want), step
        assert want is not None and want != 0.0
        assert approx(trl.filter(trl["step"] == step)["loss"][0], ref_trl(calls, step, cfg)), step


def test_log_ratio_clamp_matters(tmp_path):
    rng = np.random.default_rng(22)
    calls = random_calls(rng, spread=0.5, batch=5, max_len=12)
    calls[0].old[0, 0] = f32(calls[0].logp[0, 0] - 25.0)  # ratio e^25; A < 0 makes it count unclipped
    calls[0].advantages[0] = -1.0
    calls[0].mask[0, 0] = True
    base = {"loss_type": "dapo"}
    a = grpolens.recompute(write_run(tmp_path / "a", calls, config=base), write=False)["loss"][0]
    b = grpolens.recompute(write_run(tmp_path / "b", calls, config={**base, "log_ratio_clamp": 20}), write=False)["loss"][0]
    assert approx(a, ref_pooled(calls, 0, base)) and approx(b, ref_pooled(calls, 0, {**base, "log_ratio_clamp": 20}))
    assert a > b > 0


def test_unset_and_missing(tmp_path):
    rng = np.random.default_rng(23)
    calls = random_calls(rng)
    # dr_grpo without max_completion_length: null (the normaliser is unknown)
    run = write_run(tmp_path / "a", calls, config={"loss_type": "dr_grpo"})
    assert grpolens.recompute(run, write=False)["loss"].to_list() == [None, None]
    # beta != 0 but no reference log-probs: the trainer's KL term cannot be reproduced
    run = write_run(tmp_path / "b", random_calls(rng, ref=False), config={"beta": 0.04})
    assert grpolens.recompute(run, write=False)["loss"].to_list() == [None, None]
    # everything masked: grpolens null, TRL's returned loss is 0.0
    for c in calls:
        c.mask[:] = False
    run = write_run(tmp_path / "c", calls, config={"loss_type": "grpo"})
    assert grpolens.recompute(run, write=False)["loss"].to_list() == [None, None]
    assert grpolens.recompute(run, profile="trl", write=False)["loss"].to_list() == [0.0, 0.0]


def test_loss_hand_worked(tmp_path):
    # eps = 0.2, no KL, one call with two sequences:
    #   seq A: A = +1, ratios [1.5, 1.0]: per token -min(rA, clip(r)A) = [-1.2, -1.0]; mean -1.1, sum -2.2
    #   seq B: A = -1, ratio [0.5]:     -min(-0.5, -0.8) = 0.8;                          mean  0.8, sum  0.8
    #   grpo  = (-1.1 + 0.8) / 2 = -0.15      dapo/bnpo = (-2.2 + 0.8) / 3 = -0.4666...
    #   dr_grpo (max len 4) = -1.4 / (2·4) = -0.175      luspo = (-2.2 + 0.8) / 2 = -0.7
    #   delta = 1.1: seq A token 1 becomes -min(1.1, 1.2) = -1.1 -> grpo = (-1.05 + 0.8) / 2 = -0.125
    rng = np.random.default_rng(0)
    (c,) = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=2, max_len=2, all_masked_row=False,
                        single_token=False, zero_adv=False)
    c.lengths[:] = [2, 1]
    c.logp[:] = -1.0
    c.old[:] = -1.0 - np.log([[1.5, 1.0], [0.5, 1.0]])
    c.mask[:] = [[True, True], [True, False]]
    c.advantages[:] = [1.0, -1.0]
    want = {"grpo": -0.15, "dapo": -1.4 / 3, "bnpo": -1.4 / 3, "dr_grpo": -0.175, "luspo": -0.7}
    for lt, w in want.items():
        run = write_run(tmp_path / lt, [c], config={"loss_type": lt, "max_completion_length": 4})
        assert grpolens.recompute(run, write=False)["loss"][0] == pytest.approx(w, rel=1e-6), lt
    run = write_run(tmp_path / "delta", [c], config={"loss_type": "grpo", "delta": 1.1})
    assert grpolens.recompute(run, write=False)["loss"][0] == pytest.approx(-0.125, rel=1e-6)


IS_CASES = [  # (loss config, the run's rollout_is config as the trainer spells it)
    ({"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": True},
     {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
      "vllm_importance_sampling_clip_min": 0.9, "vllm_importance_sampling_clip_max": 1.1}),
    ({"loss_type": "grpo"},
     {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_mask",
      "vllm_importance_sampling_clip_min": 0.85, "vllm_importance_sampling_clip_max": 1.15}),
    ({"loss_type": "grpo", "beta": 0.04},
     {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
      "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 1.5}),
    ({"loss_type": "bnpo", "beta": 0.1},
     {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_truncate",
      "vllm_importance_sampling_clip_min": 0.7, "vllm_importance_sampling_clip_max": 1.4}),
    ({"loss_type": "gspo", "epsilon": 3e-3, "epsilon_high": 4e-3, "beta": 0.04},
     {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_truncate",
      "vllm_importance_sampling_clip_max": 2.0}),
    ({"loss_type": "cispo", "epsilon_high": 1.5, "beta": 0.02},
     {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate"}),
    ({"loss_type": "dr_grpo", "max_completion_length": 12},
     {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask"}),
    ({"loss_type": "grpo", "beta": 0.04}, {"level": "sequence", "mode": "mask", "lower": 0.7, "upper": 1.4}),
    ({"loss_type": "dapo"}, {"level": "token", "mode": "none"}),
]


@pytest.mark.parametrize("cfg,ris", IS_CASES, ids=lambda x: str(x.get("loss_type") or x.get("vllm_importance_sampling_mode") or x.get("mode")))
def test_loss_with_rollout_importance_sampling(tmp_path, cfg, ris):
    """Both profiles multiply the policy term by the rollout IS weight when the run's config has it."""
    rng = np.random.default_rng(24)
    calls = random_calls(rng, nonfinite=0.05, spread=0.5, batch=5, max_len=12)
    for c in calls:  # the rollout engine noticeably off, so that bands and clamps bite
        c.rollout = np.where(np.isfinite(c.rollout), f32(-np.abs(c.rollout + rng.normal(scale=0.15, size=c.rollout.shape))), c.rollout)
    full = {**cfg, "rollout_is": ris}
    run = write_run(tmp_path / "run", calls, config=full)
    got = grpolens.recompute(run, write=False)
    trl = grpolens.recompute(run, profile="trl", write=False)
    for step in (0, 1):
        want, plain = ref_pooled(calls, step, full), ref_pooled(calls, step, cfg)
        assert want is not None
        assert approx(got.filter(got["step"] == step)["loss"][0], want), step
        assert approx(trl.filter(trl["step"] == step)["loss"][0], ref_trl(calls, step, full)), step
        if ris.get("mode") == "none":
            assert approx(want, plain)  # describe-only: the loss is the uncorrected one
        else:
            assert not approx(want, plain, rel=1e-3)  # the weights matter on this data


def test_rollout_importance_sampling_without_rollout_logp(tmp_path):
    """The trainer weighted its loss by rollout IS weights the run cannot recompute: null, not a guess."""
    calls = random_calls(np.random.default_rng(25), rollout=False)
    ris = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate"}
    run = write_run(tmp_path / "run", calls, config={"loss_type": "grpo", "rollout_is": ris})
    for profile in ("grpolens", "trl"):
        assert grpolens.recompute(run, profile=profile, write=False)["loss"].to_list() == [None, None]
    off = {**ris, "vllm_importance_sampling_correction": False}
    run = write_run(tmp_path / "off", calls, config={"loss_type": "grpo", "rollout_is": off})
    assert grpolens.recompute(run, write=False)["loss"][0] == pytest.approx(ref_pooled(calls, 0, {"loss_type": "grpo"}))


def test_loss_with_rollout_importance_sampling_hand_worked(tmp_path):
    # eps = 0.2, no KL, policy ratio 1 everywhere, so the policy term is -A per token.
    #   seq A: A = +1, IS token ratios e^(old - rollout) = [2.0, 0.5]; seq B: A = -1, ratio [0.8]
    #   token_truncate [0.8, 1.25]: A -> [-1.25, -0.8], B -> [0.8]; dapo = (-2.05 + 0.8) / 3 = -0.41667
    #                               grpo = (-1.025 + 0.8) / 2 = -0.1125
    #   sequence_truncate (max 3):   A: e^(ln 2 + ln 0.5) = 1 -> [-1, -1]; B: 0.8 -> [0.8]; dapo = -1.2 / 3 = -0.4
    #   sequence_mask (max 0.9):     A: 1 > 0.9 -> 0; B: 0.8 stays -> [0.8]; dapo = 0.8 / 3 = 0.26667
    rng = np.random.default_rng(0)
    (c,) = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=2, max_len=2, all_masked_row=False,
                        single_token=False, zero_adv=False)
    c.lengths[:] = [2, 1]
    c.logp[:] = c.old[:] = -1.0
    c.rollout[:] = -1.0 - np.log([[2.0, 0.5], [0.8, 1.0]])
    c.mask[:] = [[True, True], [True, False]]
    c.advantages[:] = [1.0, -1.0]
    cases = [("token_truncate", 0.8, 1.25, "dapo", (-2.05 + 0.8) / 3), ("token_truncate", 0.8, 1.25, "grpo", -0.1125),
             ("sequence_truncate", None, 3.0, "dapo", -0.4), ("sequence_mask", None, 0.9, "dapo", 0.8 / 3)]
    for i, (mode, lo, hi, lt, want) in enumerate(cases):
        ris = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": mode,
               "vllm_importance_sampling_clip_min": lo, "vllm_importance_sampling_clip_max": hi}
        run = write_run(tmp_path / str(i), [c], config={"loss_type": lt, "rollout_is": ris})
        for profile in ("grpolens", "trl"):
            assert grpolens.recompute(run, profile=profile, write=False)["loss"][0] == pytest.approx(want, rel=1e-6), (mode, lt, profile)


def round_samples(calls, rounds: dict[int, int], at_step: int | None = None) -> dict[int, "pa.Table"]:
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


def ref_trl_rounds(calls, step, cfg, rounds, S, G):
    """TRL's dapo/cispo loss with several generation rounds per step (trl-notes §4): each call
    returns Σ L·M / (max(N, 1)/P · G/S), N = the valid tokens of ITS round's completions on all
    ranks (each completion once); the step logs Σ over a rank's calls, mean over ranks."""
    cs = [c for c in calls if c.step == step]
    ranks = sorted({c.rank for c in cs})
    N, seen = {}, set()
    for c in cs:
        v = ref_token_loss(c, cfg)[1]
        for i, sid in enumerate(c.sample_ids.tolist()):
            if sid not in seen:
                seen.add(sid)
                N[rounds[sid]] = N.get(rounds[sid], 0) + v[i].sum()
    per_rank = []
    for r in ranks:
        total = 0.0
        for c in (c for c in cs if c.rank == r):
            L, _ = ref_token_loss(c, cfg)
            k = rounds[int(c.sample_ids[0])]
            total += L.sum() / (max(N[k], 1) / len(ranks) * G / S)
        per_rank.append(total)
    return float(np.mean(per_rank))


@pytest.mark.parametrize("cfg", [{"loss_type": "dapo", "beta": 0.04}, {"loss_type": "cispo", "epsilon_high": 1.5}],
                         ids=["dapo", "cispo"])
@pytest.mark.parametrize("reuse", [False, True], ids=["S2", "S1-mu2"])
def test_trl_token_count_per_generation_round(tmp_path, cfg, reuse):
    """G = 4 loss calls per rank and step, two generation rounds per step: S = 2 micro-batches per
    round, or S = 1 reused for num_iterations = 2 (the same completions, new log-probs)."""
    rng = np.random.default_rng(31)
    calls = random_calls(rng, micro_batches=4, batch=3, max_len=10, spread=0.5)
    if reuse:
        for c in calls:
            if c.micro_batch % 2:
                (first,) = [p for p in calls if (p.step, p.rank, p.micro_batch) == (c.step, c.rank, c.micro_batch - 1)]
                c.sample_ids, c.lengths, c.mask, c.advantages = first.sample_ids, first.lengths, first.mask, first.advantages
    rounds = {int(s): 2 * c.step + c.micro_batch // 2 for c in calls for s in c.sample_ids}
    S, G = (1 if reuse else 2), 4
    full = {**cfg, "gradient_accumulation_steps": G, "steps_per_generation": S, "num_iterations": 2 if reuse else 1}
    run = write_run(tmp_path / "run", calls, config=full, samples=round_samples(calls, rounds))
    trl = grpolens.recompute(run, profile="trl", write=False)
    got = grpolens.recompute(run, write=False)
    for step in (0, 1):
        want = ref_trl_rounds(calls, step, full, rounds, S, G)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], want), step
        pooled = [c for c in calls if c.step == step and not (reuse and c.micro_batch % 2)] if reuse else calls
        assert not approx(want, ref_trl(pooled, step, full))  # one count for the step would differ
        assert approx(got.filter(got["step"] == step)["loss"][0], ref_pooled(calls, step, full))  # grpolens: unchanged


def test_trl_token_count_when_a_round_straddles_steps(tmp_path):
    """S = 4 > G = 2: one round, generated at step 0, is trained on at steps 0 and 1. TRL divides
    each call by the round's num_items_in_batch / P · G/S; the round's N comes from its completions'
    ``completion_len`` in the samples table (recorded at step 0), for the calls of both steps."""
    rng = np.random.default_rng(32)
    calls = random_calls(rng, micro_batches=2, batch=3)
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": 2, "steps_per_generation": 4}
    rounds = {int(s): 0 for c in calls for s in c.sample_ids}
    run = write_run(tmp_path / "run", calls, config=cfg, samples=round_samples(calls, rounds, at_step=0))
    trl = grpolens.recompute(run, profile="trl", write=False)
    n_round = float(sum(c.lengths.sum() for c in calls))  # completion_len of every completion of the round
    for step in (0, 1):
        total = sum(ref_token_loss(c, cfg)[0].sum() for c in calls if c.step == step)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], 4 / 2 * total / n_round), step
        assert not approx(trl.filter(trl["step"] == step)["loss"][0], ref_pooled(calls, step, cfg)), step

def test_trl_gradient_accumulation_left_null_is_trls_default_of_one(tmp_path):
    """``gradient_accumulation_steps: null`` in a run's config is "not set": TRL's value is then the
    TrainingArguments default, 1 (TRL itself always has an integer). With steps_per_generation = 2
    one round (generated at step 0) is trained on at steps 0 and 1, one loss call per rank and step,
    and each call is divided by the round's N/P · G/S = N/P · 1/2."""
    rng = np.random.default_rng(35)
    calls = random_calls(rng, micro_batches=1, batch=3)
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": None, "steps_per_generation": 2}
    rounds = {int(s): 0 for c in calls for s in c.sample_ids}
    run = write_run(tmp_path / "run", calls, config=cfg, samples=round_samples(calls, rounds, at_step=0))
    trl = grpolens.recompute(run, profile="trl", write=False)
    n_round = float(sum(c.lengths.sum() for c in calls))
    for step in (0, 1):
        total = sum(ref_token_loss(c, cfg)[0].sum() for c in calls if c.step == step)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], 2 / 1 * total / n_round), step


def _one_token_call():
    """One sequence of two stored tokens, only the first in the loss: ratio 1.5, A = +1, so with
    eps = 0.2 its loss is -min(1.5·1, 1.2·1) = -1.2."""
    (c,) = random_calls(np.random.default_rng(0), steps=(0,), ranks=1, micro_batches=1, batch=1, max_len=2,
                        all_masked_row=False, single_token=False, zero_adv=False)
    c.lengths[:] = [2]
    c.logp[:] = -1.0
    c.old[:] = -1.0 - np.log(1.5)
    c.mask[:] = [[True, False]]
    c.advantages[:] = [1.0]
    return c


def test_loss_of_a_step_with_a_single_valid_token(tmp_path):
    # Every normalisation divides by one token (or one sequence): -1.2, dr_grpo -1.2 / (1 · 4). A count
    # clamped to >= 2 instead of >= 1 would halve it; the token count must not be taken for "none".
    c = _one_token_call()
    want = {"grpo": -1.2, "dapo": -1.2, "bnpo": -1.2, "luspo": -1.2, "cispo": None, "dr_grpo": -0.3}
    for lt, w in want.items():
        cfg = {"loss_type": lt, "max_completion_length": 4}
        if lt == "cispo":  # -min(1.5, 5)·A·logp = 1.5 · 1 · (-1.0) · (-1)
            cfg["epsilon_high"], w = 5.0, 1.5
        run = write_run(tmp_path / lt, [c], config=cfg)
        for profile in ("grpolens", "trl"):
            got = grpolens.recompute(run, profile=profile, write=False)["loss"][0]
            assert got == pytest.approx(w, rel=1e-6), (lt, profile)
    # TRL's dapo divides by its generation round's tokens (samples column ``generation``): one here
    run = write_run(tmp_path / "rounds", [c], config={"loss_type": "dapo"}, samples=round_samples([c], {0: 0}))
    assert grpolens.recompute(run, profile="trl", write=False)["loss"][0] == pytest.approx(-1.2, rel=1e-6)


def test_loss_without_reference_log_probs_when_beta_is_zero(tmp_path):
    # no KL term in the loss, so a run without ref_logp has every loss it needs
    calls = random_calls(np.random.default_rng(26), ref=False, spread=0.5)
    cfg = {"loss_type": "grpo", "beta": 0.0}
    got = grpolens.recompute(write_run(tmp_path / "run", calls, config=cfg), write=False)
    for step in (0, 1):
        assert approx(got.filter(got["step"] == step)["loss"][0], ref_pooled(calls, step, cfg)), step


def _as_trl(run, version: str):
    import json

    m = json.loads((run / "grpolens.json").read_text())
    m["trainer"] = {"name": "trl", "version": version}
    (run / "grpolens.json").write_text(json.dumps(m))
    return run


def test_trl_luspo_before_1_10_is_null_only_where_its_loss_is_per_token(tmp_path):
    """TRL < 1.10 averaged luspo's L·len over padded positions once L is per token, that is with a KL
    term or token-level importance sampling (huggingface/trl#6654): null there. A sequence-level loss
    without KL is one value per sequence, which padding does not change: TRL's number."""
    calls = random_calls(np.random.default_rng(27), steps=(0,), ranks=2, micro_batches=2, spread=0.5)
    cases = [({"beta": 0.0, "importance_sampling_level": "sequence"}, True),
             ({"beta": 0.0, "importance_sampling_level": "token"}, False),
             ({"beta": 0.04, "importance_sampling_level": "sequence"}, False)]
    for i, (extra, defined) in enumerate(cases):
        cfg = {"loss_type": "luspo", **extra}
        got = grpolens.recompute(_as_trl(write_run(tmp_path / str(i), calls, config=cfg), "1.9.0"),
                                 profile="trl", write=False)["loss"][0]
        if defined:
            assert approx(got, ref_trl(calls, 0, cfg)), extra
        else:
            assert got is None, extra


@pytest.mark.parametrize("version,factor_applies", [("1.9.0", False), ("1.10.0", True)])
def test_trl_round_token_count_factor_follows_the_release(tmp_path, version, factor_applies):
    """dapo with two generation rounds per step (S = 2 micro-batches per round, G = 4): from TRL 1.10
    (PR #6024) each call divides by N/P · G/S, before it by N/P."""
    rng = np.random.default_rng(33)
    calls = random_calls(rng, micro_batches=4, batch=3, max_len=10, spread=0.5)
    rounds = {int(s): 2 * c.step + c.micro_batch // 2 for c in calls for s in c.sample_ids}
    S, G = 2, 4
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": G, "steps_per_generation": S}
    run = _as_trl(write_run(tmp_path / "run", calls, config=cfg, samples=round_samples(calls, rounds)), version)
    trl = grpolens.recompute(run, profile="trl", write=False)
    for step in (0, 1):
        want = ref_trl_rounds(calls, step, cfg, rounds, S if factor_applies else G, G)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], want), step


def test_log_ratio_clamp_applies_below_too(tmp_path):
    # one token, d = -25, A = +1: the PPO term is -min(r, clip(r)) · 1 = -r, with r = e^d and d
    # clamped to -20 first: -e^-20 (unclamped it would be -e^-25)
    c = _one_token_call()
    c.logp[:] = -30.0
    c.old[:] = -5.0
    run = write_run(tmp_path / "run", [c], config={"loss_type": "dapo", "log_ratio_clamp": 20})
    assert grpolens.recompute(run, write=False)["loss"][0] == pytest.approx(-np.exp(-20.0), rel=1e-9)


def test_trl_round_token_count_when_the_step_also_generated_a_later_round(tmp_path):
    """As above (S = 4 > G = 2, one round trained at steps 0 and 1), and step 1 also generated the
    next round, whose completions (lower sample ids here) are trained on later: the step's own
    samples do not hold the sequences it trains on, so N comes from the run's samples again."""
    import pyarrow as pa

    rng = np.random.default_rng(32)
    calls = random_calls(rng, micro_batches=2, batch=3)
    for c in calls:
        c.sample_ids = c.sample_ids + 1000
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": 2, "steps_per_generation": 4}
    rounds = {int(s): 0 for c in calls for s in c.sample_ids}
    samples = round_samples(calls, rounds, at_step=0)
    samples[1] = pa.table({
        "step": pa.array([1] * 3, pa.int64()), "rank": pa.array([0] * 3, pa.int32()),
        "sample_id": pa.array([0, 1, 2], pa.int64()), "group_id": pa.array([0, 1, 2], pa.int64()),
        "completion_len": pa.array([4, 5, 6], pa.int32()), "truncated": pa.array([False] * 3, pa.bool_()),
        "generation": pa.array([1] * 3, pa.int64())})
    trl = grpolens.recompute(write_run(tmp_path / "run", calls, config=cfg, samples=samples), profile="trl", write=False)
    n_round = float(sum(c.lengths.sum() for c in calls))
    for step in (0, 1):
        total = sum(ref_token_loss(c, cfg)[0].sum() for c in calls if c.step == step)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], 4 / 2 * total / n_round), step


def test_trl_token_count_of_one_completion_steps_with_and_without_rounds(tmp_path):
    """One completion per step (a samples table of one row): its round's N is its own valid tokens
    (some masked here, so not its completion_len). Samples without the ``generation`` column: one
    round per step, N the step's tokens -- the same number here, reached without the round table."""
    rng = np.random.default_rng(34)
    calls = random_calls(rng, ranks=1, micro_batches=1, batch=1, max_len=12, single_token=False, spread=0.5)
    for c in calls:
        c.lengths[:] = 12
        c.mask[:] = False
        c.mask[0, :9] = True  # 9 of the 12 generated tokens are in the loss
    cfg = {"loss_type": "dapo"}
    rounds = {int(c.sample_ids[0]): c.step for c in calls}
    with_rounds = round_samples(calls, rounds)
    without = {step: t.drop_columns(["generation"]) for step, t in with_rounds.items()}
    for name, samples in (("rounds", with_rounds), ("no_rounds", without)):
        trl = grpolens.recompute(write_run(tmp_path / name, calls, config=cfg, samples=samples), profile="trl", write=False)
        for step in (0, 1):
            want = ref_trl_rounds(calls, step, cfg, rounds, 1, 1)
            assert approx(trl.filter(trl["step"] == step)["loss"][0], want), (name, step)


def test_trl_token_count_per_generation_round_with_unordered_ids_beyond_float_precision(tmp_path):
    """The rounds' N found by sample id: ids from 2⁵³ up (where float64 merges neighbours: an id is
    an int64) and a samples table not in id order (each rank's shard, rank 0's ids the highest)."""
    rng = np.random.default_rng(33)
    calls = random_calls(rng, micro_batches=4, batch=3, max_len=10, spread=0.5)
    top = max(int(s) for c in calls for s in c.sample_ids)
    for c in calls:
        c.sample_ids = (2**53 + top - c.sample_ids.astype(np.int64)).astype(np.int64)
    rounds = {int(s): 2 * c.step + c.micro_batch // 2 for c in calls for s in c.sample_ids}
    full = {"loss_type": "dapo", "gradient_accumulation_steps": 4, "steps_per_generation": 2}
    samples = round_samples(calls, rounds)
    for t in samples.values():  # rank 0's shard is read first: the ids as read are out of order
        assert (np.diff(np.concatenate([t.filter(pa_equal(t, r)).column("sample_id").to_numpy() for r in (0, 1)])) < 0).any()
    run = write_run(tmp_path / "run", calls, config=full, samples=samples)
    trl = grpolens.recompute(run, profile="trl", write=False)
    for step in (0, 1):
        want = ref_trl_rounds(calls, step, full, rounds, 2, 4)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], want), step


def pa_equal(t, rank: int):
    import pyarrow.compute as pc

    return pc.equal(t.column("rank"), rank)


def test_trl_token_count_of_rounds_straddling_steps_with_ids_beyond_float_precision(tmp_path):
    """S = 4 > G = 2, two rounds (generated at steps 0 and 2, each trained on over two steps), sample
    ids from 2⁵³ up: float64 would merge neighbouring ids of the two rounds and give a call the other
    round's N. Each step: (S/G) Σ over its calls Σ L / N_round, N_round its round's completion_len total."""
    rng = np.random.default_rng(34)
    calls = random_calls(rng, steps=(0, 1, 2, 3), micro_batches=2, batch=3)
    for c in calls:
        c.sample_ids = (2**53 + 1 + c.sample_ids.astype(np.int64)).astype(np.int64)
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": 2, "steps_per_generation": 4}
    rounds = {int(s): c.step // 2 for c in calls for s in c.sample_ids}
    first = {k: min(s for s, r in rounds.items() if r == k) for k in (0, 1)}
    assert float(first[1]) == float(first[1] - 1)  # the first id of round 1 and the last of round 0, as floats
    samples = {**round_samples([c for c in calls if c.step == 0 or c.step == 1], rounds, at_step=0),
               **round_samples([c for c in calls if c.step >= 2], rounds, at_step=2)}
    run = write_run(tmp_path / "run", calls, config=cfg, samples=samples)
    trl = grpolens.recompute(run, profile="trl", write=False)
    n_round = {k: float(sum(c.lengths.sum() for c in calls if c.step // 2 == k)) for k in (0, 1)}
    assert n_round[0] != n_round[1]
    for step in range(4):
        total = sum(ref_token_loss(c, cfg)[0].sum() for c in calls if c.step == step)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], 4 / 2 * total / n_round[step // 2]), step


@pytest.mark.parametrize("cfg", [{"loss_type": "vespo"}, {"loss_type": "vespo", "vespo_k_neg": 0.5, "vespo_lambda_pos": 1.0}])
def test_vespo_phi_mean(tmp_path, cfg):
    """TRL's ``vespo/phi_seq_mean``: per micro-batch slot Σ φ over every row of every rank (fully
    masked rows count, with φ = 1) ÷ the rows, then the mean over the step's slots; the canonical
    value is the mean over all the step's sequences."""
    rng = np.random.default_rng(8)
    calls = random_calls(rng, nonfinite=0.05, spread=0.6, batch=5, max_len=12)
    calls[0].mask[1] = False  # a fully masked row
    run = write_run(tmp_path / "run", calls, config=cfg)
    got = grpolens.recompute(run, write=False)
    trl = grpolens.recompute(run, profile="trl", write=False, per_step=True)
    for step in (0, 1):
        cs = [c for c in calls if c.step == step]
        phis = [ref_vespo_phi(c, cfg) for c in cs]
        assert approx(got.filter(got["step"] == step)["loss/vespo_phi_mean"][0], np.mean(np.concatenate(phis)), rel=1e-12)
        slots = sorted({c.micro_batch for c in cs})
        per_slot = [np.concatenate([p for c, p in zip(cs, phis) if c.micro_batch == m]).mean() for m in slots]
        assert approx(trl.filter(trl["step"] == step)["vespo/phi_seq_mean"][0], np.mean(per_slot), rel=1e-12)
    assert ref_vespo_phi(calls[0], cfg)[1] == 1.0


def test_vespo_hand_worked(tmp_path):
    """One row, A = +1, log-ratios 0.2 and 0.1: ℓ = 0.3, φ = e^(3 + 2·0.3 − 3·e^0.3)."""
    from tests.refdata import LossCall

    logp = f32(np.array([[-1.0, -2.0]]))
    old = f32(logp - np.array([[0.2, 0.1]]))
    c = LossCall(0, 0, 0, np.array([0]), np.array([2]), logp, np.ones((1, 2), bool), np.array([1.0]), old=old)
    run = write_run(tmp_path / "run", [c], config={"loss_type": "vespo"})
    row = grpolens.recompute(run, write=False).row(0, named=True)
    ell = float((logp - old).sum())
    phi = np.exp(3 + 2 * ell - 3 * np.exp(ell))
    assert abs(ell - 0.3) < 1e-6
    assert approx(row["loss/vespo_phi_mean"], phi, rel=1e-12)
    assert approx(row["loss"], -phi * float(logp.sum()) / 2, rel=1e-12)  # Σ −φ·A·logp / 2 tokens
