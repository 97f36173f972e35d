"""Loss family: every variant against a numpy reference written from TRL's / the papers' formulas
(tests/metrics/loss_reference.py); TRL's per-round token count is in test_loss_trl_token_count.py."""

import numpy as np
import pytest

import grpolens
from tests.metrics.loss_reference import (
    ref_pooled,
    ref_trl,
    ref_vespo_phi,
    round_samples,
)
from tests.refdata import approx, f32, random_calls, write_run

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



def test_log_ratio_clamp_applies_below_too(tmp_path):
    # one token, d = -25, A = +1: the PPO term is -min(r, clip(r)) · 1 = -r, with r = e^d and d
    # clamped to -20 first: -e^-20 (unclamped it would be -e^-25)
    c = _one_token_call()
    c.logp[:] = -30.0
    c.old[:] = -5.0
    run = write_run(tmp_path / "run", [c], config={"loss_type": "dapo", "log_ratio_clamp": 20})
    assert grpolens.recompute(run, write=False)["loss"][0] == pytest.approx(-np.exp(-20.0), rel=1e-9)



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
