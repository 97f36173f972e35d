"""The reduction kinds a metric can declare (``grpolens.metrics.registry.KINDS``), on a hand-worked
table of per-sequence partials.

No built-in family declares ``max``, ``min``, ``seq_mean`` or the ``seq_frac_*`` kinds (they reduce
in ``custom`` functions of their own), but a plugin's metric may: each kind is pinned here against
values worked by hand, with the sequences that have no valid token (count 0, max -inf, min +inf)
that random data rarely isolates.
"""

from __future__ import annotations

import numpy as np
import pytest

from grpolens.metrics.reduce import StepData, compute
from grpolens.metrics.registry import Metric

# three sequences: two tokens, one token, none valid (the max/min partials' neutral values)
SEQS = {
    "step": np.zeros(3, np.int64), "rank": np.zeros(3, np.int64), "micro_batch": np.zeros(3, np.int64),
    "sample_id": np.arange(3),
    "x.max": np.array([-0.5, -2.0, -np.inf]), "x.min": np.array([0.5, 2.0, np.inf]),
    "x.sum": np.array([3.0, -1.0, 0.0]), "x.n": np.array([2.0, 1.0, 0.0]),
}


def _value(kind: str, seqs=SEQS, num: str | None = None, den: str | None = "x.n"):
    num = num or {"max": "x.max", "min": "x.min"}.get(kind, "x.sum")
    return compute(Metric("plugin/x", "plugin", "test", kind=kind, num=num, den=den), StepData(0, seqs, {}))


def _only(i: int) -> dict[str, np.ndarray]:
    return {k: v[i:i + 1] for k, v in SEQS.items()}


def test_extrema_keep_negative_maxima_and_skip_sequences_without_a_valid_token():
    assert _value("max") == -0.5  # the empty sequence's -inf does not win, a negative max is a value
    assert _value("min") == 0.5
    # a step whose sequences have no valid token: nothing to take the extreme of
    assert _value("max", _only(2)) is None and _value("min", _only(2)) is None
    # one sequence is a step too
    assert _value("max", _only(1)) == -2.0 and _value("min", _only(1)) == 2.0


def test_sum_and_sequence_mean():
    assert _value("sum") == 2.0
    assert _value("sum", _only(1)) == -1.0
    # mean over the sequences with a token of sum/count: (3/2 + -1/1) / 2; the empty one is left out
    assert _value("seq_mean") == pytest.approx(0.25, rel=1e-12)
    assert _value("seq_mean", _only(1)) == -1.0
    assert _value("seq_mean", _only(2)) is None


def test_sequence_fraction_extremes():
    # per-sequence fractions 3/2 and -1/1 (the sequence without a token has none)
    assert _value("seq_frac_min") == -1.0
    assert _value("seq_frac_max") == 1.5
    assert _value("seq_frac_max", _only(2)) is None


def test_a_step_without_sequences_has_no_value():
    empty = {k: v[:0] for k, v in SEQS.items()}
    for kind in ("max", "min", "sum", "seq_mean", "seq_frac_min", "token_mean"):
        assert _value(kind, empty) is None, kind


def test_a_step_without_sequences_has_no_grouped_token_mean_and_no_group():
    """A plugin's token-mean metric at a step without sequences (a samples-only step) is no value
    under every grouping rule (TRL's per slot, xtuner's per pack), and the step has no group: no
    group id (they index arrays, so integers even when there are none) and a count of 0."""
    from grpolens.metrics.reduce import grouped_ratio

    sd = StepData(0, {k: v[:0] for k, v in SEQS.items()}, {})
    for rule in ("pooled", "trl_slot", "pack_mean"):
        assert grouped_ratio(sd, "x.sum", "x.n", rule) is None, rule
    for by in (("micro_batch",), ("rank", "micro_batch")):
        g, n = sd.groups(by)
        assert n == 0 and g.shape == (0,) and np.issubdtype(g.dtype, np.integer), by


def test_zero_when_empty_needs_sequences_under_xtuner():
    """xtuner logs 0.0 for its train-policy values when the step's sequences have no valid token,
    but a step without any sequence has nothing logged (``zero_needs_sequences``)."""
    from grpolens.metrics.registry import REGISTRY, load_families
    from grpolens.profiles.xtuner import PROFILE

    load_families()
    metric = REGISTRY["policy/approx_kl"]
    masked = {**{k: SEQS[k] for k in ("step", "rank", "micro_batch", "sample_id")},
              "policy.k3.sum": np.zeros(3), "policy.k3_c20.sum": np.zeros(3), "policy.n": np.zeros(3)}
    assert compute(metric, StepData(0, masked, {}, PROFILE)) == 0.0
    assert compute(metric, StepData(0, {k: v[:0] for k, v in masked.items()}, {}, PROFILE)) is None


def test_a_step_without_an_optional_column_the_run_has_elsewhere(tmp_path):
    """The run has ref_logp and entropy, step 1 has neither: its metrics over them are null (the
    step's partial table lacks their columns altogether), step 0's are unchanged."""
    import grpolens
    from tests.refdata import approx, pooled, random_calls, write_run

    calls = random_calls(np.random.default_rng(2), steps=(0, 1), ranks=1, micro_batches=1)
    for c in calls:
        if c.step == 1:
            c.ref = c.entropy = None
    got = grpolens.recompute(write_run(tmp_path / "run", calls, config={"beta": 0.04}), write=False)
    step0 = [c for c in calls if c.step == 0]
    want = pooled(step0, 0, lambda c: c.entropy, lambda c: c.mask & np.isfinite(c.entropy))
    assert approx(got["entropy"][0], want)
    for name in ("entropy", "kl/k3", "kl/k1", "health/nonfinite/ref_logp", "health/nonfinite/entropy"):
        assert got[name][1] is None and got[name][0] is not None, name


def test_grouping_rules_on_one_token_one_group_and_a_rank_with_one_micro_batch():
    """TRL's per-slot rule clamps each slot's count to >= 1 (a slot of one token divides by 1),
    xtuner's per-pack rule keeps a pack of one token; a single slot or pack is a mean over one.
    Rank 0 has only micro-batch 0, so packs (0, 0) and (1, 0) differ by rank alone."""
    from grpolens.metrics.reduce import grouped_ratio

    seqs = {"step": np.zeros(3, np.int64), "rank": np.array([0, 1, 1]), "micro_batch": np.array([0, 0, 1]),
            "sample_id": np.arange(3), "x.sum": np.array([2.0, 4.0, 3.0]), "x.n": np.array([1.0, 1.0, 2.0])}
    sd = StepData(0, seqs, {})
    # slots: micro-batch 0 = (2 + 4) / max(1 + 1, 1), micro-batch 1 = 3 / 2
    assert grouped_ratio(sd, "x.sum", "x.n", "trl_slot") == pytest.approx((3.0 + 1.5) / 2, rel=1e-12)
    # packs (0, 0): 2 / (1 + 1e-8), (1, 0): 4 / (1 + 1e-8), (1, 1): 3 / (2 + 1e-8)
    want = (2.0 / (1.0 + 1e-8) + 4.0 / (1.0 + 1e-8) + 3.0 / (2.0 + 1e-8)) / 3
    assert grouped_ratio(sd, "x.sum", "x.n", "pack_mean") == pytest.approx(want, rel=1e-12)
    # one sequence of one token: one slot of one token, one pack
    one = StepData(0, {k: v[:1] for k, v in seqs.items()}, {})
    assert grouped_ratio(one, "x.sum", "x.n", "trl_slot") == 2.0
    assert grouped_ratio(one, "x.sum", "x.n", "pack_mean") == pytest.approx(2.0 / (1.0 + 1e-8), rel=1e-12)
    assert grouped_ratio(one, "x.sum", "x.n", "pooled") == 2.0


def test_a_reduction_that_comes_out_nan_is_no_value():
    """Values are floats or None, never NaN: a plugin's partial holding NaN (its sequence's sum, or
    its max) makes the step's sum, sequence mean, extreme and token mean NaN, reported null."""
    nan = {**SEQS, "x.sum": np.array([3.0, np.nan, 0.0]), "x.max": np.array([-0.5, np.nan, -np.inf]),
           "x.min": np.array([0.5, np.nan, np.inf])}
    for kind in ("sum", "seq_mean", "max", "min", "token_mean"):
        assert _value(kind, nan) is None, kind
    # the fractions' extremes skip a NaN fraction: the other sequence's 3/2 is the value
    assert _value("seq_frac_max", nan) == 1.5
