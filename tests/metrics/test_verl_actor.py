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


def verl_run(run, actor: dict, logp, old, adv, calls, *, algorithm: dict | None = None, dp: int = 1, ref=None):
    """One step of a verl run written through VerlCapture, as verl's actor hands it over: rows of
    (B, T) per-token ``logp`` / ``old`` / ``adv`` (NaN off the response), ``calls`` the loss calls
    in order, each (rank, rows); rank r holds rows r·B/dp to (r + 1)·B/dp − 1. ``actor`` defaults to
    one mini-batch of every row (a key set to None is left out)."""
    logp, old, adv = (np.asarray(x, dtype=np.float32) for x in (logp, old, adv))
    B, T = logp.shape
    valid = ~np.isnan(logp)
    z = lambda x: torch.tensor(np.where(valid, x, 0.0).astype(np.float32))  # noqa: E731
    per_rank = B // dp
    actor = {k: v for k, v in ({"ppo_mini_batch_size": 1, "rollout_n": B} | actor).items() if v is not None}
    cfg = verl_config(actor, algorithm or {})
    for r in range(dp):
        chunk = slice(r * per_rank, (r + 1) * per_rank)
        batch = {"responses": torch.tensor(np.where(valid, 5, 0)[chunk]),
                 "attention_mask": torch.tensor(np.concatenate([np.ones((B, 1)), valid], 1).astype(np.int64)[chunk]),
                 "response_mask": torch.tensor(valid[chunk]), "old_log_probs": z(old)[chunk],
                 "advantages": z(adv)[chunk]}
        if ref is not None:
            batch["ref_log_prob"] = z(ref)[chunk]
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
    ({"policy_loss": {"loss_mode": "geo_mean"}}, "policy_loss.loss_mode", "'geo_mean'", "vanilla, gspo, cispo and sapo"),
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
