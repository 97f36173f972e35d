"""VESPO with TRL's vLLM importance-sampling correction: TRL folds the token IS ratios into φ
(``get_gamma_weights``) instead of multiplying the loss by them. Judged by the numpy transcription
in tests/metrics/loss_reference.py (``ref_vespo_phi``, ``ref_pooled``, ``ref_trl``); TRL trained live is
tests/integration/test_trl_logging_windows.py (``window_vespo_is_*``)."""

import numpy as np
import pytest

import grpolens
from grpolens.errors import UserError
from tests.metrics.loss_reference import ref_pooled, ref_trl, ref_vespo_phi
from tests.refdata import LossCall, approx, f32, random_calls, write_run


def _is(mode: str, lo: float | None, hi: float | None = 3.0) -> dict:
    return {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": mode,
            "vllm_importance_sampling_clip_min": lo, "vllm_importance_sampling_clip_max": hi}


CASES = [
    ({"loss_type": "vespo"}, _is("token_truncate", 0.9, 1.1)),
    ({"loss_type": "vespo", "beta": 0.04}, _is("token_truncate", None, 1.2)),  # TRL's clip_min default: none
    ({"loss_type": "vespo"}, _is("token_mask", 0.8, 1.25)),
    ({"loss_type": "vespo", "beta": 0.04, "vespo_k_neg": 0.5, "vespo_lambda_pos": 1.0}, _is("token_mask", 0.5, 2.0)),
]


def _calls(seed: int):
    """Ragged calls with NaN/inf log-probs, an all-masked row, a single-token row, a zero advantage,
    and a rollout engine off enough that the bands bite."""
    rng = np.random.default_rng(seed)
    calls = random_calls(rng, nonfinite=0.05, spread=0.5, batch=5, max_len=12)
    for c in calls:
        c.rollout = np.where(np.isfinite(c.rollout), f32(-np.abs(c.rollout + rng.normal(scale=0.15, size=c.rollout.shape))), c.rollout)
    return calls


@pytest.mark.parametrize("cfg,ris", CASES, ids=lambda x: str(x.get("vllm_importance_sampling_mode") or x.get("beta", "")))
def test_vespo_loss_and_phi_with_vllm_is(tmp_path, cfg, ris):
    calls = _calls(31)
    full = {**cfg, "rollout_is": ris}
    run = write_run(tmp_path / "run", calls, config=full)
    split = write_run(tmp_path / "split", calls, config=full, parts=3, rng=np.random.default_rng(1))
    got = grpolens.recompute(run, write=False)
    trl = grpolens.recompute(run, profile="trl", write=False, per_step=True)
    assert grpolens.recompute(split, write=False).equals(got)  # merging random cuts = one pass
    for step in (0, 1):
        cs = [c for c in calls if c.step == step]
        phis = [ref_vespo_phi(c, full) for c in cs]
        plain = [ref_vespo_phi(c, cfg) for c in cs]
        assert not approx(np.mean(np.concatenate(phis)), np.mean(np.concatenate(plain)), rel=1e-3)  # IS matters here
        at, tat = got.filter(got["step"] == step), trl.filter(trl["step"] == step)
        assert approx(at["loss/vespo_phi_mean"][0], np.mean(np.concatenate(phis)), rel=1e-12)
        slots = sorted({c.micro_batch for c in cs})
        per_slot = [np.concatenate([p for c, p in zip(cs, phis) if c.micro_batch == m]).mean() for m in slots]
        assert approx(tat["vespo/phi_seq_mean"][0], np.mean(per_slot), rel=1e-12)
        assert approx(at["loss"][0], ref_pooled(calls, step, full), rel=1e-12)
        assert approx(tat["loss"][0], ref_trl(calls, step, full), rel=1e-12)
    # the all-masked row: no policy term, and off the mask TRL's ratio is 1 (ln 1 = 0): φ = 1
    assert ref_vespo_phi(calls[0], full)[1] == 1.0


def _two_token_call(ratios, rollout_nan=False):
    logp = f32(np.array([[-1.0, -2.0]]))
    rollout = f32(logp - np.log(np.array([ratios])))  # old = logp: the policy ratio is 1
    if rollout_nan:
        rollout[0, 1] = np.nan
    return LossCall(0, 0, 0, np.array([0]), np.array([2]), logp, np.ones((1, 2), bool), np.array([1.0]),
                    old=logp.copy(), rollout=rollout)


@pytest.mark.parametrize("mode,lo,hi,ratios,ell,nan", [
    # token_truncate [0.8, 1.5]: ratios 2.0 and 0.5 -> 1.5 and 0.8, ℓ = ln 1.2
    ("token_truncate", 0.8, 1.5, [2.0, 0.5], np.log(1.2), False),
    # token_mask [0.8, 1.25]: 1.2 stays, 0.5 -> 0 whose log clamps to ln 1e-8: ℓ = ln(1.2e-8)
    ("token_mask", 0.8, 1.25, [1.2, 0.5], np.log(1.2e-8), False),
    # both masked: ℓ = 2 ln 1e-8, clamped to ln 1e-8
    ("token_mask", 0.8, 1.25, [2.0, 0.5], np.log(1e-8), False),
    # the engine gave no log-prob for the second token: TRL's nan_to_num makes its ratio 1
    ("token_truncate", 0.8, 1.5, [2.0, 0.5], np.log(1.5), True),
])
def test_vespo_with_vllm_is_hand_worked(tmp_path, mode, lo, hi, ratios, ell, nan):
    """One row, A = +1, logp = old, so ℓ is the IS term alone; φ = e^(3 + 2ℓ − 3e^ℓ) (TRL's defaults
    k_pos 2, λ_pos 3) and the loss −φ·Σ logp / 2 tokens = 1.5·φ, never × the IS ratio."""
    c = _two_token_call(ratios, rollout_nan=nan)
    run = write_run(tmp_path / "run", [c], config={"loss_type": "vespo", "rollout_is": _is(mode, lo, hi)})
    phi = np.exp(3 + 2 * ell - 3 * np.exp(ell))
    for profile, key in (("grpolens", "loss/vespo_phi_mean"), ("trl", "vespo/phi_seq_mean")):
        row = grpolens.recompute(run, profile=profile, write=False).row(0, named=True)
        assert row[key] == pytest.approx(phi, rel=1e-6), profile
        assert row["loss"] == pytest.approx(1.5 * phi, rel=1e-6), profile


def test_vespo_with_vllm_is_but_no_rollout_logp_is_null(tmp_path):
    calls = random_calls(np.random.default_rng(5), rollout=False)
    run = write_run(tmp_path / "run", calls, config={"loss_type": "vespo", "rollout_is": _is("token_truncate", 0.9, 1.1)})
    for profile, key in (("grpolens", "loss/vespo_phi_mean"), ("trl", "vespo/phi_seq_mean")):
        out = grpolens.recompute(run, profile=profile, write=False)
        assert out["loss"].to_list() == [None, None] and out[key].to_list() == [None, None], profile


@pytest.mark.parametrize("ris,says", [
    (_is("sequence_mask", None, 3.0), "token_truncate and token_mask"),
    (_is("sequence_truncate", 0.5, 2.0), "token_truncate and token_mask"),
    ({"level": "token", "mode": "mask", "lower": 0.5, "upper": 2.0}, "token_truncate and token_mask"),
    ({"level": "token", "mode": "truncate", "upper": 2.0, "veto_upper": 10.0}, "no veto"),
    (_is("token_truncate", 1.1, 3.0), "excludes 1"),
    (_is("token_mask", 0.5, 0.9), "excludes 1"),
])
def test_vespo_with_other_is_configs_is_refused_by_name(tmp_path, ris, says):
    calls = random_calls(np.random.default_rng(6))
    run = write_run(tmp_path / "run", calls, config={"loss_type": "vespo", "rollout_is": ris})
    with pytest.raises(UserError, match=f"config key 'rollout_is': loss_type vespo .*{says}"):
        grpolens.recompute(run, write=False)
