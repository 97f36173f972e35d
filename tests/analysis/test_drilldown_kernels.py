"""The compiled top-token scores and selection against numpy: every score bit for bit (masked and
not), and the k best rows with the same positions in the same order as a stable sort gives."""

import numpy as np
import pyarrow as pa
import pytest

from grpolens.analysis import drilldown
from grpolens.functional import estimators as est
from grpolens.metrics.batch import TokenBatch
from tests.refdata import call_table, random_calls


def _batch(seed, nonfinite):
    rng = np.random.default_rng(seed)
    calls = random_calls(rng, steps=(0,), ranks=1, micro_batches=3, batch=6, max_len=40, nonfinite=nonfinite)
    for c in calls:  # bf16-like ties: a third of the entropies share the top value
        c.entropy[rng.random(c.entropy.shape) < 0.3] = 2.5
    return TokenBatch.from_arrow(pa.concat_tables([call_table(c) for c in calls]))


def _numpy_scores(b, by, masked_only):
    """The scores as numpy computes them from the batch's columns (drilldown's docstring)."""
    c = b.cols
    with np.errstate(all="ignore"):
        s = {"kl": lambda: est.k3(c["ref_logp"] - b.logp), "mismatch": lambda: np.abs(b.old - c["rollout_logp"]),
             "ratio": lambda: np.abs(b.log_ratio), "entropy": lambda: c["entropy"].copy(),
             "adv_ratio": lambda: np.abs(b.adv) * np.abs(b.ratio - 1.0)}[by]()
    keep = np.isfinite(s) & (b.mask if masked_only else True)
    return s, keep


@pytest.mark.parametrize("nonfinite", [0.0, 0.1])
def test_scores_equal_numpys_bit_for_bit(nonfinite):
    b = _batch(1, nonfinite)
    for by in drilldown.SCORES:
        for masked_only in (True, False):
            s, keep = _numpy_scores(b, by, masked_only)
            got = drilldown.token_scores(b, by, masked_only)
            assert np.array_equal(got, np.where(keep, s, np.nan), equal_nan=True), (by, masked_only)


@pytest.mark.parametrize("nonfinite", [0.0, 0.1])
def test_top_positions_are_a_stable_sorts_first_k(nonfinite):
    """Score descending, then position; the rows above the k-th score first, then those holding
    it, each in position order; all scored rows in position order when there are at most k."""
    b = _batch(2, nonfinite)
    for by in drilldown.SCORES:
        s, keep = _numpy_scores(b, by, True)
        ok = np.flatnonzero(keep)
        for k in (1, 2, 7, 32, len(ok) - 1, len(ok), len(ok) + 5):
            pos, score = drilldown._top_positions(b, by, k)
            if len(ok) <= k:
                want = ok
            else:
                best = ok[np.lexsort((ok, -s[ok]))[:k]]
                t = s[best[-1]]
                want = np.r_[np.sort(best[s[best] > t]), np.sort(best[s[best] == t])]
            assert np.array_equal(pos, want), (by, k)
            assert np.array_equal(score, s[want]), (by, k)


def test_a_batch_without_an_input_or_a_scored_token():
    b = _batch(3, 0.0)
    b.present.discard("entropy")
    assert drilldown._top_positions(b, "entropy", 5) is None
    none = np.zeros(8)
    assert drilldown._top(0, none, none, np.zeros(8, dtype=bool), 5)[0].size == 0
    assert drilldown._top(0, np.full(4, np.nan), none, np.ones(4, dtype=bool), 2)[0].size == 0
