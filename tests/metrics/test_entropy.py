import numpy as np
import pytest

import grpolens
from tests.refdata import approx, pooled, random_calls, trl_slot_mean, write_run


def _x(c):
    return c.entropy


def _valid(c):
    return c.mask & np.isfinite(c.entropy)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("nonfinite", [0.0, 0.1])
def test_entropy_pooled_and_trl(tmp_path, seed, nonfinite):
    rng = np.random.default_rng(seed)
    calls = random_calls(rng, nonfinite=nonfinite)
    run = write_run(tmp_path / "run", calls)
    got = grpolens.recompute(run, write=False)
    trl = grpolens.recompute(run, profile="trl", write=False)
    for step in (0, 1):
        row = got.filter(got["step"] == step)
        assert approx(row["entropy"][0], pooled(calls, step, _x, _valid))
        assert approx(trl.filter(trl["step"] == step)["entropy"][0], trl_slot_mean(calls, step, _x, _valid))


def test_entropy_hand_worked(tmp_path):
    # one call, two sequences: [1.0, 2.0 (masked), 3.0] and [0.5]; pooled = (1 + 3 + 0.5) / 3 = 1.5
    rng = np.random.default_rng(0)
    (c,) = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=2, max_len=3,
                        all_masked_row=False, single_token=False, zero_adv=False)
    c.lengths[:] = [3, 1]
    c.entropy[:] = [[1.0, 2.0, 3.0], [0.5, 9.0, 9.0]]
    c.mask[:] = [[True, False, True], [True, False, False]]
    run = write_run(tmp_path / "run", [c])
    assert grpolens.recompute(run, write=False)["entropy"][0] == pytest.approx(1.5)


def test_entropy_absent_and_all_masked(tmp_path):
    rng = np.random.default_rng(3)
    calls = random_calls(rng, entropy=False)
    got = grpolens.recompute(write_run(tmp_path / "a", calls), write=False)
    assert got["entropy"].null_count() == got.height
    calls = random_calls(rng)
    for c in calls:
        c.mask[:] = False
    got = grpolens.recompute(write_run(tmp_path / "b", calls), write=False)
    assert got["entropy"].to_list() == [None, None]
    trl = grpolens.recompute(write_run(tmp_path / "c", calls), profile="trl", write=False)
    assert trl["entropy"].to_list() == [0.0, 0.0]  # TRL's clamp(min=1) logs 0 for an all-masked slot
