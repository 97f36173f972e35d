"""Clip family against a numpy reference on the padded loss-call arrays."""

import numpy as np
import pytest

import grpolens
from tests.refdata import approx, pooled, random_calls, trl_slot_mean, write_run

PPO = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "gspo")


def _rv(c):
    """Tokens whose ratio is defined."""
    return c.mask & np.isfinite(c.logp) & np.isfinite(c.old)


def _v(c):
    return _rv(c) & np.isfinite(c.adv_tok)


def _seq_s(c):
    with np.errstate(invalid="ignore"):
        d = np.where(_rv(c), c.logp - c.old, 0.0)
    return np.exp(d.sum(1) / np.maximum(_rv(c).sum(1), 1))


def _indicators(c, cfg, seq):
    """(low, high) per token (B, T) or per sequence (B,), TRL's formulas with the delta clamp first."""
    eps, eps_hi, delta = cfg["epsilon"], cfg.get("epsilon_high", cfg["epsilon"]), cfg.get("delta")
    if seq:
        coef, adv = _seq_s(c), c.advantages
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            coef, adv = np.exp(c.logp - c.old), c.adv_tok
    if delta is not None:
        coef = np.minimum(coef, delta)
    return (coef < 1 - eps) & (adv < 0), (coef > 1 + eps_hi) & (adv > 0)


def _seq_frac(c, cfg, part):
    low, high = _indicators(c, cfg, seq=False)
    x = low if part == "low" else high
    v = _v(c)
    with np.errstate(invalid="ignore"):
        return (x & v).sum(1) / v.sum(1)  # NaN for rows without a valid token


def _trl_extreme(calls, step, cfg, part, seq):
    pick = np.nanmin if part == "low" else np.nanmax
    vals = []
    for mb in sorted({c.micro_batch for c in calls if c.step == step}):
        cs = [c for c in calls if c.step == step and c.micro_batch == mb]
        if seq:
            f = np.concatenate([_indicators(c, cfg, True)[0 if part == "low" else 1].astype(float) for c in cs])
        else:
            f = np.concatenate([_seq_frac(c, cfg, part) for c in cs])
        if np.isfinite(f).any():
            vals.append(pick(f))
    return float(np.mean(vals)) if vals else None


def _row(df, step):
    return df.filter(df["step"] == step).row(0, named=True)


CASES = [
    {"loss_type": "grpo", "epsilon": 0.2},
    {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28},
    {"loss_type": "bnpo", "epsilon": 0.1, "epsilon_high": 0.3, "delta": 1.35},
    {"loss_type": "dr_grpo", "epsilon": 0.2, "delta": 1.1},  # delta <= 1 + eps_high: never high-clipped
]


@pytest.mark.parametrize("cfg", CASES)
@pytest.mark.parametrize("nonfinite", [0.0, 0.1])
def test_token_level(tmp_path, cfg, nonfinite):
    rng = np.random.default_rng(11)
    calls = random_calls(rng, nonfinite=nonfinite, spread=0.4, batch=6, max_len=16)
    calls[0].advantages[3] = np.nan  # excluded like any non-finite value
    run = write_run(tmp_path / "run", calls, config=cfg)
    got = grpolens.recompute(run, write=False)
    trl = grpolens.recompute(run, profile="trl", write=False)
    tw = grpolens.recompute(run, profile="twinkle", write=False)
    for step in (0, 1):
        row, trow, twrow = _row(got, step), _row(trl, step), _row(tw, step)
        parts = {
            "low": lambda c: _indicators(c, cfg, False)[0].astype(float),
            "high": lambda c: _indicators(c, cfg, False)[1].astype(float),
            "region": lambda c: np.logical_or(*_indicators(c, cfg, False)).astype(float),
        }
        for part, fn in parts.items():
            assert approx(row[f"clip/{part}"], pooled(calls, step, fn, _v)), part
            assert approx(trow[f"clip_ratio/{part}_mean"], trl_slot_mean(calls, step, fn, _v)), part
        assert approx(twrow["train/clip_ratio_low"], row["clip/low"])
        assert approx(twrow["train/clip_ratio"], row["clip/low"] + row["clip/high"])
        assert approx(trow["clip_ratio/low_min"], _trl_extreme(calls, step, cfg, "low", False))
        assert approx(trow["clip_ratio/high_max"], _trl_extreme(calls, step, cfg, "high", False))
        fr_low = np.concatenate([_seq_frac(c, cfg, "low") for c in calls if c.step == step])
        fr_high = np.concatenate([_seq_frac(c, cfg, "high") for c in calls if c.step == step])
        assert approx(row["clip/low_min"], np.nanmin(fr_low))
        assert approx(row["clip/high_max"], np.nanmax(fr_high))
    if cfg.get("delta") == 1.1:
        assert got["clip/high"].to_list() == [0.0, 0.0]
    else:
        assert got["clip/high"].min() > 0 and got["clip/low"].min() > 0  # the data does clip


def test_delta_clamps_before_the_indicators(tmp_path):
    # the same data with and without delta: with delta = 1.1 < 1 + eps_high nothing is high-clipped
    rng = np.random.default_rng(12)
    calls = random_calls(rng, spread=0.5, batch=6, max_len=16)
    a = grpolens.recompute(write_run(tmp_path / "a", calls, config={"epsilon": 0.2}), write=False)
    b = grpolens.recompute(write_run(tmp_path / "b", calls, config={"epsilon": 0.2, "delta": 1.1}), write=False)
    assert a["clip/high"].min() > 0 and b["clip/high"].to_list() == [0.0, 0.0]
    assert a["clip/low"].to_list() == b["clip/low"].to_list()


@pytest.mark.parametrize("cfg", [
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05},
    {"loss_type": "gspo", "epsilon": 0.03, "epsilon_high": 0.04, "delta": 1.2},
])
@pytest.mark.parametrize("nonfinite", [0.0, 0.1])
def test_sequence_level(tmp_path, cfg, nonfinite):
    rng = np.random.default_rng(13)
    calls = random_calls(rng, nonfinite=nonfinite, spread=0.4, batch=6)
    run = write_run(tmp_path / "run", calls, config=cfg)
    got = grpolens.recompute(run, write=False)
    trl = grpolens.recompute(run, profile="trl", write=False)
    tw = grpolens.recompute(run, profile="twinkle", write=False)
    for step in (0, 1):
        cs = [c for c in calls if c.step == step]
        ind = {"low": [], "high": []}
        has = np.concatenate([_v(c).sum(1) > 0 for c in cs])
        for c in cs:
            lo, hi = _indicators(c, cfg, seq=True)
            ind["low"].append(lo)
            ind["high"].append(hi)
        ind = {k: np.concatenate(v) for k, v in ind.items()}
        ind["region"] = ind["low"] | ind["high"]
        row, trow = _row(got, step), _row(trl, step)
        for part in ("low", "high", "region"):
            # grpolens and Twinkle's GSPOMetric: over sequences with a valid token
            assert approx(row[f"clip/{part}"], ind[part][has].mean()), part
            # TRL: every sequence of each micro-batch slot counts, fully masked ones included
            slots = []
            for mb in sorted({c.micro_batch for c in cs}):
                x = np.concatenate([_indicators(c, cfg, True)[0 if part == "low" else 1] if part != "region"
                                    else np.logical_or(*_indicators(c, cfg, True)) for c in cs if c.micro_batch == mb])
                slots.append(x.mean())
            assert approx(trow[f"clip_ratio/{part}_mean"], float(np.mean(slots))), part
        assert approx(_row(tw, step)["train/clip_ratio_high"], row["clip/high"])
        assert approx(row["clip/low_min"], float(ind["low"][has].min()))
        assert approx(trow["clip_ratio/low_min"], _trl_extreme(calls, step, cfg, "low", True))
        assert approx(trow["clip_ratio/high_max"], _trl_extreme(calls, step, cfg, "high", True))
    assert got["clip/region"].max() > 0
    # the fully masked sequence is in TRL's denominator only (random_calls has one per call)
    assert not approx(_row(trl, 0)["clip_ratio/region_mean"], _row(got, 0)["clip/region"])


# epsilon_high 0.28: a token without a ratio (masked, non-finite log-prob) must count in neither rate,
# whatever stands in for its ratio (1.0, inside every band; 2.0 would be "above" 1.28)
@pytest.mark.parametrize("eps_high", [1.5, 0.28])
@pytest.mark.parametrize("nonfinite", [0.0, 0.1])
def test_cispo_and_unconditional(tmp_path, nonfinite, eps_high):
    rng = np.random.default_rng(14)
    calls = random_calls(rng, nonfinite=nonfinite, spread=0.8, batch=6, max_len=16)
    calls[1].advantages[0] = np.nan  # out of cispo_clip_ratio, still in the unconditional rates
    cfg = {"loss_type": "cispo", "epsilon": 0.2, "epsilon_high": eps_high}
    run = write_run(tmp_path / "run", calls, config=cfg)
    got, trl, tw, xt = (grpolens.recompute(run, profile=p, write=False) for p in ("grpolens", "trl", "twinkle", "xtuner"))

    def cispo(c):
        with np.errstate(invalid="ignore", over="ignore"):
            return ((np.exp(c.logp - c.old) > eps_high) & (c.adv_tok > 0)).astype(float)

    def below(c):
        with np.errstate(invalid="ignore", over="ignore"):
            return (np.exp(c.logp - c.old) < 0.8).astype(float)

    def above(c):
        with np.errstate(invalid="ignore", over="ignore"):
            return (np.exp(c.logp - c.old) > 1.0 + eps_high).astype(float)

    for step in (0, 1):
        row = _row(got, step)
        assert approx(row["clip/cispo"], pooled(calls, step, cispo, _v))
        assert approx(_row(trl, step)["cispo_clip_ratio"], trl_slot_mean(calls, step, cispo, _v))
        assert approx(row["clip/ratio_below"], pooled(calls, step, below, _rv))
        assert approx(row["clip/ratio_above"], pooled(calls, step, above, _rv))
        assert approx(row["clip/ratio_outside"], row["clip/ratio_below"] + row["clip/ratio_above"])
        # Twinkle's CISPOMetric and xtuner's clip_frac_*: the unconditional rates
        assert approx(_row(tw, step)["train/clip_ratio_low"], row["clip/ratio_below"])
        assert approx(_row(tw, step)["train/clip_ratio"], row["clip/ratio_outside"])
        assert approx(_row(xt, step)["reduced_train_policy_clip_frac_high"], row["clip/ratio_above"])
    assert got["clip/cispo"].min() > 0 and got["clip/ratio_above"].min() > 0


def test_keys_per_loss_type(tmp_path):
    rng = np.random.default_rng(15)
    calls = random_calls(rng, steps=(0,))
    trl_clip = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max"}
    for lt in (*PPO, "cispo", "sapo"):
        cols = set(grpolens.recompute(write_run(tmp_path / lt, calls, config={"loss_type": lt}),
                                      profile="trl", write=False).columns)
        assert (trl_clip <= cols) == (lt in PPO), lt
        assert not (trl_clip & cols) or lt in PPO, lt
        assert ("cispo_clip_ratio" in cols) == (lt == "cispo"), lt
        tw = grpolens.recompute(tmp_path / lt, profile="twinkle", write=False)
        g = grpolens.recompute(tmp_path / lt, write=False)
        gated = "clip/low" if lt in PPO else "clip/ratio_below"
        assert tw["train/clip_ratio_low"].to_list() == g[gated].to_list(), lt


def test_all_masked(tmp_path):
    rng = np.random.default_rng(16)
    calls = random_calls(rng)
    for c in calls:
        if c.step == 1 or c.micro_batch == 0:
            c.mask[:] = False
    run = write_run(tmp_path / "run", calls)
    got = grpolens.recompute(run, write=False)
    trl = grpolens.recompute(run, profile="trl", write=False)
    assert _row(got, 1)["clip/low"] is None and _row(got, 1)["clip/low_min"] is None
    assert _row(trl, 1)["clip_ratio/low_mean"] == 0.0  # TRL: 0.0 per all-masked slot
    assert _row(trl, 1)["clip_ratio/low_min"] is None  # nanmin of nothing: NaN, dropped
    # step 0: slot 0 is all masked -> TRL averages 0.0 with slot 1's value
    low = lambda c: _indicators(c, {"epsilon": 0.2}, False)[0].astype(float)  # noqa: E731
    assert approx(_row(trl, 0)["clip_ratio/low_mean"], trl_slot_mean(calls, 0, low, _v))
    assert approx(_row(trl, 0)["clip_ratio/low_mean"] * 2, _row(got, 0)["clip/low"])

    # Twinkle accumulates nothing over a step without a masked token and logs no rate, also for
    # its rates on T·d (temperature ≠ 1) and for CISPOMetric's ungated ones (cispo)
    for lt in ("grpo", "cispo"):
        for t in (1.0, 0.7):
            tw = grpolens.recompute(write_run(tmp_path / f"{lt}-{t}", calls, config={"loss_type": lt, "temperature": t}),
                                    profile="twinkle", write=False)
            names = ("train/clip_ratio_low", "train/clip_ratio_high", "train/clip_ratio")
            assert all(_row(tw, 0)[k] is not None for k in names), (lt, t)
            assert [_row(tw, 1)[k] for k in names] == [None] * 3, (lt, t)


def test_clip_hand_worked(tmp_path):
    # eps = 0.2, one call, two sequences:
    #   seq A (A = -1): ratios [0.5, 1.0, 0.9]  -> low at 0.5 (< 0.8): 1 of 3 tokens
    #   seq B (A = +1): ratios [1.5, 1.1]       -> high at 1.5 (> 1.2): 1 of 2 tokens
    #   low = 1/5, high = 1/5, region = 2/5; low_min = min(1/3, 0) = 0; high_max = max(0, 1/2) = 1/2
    #   GSPO (sequence level): s_A = (0.5·1·0.9)^(1/3) = 0.766 < 0.8 -> low; s_B = (1.65)^(1/2) = 1.285 -> high
    rng = np.random.default_rng(0)
    (c,) = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=2, max_len=3, all_masked_row=False,
                        single_token=False, zero_adv=False)
    c.lengths[:] = [3, 2]
    c.logp[:] = -1.0
    c.old[:] = -1.0 - np.log([[0.5, 1.0, 0.9], [1.5, 1.1, 1.0]])
    c.mask[:] = [[True, True, True], [True, True, False]]
    c.advantages[:] = [-1.0, 1.0]
    got = _row(grpolens.recompute(write_run(tmp_path / "run", [c]), write=False), 0)
    assert (got["clip/low"], got["clip/high"], got["clip/region"]) == pytest.approx((0.2, 0.2, 0.4))
    assert got["clip/low_min"] == 0.0 and got["clip/high_max"] == pytest.approx(0.5)
    gs = _row(grpolens.recompute(write_run(tmp_path / "gspo", [c], config={"loss_type": "gspo"}), write=False), 0)
    assert (gs["clip/low"], gs["clip/high"], gs["clip/region"]) == pytest.approx((0.5, 0.5, 1.0))


def test_sequence_token_level(tmp_path):
    # GSPO-token: the sequence ratio on every token, counted per token
    rng = np.random.default_rng(17)
    calls = random_calls(rng, spread=0.4, batch=6, max_len=16, nonfinite=0.05)
    cfg = {"loss_type": "grpo", "importance_sampling_level": "sequence_token", "epsilon": 0.05, "delta": 1.08}
    got = grpolens.recompute(write_run(tmp_path / "run", calls, config=cfg), write=False)

    def part(k):
        def fn(c):
            s = np.minimum(_seq_s(c), 1.08)[:, None]
            A = c.adv_tok
            return ((s < 0.95) & (A < 0)).astype(float) if k == "low" else ((s > 1.05) & (A > 0)).astype(float)
        return fn

    for step in (0, 1):
        assert approx(_row(got, step)["clip/low"], pooled(calls, step, part("low"), _v))
        assert approx(_row(got, step)["clip/high"], pooled(calls, step, part("high"), _v))
    assert got["clip/high"].max() > 0


def test_sequence_level_mean_advantage_is_over_the_valid_tokens(tmp_path):
    # At sequence level the sign test uses Ā, the mean advantage of the sequence's valid tokens
    # (Twinkle's GSPOMetric), not the advantage stored on its first token; a single valid token
    # is enough. One sequence: token 0 is masked out and carries A = +1, token 1 is valid with
    # A = -1 and d = -0.5: s = e^-0.5 = 0.61 < 1 - 0.2 and Ā = -1 < 0 -> low-clipped (with
    # Ā = +1 it would be neither).
    from dataclasses import dataclass

    from tests.refdata import LossCall, f32

    @dataclass
    class TokenAdvantages(LossCall):
        per_token: np.ndarray | None = None

        @property
        def adv_tok(self):
            return self.per_token

    c = TokenAdvantages(0, 0, 0, np.arange(1), np.array([2]), f32([[-1.0, -1.5]]), np.array([[False, True]]),
                        f32([-1.0]), old=f32([[-1.0, -1.0]]), per_token=f32([[1.0, -1.0]]))
    got = _row(grpolens.recompute(write_run(tmp_path / "run", [c], config={"loss_type": "gspo"}), write=False), 0)
    assert (got["clip/low"], got["clip/high"]) == (1.0, 0.0)
