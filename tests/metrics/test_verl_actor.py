"""verl's actor metrics (grpolens/metrics/verl_actor.py) on small hand-worked runs.

verl's own code judges the profile on random ragged steps in tests/reference/test_verl_reference.py;
these tests pin what those steps do not reach (settings the profile refuses, edge cases), with
values worked by hand from verl 0.9.1's formulas (the module doc)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import grpolens
from grpolens.errors import UserError
from grpolens.integrations.verl import VerlCapture, verl_config


def verl_run(run, actor: dict, logp, old, adv, calls, *, algorithm: dict | None = None, dp: int = 1, ref=None,
             rollout=None, mask=None, old_entropy=None):
    """One step of a verl run written through VerlCapture, as verl's actor hands it over: rows of
    (B, T) per-token ``logp`` / ``old`` / ``adv`` (NaN off the response), ``calls`` the loss calls
    in order, each (rank, rows); rank r holds rows r·B/dp to (r + 1)·B/dp − 1. ``actor`` defaults to
    one mini-batch of every row (a key set to None is left out). ``rollout``: the rollout's log-probs;
    ``mask``: the loss mask where it is not every response token (multi-turn tool output: a response
    token off the loss); ``old_entropy``: the old-log-prob pass' entropies, with the loss mask as the
    mask before rejection."""
    logp, old, adv = (np.asarray(x, dtype=np.float32) for x in (logp, old, adv))
    B, T = logp.shape
    valid = ~np.isnan(logp)
    loss_mask = valid if mask is None else valid & np.asarray(mask, dtype=bool)
    z = lambda x: torch.tensor(np.where(valid, x, 0.0).astype(np.float32))  # noqa: E731
    per_rank = B // dp
    actor = {k: v for k, v in ({"ppo_mini_batch_size": 1, "rollout_n": B} | actor).items() if v is not None}
    cfg = verl_config(actor, algorithm or {})
    for r in range(dp):
        chunk = slice(r * per_rank, (r + 1) * per_rank)
        batch = {"responses": torch.tensor(np.where(valid, 5, 0)[chunk]),
                 "attention_mask": torch.tensor(np.concatenate([np.ones((B, 1)), valid], 1).astype(np.int64)[chunk]),
                 "response_mask": torch.tensor(loss_mask[chunk]), "old_log_probs": z(old)[chunk],
                 "advantages": z(adv)[chunk]}
        if ref is not None:
            batch["ref_log_prob"] = z(ref)[chunk]
        if rollout is not None:
            batch["rollout_log_probs"] = z(rollout)[chunk]
        if old_entropy is not None:
            batch[VerlCapture.OLD_ENTROPY_KEY] = z(old_entropy)[chunk]
            batch[VerlCapture.PRE_REJECTION_MASK_KEY] = torch.tensor(loss_mask[chunk])
        cap = VerlCapture(run, config=cfg, rank=r, world_size=dp)
        cap.begin_step(SimpleNamespace(batch=batch, non_tensor_batch={}, meta_info={"global_steps": 1}))
        for rank, rows in calls:
            if rank == r:
                local = torch.tensor(rows) - r * per_rank
                cap.log_micro_batch({k: v[local] for k, v in batch.items()}, log_prob=z(logp)[torch.tensor(rows)])
        cap.end_step()
        cap.close()
    return run


@pytest.mark.parametrize("actor, key, value, choices", [
    ({"use_kl_loss": True, "kl_loss_type": "k4"}, "kl_loss_type", "'k4'",
     "kl, k1, abs, mse, k2, low_var_kl and k3, each optionally with +"),
    ({"policy_loss": {"loss_mode": "ppo_plus"}}, "policy_loss.loss_mode", "'ppo_plus'",
     "vanilla, gspo, cispo, sapo, gpg, dro, geo_mean, dppo_tv, dppo_kl, kl_cov and clip_cov"),
    # verl's DRO requires a positive dro_beta (PolicyLossConfig has none by default)
    ({"policy_loss": {"loss_mode": "dro"}}, "policy_loss.dro_beta", "None", "a positive number (verl requires one for dro)"),
    ({"loss_agg_mode": "seq-sum"}, "loss_agg_mode", "'seq-sum'",
     "token-mean, token-sum, seq-mean-token-sum, seq-mean-token-sum-norm and seq-mean-token-mean"),
])
def test_a_verl_setting_the_profile_does_not_know_is_refused_by_name(tmp_path, actor, key, value, choices):
    nan = np.nan
    run = verl_run(tmp_path / "run", actor, logp=[[-1.0, -0.5], [-0.2, nan]], old=[[-1.0, -0.6], [-0.3, nan]],
                   adv=[[1.0, 1.0], [-1.0, nan]], calls=[(0, [0, 1])], ref=[[-1.0, -0.5], [-0.2, nan]])
    with pytest.raises(UserError) as e:
        grpolens.recompute(run, profile="verl", write=False)
    # the key, what the profile knows (verl 0.9.1's kl_penalty, policy losses and agg_loss modes), the value
    assert e.value.message == f"config key 'verl_actor.{key}': the verl profile supports {choices}, got {value}"


def test_an_unknown_bypass_loss_type_is_refused_by_name(tmp_path):
    nan = np.nan
    corr = {"bypass_mode": True, "loss_type": "gspo"}
    run = verl_run(tmp_path / "run", {}, logp=[[-1.0, -0.5], [-0.2, nan]], old=[[-1.0, -0.6], [-0.3, nan]],
                   adv=[[1.0, 1.0], [-1.0, nan]], calls=[(0, [0, 1])], algorithm={"rollout_correction": corr})
    with pytest.raises(UserError) as e:
        grpolens.recompute(run, profile="verl", write=False)
    # verl 0.9.1's bypass mode has two losses; anything else was computed as ppo_clip without a word
    assert e.value.message == ("config key 'verl_algorithm.rollout_correction.loss_type': the verl profile "
                               "supports ppo_clip and reinforce, got 'gspo'")


NAN = np.nan
#: two completions, 2 and 1 tokens, on-policy (r = 1): vanilla L = −A per token, A = 1, 1 | −1
ON_POLICY = dict(logp=[[-1.0, -0.5], [-0.2, NAN]], old=[[-1.0, -0.5], [-0.2, NAN]], adv=[[1.0, 1.0], [-1.0, NAN]],
                 calls=[(0, [0, 1])])


def _actor_values(run, **kw) -> dict:
    df = grpolens.recompute(run, profile="verl", write=False, **kw)
    return {k: v for k, v in df.row(0, named=True).items() if k.startswith("actor/") and v is not None}


def test_mini_batch_without_rollout_n_is_ppo_mini_batch_size_sequences(tmp_path):
    # rollout_n unset: one sequence per prompt, G = ppo_mini_batch_size = 2 = the step's sequences:
    # one mini-batch, token-mean pg_loss = Σ −A / N = (−1 − 1 + 1) / 3
    run = verl_run(tmp_path / "run", {"ppo_mini_batch_size": 2, "rollout_n": None}, **ON_POLICY)
    v = _actor_values(run)
    assert v["actor/pg_loss"] == pytest.approx(-1 / 3, rel=1e-6)
    assert v["actor/pg_clipfrac"] == 0.0 and v["actor/ppo_kl"] == 0.0


def test_without_ppo_mini_batch_size_no_actor_loss_is_reported(tmp_path):
    # the mini-batch size is unknown: no loss call can be placed in a mini-batch, so no actor/pg_loss
    # (rather than one computed with a guessed size)
    run = verl_run(tmp_path / "run", {"ppo_mini_batch_size": None}, **ON_POLICY)
    v = _actor_values(run)
    assert not any(k in v for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/loss"))


def test_a_verl_actor_setting_that_is_not_a_table_gives_no_actor_metrics(tmp_path):
    run = verl_run(tmp_path / "run", {}, **ON_POLICY)
    assert "actor/pg_loss" in _actor_values(run)
    assert not _actor_values(run, overrides={"verl_actor": "fsdp"})


@pytest.mark.parametrize("mini_batch_size", [1, 2])
def test_loss_calls_fall_into_mini_batches_in_call_order(tmp_path, mini_batch_size):
    # four one-token completions, one loss call each, A = 1, 1, 1, 5 (r = 1, L = −A): token-mean
    # per mini-batch Σ L / N, then the mean over mini-batches. Two sequences per mini-batch:
    # {−1, −1}, {−1, −5} -> mean(−1, −3) = −2; one per mini-batch: mean(−1, −1, −1, −5) = −2
    # (calls grouped {0}, {1, 2}, {3} would give −7/3)
    run = verl_run(tmp_path / "run", {"ppo_mini_batch_size": mini_batch_size, "rollout_n": 1},
                   logp=[[-1.0]] * 4, old=[[-1.0]] * 4, adv=[[1.0], [1.0], [1.0], [5.0]],
                   calls=[(0, [0]), (0, [1]), (0, [2]), (0, [3])])
    assert _actor_values(run)["actor/pg_loss"] == pytest.approx(-2.0, rel=1e-6)


def _f32(*x) -> np.ndarray:
    """Values as the run stores them (float32), for expected values worked from what grpolens reads."""
    return np.asarray(x, dtype=np.float32).astype(np.float64)


#: verl's bypass mode with its REINFORCE loss, L = −A·logp·w (w the loss' IS weight against the
#: rollout, token TIS at 2), the weights divided by their mean over the ranks' calls made together
BYPASS_BN = {"rollout_correction": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token",
                                    "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True}}


def test_bypass_batch_normalize_of_a_call_of_one_token(tmp_path):
    # one completion of one token, one loss call, one mini-batch: w = e^(logp − rollout) = e^0.2, its
    # mean over the call's one token is w, so the normalised weight is 1 and L = −A·logp = 1 (N = 1);
    # verl logs the factor w (rollout_is_batch_norm_factor) and the applied weights' mean before it, w
    lp, ro = _f32(-1.0, -1.2)
    w = np.exp(lp - ro)
    run = verl_run(tmp_path / "run", {"ppo_mini_batch_size": 1, "rollout_n": 1}, logp=[[-1.0]], old=[[-1.2]],
                   rollout=[[-1.2]], adv=[[1.0]], calls=[(0, [0])], algorithm=BYPASS_BN)
    v = _actor_values(run)
    assert v["actor/pg_loss"] == pytest.approx(1.0, rel=1e-6)
    assert v["actor/rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(w, rel=1e-6)
    assert v["actor/rollout_corr/rollout_is_mean"] == pytest.approx(w, rel=1e-6)


def test_bypass_batch_normalize_leaves_a_weight_mean_not_above_1e_8_as_it_is(tmp_path):
    # two calls of one one-token completion in one mini-batch (N = 2): call 0's weight e^0.2 is its
    # own mean (normalised: 1, L = −A·logp = 1); call 1's e^−20 ≈ 2e-9 is not above 1e-8, so verl
    # leaves it (factor 1.0): L = 20.5·e^−20. pg_loss = Σ L / N; the factor's mean over the calls (1 + e^0.2) / 2
    lp, ro = _f32(-1.0, -20.5), _f32(-1.2, -0.5)
    w = np.exp(lp - ro)
    assert w[1] < 1e-8
    run = verl_run(tmp_path / "run", {}, logp=[[-1.0], [-20.5]], old=[[-1.2], [-0.5]], rollout=[[-1.2], [-0.5]],
                   adv=[[1.0], [1.0]], calls=[(0, [0]), (0, [1])], algorithm=BYPASS_BN)
    v = _actor_values(run)
    assert v["actor/pg_loss"] == pytest.approx((1.0 + -lp[1] * w[1]) / 2, rel=1e-6)
    assert v["actor/rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx((w[0] + 1.0) / 2, rel=1e-6)


def test_bypass_batch_normalize_leaves_a_weight_mean_of_exactly_1e_8_as_it_is(tmp_path):
    # verl divides by the mean only when it is above 1e-8. One call of one two-token completion whose
    # weights e^(logp − rollout) sum to exactly 2e-8 in float64 (found by search over float32 inputs;
    # checked here): the mean is exactly 1e-8, so the factor is 1.0 and L = −A·logp·w unnormalised
    lp, ro = _f32(-18.5, -18.347192764282227), _f32(0.0, 5.257524549051595e-07)
    w = np.exp(lp - ro)
    assert w.sum() / 2 == 1e-8
    run = verl_run(tmp_path / "run", {}, logp=[[-18.5, -18.347192764282227]], old=[[0.0, 5.257524549051595e-07]],
                   rollout=[[0.0, 5.257524549051595e-07]], adv=[[1.0, 1.0]], calls=[(0, [0])], algorithm=BYPASS_BN)
    v = _actor_values(run)
    assert v["actor/rollout_corr/rollout_is_batch_norm_factor"] == 1.0
    assert v["actor/pg_loss"] == pytest.approx(-(lp * w).sum() / 2, rel=1e-6)


def test_bypass_statistic_undefined_in_one_mini_batch_leaves_out_that_statistic_only(tmp_path):
    # two mini-batches of one one-token call each, IcePop band [0.5, 1.2]: mini-batch 0's weight
    # w = e^0.1 is kept, mini-batch 1's e^0.5 is zeroed. There every applied weight is 0, so the ESS is
    # undefined (verl's 1/mean(ŵ²) raises ZeroDivisionError): the ESS is left out, and the statistics
    # after it in verl's list keep their values, reduced over the mini-batches by verl's rule
    w = np.exp(_f32(-1.0) - _f32(-1.1))[0]
    corr = {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.5_1.2"}
    run = verl_run(tmp_path / "run", {"rollout_n": 1}, logp=[[-1.0], [-0.5]], old=[[-1.1], [-1.0]],
                   rollout=[[-1.1], [-1.0]], adv=[[1.0], [1.0]], calls=[(0, [0]), (0, [1])],
                   algorithm={"rollout_correction": corr})
    v = {k.removeprefix("actor/rollout_corr/rollout_is_"): x for k, x in _actor_values(run).items()}
    assert "eff_sample_size" not in v
    assert v["mean"] == v["seq_mean"] == pytest.approx(w / 2, rel=1e-12)
    assert (v["seq_max"], v["seq_min"], v["oob_ratio"]) == (pytest.approx(w, rel=1e-12), 0.0, 0.5)


def test_a_bypass_loss_call_without_a_loss_token_keeps_its_weights_as_they_are(tmp_path):
    # call 1's only token is off the loss mask (verl itself raises on such a call: compute_is_metrics
    # wants a token); its weights' mean is 0/0, not above 1e-8, so factor 1.0 and no loss. Call 0:
    # normalised weight 1, L = 1 over N = 1 token
    run = verl_run(tmp_path / "run", {}, logp=[[-1.0], [-0.5]], old=[[-1.2], [-0.7]], rollout=[[-1.2], [-0.7]],
                   mask=[[1], [0]], adv=[[1.0], [1.0]], calls=[(0, [0]), (0, [1])], algorithm=BYPASS_BN)
    assert _actor_values(run)["actor/pg_loss"] == pytest.approx(1.0, rel=1e-6)


def test_bypass_sequence_level_batch_normalize_averages_the_sequences_with_a_token(tmp_path):
    # one call, sequence-level IS: completion 0's weight e^(0.2 + 0.1), completion 1 entirely off the
    # loss mask (tool output). verl's mean over sequences counts only those with a token (seq_mask), so
    # the factor is completion 0's weight, its normalised weight 1: L = −A·logp = 1 + 0.5 over N = 2
    lp, ro = _f32(-1.0, -0.5), _f32(-1.2, -0.6)
    w = np.exp((lp - ro).sum())
    corr = {**BYPASS_BN["rollout_correction"], "rollout_is": "sequence"}
    run = verl_run(tmp_path / "run", {}, logp=[[-1.0, -0.5], [-0.3, -0.2]], old=[[-1.2, -0.6], [-0.4, -0.1]],
                   rollout=[[-1.2, -0.6], [-0.4, -0.1]], mask=[[1, 1], [0, 0]], adv=[[1.0, 1.0], [1.0, 1.0]],
                   calls=[(0, [0, 1])], algorithm={"rollout_correction": corr})
    v = _actor_values(run)
    assert v["actor/pg_loss"] == pytest.approx(1.5 / 2, rel=1e-6)
    assert v["actor/rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(w, rel=1e-6)


@pytest.mark.parametrize("corr, pg_loss", [
    # bypass REINFORCE without rollout log-probs: no IS weight, no factor: Σ −A·logp / N = (1 + 0.5 − 0.2) / 3
    ({"bypass_mode": True, "loss_type": "reinforce"}, 1.3 / 3),
    # decoupled mode (the driver's weights), on-policy: vanilla L = −A, (−1 − 1 + 1) / 3
    ({}, -1 / 3),
])
def test_batch_normalize_without_rollout_log_probs_divides_nothing(tmp_path, corr, pg_loss):
    # the run holds no rollout log-probs: there are no IS weights to normalise, whatever the config says
    corr = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True, **corr}
    run = verl_run(tmp_path / "run", {}, **ON_POLICY, algorithm={"rollout_correction": corr})
    v = _actor_values(run)
    assert v["actor/pg_loss"] == pytest.approx(pg_loss, rel=1e-6)
    assert not any(k.startswith("actor/rollout_corr/") for k in v)


def test_bypass_mode_with_a_verl_actor_setting_that_is_not_a_table_gives_no_actor_metrics(tmp_path):
    # the loss calls cannot be placed in mini-batches without the actor's settings: no rollout_corr either
    run = verl_run(tmp_path / "run", {}, **ON_POLICY, rollout=ON_POLICY["old"], algorithm=BYPASS_BN)
    assert "actor/rollout_corr/rollout_is_mean" in _actor_values(run)
    assert not _actor_values(run, overrides={"verl_actor": "fsdp"})


def test_bypass_corr_keys_are_reduced_by_verls_logged_names():
    # verl's reduce_metrics takes the max of a logged name containing "max", else the min of one containing
    # "min", else the mean; grpolens decides by its key, which must agree with verl's name for every key
    from grpolens.metrics.registry import REGISTRY
    from grpolens.metrics.verl_actor import _BYPASS_KEYS
    from grpolens.plugins import load_plugins

    load_plugins()
    rule = lambda s: "max" if "max" in s else "min" if "min" in s else "mean"  # noqa: E731
    names = {k: REGISTRY[f"verl_actor/rollout_corr/{k}"].name_in("verl") for k in _BYPASS_KEYS}
    assert all(names.values())
    assert {k: rule(k) for k in names} == {k: rule(n) for k, n in names.items()}
    assert {rule(k) for k in names} == {"max", "min", "mean"}


#: two completions of two tokens; the old-log-prob pass' entropies 1, 2 | 3, 4
OLD_ENT = dict(logp=[[-1.0, -0.5], [-0.2, -0.3]], old=[[-1.0, -0.5], [-0.2, -0.3]], adv=[[1.0, 1.0], [-1.0, -1.0]],
               calls=[(0, [0, 1])], old_entropy=[[1.0, 2.0], [3.0, 4.0]])


def test_bypass_mode_logs_no_old_entropy_even_when_the_run_holds_one(tmp_path):
    # actor/entropy is verl's old-log-prob pass' entropy (token-mean: 10 / 4); bypass mode has no such pass
    assert _actor_values(verl_run(tmp_path / "a", {}, **OLD_ENT))["actor/entropy"] == pytest.approx(2.5, rel=1e-6)
    bypassed = verl_run(tmp_path / "b", {}, **OLD_ENT, rollout=OLD_ENT["old"],
                        algorithm={"rollout_correction": {"bypass_mode": True}})
    assert "actor/entropy" not in _actor_values(bypassed)


def test_old_entropy_seq_mean_leaves_out_a_completion_without_a_token(tmp_path):
    # verl's agg_loss seq-mean-token-sum: Σ over sequences with a token (seq_mask) / their count;
    # completion 1 is entirely off the mask: 1 + 2 over 1 sequence (not 2)
    run = verl_run(tmp_path / "run", {"loss_agg_mode": "seq-mean-token-sum"}, **OLD_ENT, mask=[[1, 1], [0, 0]])
    assert _actor_values(run)["actor/entropy"] == pytest.approx(3.0, rel=1e-6)


def test_old_entropy_of_a_step_without_a_token_is_no_value(tmp_path):
    # every token off the mask: verl's token-mean is 0/0, NaN; grpolens reports no value, not NaN
    run = verl_run(tmp_path / "run", {}, **OLD_ENT, mask=[[0, 0], [0, 0]])
    assert "actor/entropy" not in _actor_values(run)
