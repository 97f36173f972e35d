"""The constant train-rollout offset diagnosis (``grpolens.metrics.rollout_is.offset``): the
flag, the sign agreement around the median and the quartiles, against the reference.
"""

import numpy as np
import pytest

import grpolens

from tests.metrics.rollout_is_reference import one_call, ref_mismatch, within_histogram_bound
from tests.refdata import f32, random_calls, shift_logprobs, write_run


def test_constant_offset_diagnosis(tmp_path):
    rng = np.random.default_rng(29)
    calls = random_calls(rng, spread=0.03)
    for c in calls:
        shift_logprobs(c, 1.0)  # room below 0 for the raised rollout log-probs
        if c.step == 1:  # top-p 0.9 renormalisation: every rollout log-prob raised by −log S
            c.rollout = f32(c.rollout - np.log(rng.uniform(0.88, 0.93, size=c.rollout.shape)))
    res = grpolens.recompute(write_run(tmp_path / "run", calls), write=False, result=True)
    df = res.metrics
    assert df["mismatch/constant_offset"].to_list() == [0.0, 1.0]
    ref = ref_mismatch(calls, 1)
    assert within_histogram_bound(df["mismatch/delta_median"][1], ref["delta_median"])
    assert within_histogram_bound(df["mismatch/delta_iqr"][1], ref["delta_iqr"])
    assert any("constant train–rollout offset at step(s) 1" in n and "top-p" in n for n in res.notes)


@pytest.mark.parametrize("delta,agreement,quartiles,flag", [
    # δ = 0 is on neither side: 4 of 7 tokens share the median's sign, below 75 %: no offset
    ([-0.5, 0.0, 0.0, 0.3, 0.3, 0.3, 2.0], 4 / 7, (0.0, 0.3), 0.0),      # median 0.3
    ([0.5, 0.0, 0.0, -0.3, -0.3, -0.3, -2.0], 4 / 7, (-0.3, 0.0), 0.0),  # median -0.3
    ([-0.5, 0.3, 0.3, 0.3], 0.75, (-0.5, 0.3), 1.0),                     # exactly 75 % on its side
    ([-0.5, 0.0, 0.0, 0.3], 0.0, (-0.5, 0.0), 0.0),                      # median 0: no side agrees
])
def test_delta_sign_agreement_counts_the_median_side_only(tmp_path, delta, agreement, quartiles, flag):
    # one row; δ = old − rollout with old = −1. Quantiles are lower ones (sorted δ at floor(q·(n−1))).
    d = np.array([delta])
    run, _ = one_call(tmp_path, np.full(d.shape, -1.0), -1.0 - d)
    got = grpolens.recompute(run, write=False).row(0, named=True)
    assert got["mismatch/delta_sign_agreement"] == agreement
    assert got["mismatch/constant_offset"] == flag
    assert within_histogram_bound(got["mismatch/delta_median"], np.quantile(d, 0.5, method="lower"))
    q25, q75 = quartiles
    assert within_histogram_bound(got["mismatch/delta_iqr"], (q75, q25))
