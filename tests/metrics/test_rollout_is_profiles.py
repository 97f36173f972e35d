"""Rollout IS as the trainers summarise it (the xtuner, verl and TRL profiles), against the
reference of :mod:`tests.metrics.rollout_is_reference`, and their edge cases.
"""

import numpy as np
import polars as pl
import pytest

import grpolens

from tests.metrics.rollout_is_reference import (_old, close, norm, one_call, verl_ref, weights_of, xtuner_merge,
                                                xtuner_pack_ref)
from tests.refdata import LossCall, f32, random_calls, write_run


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_xtuner_profile(tmp_path, level):
    rng = np.random.default_rng(11)
    # rollout log-probs 0.4 nats from the old ones (σ): weights beyond the band and the veto occur
    calls = random_calls(rng, spread=1.2, ranks=2, micro_batches=3)
    calls[2].mask[:] = False  # an invalid pack: dropped by the merger
    xt = {"rollout_is_level": level, "rollout_is_mode": "both", "rollout_is_threshold": [1.3, 0.8],
          "rollout_is_mask_threshold": [1.2, 0.85], "rollout_is_veto_threshold": [1.6, 0.6]}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": xt})
    got = grpolens.recompute(run, profile="xtuner", write=False)
    cfg = norm(xt)
    assert cfg["mask_upper"] == 1.2 and cfg["upper"] == 1.3 and cfg["veto_lower"] == 0.6
    for step in (0, 1):
        packs = [xtuner_pack_ref(c, cfg, level) for c in calls if c.step == step]
        ref = {**xtuner_merge([p[0] for p in packs]), **xtuner_merge([p[1] for p in packs])}
        row = got.filter(pl.col("step") == step).row(0, named=True)
        # rel 1e-5: the reference's masked means carry a +1e-8 guard, which the variance (a
        # difference of two means) amplifies; grpolens divides exactly. A pack whose clamped
        # weights are all equal has variance 0, which the guard leaves at ~1e-9: its std reads
        # ~3e-5 in the reference, 0 in grpolens (abs 1e-5 on the mean over packs)
        tol = lambda k: {"abs_": 1e-5} if k == "rollout_is_std" else {}  # noqa: E731
        bad = {k: (row.get("mismatch/" + k), v) for k, v in ref.items()
               if not close(row.get("mismatch/" + k), v, rel=1e-5, **tol(k))}
        assert not bad, bad
        assert set("mismatch/" + k for k in ref) == set(c for c in got.columns if c.startswith("mismatch/"))
        # the data reach every threshold: the fractions compared above are not all 0
        for k in ("rollout_is_veto_fraction", "rollout_is_catastrophic_token_fraction", "rollout_is_ratio_fraction_high",
                  "rollout_is_ratio_fraction_low", "rollout_is_masked_fraction"):
            assert 0 < ref[k] < 1, (k, ref[k])


def test_xtuner_disabled_without_threshold(tmp_path):
    calls = random_calls(np.random.default_rng(2))
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"rollout_is_veto_threshold": [20, 0]}})
    got = grpolens.recompute(run, profile="xtuner", write=False)
    assert "mismatch/rollout_is_veto_fraction" not in got.columns  # xtuner ignores a lone veto
    assert "mismatch/mismatch_kl" in got.columns


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_profile(tmp_path, level):
    rng = np.random.default_rng(13)
    calls = random_calls(rng, spread=0.3)
    band = "0.9_1.1" if level == "token" else "0.75_1.3"
    verl = {"rollout_is": level, "rollout_is_threshold": band}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": verl})
    got = grpolens.recompute(run, profile="verl", write=False)
    cfg = norm(verl)
    assert cfg["mode"] == "icepop"
    for step in (0, 1):
        ref = verl_ref(calls, step, cfg)
        row = got.filter(pl.col("step") == step).row(0, named=True)
        bad = {k: (row.get("rollout_corr/" + k), v) for k, v in ref.items() if not close(row.get("rollout_corr/" + k), v, rel=1e-6)}
        assert not bad, bad
    # TIS (a float threshold): upper cap only; lower = 1/U for the fraction metrics
    tis = norm({"rollout_is": "token", "rollout_is_threshold": 1.05})
    assert tis["mode"] == "truncate_upper" and tis["lower"] == pytest.approx(1 / 1.05)
    run2 = write_run(tmp_path / "run2", calls, config={"rollout_is": {"rollout_is": "token", "rollout_is_threshold": 1.05}})
    got2 = grpolens.recompute(run2, profile="verl", write=False)
    for step in (0, 1):
        ref = verl_ref(calls, step, tis)
        ref.pop("rollout_is_oob_ratio")
        row = got2.filter(pl.col("step") == step).row(0, named=True)
        bad = {k: (row.get("rollout_corr/" + k), v) for k, v in ref.items() if not close(row.get("rollout_corr/" + k), v, rel=1e-6)}
        assert not bad, bad
    assert got2["rollout_corr/rollout_is_max"].max() <= 1.05


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_profile(tmp_path, mode):
    rng = np.random.default_rng(17)
    calls = random_calls(rng, spread=0.3, ranks=3)
    trl = {"vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": 0.9,
           "vllm_importance_sampling_clip_max": 1.1}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": trl})
    got = grpolens.recompute(run, profile="trl", write=False)
    level, _, kind = mode.partition("_")
    for step in (0, 1):
        dmeans, dmax, rmin, rmean, rmax = [], [], [], [], []
        for rank in range(3):
            cs = [c for c in calls if c.step == step and c.rank == rank]
            d = np.concatenate([np.abs(_old(c) - c.rollout)[c.mask & c.valid] for c in cs])
            dmeans.append(d.mean() if len(d) else 0.0)
            dmax.append(d.max())
            ratios = []
            for c in cs:
                m = c.mask & c.valid
                dd = np.where(m, _old(c) - c.rollout, 0.0)
                r = np.exp(dd) if level == "token" else np.exp(dd.sum(1))
                r = np.clip(r, 0.9, 1.1) if kind == "truncate" else np.where((r >= 0.9) & (r <= 1.1), r, 0.0)
                ratios.append(r[m] if level == "token" else r)
            r = np.concatenate(ratios)
            rmin.append(r.min())
            rmean.append(r.mean())
            rmax.append(r.max())
        row = got.filter(pl.col("step") == step).row(0, named=True)
        assert close(row["sampling/sampling_logp_difference/mean"], np.mean(dmeans))
        assert close(row["sampling/sampling_logp_difference/max"], max(dmax))
        assert close(row["sampling/importance_sampling_ratio/min"], min(rmin))
        assert close(row["sampling/importance_sampling_ratio/mean"], np.mean(rmean))
        assert close(row["sampling/importance_sampling_ratio/max"], max(rmax))


def test_verl_seq_std_of_one_sequence_is_zero(tmp_path):
    # verl: ``seq_mean_weights.std() if seq_mean_weights.numel() > 1 else 0.0``; a batch of one sequence
    run, _ = one_call(tmp_path, [[0.0, 0.0]], [-np.log([0.5, 0.25])], config={"rollout_is": "token", "rollout_is_threshold": 2.0})
    v = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert v["rollout_corr/rollout_is_seq_std"] == 0.0
    assert v["rollout_corr/rollout_is_seq_mean"] == pytest.approx(0.375, rel=1e-6)


def test_trl_truncate_without_clip_min_caps_only(tmp_path):
    # TRL's token_truncate without vllm_importance_sampling_clip_min: min(w, clip_max), no lower
    # bound. Raw weights [1, e] (δ = 0, 1), clip_max 2: applied [1, 2].
    run, _ = one_call(tmp_path, [[-1.0, -1.0]], [[-1.0, -2.0]],
                      config={"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0})
    assert weights_of(run).sort("pos")["is_weight"].to_list() == [1.0, 2.0]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_sampling_metrics_count_each_completion_once_and_log_an_empty_rank_as_zero(tmp_path, level):
    """TRL computes ``sampling/*`` once per generated completion, on each rank: a completion trained
    on in two loss calls counts once. A rank without a completion token logs 0.0 (the
    ``numel() > 0`` guards of ``GRPOTrainer._generate_and_score_completions``), and the gather
    takes it: into the mean over ranks, and into ``nanmin`` at token level (at sequence level the
    empty completion's ratio is e^0 = 1).

    rank 0: completion 0 (δ = 0.1, −0.2, 0.3) in two loss calls, completion 1 of one token (δ = 0.5:
    the step's largest |δ| and ratio); rank 1: every token masked; rank 2: one token (δ = −0.4)."""
    roll = -1.0
    deltas = {0: [0.1, -0.2, 0.3], 1: [0.5], 2: [0.0, 0.0], 3: [-0.4]}

    def call(rank, mb, ids, masked=True):
        T = max(len(deltas[i]) for i in ids)
        lengths = np.array([len(deltas[i]) for i in ids])
        old = np.full((len(ids), T), roll)
        for r, i in enumerate(ids):
            old[r, :lengths[r]] += deltas[i]
        mask = (np.arange(T)[None, :] < lengths[:, None]) & masked
        return LossCall(0, rank, mb, np.array(ids), lengths, f32(old), mask, f32(np.ones(len(ids))), old=f32(old),
                        rollout=f32(np.full(old.shape, roll)))

    calls = [call(0, 0, [0, 1]), call(0, 1, [0]), call(1, 0, [2], masked=False), call(2, 0, [3])]
    cfg = {"vllm_importance_sampling_mode": f"{level}_truncate", "vllm_importance_sampling_clip_min": 0.5,
           "vllm_importance_sampling_clip_max": 2.0}
    row = grpolens.recompute(write_run(tmp_path / "run", calls, config={"rollout_is": cfg}), profile="trl",
                             write=False).row(0, named=True)
    # δ as written (float32 log-probs), each completion once
    d = {i: (np.float32(roll + np.float32(x)) - np.float32(roll)).astype(np.float64)
         for i, x in ((i, np.array(v)) for i, v in deltas.items())}
    per_rank = {0: np.concatenate([d[0], d[1]]), 1: np.array([]), 2: d[3]}
    means = [np.abs(x).mean() if len(x) else 0.0 for x in per_rank.values()]
    assert close(row["sampling/sampling_logp_difference/mean"], np.mean(means))
    assert close(row["sampling/sampling_logp_difference/max"], abs(d[1][0]))
    if level == "token":
        ratios = {r: np.exp(x) for r, x in per_rank.items()}  # all inside [0.5, 2]
    else:
        ratios = {0: np.exp([d[0].sum(), d[1].sum()]), 1: np.array([1.0]), 2: np.exp(d[3])}
    stat = lambda fn: [fn(x) if len(x) else 0.0 for x in ratios.values()]  # noqa: E731
    assert close(row["sampling/importance_sampling_ratio/min"], min(stat(np.min)))
    assert close(row["sampling/importance_sampling_ratio/mean"], np.mean(stat(np.mean)))
    assert close(row["sampling/importance_sampling_ratio/max"], np.exp(d[1][0]))
    if level == "token":
        assert row["sampling/importance_sampling_ratio/min"] == 0.0


def test_verl_weight_statistics_of_one_and_of_two_tokens(tmp_path):
    # verl TIS (threshold 2.0: w' = clamp(w, 0, 2)), the whole step one batch. One token of δ = −20:
    # std 0 (verl's Σm > 1 guard), ESS 1/mm((w/(mm(w) + 1e-8))²) = ((w + 1e-8)/w)² with w = e^−20
    # (the guard dominates a vanishing weight). Two tokens of weights 1 and 1/2: mean 3/4, population
    # std 1/4, ESS (3/4)²/((1 + 1/4)/2) = 0.9.
    verl = {"rollout_is": "token", "rollout_is_threshold": 2.0}
    one, _ = one_call(tmp_path, [[-21.0]], [[-1.0]], config=verl, name="one")
    two, c = one_call(tmp_path, [[-1.0, -1.0 - np.log(2.0)]], [[-1.0, -1.0]], config=verl, name="two")
    r1 = grpolens.recompute(one, profile="verl", write=False).row(0, named=True)
    w = np.exp(-20.0)
    assert close(r1["rollout_corr/rollout_is_mean"], w)
    assert r1["rollout_corr/rollout_is_std"] == 0.0
    assert close(r1["rollout_corr/rollout_is_eff_sample_size"], ((w + 1e-8) / w) ** 2, rel=1e-6)
    r2 = grpolens.recompute(two, profile="verl", write=False).row(0, named=True)
    ws = np.exp(c.old[0] - c.rollout[0])  # the float32 log-probs as written: 1 and ~1/2
    m = ws.mean()
    assert close(r2["rollout_corr/rollout_is_mean"], m)
    assert close(r2["rollout_corr/rollout_is_std"], np.sqrt((ws * ws).mean() - m * m), rel=1e-6)
    assert close(r2["rollout_corr/rollout_is_eff_sample_size"], 1 / ((ws / (m + 1e-8)) ** 2).mean(), rel=1e-6)
    assert r2["rollout_corr/rollout_is_std"] == pytest.approx(0.25, rel=1e-6)


@pytest.mark.parametrize("band,high,low", [("0.5_1.0", 1 / 3, 0.0), ("1.0_2.0", 0.0, 1 / 3)])
def test_verl_sequence_weight_exactly_on_a_band_bound_is_inside(tmp_path, band, high, low):
    # sequence level, rows δ = [0, 0] (L = 0, raw weights 1, their mean s = 1), [0.5, 0] (L = 0.5,
    # s = (e^0.5 + 1)/2) and [−0.25, −0.25] (L = −0.5, s = e^−0.25): the first row sits exactly on a
    # bound of 1.0 (log 1 = 0) and is inside it, for the log-space ratio fractions and for the seq
    # fractions of the rows' mean raw weight; the others are beyond 1.0 and inside [0.5, 2]
    run, _ = one_call(tmp_path, [[-1.0, -1.0], [-0.5, -1.0], [-1.25, -1.25]], [[-1.0, -1.0]] * 3,
                      config={"rollout_is": "sequence", "rollout_is_threshold": band})
    row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert row["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(high)
    assert row["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(low)
    assert row["rollout_corr/rollout_is_seq_fraction_high"] == pytest.approx(high)
    assert row["rollout_corr/rollout_is_seq_fraction_low"] == pytest.approx(low)


def test_verl_profile_of_a_band_without_lower_bound_and_of_every_weight_zeroed(tmp_path):
    # a run configured with grpolens' own keys and no lower bound (verl's float threshold always
    # sets 1/U): under the verl profile the low fractions are 0.0, nothing below a bound not set
    old, roll = [[-1.0, -1.0], [-1.6, -1.2]], [[-1.0, -1.0]] * 2
    for level in ("token", "sequence"):
        run, _ = one_call(tmp_path, old, roll, name=level,
                          config={"level": level, "mode": "truncate_upper", "upper": 2.0})
        row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
        assert row["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0
        assert row["rollout_corr/rollout_is_seq_fraction_low"] == 0.0
        assert row["rollout_corr/rollout_is_mean"] is not None
    # IcePop zeroing every token: applied weights all 0, so Σw² = 0 and verl's ESS 1/mm(ŵ²) divides
    # by zero (a ZeroDivisionError in verl): null here, never inf
    run, _ = one_call(tmp_path, [[-0.5, -0.5]], [[-1.0, -1.0]], name="zeroed",
                      config={"rollout_is": "token", "rollout_is_threshold": "0.5_1.2"})
    row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert row["rollout_corr/rollout_is_mean"] == 0.0
    assert row["rollout_corr/rollout_is_eff_sample_size"] is None
    # with batch normalisation: a mean of 0 is not above 1e-8, so verl leaves the weights as they are (factor 1.0)
    run, _ = one_call(tmp_path, [[-0.5, -0.5]], [[-1.0, -1.0]], name="zeroed_bn",
                      config={"rollout_is": "token", "rollout_is_threshold": "0.5_1.2", "rollout_is_batch_normalize": True})
    assert grpolens.recompute(run, profile="verl", write=False)["rollout_corr/rollout_is_batch_norm_factor"][0] == 1.0
    # configured without an IS band (rejection filters only): the mismatch and rollout_rs metrics, no IS statistic
    run, _ = one_call(tmp_path, old, roll, name="rs",
                      config={"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"})
    row = grpolens.recompute(run, profile="verl", write=False).row(0, named=True)
    assert row["rollout_corr/rollout_is_mean"] is None and row["rollout_corr/rollout_rs_masked_fraction"] is not None


def test_xtuner_pack_of_one_token_reports_its_mismatch(tmp_path):
    # xtuner's compute_mismatch_metrics treats the pack as one row, whatever its number of tokens:
    # one valid token, log π_train = -1, log π_rollout = -1.5 (δ = 0.5): training log-PPL 1,
    # rollout log-PPL 1.5, k1 = mean(log π_rollout − log π_train) = -0.5, k3 = e^0.5 − 0.5 − 1,
    # log-PPL difference lr − lo = -0.5
    run, _ = one_call(tmp_path, [[-1.0]], [[-1.5]], config={"rollout_is_threshold": [2.0, 0.5]})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    want = {"mismatch_training_log_ppl": 1.0, "mismatch_training_ppl": np.e, "mismatch_rollout_log_ppl": 1.5,
            "mismatch_rollout_ppl": np.exp(1.5), "mismatch_kl": -0.5, "mismatch_k3_kl": np.exp(0.5) - 1.5,
            "mismatch_log_ppl_diff": -0.5, "mismatch_log_ppl_abs_diff": 0.5, "mismatch_log_ppl_diff_max": -0.5,
            "mismatch_log_ppl_diff_min": -0.5, "mismatch_ppl_ratio": np.exp(-0.5), "mismatch_logprob_abs_diff": 0.5}
    assert {k: xt["mismatch/" + k] for k in want} == pytest.approx(want, rel=1e-6)


def test_xtuner_without_an_is_threshold_logs_only_the_mismatch(tmp_path):
    # xtuner computes no IS weight metrics without rollout_is_threshold (a lone veto, written the
    # canonical way so that the config keeps it): its mismatch metrics only
    run, _ = one_call(tmp_path, [[-1.0, -1.0]], [[-1.5, -1.2]], config={"veto_upper": 10.0})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    assert xt["mismatch/mismatch_kl"] == pytest.approx(-0.35, rel=1e-6)
    assert all(v is None for k, v in xt.items() if k.startswith("mismatch/rollout_is_")), xt


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_xtuner_pack_without_a_lower_bound(tmp_path, level):
    # a config with an upper bound only (xtuner itself always has both; grpolens' canonical config
    # may not), one pack: row A δ = [1, 1], row B δ = [-1]. Sequence level X = [2, -1], geometric
    # X = [1, -1]; upper 2: no row is below a missing lower bound, and the clamp for the spread
    # has no floor: w' = min(e^X, 2), token-weighted over the pack's 3 tokens.
    run, _ = one_call(tmp_path, [[-1.0, -1.0], [-1.0, -1.0]], [[-2.0, -2.0], [0.0, -9.0]],
                      mask=np.array([[True, True], [True, False]]),
                      config={"level": level, "mode": "truncate", "upper": 2.0})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    X = np.array([2.0, -1.0]) if level == "sequence" else np.array([1.0, -1.0])
    n = np.array([2, 1])
    wc = np.minimum(np.exp(X), 2.0)
    mean, sq = (n * wc).sum() / 3, (n * wc * wc).sum() / 3
    assert xt["mismatch/rollout_is_ratio_fraction_low"] == 0.0
    high = 0.5 if level == "sequence" else 2 / 3  # sequence level: a share of rows; geometric: of tokens
    assert xt["mismatch/rollout_is_ratio_fraction_high"] == pytest.approx(high)
    assert xt["mismatch/rollout_is_std"] == pytest.approx(np.sqrt(sq - mean ** 2), rel=1e-6)
    assert xt["mismatch/rollout_is_seq_fraction_low"] == 0.0


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_xtuner_row_weight_exactly_on_a_band_bound_is_inside(tmp_path, level):
    # xtuner counts X > log upper and X < log lower (strictly): rows with δ = 0 everywhere have
    # X = 0 = log 1.0, exactly on the upper bound of [0.5, 1.0] and on the lower bound of
    # [1.0, 2.0]; the other row (δ = 1) is above both bands
    old, rollout = [[-1.0, -1.0], [-1.0, -1.0]], [[-1.0, -1.0], [-2.0, -2.0]]
    for band, key, want in (([1.0, 0.5], "rollout_is_ratio_fraction_high", 0.5),
                            ([2.0, 1.0], "rollout_is_ratio_fraction_low", 0.0)):
        run, _ = one_call(tmp_path, old, rollout, name=f"{level}-{band[1]}",
                          config={"rollout_is_level": level, "rollout_is_mode": "truncate", "rollout_is_threshold": band})
        xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
        assert xt["mismatch/" + key] == want, band


def test_xtuner_clamped_spread_of_a_two_token_pack(tmp_path):
    # xtuner: std of the clamped weights when the pack has more than one token. Weights 0.5 and
    # 0.25 inside [0.1, 2]: population std 0.125; ESS = mean² / mean of squares = 0.140625 / 0.15625
    run, _ = one_call(tmp_path, [[0.0, 0.0]], [-np.log([0.5, 0.25])], config={"rollout_is_threshold": [2.0, 0.1]})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    assert xt["mismatch/rollout_is_std"] == pytest.approx(0.125, rel=1e-6)
    assert xt["mismatch/rollout_is_eff_sample_size"] == pytest.approx(0.9, rel=1e-6)


def test_xtuner_ess_of_vanishing_weights_keeps_the_reference_guard(tmp_path):
    # xtuner's ESS divides the weights by (mean + 1e-8) before squaring: for one token of weight
    # w = e^-20 (lower bound 0, so nothing clamps it up) that is ((w + 1e-8) / w)², about 34, not 1
    run, _ = one_call(tmp_path, [[-21.0]], [[-1.0]], config={"rollout_is_threshold": [2.0, 0.0]})
    xt = grpolens.recompute(run, profile="xtuner", write=False).row(0, named=True)
    w = np.exp(-20.0)
    assert xt["mismatch/rollout_is_eff_sample_size"] == pytest.approx(((w + 1e-8) / w) ** 2, rel=1e-6)
