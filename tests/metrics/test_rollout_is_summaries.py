"""The per-profile step summaries of the rollout-IS family (``grpolens.metrics.rollout_is``): which
rows each trainer's summary counts, and when it reports nothing. The references are those of
``tests/metrics/rollout_is_reference.py`` (numpy on padded arrays) and of
``tests/metrics/test_rollout_is_visitors.py`` (verl's rejection filters)."""

import copy

import numpy as np
import pytest

import grpolens
from tests.metrics.rollout_is_reference import close, norm, verl_ref
from tests.metrics.test_rollout_is_visitors import padded, verl_rs_ref
from tests.refdata import random_calls, write_run

VERL = {"rollout_is": "token", "rollout_is_threshold": "0.9_1.1", "rollout_rs": "token_k1,seq_max_k2",
        "rollout_rs_threshold": "0.95_1.05,0.015"}


def test_verl_profile_counts_a_completion_in_two_loss_calls_once(tmp_path):
    """verl computes its rollout correction once per completion, on the driver, before the
    mini-batches and PPO epochs: a completion trained on in two loss calls (rank 0's first loss
    call again as micro-batch 2) counts once, in the IS and mismatch statistics and in the
    rejection filters' ``rollout_rs_*``."""
    calls = random_calls(np.random.default_rng(67), spread=0.4, steps=(0,))
    again = copy.deepcopy(calls[0])
    again.micro_batch = 2
    run = write_run(tmp_path / "run", calls + [again], config={"rollout_is": VERL})
    row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    cfg = norm(VERL)
    want = {"rollout_corr/" + k: v for k, v in verl_ref(calls, 0, cfg).items()}
    want.update({"rollout_corr/rollout_rs_" + k.replace("/", "_"): v
                 for k, v in verl_rs_ref(*padded(calls, 0), cfg["rs"]).items()})
    bad = {k: (row.get(k), v) for k, v in want.items() if not close(row.get(k), v, rel=1e-6)}
    assert not bad, bad
    # counted twice, the repeated rows would weigh: the data tell the two apart
    twice = verl_ref(calls + [again], 0, cfg)
    assert twice["rollout_is_mean"] != want["rollout_corr/rollout_is_mean"]


def test_verl_profile_reports_nothing_when_the_trainer_had_no_rollout_correction(tmp_path):
    """``rollout_metrics: false`` (a verl run without ``rollout_correction``, as the verl
    integration records it): verl logs no ``rollout_corr/*``, whatever the rollout log-probs."""
    calls = random_calls(np.random.default_rng(71), spread=0.3)
    for flag in (False, True):
        run = write_run(tmp_path / f"run-{flag}", calls, config={"rollout_is": VERL, "rollout_metrics": flag})
        got = grpolens.recompute(run, profile="verl", write=False)
        corr = [c for c in got.columns if c.startswith("rollout_corr/")]
        values = [v for c in corr for v in got[c].to_list() if v is not None]
        if flag:
            assert "rollout_corr/rollout_rs_masked_fraction" in corr and len(values) > 20
        else:
            assert values == [], corr


def test_verl_batch_norm_factor_of_a_mean_exactly_on_its_guard_is_one(tmp_path):
    """verl divides by the batch mean of the applied weights only when it is above 1e-8, and logs
    a factor of 1.0 otherwise. One token of raw weight e^-19 truncated up to a lower bound of 1e-8
    (grpolens' own keys under the verl profile): the mean is exactly 1e-8, not above it."""
    from tests.metrics.rollout_is_reference import one_call

    cfg = {"level": "token", "mode": "truncate", "lower": 1e-8, "upper": 2.0, "batch_normalize": True}
    run, _ = one_call(tmp_path, [[-20.0]], [[-1.0]], config=cfg)
    row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert row["rollout_corr/rollout_is_mean"] == 1e-8
    assert row["rollout_corr/rollout_is_batch_norm_factor"] == 1.0


def test_trl_empty_rank_logs_zero_also_when_every_ratio_is_below_one(tmp_path):
    """TRL logs 0.0 for a rank without a completion token (its ``numel() > 0`` guards) in each of
    min, mean and max, and its gather over ranks takes them: with every ratio of rank 0 below 1
    (δ = −0.1, −0.2) the max is rank 0's largest ratio e^−0.1, never 1, the min 0.0 and the mean
    half of rank 0's mean. Only with vLLM IS configured does TRL log ``sampling/*`` at all."""
    from tests.refdata import LossCall, f32

    old = np.array([[-1.1, -1.2]])
    rank0 = LossCall(0, 0, 0, np.array([0]), np.array([2]), f32(old), np.ones((1, 2), bool), f32(np.ones(1)),
                     old=f32(old), rollout=f32(np.full((1, 2), -1.0)))
    rank1 = LossCall(0, 1, 0, np.array([1]), np.array([2]), f32(old), np.zeros((1, 2), bool), f32(np.ones(1)),
                     old=f32(old), rollout=f32(np.full((1, 2), -1.0)))
    trl = {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0}
    names = ("min", "mean", "max")
    for config, want in ((trl, None), (None, {k: None for k in names})):
        run = write_run(tmp_path / f"run-{config is None}", [rank0, rank1], config={"rollout_is": config} if config else None)
        row = grpolens.recompute(run, profile="trl", write=False).row(0, named=True)
        got = {k: row.get(f"sampling/importance_sampling_ratio/{k}") for k in names}
        if want is None:
            r = np.exp(rank0.old[0] - rank0.rollout[0])  # the float32 log-probs as written
            want = {"min": 0.0, "mean": r.mean() / 2, "max": r.max()}
            assert want["max"] == pytest.approx(np.exp(-0.1), rel=1e-6)
            assert got == pytest.approx(want, rel=1e-12)
        else:
            assert got == want
