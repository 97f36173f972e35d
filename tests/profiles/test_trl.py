"""The trl profile's logging windows and per-release rules (grpolens.profiles.trl), on hand-worked
schedules and random runs against numpy references. Real TRL runs are in tests/integration."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import grpolens
from grpolens.profiles import trl as trl_profile
from grpolens.profiles.trl import Rules, default_bias_correction_kl, parse_version, windows
from tests.refdata import random_calls, random_samples, write_rounds, write_run


def test_versions_and_the_kl_default():
    assert parse_version("1.8.0") == (1, 8, 0) and parse_version("1.10.0.dev0") == (1, 10, 0)
    assert parse_version("0.29") == (0, 29, 0) and parse_version(None) is None and parse_version("x") is None
    assert [default_bias_correction_kl(v) for v in ("0.29.1", "1.9.2", "1.10.0", "1.16.0", None)] == \
        [False, False, True, True, False]


def _rules(**args):
    state = args.pop("state", None)
    version = args.pop("version", "1.16.0")
    return Rules.from_run({"name": "trl", "version": version}, {"trl_args": args}, state)


def test_schedule_hand_worked():
    steps = list(range(1, 24))
    w = windows(steps, _rules(logging_steps=10, max_steps=23))
    assert w == [(10, list(range(1, 11)), False), (20, list(range(11, 21)), False), (23, [21, 22, 23], True)]
    w = windows(steps[:12], _rules(logging_steps=10, logging_first_step=True, max_steps=12))
    assert [(s, len(m), summ) for s, m, summ in w] == [(1, 1, False), (10, 9, False), (12, 2, True)]
    # a fraction of the training steps (transformers: ceil(max_steps * logging_steps))
    assert [s for s, _, _ in windows(list(range(1, 21)), _rules(logging_steps=0.25, max_steps=20))] == [5, 10, 15, 20]
    # --steps starting inside a window: that window is left out; a run short of max_steps: no summary
    assert [s for s, _, _ in windows(list(range(5, 24)), _rules(logging_steps=10, max_steps=30))] == [20]
    # logging_strategy "no": TRL logs everything with the end-of-training summary
    assert windows([1, 2, 3], _rules(logging_strategy="no", max_steps=3)) == [(3, [1, 2, 3], True)]
    # epochs from the Trainer's recorded schedule; a window with no recorded step is not shown
    r = _rules(logging_strategy="epoch", state={"max_steps": 8, "epoch_ends": [4, 8]})
    assert windows([1, 2, 3, 4, 6, 7, 8], r) == [(4, [1, 2, 3, 4], False), (8, [6, 7, 8], False)]
    assert windows([1, 2, 5, 6], _rules(logging_steps=2, max_steps=6)) == [(2, [1, 2], False), (6, [5, 6], False)]
    # a run not written by TRL keeps today's rules whatever its version says
    assert Rules.from_run({"name": "tests", "version": "0"}, {}).version is None
    assert Rules.from_run({"name": "trl", "version": "1.8.0"}, {}).rank_means
    assert not Rules.from_run({"name": "trl", "version": "0.29.1"}, {}).drops_nan


def _trl_run(path, calls, version, trl_args, config=None):
    run = write_run(path, calls, {"beta": 0.04, "epsilon": 0.2, "trl_args": trl_args, **(config or {})})
    m = json.loads((run / "grpolens.json").read_text())
    m["trainer"] = {"name": "trl", "version": version}
    (run / "grpolens.json").write_text(json.dumps(m))
    return run


def _ref_slot(calls, value, rank_means: bool, pick=None):
    """TRL's value for one slot (one micro-batch index, all ranks): token-weighted over ranks (>= 1.9),
    or each rank's clamped masked mean then the mean (or ``pick``: min/max) over ranks (< 1.9)."""
    sums = [(float((value(c) * c.mask).sum()), float(c.mask.sum())) for c in calls]
    if rank_means:
        per_rank = [s / max(n, 1.0) for s, n in sums]
        return (pick or np.mean)(per_rank)
    return sum(s for s, _ in sums) / max(sum(n for _, n in sums), 1.0)


def _low(c, eps=0.2):
    return ((np.exp(c.logp - c.old) < 1 - eps) & (c.advantages[:, None] < 0)).astype(float)


@pytest.mark.parametrize("version", ["1.16.0", "1.8.0"])
@pytest.mark.parametrize("seed", [0, 1])
def test_window_means_numpy_reference(tmp_path, version, seed):
    rng = np.random.default_rng(seed)
    calls = random_calls(rng, steps=(1, 2, 3, 4, 5), ranks=2, micro_batches=2, spread=0.5)
    run = _trl_run(tmp_path / "run", calls, version, {"logging_steps": 2, "max_steps": 5})
    got = {r["step"]: r for r in grpolens.recompute(run, profile="trl", write=False).iter_rows(named=True)}
    per_step = grpolens.recompute(run, profile="trl", write=False, per_step=True)
    assert sorted(got) == [2, 4, 5] and per_step.height == 5
    old_rules = version == "1.8.0"
    for logged, members in ((2, (1, 2)), (4, (3, 4)), (5, (5,))):
        slots = [[c for c in calls if c.step == s and c.micro_batch == mb] for s in members for mb in (0, 1)]
        ent = np.mean([_ref_slot(sl, lambda c: c.entropy, old_rules) for sl in slots])
        assert got[logged]["entropy"] == pytest.approx(ent, rel=1e-9)
        low = np.mean([_ref_slot(sl, _low, old_rules) for sl in slots])
        assert got[logged]["clip_ratio/low_mean"] == pytest.approx(low, rel=1e-9, abs=1e-12)
        if old_rules:  # min over ranks of each rank's mean
            low_min = np.mean([_ref_slot(sl, _low, True, pick=np.min) for sl in slots])
        else:  # per-sequence fractions, nanmin over the slot's sequences of all ranks
            fr = [[np.sum(_low(c)[i] * c.mask[i]) / c.mask[i].sum() for c in sl for i in range(len(c.lengths))
                   if c.mask[i].sum() > 0] for sl in slots]
            low_min = np.mean([min(f) for f in fr])
        assert got[logged]["clip_ratio/low_min"] == pytest.approx(low_min, rel=1e-9, abs=1e-12)
        losses = per_step.filter(per_step["step"].is_in(list(members)))["loss"].to_list()
        if logged == 5:
            assert got[logged]["loss"] is None  # the end-of-training summary has train_loss, not loss
        else:
            assert got[logged]["loss"] == pytest.approx(np.mean(losses), rel=1e-12)


@pytest.mark.parametrize("version, dropped", [("1.16.0", True), ("1.0.0", True), ("0.29.1", False)])
def test_nan_in_a_window(tmp_path, version, dropped):
    """A round whose reward std is NaN (one scorable completion): TRL >= 1.0 drops it from the
    window's mean, 0.29 does not (the window's value is NaN, which the log holds as null)."""
    rng = np.random.default_rng(3)
    good = random_samples(rng, 1, groups=3, nonfinite=0.0, unscored_group=False)
    one = random_samples(rng, 2, groups=3, nonfinite=0.0, unscored_group=False, first_id=500)
    one.reward_null[1:] = True
    run = write_rounds(tmp_path / "run", [good, one])
    m = json.loads((run / "grpolens.json").read_text())
    m["trainer"] = {"name": "trl", "version": version}
    m["config"]["trl_args"] = {"logging_steps": 2, "max_steps": 2}
    (run / "grpolens.json").write_text(json.dumps(m))
    row = grpolens.recompute(run, profile="trl", write=False).row(0, named=True)
    r = good.reward[~good.reward_null]
    if dropped:
        assert row["reward_std"] == pytest.approx(float(np.std(r[np.isfinite(r)], ddof=1)), rel=1e-12)
    else:
        assert row["reward_std"] is None
    # the mean has a value in both rounds: averaged over them
    one_r = one.reward[~one.reward_null]
    assert row["reward"] == pytest.approx((np.mean(r) + np.mean(one_r)) / 2, rel=1e-12)
    assert not math.isnan(row["reward"])


def test_the_kl_default_follows_the_recorded_release(tmp_path):
    """A TRL run whose manifest has no use_bias_correction_kl: TRL >= 1.10 multiplied kl by the
    ratio, older releases did not."""
    rng = np.random.default_rng(9)
    calls = random_calls(rng, steps=(1,), ranks=1, micro_batches=1)
    kl = {}
    for v in ("1.9.0", "1.10.0"):
        run = _trl_run(tmp_path / v, calls, v, {"logging_steps": 1})
        kl[v] = grpolens.recompute(run, profile="trl", write=False)["kl"][0]
    c = calls[0]
    x = c.ref - c.logp
    k3 = np.exp(x) - x - 1
    ratio = np.exp(c.logp - c.old)
    assert kl["1.9.0"] == pytest.approx(float((k3 * c.mask).sum() / c.mask.sum()), rel=1e-9)
    assert kl["1.10.0"] == pytest.approx(float((k3 * ratio * c.mask).sum() / c.mask.sum()), rel=1e-9)


def test_per_step_cli_option(tmp_path):
    import subprocess
    import sys

    rng = np.random.default_rng(2)
    run = _trl_run(tmp_path / "run", random_calls(rng, steps=(1, 2, 3, 4)), "1.16.0", {"logging_steps": 2, "max_steps": 4})
    for extra, n in (([], 2), (["--per-step"], 4)):
        r = subprocess.run([sys.executable, "-m", "grpolens.cli", "recompute", str(run), "--profile", "trl", "-q", *extra],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        lines = (run / "grpolens" / "trl" / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == n and json.loads(lines[-1])["step"] == 4
    assert trl_profile.COUNT not in (run / "grpolens" / "trl" / "metrics.jsonl").read_text()


def test_luspo_loss_before_1_10_is_not_made_up(tmp_path):
    """TRL < 1.10 averaged luspo's per-token loss over padded positions (huggingface/trl#6654): not
    reproducible from a run without padding, so null; from 1.10 the mean of per-sequence sums."""
    rng = np.random.default_rng(12)
    calls = random_calls(rng, steps=(1,), ranks=1, micro_batches=1)
    got = {}
    for v in ("1.9.0", "1.10.0"):
        run = _trl_run(tmp_path / v, calls, v, {"logging_steps": 1}, {"loss_type": "luspo"})
        got[v] = grpolens.recompute(run, profile="trl", write=False)["loss"][0]
    assert got["1.9.0"] is None and got["1.10.0"] is not None
