"""Policy-ratio family against a numpy reference on the padded loss-call arrays."""

import numpy as np
import pytest

import grpolens
from grpolens.metrics.batch import TokenBatch
from tests.refdata import LossCall, approx, f32, random_calls, write_run


def _tokens(calls, step, clamp=None):
    """Flat arrays of one step: (logp over new-valid tokens, old, d over ratio-valid tokens)."""
    lp_new, old, d = [], [], []
    for c in calls:
        if c.step != step:
            continue
        vnew = c.mask & np.isfinite(c.logp)
        v = vnew & np.isfinite(c.old)
        lp_new.append(c.logp[vnew])
        old.append(c.old[v])
        d.append(c.logp[v] - c.old[v])
    d = np.concatenate(d)
    if clamp is not None:
        d = np.clip(d, -clamp, clamp)
    return np.concatenate(lp_new), np.concatenate(old), d


def _ref(calls, step, clamp=None):
    lp, old, d = _tokens(calls, step, clamp)
    r = np.exp(d)
    k3 = r - d - 1.0
    out = {
        "policy/logp_mean": lp.mean() if lp.size else None,
        "policy/confidence": float(np.exp(lp.mean())) if lp.size else None,
    }
    if d.size:
        out.update({
            "policy/old_logp_mean": old.mean(), "policy/log_ratio_mean": d.mean(), "policy/k1": -d.mean(),
            "policy/approx_kl": k3.mean(), "policy/token_kl_max": k3.max(), "policy/ratio_max": r.max(),
            "policy/ratio_min": r.min(),
        })
    else:
        out.update(dict.fromkeys(["policy/old_logp_mean", "policy/log_ratio_mean", "policy/k1", "policy/approx_kl",
                                  "policy/token_kl_max", "policy/ratio_max", "policy/ratio_min"]))
    dc = np.clip(_tokens(calls, step)[2], -20, 20)
    out["policy/ratio_abs_dev_mean"] = np.abs(np.exp(dc) - 1).mean() if dc.size else None
    return out


TWINKLE = {"policy/logp_mean": "train/mean_new_logp", "policy/confidence": "train/policy_confidence",
           "policy/old_logp_mean": "train/mean_old_logp", "policy/log_ratio_mean": "train/logp_diff_mean",
           "policy/approx_kl": "train/approx_kl", "policy/token_kl_max": "train/token_kl_max",
           "policy/ratio_max": "train/token_ratio_max"}
XTUNER = {"policy/k1": "reduced_train_policy_kl1", "policy/approx_kl": "reduced_train_policy_kl3",
          "policy/ratio_abs_dev_mean": "reduced_train_policy_ratio_abs_dev_mean",
          "policy/ratio_max": "reduced_train_policy_ratio_max", "policy/ratio_min": "reduced_train_policy_ratio_min"}


def _row(df, step):
    return df.filter(df["step"] == step).row(0, named=True)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("nonfinite", [0.0, 0.1])
def test_policy_against_reference(tmp_path, seed, nonfinite):
    rng = np.random.default_rng(seed)
    calls = random_calls(rng, nonfinite=nonfinite, spread=0.5)
    run = write_run(tmp_path / "run", calls)
    got = grpolens.recompute(run, write=False)
    tw = grpolens.recompute(run, profile="twinkle", write=False)
    xt = grpolens.recompute(run, profile="xtuner", write=False)
    for step in (0, 1):
        ref = _ref(calls, step)
        row, trow, xrow = _row(got, step), _row(tw, step), _row(xt, step)
        for name, want in ref.items():
            assert approx(row[name], want), (name, row[name], want)
        for name, tname in TWINKLE.items():
            assert approx(trow[tname], ref[name]), tname
        # |d| < 20 here, so xtuner's clamp changes nothing
        for name, xname in XTUNER.items():
            assert approx(xrow[xname], ref[name]), xname
    assert set(xt.columns) >= set(XTUNER.values()) and "train/entropy" in tw.columns


def test_policy_hand_worked(tmp_path):
    # One sequence, tokens d = logp - old = [ln 2, 0, -ln 2] (masked middle token excluded below):
    #   logp = [-1, -2, -3], old = [-1 - ln2, -2, -3 + ln2]; mask = [T, F, T]
    #   d over valid = [ln2, -ln2]: mean 0; r = [2, 0.5]; K3 = r - d - 1 = [1 - ln2, ln2 - 0.5]
    #   approx_kl = (1 - ln2 + ln2 - 0.5) / 2 = 0.25; token_kl_max = 1 - ln2 = 0.30685...
    #   logp_mean over masked = (-1 - 3)/2 = -2; confidence = e^-2; old mean = (-1-ln2-3+ln2)/2 = -2
    rng = np.random.default_rng(0)
    (c,) = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=1, max_len=3, all_masked_row=False,
                        single_token=False, zero_adv=False)
    ln2 = np.log(2.0)
    c.lengths[:] = 3
    c.logp[:] = [[-1.0, -2.0, -3.0]]
    c.old[:] = [[-1.0 - ln2, -2.0, -3.0 + ln2]]
    c.mask[:] = [[True, False, True]]
    got = _row(grpolens.recompute(write_run(tmp_path / "run", [c]), write=False), 0)
    assert got["policy/approx_kl"] == pytest.approx(0.25, rel=1e-6)
    assert got["policy/token_kl_max"] == pytest.approx(1 - ln2, rel=1e-6)
    assert got["policy/ratio_max"] == pytest.approx(2.0, rel=1e-6)
    assert got["policy/ratio_min"] == pytest.approx(0.5, rel=1e-6)
    assert got["policy/logp_mean"] == pytest.approx(-2.0)
    assert got["policy/confidence"] == pytest.approx(np.exp(-2.0))
    assert got["policy/old_logp_mean"] == pytest.approx(-2.0, rel=1e-6)
    assert got["policy/log_ratio_mean"] == pytest.approx(0.0, abs=1e-6)
    assert got["policy/ratio_abs_dev_mean"] == pytest.approx(0.75, rel=1e-6)  # (|2-1| + |0.5-1|) / 2


def test_xtuner_clamp_and_empty(tmp_path):
    rng = np.random.default_rng(5)
    calls = random_calls(rng, steps=(0, 1), nonfinite=0.0)
    calls[0].logp[0, 0] = -0.5
    calls[0].old[0, 0] = -30.0  # d = 29.5: xtuner clamps it to 20
    calls[0].mask[0, 0] = True
    for c in calls:
        if c.step == 1:
            c.mask[:] = False  # step 1: nothing valid
    run = write_run(tmp_path / "run", calls)
    got, xt, tw = (grpolens.recompute(run, profile=p, write=False) for p in ("grpolens", "xtuner", "twinkle"))
    ref, refc = _ref(calls, 0), _ref(calls, 0, clamp=20.0)
    row, xrow = _row(got, 0), _row(xt, 0)
    assert approx(row["policy/approx_kl"], ref["policy/approx_kl"])
    assert approx(xrow["reduced_train_policy_kl3"], refc["policy/approx_kl"])
    assert not approx(xrow["reduced_train_policy_kl3"], ref["policy/approx_kl"], rel=1e-3)
    assert approx(row["policy/ratio_max"], np.exp(29.5), rel=1e-6)
    assert approx(xrow["reduced_train_policy_ratio_max"], np.exp(20.0))
    assert approx(xrow["reduced_train_policy_kl1"], -_tokens(calls, 0)[2].mean())  # kl1 is not clamped
    # step 1: grpolens null, xtuner 0.0, Twinkle logs nothing (no masked token)
    assert all(_row(got, 1)[k] is None for k in ("policy/approx_kl", "policy/ratio_max", "policy/logp_mean"))
    assert all(_row(xt, 1)[k] == 0.0 for k in XTUNER.values())
    assert _row(tw, 1)["train/token_kl_max"] is None and _row(tw, 1)["train/mean_new_logp"] is None


def test_twinkle_max_starts_at_zero(tmp_path):
    # masked tokens exist but none has a finite old log-prob: grpolens null, Twinkle 0.0
    rng = np.random.default_rng(2)
    calls = random_calls(rng, steps=(0,))
    for c in calls:
        c.old[:] = np.nan
    run = write_run(tmp_path / "run", calls)
    got = _row(grpolens.recompute(run, write=False), 0)
    tw = _row(grpolens.recompute(run, profile="twinkle", write=False), 0)
    assert got["policy/token_kl_max"] is None and got["policy/ratio_max"] is None
    assert tw["train/token_kl_max"] == 0.0 and tw["train/token_ratio_max"] == 0.0
    assert tw["train/approx_kl"] is None and tw["train/mean_new_logp"] is not None


def test_without_old_logp(tmp_path):
    rng = np.random.default_rng(3)
    calls = random_calls(rng, old=False, rollout=False)
    got = grpolens.recompute(write_run(tmp_path / "run", calls), write=False)
    for name in ("policy/approx_kl", "policy/old_logp_mean", "policy/ratio_max", "policy/k1"):
        assert got[name].null_count() == got.height, name
    lp = np.concatenate([c.logp[c.mask & np.isfinite(c.logp)] for c in calls if c.step == 0])
    assert approx(_row(got, 0)["policy/logp_mean"], lp.mean())


def test_xtuner_clamps_negative_log_ratios_too(tmp_path):
    # one token, d = logp - old = -30 - (-5) = -25; xtuner clamps d to -20 first:
    #   kl3 = k3(-20) = e^-20 + 20 - 1, ratio_min = e^-20, |r - 1| = 1 - e^-20
    # the canonical values are not clamped: approx_kl = e^-25 + 25 - 1, ratio_min = e^-25
    c = LossCall(0, 0, 0, np.arange(1), np.array([1]), f32([[-30.0]]), np.ones((1, 1), bool), f32([1.0]),
                 old=f32([[-5.0]]))
    run = write_run(tmp_path / "run", [c])
    got = _row(grpolens.recompute(run, write=False), 0)
    xt = _row(grpolens.recompute(run, profile="xtuner", write=False), 0)
    assert got["policy/approx_kl"] == pytest.approx(np.exp(-25.0) + 24.0, rel=1e-12)
    assert got["policy/ratio_min"] == pytest.approx(np.exp(-25.0), rel=1e-9)
    assert xt["reduced_train_policy_kl3"] == pytest.approx(np.exp(-20.0) + 19.0, rel=1e-12)
    assert xt["reduced_train_policy_ratio_min"] == pytest.approx(np.exp(-20.0), rel=1e-9)
    assert xt["reduced_train_policy_ratio_abs_dev_mean"] == pytest.approx(1.0 - np.exp(-20.0), rel=1e-12)


def test_token_kl_max_of_a_sequence_with_a_single_valid_token(tmp_path):
    # sequence 0: one valid token, d = ln 2: K3 = 2 - ln 2 - 1 = 1 - ln 2 (the step's largest);
    # sequence 1: two valid tokens, d = ln 1.2: K3 = 0.2 - ln 1.2 each
    ln2 = np.log(2.0)
    logp = f32([[-1.0, -1.0], [-1.0, -1.0]])
    old = f32([[-1.0 - ln2, -1.0], [-1.0 - np.log(1.2), -1.0 - np.log(1.2)]])
    mask = np.array([[True, False], [True, True]])
    c = LossCall(0, 0, 0, np.arange(2), np.array([2, 2]), logp, mask, f32([1.0, -1.0]), old=old)
    got = _row(grpolens.recompute(write_run(tmp_path / "run", [c]), write=False), 0)
    d = (logp - old)[mask]
    assert got["policy/token_kl_max"] == pytest.approx(float((np.exp(d) - d - 1).max()), rel=1e-9)
    assert got["policy/token_kl_max"] == pytest.approx(1 - ln2, rel=1e-6)
    assert got["policy/ratio_max"] == pytest.approx(2.0, rel=1e-6)


def test_a_tokens_shard_without_rows(tmp_path):
    """A rank that stored no token at a step (an empty shard) gives that step no value, in every
    profile (xtuner's 0.0 for an empty step needs sequences), and leaves the other steps alone; with
    a log-ratio clamp configured, the clamp of no token is no token."""
    import pyarrow.parquet as pq

    from grpolens.run import format as fmt
    from tests.refdata import call_table

    calls = random_calls(np.random.default_rng(1), steps=(0,), ranks=1, micro_batches=1)
    cfg = {"loss_type": "dapo", "log_ratio_clamp": 20, "beta": 0.04}
    plain = write_run(tmp_path / "plain", calls, config=cfg)
    run = write_run(tmp_path / "run", calls, config=cfg)
    empty = run / fmt.shard_relpath(fmt.TOKENS, 1, 0, None)
    empty.parent.mkdir(parents=True)
    pq.write_table(call_table(calls[0]).slice(0, 0), empty)
    for profile in ("grpolens", "xtuner", "trl", "twinkle"):
        got = grpolens.recompute(run, profile=profile, write=False)
        want = _row(grpolens.recompute(plain, profile=profile, write=False), 0)
        assert _row(got, 0) == want, profile
        step1 = _row(got, 1)
        names = [n for n in want if n.startswith(("policy/", "reduced_train_policy_", "loss", "kl", "entropy", "train/"))]
        assert names and all(step1[n] is None for n in names), (profile, {n: step1[n] for n in names})


def test_seq_log_ratio_of_a_fresh_batch_is_the_mean_valid_log_ratio_per_sequence():
    """GSPO's per-sequence log ratio called first on a batch, before any other producer has counted
    its valid tokens: Σ_t d / max(#valid, 1), worked by hand on three ragged sequences (one without a
    valid token), unclamped and clamped at 0.3."""
    from grpolens.metrics.ratios import seq_log_ratio
    from tests.metrics.test_batch import _table

    nan = float("nan")
    rows = [  # sample 0: d = 0.5, 0.5; sample 1: the old log-prob undefined; sample 2: d = 0.2, -0.4, masked
        {"sample_id": 0, "pos": 0, "logp": -1.0, "old_logp": -1.5, "mask": True},
        {"sample_id": 0, "pos": 1, "logp": -2.0, "old_logp": -2.5, "mask": True},
        {"sample_id": 1, "pos": 0, "logp": -1.0, "old_logp": nan, "mask": True},
        {"sample_id": 2, "pos": 0, "logp": -1.0, "old_logp": -1.2, "mask": True},
        {"sample_id": 2, "pos": 1, "logp": -1.0, "old_logp": -0.6, "mask": True},
        {"sample_id": 2, "pos": 2, "logp": -9.0, "old_logp": -1.0, "mask": False},
    ]
    for clamp, expected in ((None, [0.5, 0.0, -0.1]), (0.3, [0.3, 0.0, -0.05])):
        b = TokenBatch.from_arrow(_table(rows))
        np.testing.assert_allclose(seq_log_ratio(b, clamp), expected, rtol=0, atol=1e-12)
