"""Values exactly on a threshold, and the edges random data never reaches.

Random floats never land on ``1 - epsilon`` or on a bucket edge, so a ``<`` turned into ``<=`` goes
unnoticed by the reference tests. Here each threshold is hit exactly: the ratio is built from
float32 log-probs whose difference gives a float64 ``r``, and the config bound is chosen so that the
code's own ``1 - epsilon`` / ``1 + epsilon_high`` is exactly ``r`` (Sterbenz: ``1 - (1 - r) == r``
for ``r`` in [0.5, 2]). Each test also has a value just past the bound, so it is not vacuous.
"""

from __future__ import annotations

import numpy as np
import pytest

import grpolens
from grpolens.metrics.kl import BUCKET_LABELS, bucket_of
from tests.refdata import LossCall, f32, random_calls, write_run


def _row(df, step=0):
    return df.filter(df["step"] == step).row(0, named=True)


def _ratio(logp: float, old: float) -> float:
    """The token ratio the engine computes from these stored (float32) log-probs."""
    return float(np.exp(np.float64(np.float32(logp)) - np.float64(np.float32(old))))


def test_clip_ratio_exactly_on_the_trust_region_bounds_is_not_clipped(tmp_path):
    # TRL: low-clipped = ratio < 1 - eps and A < 0; high-clipped = ratio > 1 + eps_high and A > 0.
    # seq 0 (A = -1): ratios [r_lo, just below r_lo]; seq 1 (A = +1): ratios [r_hi, just above r_hi]
    old = -1.0
    lp_lo, lp_hi = -1.25, -0.75
    r_lo, r_hi = _ratio(lp_lo, old), _ratio(lp_hi, old)
    assert 0.5 < r_lo < 1.0 < r_hi < 2.0
    eps, eps_high = 1.0 - r_lo, r_hi - 1.0
    assert 1.0 - eps == r_lo and 1.0 + eps_high == r_hi  # the bounds the code computes are exact
    below = float(np.nextafter(np.float32(lp_lo), np.float32(-2)))
    above = float(np.nextafter(np.float32(lp_hi), np.float32(0)))
    assert _ratio(below, old) < r_lo and _ratio(above, old) > r_hi
    logp = np.array([[lp_lo, below], [lp_hi, above]])
    c = LossCall(0, 0, 0, np.arange(2), np.array([2, 2]), f32(logp), np.ones((2, 2), bool), f32([-1.0, 1.0]),
                 old=f32(np.full((2, 2), old)))
    cfg = {"loss_type": "dapo", "epsilon": eps, "epsilon_high": eps_high}
    run = write_run(tmp_path / "run", [c], config=cfg)
    got, trl = _row(grpolens.recompute(run, write=False)), _row(grpolens.recompute(run, profile="trl", write=False))
    assert got["clip/low"] == pytest.approx(1 / 4) and got["clip/high"] == pytest.approx(1 / 4)
    assert trl["clip_ratio/low_mean"] == pytest.approx(1 / 4) and trl["clip_ratio/high_mean"] == pytest.approx(1 / 4)
    # the unconditional rates (no advantage gate): e^d < 1 - eps, e^d > 1 + eps_high, strictly
    assert got["clip/ratio_below"] == pytest.approx(1 / 4) and got["clip/ratio_above"] == pytest.approx(1 / 4)
    assert got["clip/ratio_outside"] == pytest.approx(2 / 4)


def test_cispo_weight_exactly_on_the_cap_is_not_counted(tmp_path):
    # TRL: is_cispo_clipped = (coef_1 > epsilon_high) & (A > 0); under CISPO epsilon_high is the
    # absolute cap of the weight. One sequence (A = +1): ratios [exactly the cap, just above it].
    old, lp = -1.0, -0.75
    cap = _ratio(lp, old)
    above = float(np.nextafter(np.float32(lp), np.float32(0)))
    assert _ratio(above, old) > cap
    c = LossCall(0, 0, 0, np.arange(1), np.array([2]), f32([[lp, above]]), np.ones((1, 2), bool), f32([1.0]),
                 old=f32(np.full((1, 2), old)))
    run = write_run(tmp_path / "run", [c], config={"loss_type": "cispo", "epsilon": 0.2, "epsilon_high": cap})
    assert _row(grpolens.recompute(run, write=False))["clip/cispo"] == pytest.approx(1 / 2)


def test_kl_length_buckets_include_their_upper_edge():
    lengths = np.array([0, 1, 32, 33, 64, 65, 128, 129, 256, 257, 10_000])
    assert BUCKET_LABELS == ("0-32", "33-64", "65-128", "129-256", "257+")
    assert bucket_of(lengths).tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_kl_by_length_sequences_exactly_on_the_edges(tmp_path):
    # five sequences with exactly 32, 33, 64, 128 and 256 masked tokens (stored rows: one more each)
    counts = [32, 33, 64, 128, 256]
    rng = np.random.default_rng(3)
    (c,) = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=len(counts), max_len=257,
                        all_masked_row=False, zero_adv=False, single_token=False)
    c.lengths[:] = [n + 1 for n in counts]
    c.mask[:] = False
    for i, n in enumerate(counts):
        c.mask[i, :n] = True
    got = _row(grpolens.recompute(write_run(tmp_path / "run", [c], config={"beta": 0.04}), write=False))
    tokens = {lab: got[f"kl/by_length_tokens/{lab}"] for lab in BUCKET_LABELS}
    assert tokens == {"0-32": 32.0, "33-64": 33.0 + 64.0, "65-128": 128.0, "129-256": 256.0, "257+": 0.0}


def test_xtuner_pack_without_a_valid_token_is_left_out_of_the_pack_mean():
    """xtuner's token means (the ``pack_mean`` rule: per (rank, micro_batch) pack Σx / (n + 1e-8),
    then the mean over packs) skip a pack with no valid token: it contributes nothing, not a zero.
    Three packs on two ranks; pack (1, 0) has sequences but no valid token."""
    from grpolens.metrics.reduce import StepData, grouped_ratio

    seqs = {"step": np.zeros(5, np.int64), "rank": np.array([0, 0, 0, 1, 1]),
            "micro_batch": np.array([0, 0, 1, 0, 0]), "sample_id": np.arange(5),
            "x.sum": np.array([1.0, 2.0, 4.0, 0.0, 0.0]), "x.n": np.array([2.0, 1.0, 2.0, 0.0, 0.0])}
    sd = StepData(0, seqs, {}, profile="xtuner")
    want = np.mean([3.0 / (3.0 + 1e-8), 4.0 / (2.0 + 1e-8)])  # packs (0, 0) and (0, 1) only
    assert grouped_ratio(sd, "x.sum", "x.n", "pack_mean") == pytest.approx(want, rel=1e-12)
    # no pack with a valid token at all: undefined, not 0
    empty = StepData(0, {**seqs, "x.n": np.zeros(5)}, {}, profile="xtuner")
    assert grouped_ratio(empty, "x.sum", "x.n", "pack_mean") is None


def test_merging_a_piece_without_a_max_column_keeps_negative_maxima():
    """A rank that lacks an optional column (no old_logp there) contributes the max rule's neutral
    -inf, so the step's maximum of negative values stays negative (0.0 would win)."""
    from grpolens.metrics.partials import merge_arrays
    from grpolens.metrics.registry import load_families

    load_families()
    keys = lambda rank, ids: {"step": np.zeros(len(ids), np.int64), "rank": np.full(len(ids), rank, np.int64),  # noqa: E731
                              "micro_batch": np.zeros(len(ids), np.int64), "sample_id": np.asarray(ids, np.int64)}
    with_old = {**keys(0, [0, 1]), "policy.d.max": np.array([-0.5, -0.25])}
    without = keys(1, [2, 3])
    out = merge_arrays([with_old, without])
    assert out["policy.d.max"].tolist() == [-0.5, -0.25, -np.inf, -np.inf]
    assert out["policy.d.max"].max() == -0.25


def test_kl_length_bucket_holding_a_single_token(tmp_path):
    # one sequence with one masked token, x = ref - logp = -0.5: k3 = e^-0.5 + 0.5 - 1 = 0.10653,
    # over 1 token (canonical), and over max(1 token, 1) under MaxEnt-GRPO's profile
    c = LossCall(0, 0, 0, np.arange(1), np.array([1]), f32([[-1.0]]), np.ones((1, 1), bool), f32([1.0]),
                 ref=f32([[-1.5]]))
    run = write_run(tmp_path / "run", [c], config={"beta": 0.04})
    k3 = np.exp(-0.5) + 0.5 - 1.0
    got = _row(grpolens.recompute(run, write=False))
    assert got["kl/by_length/0-32"] == pytest.approx(k3, rel=1e-6) and got["kl/by_length_tokens/0-32"] == 1.0
    mx = _row(grpolens.recompute(run, profile="maxent", write=False))
    assert mx["train/kl_per_token_bucket/0-32"] == pytest.approx(k3, rel=1e-6)
    assert mx["train/kl_per_token_bucket_tokens/0-32"] == 1.0


def test_maxent_kl_clamps_x_on_the_negative_side_too(tmp_path):
    # MaxEnt-GRPO clamps x = ref - logp to [-60, 60] before exp: x = -69 (ref -70, logp -1) counts as
    # -60, k3 = e^-60 + 60 - 1 (unclamped it would be e^-69 + 69 - 1 = 68)
    c = LossCall(0, 0, 0, np.arange(1), np.array([1]), f32([[-1.0]]), np.ones((1, 1), bool), f32([1.0]),
                 ref=f32([[-70.0]]))
    run = write_run(tmp_path / "run", [c], config={"beta": 0.04, "loss_type": "grpo"})
    mx = _row(grpolens.recompute(run, profile="maxent", write=False))
    assert mx["train/kl"] == pytest.approx(np.exp(-60.0) + 60.0 - 1.0, rel=1e-12)


def test_kl_loss_norm_on_one_token_and_on_no_token(tmp_path):
    # one valid token, x = -0.5: k3 = e^-0.5 + 0.5 - 1 under every loss normalisation (one sequence of
    # one token). All masked: nothing to average canonically (null); MaxEnt-GRPO clamps its
    # denominators to >= 1 and logs 0.0
    one = LossCall(0, 0, 0, np.arange(1), np.array([1]), f32([[-1.0]]), np.ones((1, 1), bool), f32([1.0]),
                   ref=f32([[-1.5]]))
    none = LossCall(1, 0, 0, np.arange(1, 2), np.array([1]), f32([[-1.0]]), np.zeros((1, 1), bool), f32([1.0]),
                    ref=f32([[-1.5]]))
    run = write_run(tmp_path / "run", [one, none], config={"beta": 0.04, "loss_type": "dapo"})
    got, mx = grpolens.recompute(run, write=False), grpolens.recompute(run, profile="maxent", write=False)
    k3 = np.exp(-0.5) + 0.5 - 1.0
    assert _row(got, 0)["kl/k3_loss_norm"] == pytest.approx(k3, rel=1e-6)
    assert _row(mx, 0)["train/kl"] == pytest.approx(k3, rel=1e-6)
    assert _row(got, 1)["kl/k3_loss_norm"] is None
    assert _row(mx, 1)["train/kl"] == 0.0
