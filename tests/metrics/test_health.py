"""health/*: stored tokens, masked tokens, sequences and non-finite counts, against numpy on the
padded arrays (tests/refdata.py writes the run without grpolens' writer)."""

import numpy as np
import pytest

import grpolens
from tests.refdata import random_calls, write_run

_COLUMNS = {"logp": "logp", "old_logp": "old", "ref_logp": "ref", "rollout_logp": "rollout",
            "entropy": "entropy"}


def _reference(calls, step):
    cs = [c for c in calls if c.step == step]
    ref = {
        "health/tokens": sum(int(c.valid.sum()) for c in cs),
        "health/masked_tokens": sum(int(c.mask.sum()) for c in cs),
        "health/sequences": sum(len(c.sample_ids) for c in cs),
        # advantages are per sequence, finite in random_calls: no masked token has a bad one
        "health/nonfinite/advantage": 0,
    }
    for col, attr in _COLUMNS.items():
        ref[f"health/nonfinite/{col}"] = sum(int((c.mask & ~np.isfinite(getattr(c, attr))).sum()) for c in cs)
    return ref


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("nonfinite", [0.0, 0.2])
def test_health_counts(tmp_path, seed, nonfinite):
    calls = random_calls(np.random.default_rng(seed), nonfinite=nonfinite)
    got = grpolens.recompute(write_run(tmp_path / "run", calls), write=False)
    for step in (0, 1):
        row = got.filter(got["step"] == step).row(0, named=True)
        for name, want in _reference(calls, step).items():
            assert row[name] == want, (step, name)
    if nonfinite:  # the injection must have produced something to count
        assert got["health/nonfinite/logp"].sum() > 0


def test_health_nonfinite_advantage_counts_masked_tokens_only(tmp_path):
    calls = random_calls(np.random.default_rng(4), steps=(0,), ranks=1, micro_batches=1)
    c = calls[0]
    c.advantages[0] = np.nan      # row 0: its masked tokens count
    c.advantages[1] = np.inf      # row 1 is the all-masked row: nothing counts
    got = grpolens.recompute(write_run(tmp_path / "run", calls), write=False)
    assert got["health/nonfinite/advantage"][0] == int(c.mask[0].sum())
    assert c.mask[1].sum() == 0


def test_health_hand_worked(tmp_path):
    # two sequences: [masked, masked, NaN logp masked-in] and [one token, inf entropy]
    (c,) = random_calls(np.random.default_rng(0), steps=(0,), ranks=1, micro_batches=1, batch=2, max_len=3,
                        all_masked_row=False, single_token=False, zero_adv=False)
    c.lengths[:] = [3, 1]
    c.mask[:] = [[True, False, True], [True, False, False]]
    c.logp[0, 2] = np.nan
    c.entropy[1, 0] = np.inf
    c.entropy[0, 1] = np.nan      # not in the loss: not counted
    got = grpolens.recompute(write_run(tmp_path / "run", [c]), write=False).row(0, named=True)
    assert (got["health/tokens"], got["health/masked_tokens"], got["health/sequences"]) == (4, 3, 2)
    assert got["health/nonfinite/logp"] == 1
    assert got["health/nonfinite/entropy"] == 1


def test_health_absent_column_is_not_counted(tmp_path):
    calls = random_calls(np.random.default_rng(2), ref=False, rollout=False)
    got = grpolens.recompute(write_run(tmp_path / "run", calls), write=False)
    # a column the run does not hold has no count (null), not a reassuring 0
    for col in ("health/nonfinite/ref_logp", "health/nonfinite/rollout_logp"):
        assert got[col].to_list() == [None, None]
    assert got["health/nonfinite/old_logp"].to_list() == [0, 0]
