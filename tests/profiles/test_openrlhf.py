"""The OpenRLHF profile against a numpy transcription of what OpenRLHF logs (PolicyLoss.forward's
``clip_ratio``/``ppo_kl``/``vllm_kl`` per micro-batch, ``ppo_train``'s token-weighted all-reduce and
merge over micro-batches, ``_compute_rollout_stats``), on ragged random loss calls, a one-sample
step, GSPO, and a hand-worked example."""

import math

import numpy as np

import grpolens
from tests.refdata import LossCall, approx, f32, random_calls, random_samples, samples_run

CFG = {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.0}


def masked_mean(x, m):
    return (x * m).sum() / m.sum()


def openrlhf_micro_batch(c: LossCall, eps_lo: float, eps_hi: float) -> dict:
    """openrlhf/models/loss.py PolicyLoss.forward (policy_loss_type="ppo") on one padded micro-batch."""
    m = c.mask.astype(float)
    raw = np.where(c.mask, c.logp - c.old, 0.0)
    ratio = np.exp(np.clip(raw, -20.0, 20.0))
    adv = c.adv_tok
    surr1 = ratio * adv
    surr2 = np.clip(ratio, 1 - eps_lo, 1 + eps_hi) * adv
    out = {"ppo_clip_ratio": masked_mean((surr2 < surr1).astype(float), m),
           "ppo_kl": masked_mean(-raw, m)}
    if c.rollout is not None:
        out["vllm_kl"] = masked_mean(np.where(c.mask, c.rollout - c.old, 0.0), m)
    return out, float(m.sum())


def openrlhf_step(calls, step, eps_lo, eps_hi) -> dict:
    """ppo_actor.ppo_train: per micro-batch value × its tokens, all-reduced over ranks, ÷ the tokens;
    then the token-weighted mean over the step's micro-batches."""
    merged = []
    for mb in sorted({c.micro_batch for c in calls if c.step == step}):
        num, tokens = {}, 0.0
        for c in (c for c in calls if c.step == step and c.micro_batch == mb):
            vals, n = openrlhf_micro_batch(c, eps_lo, eps_hi)
            for k, v in vals.items():
                num[k] = num.get(k, 0.0) + v * n
            tokens += n
        merged.append(({k: v / tokens for k, v in num.items()}, tokens))
    total = sum(t for _, t in merged)
    return {k: sum(d[k] * t for d, t in merged) / total for k in merged[0][0]}


def rollout_stats(s) -> dict:
    """ppo_trainer._compute_rollout_stats over the step's completions."""
    r = s.reward.astype(np.float32).astype(float)
    return {"train/rollout/reward_mean": float(np.mean(r)),
            "train/rollout/reward_std": float(np.std(r, ddof=1)) if len(r) > 1 else 0.0,
            "train/rollout/response_length_mean": float(np.mean(s.completion_len)),
            "train/rollout/truncated_rate": float(np.mean(s.truncated)),
            "train/rollout/num_samples": float(len(r))}


def test_random_steps_match_openrlhf(tmp_path):
    rng = np.random.default_rng(11)
    calls = random_calls(rng, steps=(0, 1), ranks=2, micro_batches=3, spread=0.4)
    samples = [random_samples(rng, 0, nonfinite=0.0, unscored_group=False),
               random_samples(rng, 1, nonfinite=0.0, unscored_group=False, first_id=1000),
               # a step with one completion and no loss call: torch.std of one value is logged as 0.0
               random_samples(rng, 2, groups=1, generations=1, single_sample_group=False, equal_group=False,
                              unscored_group=False, nonfinite=0.0, first_id=2000)]
    run = samples_run(tmp_path / "run", samples, config=CFG, calls=calls)
    got = {r["step"]: r for r in grpolens.recompute(run, profile="openrlhf", write=False).iter_rows(named=True)}
    for step in (0, 1):
        ref = openrlhf_step(calls, step, CFG["epsilon"], CFG["epsilon_high"])
        for key in ("ppo_clip_ratio", "ppo_kl", "vllm_kl"):
            assert approx(got[step][f"train/{key}"], ref[key], rel=1e-9), (step, key, got[step][f"train/{key}"], ref[key])
    for s in samples:
        for key, want in rollout_stats(s).items():
            assert approx(got[s.step][key], want, rel=1e-9), (s.step, key, got[s.step][key], want)
    assert got[2]["train/rollout/reward_std"] == 0.0 and got[2]["train/ppo_kl"] is None


def test_names_are_the_profile_table(tmp_path):
    rng = np.random.default_rng(3)
    calls = random_calls(rng, steps=(0,), ranks=1, micro_batches=1)
    run = samples_run(tmp_path / "run", [random_samples(rng, 0, nonfinite=0.0)], config=CFG, calls=calls)
    df = grpolens.recompute(run, profile="openrlhf", write=False)
    assert sorted(df.columns) == sorted(["step", "train/ppo_clip_ratio", "train/ppo_kl", "train/vllm_kl",
                                         "train/rollout/reward_mean", "train/rollout/reward_std",
                                         "train/rollout/response_length_mean", "train/rollout/truncated_rate",
                                         "train/rollout/num_samples"])


def test_gspo_clip_ratio_is_not_claimed(tmp_path):
    rng = np.random.default_rng(5)
    calls = random_calls(rng, steps=(0,), ranks=1, micro_batches=2)
    run = samples_run(tmp_path / "run", [], config={**CFG, "loss_type": "gspo", "importance_sampling_level": "sequence"},
                      calls=calls)
    row = grpolens.recompute(run, profile="openrlhf", write=False).row(0, named=True)
    assert row["train/ppo_clip_ratio"] is None
    ref = openrlhf_step(calls, 0, CFG["epsilon"], CFG["epsilon_high"])
    assert approx(row["train/ppo_kl"], ref["ppo_kl"], rel=1e-9)  # not affected by the loss type


def test_hand_worked(tmp_path):
    # one sequence, A = +1; ratios 1.5 (> 1 + 0.28: clipped), 0.5 (A > 0: not clipped), 1.0
    logp = f32(np.array([[-1.0, -1.0, -1.0]]))
    old = f32(logp - np.log([[1.5, 0.5, 1.0]]))
    c = LossCall(0, 0, 0, np.array([0]), np.array([3]), logp, np.ones((1, 3), bool), np.array([1.0]), old=old)
    run = samples_run(tmp_path / "run", [], config=CFG, calls=[c])
    row = grpolens.recompute(run, profile="openrlhf", write=False).row(0, named=True)
    assert approx(row["train/ppo_clip_ratio"], 1 / 3, rel=1e-12)
    d = logp - old  # float32-stored values, as the run holds them
    assert approx(row["train/ppo_kl"], -d.sum() / 3, rel=1e-9)
    assert math.isclose(row["train/ppo_kl"], -math.log(0.75) / 3, rel_tol=1e-6)
    assert row["train/vllm_kl"] is None  # no rollout log-probs in this run

