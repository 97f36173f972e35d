"""Rollout IS and mismatch metrics of the canonical profile against an independent reference on
padded arrays (:mod:`tests.metrics.rollout_is_reference`): every level, mode and veto, the edge
cases, the public verl fixtures' exact numbers and what the summary holds. The trainers' own
summaries are in test_rollout_is_profiles.py, the constant-offset diagnosis in
test_rollout_is_offset.py, the ``--is-weights`` output in tests/analysis/test_is_weights.py.
"""

import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest

import grpolens
from grpolens.run.config import check_config
from grpolens.run.format import CONFIG_DEFAULTS

from tests.metrics.rollout_is_reference import (BANDS, MODES, _old, _partials, check, close, norm, one_call,
                                                ref_call, ref_canonical, ref_mismatch, weights_of)
from tests.refdata import f32, random_calls, shift_logprobs, write_run


@pytest.mark.parametrize("level", list(BANDS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("veto", [None, (0.8, 1.25)])
def test_levels_modes_veto(tmp_path, level, mode, veto):
    rng = np.random.default_rng(list(BANDS).index(level) * 100 + MODES.index(mode) * 2 + (veto is None))
    calls = random_calls(rng, spread=0.45)
    lo, hi = BANDS[level]
    ris = {"level": level, "mode": mode, "threshold": [lo, hi]}
    if veto:
        ris["veto_threshold"] = list(veto)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    got = grpolens.recompute(run, write=False)
    cfg = norm(ris)
    for step in (0, 1):
        check(got, step, ref_canonical(calls, step, cfg), "rollout_is/")
    # something actually happened in the interesting combinations
    if mode in ("mask", "both") or veto:
        assert got["rollout_is/rejected/token_fraction"].max() > 0
    if mode in ("truncate", "truncate_upper", "both"):
        assert got["rollout_is/truncated_fraction"].max() > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_nonfinite_and_beyond_bound(tmp_path, seed):
    rng = np.random.default_rng(seed)
    calls = random_calls(rng, nonfinite=0.1, spread=0.3)
    # exponents beyond ±20: per-token and per-sequence
    calls[0].rollout[0, :] = f32(calls[0].logp[0, :] - 30.0)
    shift_logprobs(calls[1], 30.0)  # room below 0 for a rollout log-prob 25 above the old one
    calls[1].rollout[3, :] = f32(_old(calls[1])[3, :] + 25.0)
    calls[2].rollout[0, 0] = -np.inf  # δ = +inf
    for level in ("token", "sequence", "geometric"):
        ris = {"level": level, "mode": "both", "threshold": [0.5, 2.0], "veto_threshold": [1e-3, 1e3]}
        run = write_run(tmp_path / f"run-{level}", calls, config={"rollout_is": ris})
        got = grpolens.recompute(run, write=False)
        for step in (0, 1):
            check(got, step, ref_canonical(calls, step, norm(ris)), "rollout_is/")
            check(got, step, ref_mismatch(calls, step), "mismatch/")
        assert got["rollout_is/safety_bound_fraction"].max() > 0
        assert got["rollout_is/undefined_tokens"].max() > 0


def test_mismatch_metrics(tmp_path):
    rng = np.random.default_rng(5)
    calls = random_calls(rng, spread=0.3)
    got = grpolens.recompute(write_run(tmp_path / "run", calls), write=False)
    for step in (0, 1):
        check(got, step, ref_mismatch(calls, step), "mismatch/")
    # no rollout_is config: the raw (token-level) weights are still described
    check(got, 0, {k: v for k, v in ref_canonical(calls, 0, norm({"level": "token"})).items()
                   if k.startswith(("raw/mean", "raw/max", "raw/min", "raw/ess", "applied/mean"))}, "rollout_is/")
    assert "rollout_is/veto/seq_fraction" not in got.columns


def test_rejection_filters(tmp_path):
    rng = np.random.default_rng(7)
    calls = random_calls(rng, spread=0.3)
    ris = {"level": "token", "mode": "truncate_upper", "threshold": 2.0,
           "rs": "token_k1,seq_sum_k2,seq_mean_k3,seq_max_k2", "rs_threshold": "0.9_1.1,0.05,0.004,0.02"}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    got = grpolens.recompute(run, write=False)
    cfg = norm(ris)
    for step in (0, 1):
        check(got, step, ref_canonical(calls, step, cfg), "rollout_is/")
    assert 0 < got["rollout_is/rejected/token_fraction"].max() < 1
    # per-filter verl metrics: masked fractions against the reference
    for step in (0, 1):
        rs = [ref_call(c, {**cfg, "rs": [f]}) for c in calls if c.step == step for f in cfg["rs"][:1]]
        frac = sum(r["rej"].sum() for r in rs) / sum(r["V"].sum() for r in rs)
        assert close(got.filter(pl.col("step") == step)["rollout_rs/token_k1/masked_fraction"][0], frac)
    verl = grpolens.recompute(run, profile="verl", write=False)
    assert "rollout_corr/rollout_rs_seq_max_k2_seq_max" in verl.columns
    assert "rollout_corr/rollout_rs_masked_fraction" in verl.columns


def test_all_masked_and_empty(tmp_path):
    rng = np.random.default_rng(3)
    calls = random_calls(rng)
    for c in calls:
        c.mask[:] = False
    ris = {"level": "sequence", "mode": "both", "threshold": [0.5, 2.0], "veto_threshold": [1e-4, 1e4]}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    got = grpolens.recompute(run, write=False)
    assert got["rollout_is/valid_tokens"].to_list() == [0.0, 0.0]
    for c in ("rollout_is/raw/mean", "rollout_is/veto/seq_fraction", "mismatch/kl_k1", "rollout_is/applied/ess"):
        assert got[c].to_list() == [None, None], c
    xt = grpolens.recompute(run, profile="xtuner", write=False)  # xtuner's merger logs 0.0 with no valid pack
    assert xt["mismatch/rollout_is_mean"].to_list() == [0.0, 0.0]
    assert xt["mismatch/mismatch_kl"].to_list() == [0.0, 0.0]
    vl = grpolens.recompute(run, profile="verl", write=False)  # verl raises; grpolens reports null
    assert vl["rollout_corr/kl"].to_list() == [None, None]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_at_the_smallest_upper_bound_every_weight_is_capped_and_the_ess_is_one(tmp_path, level):
    """Hand-worked: with the upper bound at exp(-20), the smallest weight there is, truncation caps
    every weight at it, so the applied and clamped weights are all equal: std 0, ESS fraction
    (Σw)²/(N·Σw²) = 1. (Far below that bound, now refused, w² underflowed and the ESS was null.)"""
    U = float(np.exp(-20.0))
    rng = np.random.default_rng(5)
    calls = random_calls(rng, all_masked_row=False)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"level": level, "mode": "truncate", "upper": U}})
    got = grpolens.recompute(run, write=False)
    assert got.height == 2 and (got["rollout_is/valid_tokens"] > 0).all()
    for c in ("rollout_is/applied/ess", "rollout_is/clamped/ess"):
        assert got[c].to_list() == [pytest.approx(1.0, rel=1e-12)] * 2, c
    assert got["rollout_is/applied/max"].to_list() == got["rollout_is/applied/min"].to_list() == [pytest.approx(U)] * 2


def test_step_mixing_shards_with_and_without_rollout_logprobs(tmp_path):
    # rank 1 recorded no rollout_logp: validate accepts it (an optional column, checked per file),
    # and its sequences have no IS or mismatch partials, so each step's rollout_is/* and mismatch/*
    # are those of rank 0's tokens alone (a piece without the partials adds nothing to a sum, -inf
    # to a max, +inf to a min)
    from grpolens.run.validate import validate_run

    rng = np.random.default_rng(12)
    calls = random_calls(rng, spread=0.45, nonfinite=0.05)
    for c in calls:
        if c.rank == 1:
            c.rollout = None
    ris = {"level": "token", "mode": "both", "threshold": [0.9, 1.1], "veto_threshold": [0.5, 2.0]}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    assert validate_run(run).errors == []
    got = grpolens.recompute(run, write=False)
    own = [c for c in calls if c.rank == 0]
    for step in (0, 1):
        check(got, step, ref_canonical(own, step, norm(ris)), "rollout_is/")
        check(got, step, ref_mismatch(own, step), "mismatch/")
    assert got["rollout_is/rejected/token_fraction"].max() > 0


@pytest.mark.parametrize("profile", [None, "verl", "verl-batch-normalize", "xtuner", "trl"])
def test_step_without_rollout_logprobs_has_null_is_metrics(tmp_path, profile):
    # no rank recorded rollout_logp at step 1: the step has no IS or mismatch partials at all, its
    # rollout_is/* and mismatch/* are null (no IS histogram for it), and step 0 is as without it.
    # verl's batch normalisation reads the step's IS summary from the policy loss, which a step
    # without rollout log-probs still has
    rng = np.random.default_rng(14)
    calls = random_calls(rng, spread=0.3)
    for c in calls:
        if c.step == 1:
            c.rollout = None
    ris = {"level": "token", "mode": "truncate", "threshold": [0.8, 1.25]}
    if profile == "verl-batch-normalize":
        profile, ris = "verl", {"rollout_is": "token", "rollout_is_threshold": 1.25, "rollout_is_batch_normalize": True}
    if profile == "trl":
        ris = {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": 0.8,
               "vllm_importance_sampling_clip_max": 1.25}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    got = grpolens.recompute(run, profile=profile, write=False) if profile else grpolens.recompute(run)
    names = [n for n in got.columns if n.startswith(("rollout_is/", "mismatch/", "rollout_corr/", "sampling/"))]
    assert names
    step0, step1 = (got.filter(pl.col("step") == s).row(0, named=True) for s in (0, 1))
    assert all(step1[n] is None for n in names), {n: step1[n] for n in names if step1[n] is not None}
    assert any(step0[n] is not None for n in names)
    if profile is None:
        check(got, 0, ref_canonical([c for c in calls if c.step == 0], 0, norm(ris)), "rollout_is/")
        hist = pl.read_parquet(run / "grpolens" / "is_hist.parquet")
        assert hist["step"].unique().to_list() == [0]


def test_single_token(tmp_path):
    c = random_calls(np.random.default_rng(0), steps=(0,), ranks=1, micro_batches=1, batch=1, max_len=3,
                     all_masked_row=False, zero_adv=False)[0]
    c.lengths[:] = 1
    c.mask[:] = [[True, False, False]]
    c.old[0, 0], c.rollout[0, 0] = -1.0, -1.5  # w = e^0.5
    ris = {"level": "token", "mode": "truncate", "threshold": [0.5, 1.5]}
    run = write_run(tmp_path / "run", [c], config={"rollout_is": ris})
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["rollout_is/raw/mean"] == pytest.approx(np.exp(0.5))
    assert got["rollout_is/applied/mean"] == pytest.approx(1.5)
    assert got["rollout_is/raw/std"] == 0 and got["rollout_is/raw/ess"] == pytest.approx(1.0)
    assert got["rollout_is/raw/seq_std"] is None
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    assert xt["mismatch/rollout_is_std"] == 0.0 and xt["mismatch/rollout_is_seq_std"] == 0.0
    assert xt["mismatch/rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_hand_worked(tmp_path):
    # one call, two sequences, token level, truncate [0.5, 2], veto [0.1, 10]:
    #   seq A: δ = [ln 3, 0, ln 0.25]   w = [3, 1, 0.25] -> a = [2, 1, 0.5]
    #   seq B: δ = [ln 20]              w = [20] -> vetoed (20 > 10), a = [2]
    # raw mean = (3 + 1 + .25 + 20) / 4 = 6.0625; applied mean = (2 + 1 + .5 + 2) / 4 = 1.375
    # truncated 3/4, rejected 1/4 tokens and 1/2 sequences, modified 3/4 (the w = 1 token is untouched)
    c = random_calls(np.random.default_rng(0), steps=(0,), ranks=1, micro_batches=1, batch=2, max_len=3,
                     all_masked_row=False, zero_adv=False, single_token=False)[0]
    c.lengths[:] = [3, 1]
    c.mask[:] = [[True, True, True], [True, False, False]]
    c.old[:] = -2.0
    c.rollout[:] = -2.0 - np.log([[3, 1, 0.25], [20, 1, 1]])
    c.advantages[:] = [1.0, -2.0]
    ris = {"level": "token", "mode": "truncate", "threshold": [0.5, 2.0], "veto_threshold": [0.1, 10]}
    got = grpolens.recompute(write_run(tmp_path / "run", [c], config={"rollout_is": ris}), write=False).row(0, named=True)
    assert got["rollout_is/raw/mean"] == pytest.approx(6.0625, rel=1e-6)
    assert got["rollout_is/applied/mean"] == pytest.approx(1.375, rel=1e-6)
    assert got["rollout_is/truncated_fraction"] == pytest.approx(0.75)
    assert got["rollout_is/rejected/token_fraction"] == pytest.approx(0.25)
    assert got["rollout_is/rejected/seq_fraction"] == pytest.approx(0.5)
    assert got["rollout_is/modified/token_fraction"] == pytest.approx(0.75)
    assert got["rollout_is/veto/seq_fraction"] == pytest.approx(0.5)
    assert got["rollout_is/loss_mass_removed"] == pytest.approx(2.0 / 5.0)  # |A|: 1+1+1 kept, 2 vetoed


# The public verl fixtures (verl-xtuner-notes §2, §6.7): exact numbers
def test_fixture_icepop_triplet(tmp_path):
    # raw weights [0.4, 0.8, 6.0], "0.5_5.0": weights [0, 0.8, 0], mask unchanged,
    # oob 2/3, std 0.3771236, ESS 1/3
    run, _ = one_call(tmp_path, [[0.0, 0.0, 0.0]], [-np.log([0.4, 0.8, 6.0])],
                      config={"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"})
    w = weights_of(run)
    assert np.allclose(w["is_weight"].to_numpy(), [0.0, 0.8, 0.0], atol=1e-6)
    assert w["is_mask"].to_list() == [True, True, True]
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 3, abs=1e-6)
    assert v["rollout_corr/rollout_is_std"] == pytest.approx(0.3771236, abs=1e-6)
    assert v["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1 / 3, abs=1e-6)


def test_icepop_weight_exactly_on_a_band_bound_is_kept(tmp_path):
    # old = rollout: weight exactly 1.0. Band [0.5, 1.0]: 1.0 is on the upper bound, kept; band
    # [1.0, 2.0]: on the lower bound, kept. A weight just above 1 (rollout one float32 step lower)
    # is outside [0.5, 1.0] and zeroed.
    below = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    old, rollout = [[-1.0, -1.0, -1.0]], [[-1.0, -1.0, below]]
    for band, want in (("0.5_1.0", [1.0, 1.0, 0.0]), ("1.0_2.0", None)):
        run, _ = one_call(tmp_path, old, rollout, config={"rollout_is": "token", "rollout_is_threshold": band},
                          name=band)
        w = weights_of(run)["is_weight"].to_numpy()
        if want is None:
            above = float(np.exp(np.float64(np.float32(-1.0)) - np.float64(np.float32(below))))
            want = [1.0, 1.0, above]
        assert w.tolist() == pytest.approx(want, abs=0, rel=1e-12), band


def test_fixture_icepop_loss(tmp_path):
    # old = −1, rollout = [−0.5, −3.5, −0.8], A = [1, −1, 2], "0.5_5.0":
    # weights [0.60653067, 0, 0.81873075], loss = mean(w·(−A)) over all three tokens, oob 1/3
    run, _ = one_call(tmp_path, [[-1.0, -1.0, -1.0]], [[-0.5, -3.5, -0.8]],
                      config={"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"})
    w = weights_of(run)["is_weight"].to_numpy()
    assert np.allclose(w, [0.60653067, 0.0, 0.81873075], atol=1e-6)
    assert np.mean(w * -np.array([1.0, -1.0, 2.0])) == pytest.approx(-(0.60653067 + 2 * 0.81873075) / 3, abs=1e-6)
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(1 / 3, abs=1e-6)


def test_fixture_mask_mode_k1(tmp_path):
    # constant rows δ = −1 (r ≈ 0.368) and +0.5 (r ≈ 1.649); token TIS U = 2 + token_k1 "0.5_2.0":
    # weights untouched by the filter, row 0 rejected whole, row 1 kept, masked fraction 0.5
    old = np.zeros((2, 5))
    rollout = np.array([[1.0] * 5, [-0.5] * 5])
    run, _ = one_call(tmp_path, old, rollout, config={"rollout_is": "token", "rollout_is_threshold": 2.0,
                                                     "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"})
    w = weights_of(run).sort(["sample_id", "pos"])
    assert w["is_weight"][0] == pytest.approx(0.368, abs=0.01) and w["is_weight"][5] == pytest.approx(1.649, abs=0.01)
    assert w["is_mask"].to_list() == [False] * 5 + [True] * 5
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5, abs=0.01)


def test_fixture_veto(tmp_path):
    # rollout log-prob +15 above the old one at [0, 2] (r ≈ 3e-7), veto 1e-4: row 0 rejected whole,
    # row 1 kept, row 0's weights still positive, 0 < veto fraction ≤ 1
    rng = np.random.default_rng(0)
    old = rng.normal(-1.0, 0.3, size=(2, 5))
    rollout = old + rng.normal(0, 0.01, size=(2, 5))
    rollout[0, 2] = old[0, 2] + 15.0
    run, _ = one_call(tmp_path, old, rollout, config={"level": "token", "mode": "truncate", "threshold": [0.5, 2.0],
                                                     "veto_lower": 1e-4})
    w = weights_of(run).sort(["sample_id", "pos"])
    m = w["is_mask"].to_numpy().reshape(2, 5)
    assert m[0].sum() == 0 and m[1].sum() > 0
    assert (w["is_weight"].to_numpy()[:5] > 0).all()
    g = grpolens.recompute(run, write=False).row(0, named=True)
    assert 0 < g["rollout_is/veto/seq_fraction"] <= 1


def test_fixture_seq_fraction_high_raw(tmp_path):
    # raw [[1, 6], [0.9, 1.1]], U = 2: seq_fraction_high from raw weights = 0.5 (verl)
    run, _ = one_call(tmp_path, np.zeros((2, 2)), -np.log([[1.0, 6.0], [0.9, 1.1]]),
                      config={"rollout_is": "token", "rollout_is_threshold": 2.0})
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_is_seq_fraction_high"] == pytest.approx(0.5)


def test_fixture_k1_inversion(tmp_path):
    # verl's k1 band is on π_rollout/π_train: "0.8_1.5" keeps IS ratios in [1/1.5, 1/0.8] = [0.667, 1.25]
    ratios = np.array([[0.6, 0.7, 1.2, 1.3]])
    run, _ = one_call(tmp_path, np.zeros((1, 4)), -np.log(ratios).reshape(1, 4),
                      config={"rs": "token_k1", "rs_threshold": "0.8_1.5"})
    assert weights_of(run)["is_mask"].to_list() == [False, True, True, False]


def test_rejection_filter_statistic_exactly_on_its_bound_is_kept(tmp_path):
    # verl keeps log lower <= k1 <= log upper and k2/k3 <= upper (its fraction_high counts
    # stat > up, fraction_low k1 < log lower). k1 = -δ: δ = 0 gives k1 = -0.0, exactly on log 1.0 = 0
    # as an upper bound ("0.5_1.0") and as a lower bound ("1.0_2.0"); a rollout log-prob one float32
    # step below / above the old one puts k1 just below / above 0.
    below = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    above = float(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    old, rollout = [[-1.0, -1.0, -1.0]], [[-1.0, below, above]]  # k1 = [-0.0, < 0, > 0]
    for band, kept in (("0.5_1.0", [True, True, False]), ("1.0_2.0", [True, False, True])):
        run, _ = one_call(tmp_path, old, rollout, config={"rs": "token_k1", "rs_threshold": band}, name=band)
        assert weights_of(run)["is_mask"].to_list() == kept, band
    # k2 = δ²/2: δ = 0.5 (old -1.0, rollout -1.5, exact in float32) gives exactly 0.125; one float32
    # step further gives more
    further = float(np.nextafter(np.float32(-1.5), np.float32(-2.0)))
    run, _ = one_call(tmp_path, [[-1.0, -1.0]], [[-1.5, further]], config={"rs": "token_k2", "rs_threshold": "0.125"},
                      name="k2")
    assert weights_of(run)["is_mask"].to_list() == [True, False]


def test_rejection_statistics_use_the_bounded_log_ratio(tmp_path):
    # the filters see δs = clip(δ, ±20): δ = -21 and +21 both give k2 = 20²/2 = 200, kept under an
    # upper bound of 210 (the unbounded 21²/2 = 220.5 would be rejected)
    run, _ = one_call(tmp_path, [[-22.0, -1.0]], [[-1.0, -22.0]], config={"rs": "token_k2", "rs_threshold": "210"})
    assert weights_of(run)["is_mask"].to_list() == [True, True]


def test_sequence_filters_reduce_their_statistic_as_named(tmp_path):
    # k2 = δ²/2 per token. Row A: δ = [0.5, 0.5, 0.5] -> k2 sum 0.375, mean 0.125, max 0.125;
    # row B: δ = [1, 0, 0] -> sum 0.5, mean 1/6, max 0.5; row C: δ = [0.5, 0, 0] -> sum = max = 0.125,
    # mean 1/24. Each filter rejects its rows whole.
    old = np.full((3, 3), -1.0)
    rollout = old - np.array([[0.5, 0.5, 0.5], [1.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    for option, bound, kept in (("seq_sum_k2", "0.3", [False, False, True]),
                                ("seq_mean_k2", "0.15", [True, False, True]),
                                ("seq_max_k2", "0.3", [True, False, True])):
        run, _ = one_call(tmp_path, old, rollout, config={"rs": option, "rs_threshold": bound}, name=option)
        mask = weights_of(run).sort(["sample_id", "pos"])["is_mask"].to_numpy().reshape(3, 3)
        assert mask.all(1).tolist() == kept and (mask.any(1) == mask.all(1)).all(), option


def test_sequence_filters_use_their_own_statistic(tmp_path):
    # rows δ = A [-1, -1], B [1, 0], C [0.1, 0.1]; per token k1 = -δ, k2 = δ²/2, k3 = e^δ - 1 - δ:
    # δ = -1: k1 1, k2 0.5, k3 e^-1 = 0.368; δ = 1: k1 -1, k2 0.5, k3 e - 2 = 0.718; δ = 0.1: k3 0.0052.
    # seq_mean_k1 keeps log 0.5 <= mean k1 <= log 2 (±0.693): A's mean 1 is out, B's -0.5 and C's -0.1 in.
    # seq_max_k2 <= 0.6: every row (max 0.5, 0.5, 0.005); k3's maxima would put B out (0.718).
    # seq_sum_k3 <= 0.6: A (0.736) and B (0.718) out, C (0.0103) in; k2's sums would keep B (0.5).
    old = np.full((3, 2), -2.0)
    rollout = old - np.array([[-1.0, -1.0], [1.0, 0.0], [0.1, 0.1]])
    for option, bound, kept in (("seq_mean_k1", "0.5_2.0", [False, True, True]),
                                ("seq_max_k2", "0.6", [True, True, True]),
                                ("seq_sum_k3", "0.6", [False, False, True])):
        run, _ = one_call(tmp_path, old, rollout, config={"rs": option, "rs_threshold": bound}, name=option)
        mask = weights_of(run).sort(["sample_id", "pos"])["is_mask"].to_numpy().reshape(3, 2)
        assert mask.all(1).tolist() == kept and (mask.any(1) == mask.all(1)).all(), option


def test_veto_ratio_exactly_on_its_bound_is_kept(tmp_path):
    # the veto rejects a sequence with a raw ratio e^δ strictly outside [veto_lower, veto_upper]:
    # δ = 0 (ratio 1) is exactly on a bound of 1.0 and kept; one float32 step of the rollout
    # log-prob below / above the old one gives δ just above / below 0. One token per sequence.
    below = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    above = float(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    old, rollout = [[-1.0], [-1.0], [-1.0]], [[-1.0], [below], [above]]  # δ = [0, > 0, < 0]
    for side, kept in (("veto_lower", [True, True, False]), ("veto_upper", [True, False, True])):
        run, _ = one_call(tmp_path, old, rollout, config={"level": "token", "mode": "none", side: 1.0}, name=side)
        assert weights_of(run).sort("sample_id")["is_mask"].to_list() == kept, side


#: docs/metrics.md: the share-of-the-band metrics, computed only with an upper bound
BAND_METRICS = {"raw/fraction_high", "raw/fraction_low", "raw/seq_fraction_high", "raw/seq_fraction_low",
                "clamped/std", "clamped/ess"}


MASK_METRICS = {"mask/token_fraction", "mask/seq_fraction"}


@pytest.mark.parametrize("ris,absent", [
    ({"level": "token", "mode": "truncate", "threshold": [0.5, 2.0]}, MASK_METRICS | {"zeroed_fraction"}),
    ({"level": "token", "mode": "both", "upper": 2.0, "mask_threshold": [0.2, 5.0]}, {"zeroed_fraction"}),
    ({"level": "sequence", "mode": "icepop", "threshold": [0.5, 2.0]}, MASK_METRICS | {"truncated_fraction"}),
    ({"level": "geometric", "mode": "mask", "threshold": [0.5, 2.0]}, {"truncated_fraction", "zeroed_fraction"}),
    ({"level": "token", "veto_threshold": [1e-4, 1e4]}, BAND_METRICS | MASK_METRICS | {"truncated_fraction", "zeroed_fraction"}),
])
def test_canonical_summary_holds_exactly_the_documented_metrics(ris, absent):
    # every rollout_is/* metric docs/metrics.md lists, but those that do not apply to the config
    # (the band's without an upper bound, a mode's own fractions; batch_norm_factor is the verl
    # profile's), and nothing else: the applied weights' sequence summary has no band fractions
    from grpolens.functional.rollout_is import ISConfig, summarize

    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `rollout_is/([^`]+)` \|", docs, flags=re.M))
    assert {"raw/mean", "applied/seq_mean", "loss_mass_removed"} <= documented
    p = _partials(**{"ris.n": [2, 1], "ris.L": [0.4, -0.2], "ris.tw": [2.2, 0.8], "ris.tw2": [2.6, 0.64],
                     "ris.ta": [2.0, 0.8], "ris.ta2": [2.0, 0.64], "ris.adv": [2.0, 1.0]})
    got = summarize(p, ISConfig.from_cfg(norm(ris)))
    assert set(got) == documented - absent - {"batch_norm_factor"}


def test_a_summary_value_that_is_not_a_number_is_reported_as_null():
    # the IS and mismatch summaries of every profile report their values through is_weights._f: a
    # NaN (nothing to average) is reported as null, never as NaN
    from grpolens.functional.rollout_is import _f

    assert _f(np.float64(np.nan)) is None and _f(float("nan")) is None and _f(None) is None
    assert _f(np.float64(2.5)) == 2.5 and type(_f(np.float32(0.5))) is float


def test_sequence_max_filter_on_one_token_and_on_no_token():
    # seq_max_k2 <= 0.3: a sequence whose one valid token has k2 = 0.5 is rejected; a sequence
    # without a valid token (its max is the empty max, -inf) has statistic 0 and is not.
    from grpolens.functional.rollout_is import ISConfig, seq_view

    c = ISConfig.from_cfg(norm({"rs": "seq_max_k2", "rs_threshold": "0.3"}))
    p = _partials(**{"ris.n": [1, 0, 2], "ris.k2max": [0.5, -np.inf, 0.2]})
    sv = seq_view(p, c)
    assert sv.rs_rej.tolist() == [True, False, False]
    assert sv.rs_value["seq_max_k2"].tolist() == [0.5, 0.0, 0.2]


def test_weights_of_one_sequence_below_one(tmp_path):
    # one sequence, raw weights e^δ = [0.5, 0.25] (Σw² = 0.3125 < 1): mean 0.375, ESS (Σw)²/(N·Σw²)
    # = 0.5625 / 0.625 = 0.9; the sequence statistics are those of its one mean weight, and a
    # standard deviation of one value is undefined.
    run, _ = one_call(tmp_path, [[0.0, 0.0]], [-np.log([0.5, 0.25])])
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["rollout_is/raw/mean"] == pytest.approx(0.375, rel=1e-6)
    assert got["rollout_is/raw/ess"] == pytest.approx(0.9, rel=1e-6)
    assert got["rollout_is/raw/seq_mean"] == pytest.approx(0.375, rel=1e-6)
    assert got["rollout_is/raw/seq_max_deviation"] == pytest.approx(0.625, rel=1e-6)
    assert got["rollout_is/raw/seq_std"] is None


def test_sequence_mean_weight_exactly_on_a_band_bound_is_inside(tmp_path):
    # token weights [1, 1, e, e] (δ = 0 and 1), sequence mean weights [1, e]: 1.0 is exactly on the
    # upper bound of "0.5_1.0" and on the lower bound of "1.0_2.0", and counted in neither fraction,
    # of tokens or of sequences.
    old, rollout = [[-1.0, -1.0], [-1.0, -1.0]], [[-1.0, -1.0], [-2.0, -2.0]]
    for band, key, want in (("0.5_1.0", "fraction_high", 0.5), ("1.0_2.0", "fraction_low", 0.0)):
        run, _ = one_call(tmp_path, old, rollout, config={"rollout_is": "token", "rollout_is_threshold": band},
                          name=band)
        got = grpolens.recompute(run, write=False).row(0, named=True)
        assert (got[f"rollout_is/raw/seq_{key}"], got[f"rollout_is/raw/{key}"]) == (want, want), band


def test_sequence_holding_both_infinite_log_ratios_is_left_out_whole(tmp_path):
    # row A: δ = [+inf, -inf, 0.1] has no defined Σδ: its three tokens are undefined; row B's lone
    # +inf stays in (weight e^20); row C's third token is masked out, so neither valid nor undefined
    old = [[-1.0, -np.inf, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    rollout = [[-np.inf, -1.0, -1.1], [-np.inf, -1.0, -1.0], [-1.2, -1.3, -1.1]]
    mask = np.array([[True, True, True], [True, True, True], [True, True, False]])
    run, _ = one_call(tmp_path, old, rollout, mask=mask, config={"level": "token", "mode": "none"})
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert (got["rollout_is/valid_tokens"], got["rollout_is/undefined_tokens"]) == (5.0, 3.0)
    w = weights_of(run).sort(["sample_id", "pos"])
    assert w["valid"].to_list() == [False] * 3 + [True] * 3 + [True, True, False]


def test_loss_mass_removed_counts_a_non_finite_advantage_as_zero(tmp_path):
    # one token per sequence, veto_upper 10: sequence 0 (w = 20, |A| = 2) is vetoed; sequence 1's
    # advantage is NaN (|A| counted as 0), sequence 2's is 1: removed mass 2 / (2 + 0 + 1)
    run, _ = one_call(tmp_path, [[-1.0], [-1.0], [-1.0]], [[-1.0 - np.log(20.0)], [-1.0], [-1.0]],
                      adv=[2.0, np.nan, 1.0], config={"level": "token", "mode": "none", "veto_upper": 10.0})
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["rollout_is/veto/seq_fraction"] == pytest.approx(1 / 3)
    assert got["rollout_is/loss_mass_removed"] == pytest.approx(2 / 3)


def test_log_weight_exactly_on_the_safety_bound_is_not_beyond_it(tmp_path):
    # the ±20 bound counts |X| > 20. δ rows [20, 0], [10, 10], [21, 0]: at token level only the 21
    # is beyond (1 of 6 tokens); at sequence level X = Σδ = [20, 20, 21], only the last sequence
    # (2 of 6 tokens); at geometric level X = [10, 10, 10.5], none
    old, rollout = np.zeros((3, 2)), -np.array([[20.0, 0.0], [10.0, 10.0], [21.0, 0.0]])
    for level, want in (("token", 1 / 6), ("sequence", 2 / 6), ("geometric", 0.0)):
        run, _ = one_call(tmp_path, old, rollout, config={"level": level, "mode": "none"}, name=level)
        got = grpolens.recompute(run, write=False).row(0, named=True)
        assert got["rollout_is/safety_bound_fraction"] == pytest.approx(want), level


def test_sequence_log_weight_exactly_on_a_band_bound_is_inside(tmp_path):
    # sequence level, δ rows [0.5, -0.5] (X = 0, exactly log 1.0) and [-0.25, -0.25] (X = -0.5):
    # the token fractions count X > log upper and X < log lower strictly
    old, rollout = np.zeros((2, 2)), -np.array([[0.5, -0.5], [-0.25, -0.25]])
    for band, key, want in (([0.5, 1.0], "fraction_high", 0.0), ([1.0, 2.0], "fraction_low", 0.5)):
        run, _ = one_call(tmp_path, old, rollout, config={"level": "sequence", "mode": "truncate", "threshold": band},
                          name=f"band-{band[0]}")
        got = grpolens.recompute(run, write=False).row(0, named=True)
        assert got[f"rollout_is/raw/{key}"] == want, band
    # no lower bound: no fraction_low, and the clamped weights are clip(w, 0, upper) = [1, e^-0.5]
    # per token: population std (1 - e^-0.5) / 2
    run, _ = one_call(tmp_path, old, rollout, config={"level": "sequence", "mode": "truncate_upper", "upper": 2.0},
                      name="upper-only")
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["rollout_is/raw/fraction_low"] is None
    assert got["rollout_is/clamped/std"] == pytest.approx((1 - np.exp(-0.5)) / 2, rel=1e-6)


def test_a_configs_own_top_level_mode_or_level_key_is_not_read_as_the_is_settings():
    """A run config may hold keys of the user's own (``mode: "train"``); only ``rollout_is`` holds
    the IS settings, configured or not."""
    from grpolens.functional.rollout_is import ISConfig

    band = {"level": "token", "mode": "truncate", "threshold": [0.5, 2.0]}
    configured = check_config({**CONFIG_DEFAULTS, "rollout_is": band})
    for extra in ({"mode": "train"}, {"level": "sequence"}, {"mode": "train", "level": "sequence"}):
        got = ISConfig.from_cfg(check_config({**CONFIG_DEFAULTS, "rollout_is": band, **extra}))
        assert (got.level, got.mode, got.lower, got.upper, got.configured) == ("token", "truncate", 0.5, 2.0, True)
        assert got == ISConfig.from_cfg(configured)
        assert ISConfig.from_cfg(check_config({**CONFIG_DEFAULTS, **extra})) == ISConfig()
    # the mapping alone still reads as itself
    assert ISConfig.from_cfg(configured["rollout_is"]) == ISConfig.from_cfg(configured)
