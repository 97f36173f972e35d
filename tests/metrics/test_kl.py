"""KL-to-reference family against a numpy reference on the padded loss-call arrays."""

import numpy as np
import pytest

import grpolens
from tests.refdata import approx, pooled, random_calls, trl_slot_mean, write_run


def _valid(c):
    return c.mask & np.isfinite(c.logp) & np.isfinite(c.ref)


def _x(c):
    with np.errstate(invalid="ignore"):
        return c.ref - c.logp


def _k3(c):
    x = _x(c)
    return np.exp(x) - x - 1.0


def _seq_ratio(c):
    """GSPO's sequence ratio per row, over tokens with finite logp and old (0 tokens: 1)."""
    v = c.mask & np.isfinite(c.logp) & np.isfinite(c.old)
    d = np.where(v, c.logp - c.old, 0.0)
    return np.exp(d.sum(1) / np.maximum(v.sum(1), 1))


def _corrected(level):
    if level == "token":
        def x(c):
            return _k3(c) * np.exp(c.logp - c.old)

        def v(c):
            return _valid(c) & np.isfinite(c.old)
    else:
        def x(c):
            return _k3(c) * _seq_ratio(c)[:, None]
        v = _valid
    return x, v


def _row(df, step):
    return df.filter(df["step"] == step).row(0, named=True)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("nonfinite", [0.0, 0.1])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_estimators(tmp_path, seed, nonfinite, level):
    rng = np.random.default_rng(seed)
    calls = random_calls(rng, nonfinite=nonfinite, spread=0.6)
    cfg = {"beta": 0.04, "use_bias_correction_kl": True, "importance_sampling_level": level}
    run = write_run(tmp_path / "run", calls, config=cfg)
    got = grpolens.recompute(run, write=False)
    trl = grpolens.recompute(run, profile="trl", write=False)
    cx, cv = _corrected(level)
    for step in (0, 1):
        row = _row(got, step)
        assert approx(row["kl/k1"], pooled(calls, step, lambda c: -_x(c), _valid))
        assert approx(row["kl/k2"], pooled(calls, step, lambda c: 0.5 * _x(c) ** 2, _valid))
        assert approx(row["kl/k3"], pooled(calls, step, _k3, _valid))
        assert approx(row["kl/k3_corrected"], pooled(calls, step, cx, cv))
        assert approx(row["kl/penalty"], row["kl/k3_corrected"])
        assert approx(_row(trl, step)["kl"], trl_slot_mean(calls, step, cx, cv))


def test_trl_kl_presence_and_uncorrected(tmp_path):
    rng = np.random.default_rng(4)
    calls = random_calls(rng)
    trl0 = grpolens.recompute(write_run(tmp_path / "a", calls, config={"beta": 0.0}), profile="trl", write=False)
    assert "kl" not in trl0.columns  # TRL logs kl only when beta != 0
    g0 = grpolens.recompute(tmp_path / "a", write=False)
    assert "kl/penalty" not in g0.columns and "kl/k3" in g0.columns
    run = write_run(tmp_path / "b", calls, config={"beta": 0.1, "use_bias_correction_kl": False})
    trl = grpolens.recompute(run, profile="trl", write=False)
    for step in (0, 1):
        assert approx(_row(trl, step)["kl"], trl_slot_mean(calls, step, _k3, _valid))
    # all-masked slot: TRL logs 0.0 for it; grpolens has nothing to average
    for c in calls:
        if c.micro_batch == 1:
            c.mask[:] = False
    run = write_run(tmp_path / "c", calls, config={"beta": 0.1})
    trl = grpolens.recompute(run, profile="trl", write=False)
    want = trl_slot_mean(calls, 0, _k3, _valid)
    assert approx(_row(trl, 0)["kl"], want) and approx(want * 2, pooled(calls, 0, _k3, _valid))
    for c in calls:
        c.mask[:] = False
    run = write_run(tmp_path / "d", calls, config={"beta": 0.1})
    assert grpolens.recompute(run, profile="trl", write=False)["kl"].to_list() == [0.0, 0.0]
    assert grpolens.recompute(run, write=False)["kl/k3"].to_list() == [None, None]


def test_no_reference(tmp_path):
    rng = np.random.default_rng(6)
    calls = random_calls(rng, ref=False)
    run = write_run(tmp_path / "run", calls, config={"beta": 0.04})
    got = grpolens.recompute(run, write=False)
    for name in ("kl/k1", "kl/k3", "kl/penalty", "kl/by_length/0-32", "kl/k3_loss_norm"):
        assert got[name].null_count() == got.height, name
    assert grpolens.recompute(run, profile="trl", write=False)["kl"].null_count() == 2


def _maxent_kl(calls, step, loss_type, max_len):
    """MaxEnt-GRPO's train/kl over the whole step: k3 with x clamped to ±60, by loss type."""
    rows_s, rows_n, width = [], [], 0
    for c in calls:
        if c.step != step:
            continue
        v = _valid(c)
        x = np.clip(np.where(v, _x(c), 0.0), -60, 60)
        k = np.where(v, np.exp(x) - x - 1, 0.0)
        rows_s += list(k.sum(1))
        rows_n += list(v.sum(1))
        width = max(width, c.lengths.max())
    s, n = np.array(rows_s), np.array(rows_n, dtype=float)
    if loss_type == "grpo":
        return np.mean(s / np.maximum(n, 1))
    if loss_type == "dr_grpo":
        return s.sum() / (len(s) * (max_len or width))
    return s.sum() / max(n.sum(), 1)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo"])
@pytest.mark.parametrize("max_len", [None, 16])
def test_maxent_train_kl(tmp_path, loss_type, max_len):
    rng = np.random.default_rng(7)
    calls = random_calls(rng, nonfinite=0.05, spread=0.8)
    calls[0].logp[0, 0] = -75.0  # a log-prob can be very negative, never positive
    calls[0].ref[0, 0] = calls[0].logp[0, 0] + 70.0  # beyond MaxEnt's ±60 clamp
    calls[0].mask[0, 0] = True
    cfg = {"loss_type": loss_type, "max_completion_length": max_len}
    run = write_run(tmp_path / "run", calls, config=cfg)
    mx = grpolens.recompute(run, profile="maxent", write=False)
    got = grpolens.recompute(run, write=False)
    for step in (0, 1):
        assert approx(_row(mx, step)["train/kl"], _maxent_kl(calls, step, loss_type, max_len))
    # grpolens: unclamped k3, same normalisation (null for dr_grpo without max_completion_length)
    k3 = pooled(calls, 1, _k3, _valid)
    if loss_type in ("bnpo", "dapo"):
        assert approx(_row(got, 1)["kl/k3_loss_norm"], k3)
    if loss_type == "dr_grpo" and max_len is None:
        assert got["kl/k3_loss_norm"].to_list() == [None, None]
    assert _row(got, 0)["kl/k3_loss_norm"] != _row(mx, 0)["train/kl"]  # the clamp matters at step 0


LABELS = ("0-32", "33-64", "65-128", "129-256", "257+")


def _bucket_ref(calls, step, maxent):
    num, tok, seen = dict.fromkeys(LABELS, 0.0), dict.fromkeys(LABELS, 0.0), set()
    for c in calls:
        if c.step != step:
            continue
        v = _valid(c)
        x = np.where(v, _x(c), 0.0)
        if maxent:
            x = np.clip(x, -60, 60)
        k = np.where(v, np.exp(x) - x - 1, 0.0)
        for i in range(len(c.lengths)):
            m = c.mask[i].sum()
            t = max(m, 1) if maxent else m
            label = next(lab for lab, hi in zip(LABELS, (32, 64, 128, 256, np.inf)) if t <= hi)
            seen.add(label)
            num[label] += k[i].sum()
            tok[label] += t if maxent else v[i].sum()
    return num, tok, seen


@pytest.mark.parametrize("nonfinite", [0.0, 0.05])
def test_kl_by_length(tmp_path, nonfinite):
    rng = np.random.default_rng(8)
    calls = random_calls(rng, steps=(0,), max_len=300, nonfinite=nonfinite, batch=6)
    lengths = [1, 40, 100, 200, 300, 290]
    for c, L in zip(calls, [lengths, lengths[::-1], lengths, lengths[::-1]]):
        c.lengths[:] = L
        c.mask &= np.arange(300)[None, :] < c.lengths[:, None]
        c.mask[np.argmax(c.lengths)] = np.arange(300) < c.lengths.max()  # every token of the longest counts: 257+
    run = write_run(tmp_path / "run", calls)
    got, mx = _row(grpolens.recompute(run, write=False), 0), _row(grpolens.recompute(run, profile="maxent", write=False), 0)
    num, tok, _ = _bucket_ref(calls, 0, maxent=False)
    mnum, mtok, seen = _bucket_ref(calls, 0, maxent=True)
    for lab in LABELS:
        assert approx(got[f"kl/by_length/{lab}"], num[lab] / tok[lab] if tok[lab] else None), lab
        assert got[f"kl/by_length_tokens/{lab}"] == tok[lab]
        if lab in seen:
            assert approx(mx[f"train/kl_per_token_bucket/{lab}"], mnum[lab] / max(mtok[lab], 1)), lab
            assert mx[f"train/kl_per_token_bucket_tokens/{lab}"] == mtok[lab]
        else:
            assert mx[f"train/kl_per_token_bucket/{lab}"] is None
    assert tok["257+"] > 0 and tok["0-32"] > 0


def test_kl_hand_worked(tmp_path):
    # One sequence, ref - logp = x = [ln 2, -ln 2] (third token masked):
    #   k1 = mean(logp - ref) = 0; k2 = mean(½ ln²2) = ½ ln²2 = 0.240227...
    #   k3 = mean(e^x - x - 1) = ((2 - ln2 - 1) + (0.5 + ln2 - 1)) / 2 = 0.25
    #   old = logp - ln 2 everywhere: ratio 2, so k3_corrected = 0.5; GSPO: the same (s = 2)
    #   by_length: 2 masked tokens -> bucket 0-32 holds 0.25 over 2 tokens
    rng = np.random.default_rng(0)
    (c,) = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=1, max_len=3, all_masked_row=False,
                        single_token=False, zero_adv=False)
    ln2 = np.log(2.0)
    c.lengths[:] = 3
    c.logp[:] = [[-1.0, -2.0, -0.5]]
    c.ref[:] = [[-1.0 + ln2, -2.0 - ln2, -5.0]]
    c.old[:] = c.logp - ln2
    c.mask[:] = [[True, True, False]]
    got = _row(grpolens.recompute(write_run(tmp_path / "run", [c]), write=False), 0)
    assert got["kl/k1"] == pytest.approx(0.0, abs=1e-6)
    assert got["kl/k2"] == pytest.approx(0.5 * ln2 ** 2, rel=1e-5)
    assert got["kl/k3"] == pytest.approx(0.25, rel=1e-5)
    assert got["kl/k3_corrected"] == pytest.approx(0.5, rel=1e-5)
    assert got["kl/by_length/0-32"] == pytest.approx(0.25, rel=1e-5) and got["kl/by_length_tokens/0-32"] == 2.0
    assert got["kl/by_length/33-64"] is None and got["kl/by_length_tokens/33-64"] == 0.0
    cfg = {"importance_sampling_level": "sequence"}
    gs = _row(grpolens.recompute(write_run(tmp_path / "gspo", [c], config=cfg), write=False), 0)
    assert gs["kl/k3_corrected"] == pytest.approx(0.5, rel=1e-5)


def test_kl_loss_norm_luspo_is_the_mean_of_sequence_sums(tmp_path):
    # LUSPO normalises by the number of sequences only: kl/k3_loss_norm = mean over the step's
    # sequences (fully masked ones included, with sum 0) of each sequence's k3 sum
    rng = np.random.default_rng(11)
    calls = random_calls(rng, nonfinite=0.05, spread=0.8)
    run = write_run(tmp_path / "run", calls, config={"loss_type": "luspo"})
    got = grpolens.recompute(run, write=False)
    for step in (0, 1):
        with np.errstate(invalid="ignore", over="ignore"):  # k3 of the non-finite tokens, dropped by the where
            sums = np.concatenate([np.where(_valid(c), _k3(c), 0.0).sum(1) for c in calls if c.step == step])
        assert approx(_row(got, step)["kl/k3_loss_norm"], sums.mean())


def test_kl_loss_norm_dr_grpo_with_a_one_token_length(tmp_path):
    # Dr. GRPO divides by sequences × max_completion_length, a constant: with 1 it is Σ k3 / sequences
    rng = np.random.default_rng(12)
    calls = random_calls(rng, spread=0.8)
    run = write_run(tmp_path / "run", calls, config={"loss_type": "dr_grpo", "max_completion_length": 1})
    got = grpolens.recompute(run, write=False)
    for step in (0, 1):
        with np.errstate(invalid="ignore", over="ignore"):
            sums = np.concatenate([np.where(_valid(c), _k3(c), 0.0).sum(1) for c in calls if c.step == step])
        assert approx(_row(got, step)["kl/k3_loss_norm"], sums.sum() / len(sums))


def test_a_length_bucket_without_a_token_has_no_kl(tmp_path):
    """No completion reaches 33 tokens: the longer buckets count 0 tokens and have no KL (null, not
    the NaN of 0/0)."""
    rng = np.random.default_rng(5)
    calls = random_calls(rng, steps=(0,), max_len=30, batch=4)
    got = _row(grpolens.recompute(write_run(tmp_path / "run", calls), write=False), 0)
    for lab in ("33-64", "65-128", "129-256", "257+"):
        assert got[f"kl/by_length_tokens/{lab}"] == 0, lab
        assert got[f"kl/by_length/{lab}"] is None, lab
    assert got["kl/by_length_tokens/0-32"] > 0 and got["kl/by_length/0-32"] is not None
