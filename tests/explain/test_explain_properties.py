"""Properties of every explanation on random runs: each dimension's contributions sum to the
change, mix + rate = contribution for keys at both steps, and the way the data was split over
ranks and loss calls changes nothing but the rank and micro-batch dimensions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from grpolens.analysis.explain import explain
from tests.explain.runs import random_step, write_run

SPLIT_FREE = ("token_id", "completion", "group", "position", "length", "outcome")


def _sums_to_delta(d: dict) -> None:
    delta = d["delta"]
    for dim, entries in d["by"].items():
        total = sum(e["contribution"] for e in entries)
        scale = max(abs(delta), sum(abs(e["contribution"]) for e in entries), 1e-300)
        assert abs(total - delta) <= 1e-9 * scale, (dim, total, delta)
        for e in entries:
            if e["mix"] is not None:
                assert e["mix"] + e["rate"] == pytest.approx(e["contribution"], rel=1e-12, abs=1e-15)
            else:
                assert e["present"] != "both" or e["key"] == "other"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), ranks=st.integers(1, 3), mbs=st.integers(1, 3),
       metric=st.sampled_from(["kl/k3", "kl/k1", "entropy", "clip/region", "policy/approx_kl", "kl/k3_loss_norm", "loss",
                              "reward/mean", "completions/length/mean"]),
       profile=st.sampled_from(["grpolens", "trl", "xtuner", "verl"]))
def test_every_dimension_sums_to_the_change(tmp_path_factory, seed, ranks, mbs, metric, profile):
    rng = np.random.default_rng(seed)
    run = write_run(tmp_path_factory.mktemp("run"), {s: random_step(rng, s) for s in range(3)}, ranks=ranks,
                    micro_batches=mbs)
    for baseline in (None, 0, (0, 1)):
        try:
            e = explain(run, metric, 2, baseline=baseline, profile=profile, top=3)
        except Exception as err:  # a metric the profile does not log is a UserError, nothing else
            from grpolens.errors import UserError

            assert isinstance(err, UserError) and "does not apply" in str(err)
            return
        d = e.to_dict()
        assert d["value"] is not None
        if d.get("note") is None:
            assert d["by"], d
            _sums_to_delta(d)


@pytest.mark.parametrize("metric", ["kl/k3", "entropy", "clip/low", "policy/log_ratio_mean"])
def test_splitting_ranks_and_loss_calls_changes_nothing(tmp_path, metric):
    rng = np.random.default_rng(7)
    steps = {s: random_step(rng, s) for s in range(2)}
    one = explain(write_run(tmp_path / "one", steps, ranks=1, micro_batches=1), metric, 1, top=1000).to_dict()
    three = explain(write_run(tmp_path / "three", steps, ranks=3, micro_batches=2, max_part_rows=50), metric, 1,
                    top=1000).to_dict()
    assert len(list((tmp_path / "three" / "tokens" / "step=00000001").glob("*.parquet"))) > 3  # parts of ranks
    assert three["value"] == pytest.approx(one["value"], rel=1e-12)
    for dim in SPLIT_FREE:
        a = {e["key"]: e for e in one["by"][dim]}
        b = {e["key"]: e for e in three["by"][dim]}
        assert a.keys() == b.keys(), dim
        for k in a:
            for f in ("contribution", "mix", "rate"):
                if a[k][f] is None:
                    assert b[k][f] is None
                else:
                    assert b[k][f] == pytest.approx(a[k][f], rel=1e-9, abs=1e-15), (dim, k, f)
    assert one["concentration"] == pytest.approx(three["concentration"], rel=1e-9)


def test_every_step_of_the_real_trl_run(tmp_path):
    """The bundled real TRL run: every step of its loss-side and reward metrics explains without an
    error, each dimension summing to the change."""
    from pathlib import Path

    from grpolens.run import format as fmt

    run = Path(__file__).resolve().parents[2] / "sample_runs" / "trl-tiny"
    for metric in ("kl", "entropy", "clip_ratio/region_mean", "loss", "reward"):
        steps = fmt.list_steps(run, fmt.SAMPLES if metric == "reward" else fmt.TOKENS)
        for step in steps[1::3]:
            d = explain(run, metric, step, profile="trl", top=3).to_dict()
            if d.get("note") is None and d["delta"] is not None:
                _sums_to_delta(d)
