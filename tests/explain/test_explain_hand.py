"""Hand-worked explanations, one per reduction kind: every expected number is worked out in the
comments from the definitions (docs/explain.md), not read from the code."""

from __future__ import annotations

import math

import numpy as np
import pytest

from grpolens.analysis.explain import explain
from tests.explain.runs import Completion, write_run


def _c(sid, gid, ids, *, entropy=None, logp=None, old=None, ref=None, adv=1.0, reward=1.0):
    n = len(ids)
    lp = np.full(n, -1.0) if logp is None else np.asarray(logp, float)
    return Completion(sid, gid, reward, np.asarray(ids), lp, lp.copy() if old is None else np.asarray(old, float),
                      lp.copy() if ref is None else np.asarray(ref, float),
                      np.ones(n) if entropy is None else np.asarray(entropy, float), adv)


def _by(d, dim):
    return {e["key"]: e for e in d["by"][dim]}


def test_pooled_token_mean(tmp_path):
    # step 0: A = ids [1, 2], H = [1, 3]            -> entropy 4/2 = 2
    # step 1: B = ids [1, 1, 2], H = [1, 2, 6]      -> entropy 9/3 = 3, delta 1
    # id 1: A_S = 3/3 = 1, A_B = 1/2 -> +0.5; W_S = 2/3, W_B = 1/2, r_S = 1.5, r_B = 1
    #        mix = (2/3 − 1/2)(1.5 + 1)/2 = 5/24, rate = 0.5 − 5/24 = 7/24
    # id 2: A_S = 6/3 = 2, A_B = 3/2 -> +0.5; mix = (1/3 − 1/2)(6 + 3)/2 = −3/4, rate = 5/4
    run = write_run(tmp_path / "r", {0: [_c(10, 0, [1, 2], entropy=[1, 3])],
                                     1: [_c(11, 1, [1, 1, 2], entropy=[1, 2, 6])]}, micro_batches=1)
    d = explain(run, "entropy", 1).to_dict()
    assert (d["value"], d["baseline"], d["delta"]) == (pytest.approx(3.0), {"steps": [0], "value": pytest.approx(2.0)}, pytest.approx(1.0))
    t = _by(d, "token_id")
    assert t[1]["contribution"] == pytest.approx(0.5) and t[2]["contribution"] == pytest.approx(0.5)
    assert t[1]["mix"] == pytest.approx(5 / 24) and t[1]["rate"] == pytest.approx(7 / 24)
    assert t[2]["mix"] == pytest.approx(-3 / 4) and t[2]["rate"] == pytest.approx(5 / 4)
    assert t[1]["count"] == 2 and t[1]["present"] == "both"
    c = _by(d, "completion")  # each completion in one step only: its own share, with sign, no split
    assert c[11]["contribution"] == pytest.approx(3.0) and c[10]["contribution"] == pytest.approx(-2.0)
    assert c[10]["mix"] is None and c[10]["present"] == "baseline"
    # step 1's terms 1/3, 2/3, 2: the top token (at least one) holds 2/3 of 3
    assert d["concentration"]["top_0.1%_tokens"] == pytest.approx(2 / 3)
    assert d["concentration"]["top_1_completions"] == pytest.approx(1.0)


def test_trl_per_micro_batch_slot_mean(tmp_path):
    # TRL >= 1.9: per loss call (slot) Σ H / max(Σ m, 1), then the mean over slots.
    # step 0, one slot: A = ids [1, 2], H = [1, 3] -> 2
    # step 1, slot 0: B = ids [1, 1], H = [1, 2] -> 1.5; slot 1: C = id [2], H = [6] -> 6; mean 3.75
    # token terms at step 1: 1/(2·2), 2/(2·2), 6/(1·2) = 0.25, 0.5, 3
    # id 1: 0.75 − 0.5 = +0.25; id 2: 3 − 1.5 = +1.5; sum = delta 1.75
    cfg = {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.2, "beta": 0.0}
    run = write_run(tmp_path / "r", {0: [_c(10, 0, [1, 2], entropy=[1, 3])],
                                     1: [_c(11, 1, [1, 1], entropy=[1, 2]), _c(12, 1, [2], entropy=[6])]},
                    micro_batches=2, config=cfg)
    d = explain(run, "entropy", 1, profile="trl").to_dict()
    assert d["value"] == pytest.approx(3.75) and d["delta"] == pytest.approx(1.75)
    t = _by(d, "token_id")
    assert t[1]["contribution"] == pytest.approx(0.25) and t[2]["contribution"] == pytest.approx(1.5)
    mb = _by(d, "micro_batch")  # slot 0: 0.75 − 2 (step 0 was all slot 0); slot 1: +3
    assert mb[0]["contribution"] == pytest.approx(-1.25) and mb[1]["contribution"] == pytest.approx(3.0)


def test_sequence_mean_of_token_means(tmp_path):
    # kl/k3_loss_norm under loss_type grpo (verl's seq-mean-token-mean): the mean over sequences
    # of each sequence's token-mean k3, k3(x) = e^x − x − 1 with x = ref − logp.
    # step 0: A = [x=0.5] -> k3(0.5)
    # step 1: B = [x=1, x=0] (ids 1, 2), C = [x=2] (id 1) -> (k3(1)/2 + k3(2)) / 2
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    cfg = {"loss_type": "grpo", "epsilon": 0.2, "epsilon_high": 0.2, "beta": 0.04}
    lp = -3.0
    run = write_run(tmp_path / "r", {0: [_c(10, 0, [1], logp=[lp], ref=[lp + 0.5])],
                                     1: [_c(11, 1, [1, 2], logp=[lp, lp], ref=[lp + 1, lp]),
                                         _c(12, 1, [1], logp=[lp], ref=[lp + 2])]}, micro_batches=1, config=cfg)
    d = explain(run, "kl/k3_loss_norm", 1).to_dict()
    value = (k3(1) / 2 + k3(2)) / 2
    assert d["value"] == pytest.approx(value, rel=1e-6) and d["delta"] == pytest.approx(value - k3(0.5), rel=1e-6)
    assert d["units"] == "tokens"
    t = _by(d, "token_id")  # id 1 holds every nonzero term: k3(1)/4 + k3(2)/2 − k3(0.5); id 2 holds 0
    assert t[1]["contribution"] == pytest.approx(k3(1) / 4 + k3(2) / 2 - k3(0.5), rel=1e-6)
    assert t[2]["contribution"] == pytest.approx(0.0, abs=1e-9)
    c = _by(d, "completion")
    assert c[11]["contribution"] == pytest.approx(k3(1) / 4, rel=1e-6)


def test_fraction(tmp_path):
    # clip/low: share of valid tokens with ratio < 1 − 0.2 and A < 0. A ratio of 0.5 is clipped.
    # step 0: 4 tokens (ids 1, 1, 2, 2), one clipped (an id 2)     -> 1/4
    # step 1: 4 tokens (ids 1, 1, 2, 2), three clipped (1, 2, 2)   -> 3/4, delta 1/2
    # id 1: 1/4 − 0 = +1/4; id 2: 2/4 − 1/4 = +1/4
    lp = -1.0
    half = lp - math.log(0.5)  # old logp with ratio 0.5
    run = write_run(tmp_path / "r", {
        0: [_c(10, 0, [1, 1, 2, 2], logp=[lp] * 4, old=[lp, lp, half, lp], adv=-1.0)],
        1: [_c(11, 1, [1, 1, 2, 2], logp=[lp] * 4, old=[half, lp, half, half], adv=-1.0)]}, micro_batches=1)
    d = explain(run, "clip/low", 1).to_dict()
    assert d["value"] == pytest.approx(0.75) and d["delta"] == pytest.approx(0.5)
    t = _by(d, "token_id")
    assert t[1]["contribution"] == pytest.approx(0.25) and t[2]["contribution"] == pytest.approx(0.25)
    assert t[2]["mix"] == pytest.approx(0.0) and t[2]["rate"] == pytest.approx(0.25)  # same share, rate only


def test_extremum_by_its_arg_max_token(tmp_path):
    # policy/ratio_max: the largest e^(logp − old) of the step; at step 1 token id 9 at position 2
    # of sample 12 has d = 1.5
    lp = -2.0
    run = write_run(tmp_path / "r", {
        0: [_c(10, 0, [1, 2], logp=[lp, lp], old=[lp - 0.3, lp])],
        1: [_c(11, 1, [1, 2], logp=[lp, lp], old=[lp - 0.2, lp]), _c(12, 1, [3, 4, 9], logp=[lp] * 3, old=[lp, lp, lp - 1.5])]},
        micro_batches=1)
    e = explain(run, "policy/ratio_max", 1)
    d = e.to_dict()
    assert d["value"] == pytest.approx(math.exp(1.5), rel=1e-6)
    u = d["extremum"]["step"]
    assert (u["sample_id"], u["pos"], u["token_id"]) == (12, 2, 9)
    assert d["extremum"]["baseline"][0]["sample_id"] == 10 and d["extremum"]["baseline"][0]["pos"] == 0
    assert "maximum" in d["note"] and "position 2 of sample 12" in e.headline()
    assert d["by"] == {}


@pytest.mark.parametrize("metric, says", [("rollout_is/raw/std", "standard deviation"), ("policy/confidence", "not a sum")])
def test_not_decomposable_is_one_line(tmp_path, metric, says):
    rng = np.random.default_rng(0)
    from tests.explain.runs import random_step

    cfg = {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04,
           "rollout_is": {"level": "token", "mode": "truncate", "upper": 2.0}}
    run = write_run(tmp_path / "r", {s: random_step(rng, s) for s in range(2)}, config=cfg)
    e = explain(run, metric, 1)
    assert says in e.to_dict()["note"] and "\n" not in e.headline()
    assert e.to_dict()["by"] == {}


def _rewarded(step_rewards: dict[int, list[tuple[int, int, float, int]]]):
    """Steps of completions (sample_id, group_id, reward, length) with unremarkable tokens."""
    return {s: [Completion(sid, gid, r, np.arange(n), np.full(n, -1.0), np.full(n, -1.0), np.full(n, -1.0),
                           np.ones(n), 0.0) for sid, gid, r, n in rows] for s, rows in step_rewards.items()}


def test_mean_of_the_samples(tmp_path):
    # reward/mean: step 0 rewards [1, 0] (group 0) -> 0.5; step 1: group 1 [1, 1], group 2 [0, 0.5] -> 0.625
    # group: 1 -> (1 + 1)/4 = 0.5, 2 -> 0.5/4 = 0.125, 0 (baseline only) -> −0.5; sum 0.125 = delta
    # outcome "reward > 0, mixed": step 1 sample 0.5 of group 2 -> 0.125, step 0 sample 1 of group 0 -> 0.5:
    #   −0.375; W_S = 1/4, W_B = 1/2, r_S = 0.5, r_B = 1 -> mix = (−1/4)(1.5)/2 = −0.1875, rate = −0.1875
    run = write_run(tmp_path / "r", _rewarded({0: [(10, 0, 1.0, 3), (11, 0, 0.0, 5)],
                                               1: [(20, 1, 1.0, 2), (21, 1, 1.0, 4), (22, 2, 0.0, 6), (23, 2, 0.5, 40)]}),
                    micro_batches=1)
    d = explain(run, "reward/mean", 1).to_dict()
    assert d["units"] == "completions" and d["delta"] == pytest.approx(0.125)
    g = _by(d, "group")
    assert (g[1]["contribution"], g[2]["contribution"], g[0]["contribution"]) == pytest.approx((0.5, 0.125, -0.5))
    o = _by(d, "outcome")
    mixed = o["reward > 0, mixed"]
    assert mixed["contribution"] == pytest.approx(-0.375)
    assert (mixed["mix"], mixed["rate"]) == pytest.approx((-0.1875, -0.1875))
    assert o["reward > 0, all correct"]["contribution"] == pytest.approx(0.5)
    assert _by(d, "length")["33-64"]["contribution"] == pytest.approx(0.125)  # sample 23, 40 tokens
    assert "token_id" not in d["by"]


def test_samples_std_quantile_and_extremum_say_what_can_be_said(tmp_path):
    run = write_run(tmp_path / "r", _rewarded({0: [(10, 0, 1.0, 3), (11, 0, 0.0, 5)],
                                               1: [(20, 1, 1.0, 2), (21, 1, 3.0, 4), (22, 2, 0.0, 6), (23, 2, 0.0, 9)]}),
                    micro_batches=1)
    # rewards 1, 3, 0, 0: mean 1, squared deviations 0, 4, 1, 1 -> sample 21 holds 4/6
    std = explain(run, "reward/std", 1).to_dict()
    assert "standard deviation" in std["note"] and "sample 21 (reward 3, 67 %)" in std["note"] and std["by"] == {}
    assert "sample" in explain(run, "reward/p50", 1).to_dict()["note"]
    mx = explain(run, "completions/length/max", 1).to_dict()
    assert mx["extremum"]["step"]["sample_id"] == 23 and mx["extremum"]["baseline"][0]["sample_id"] == 11


def test_sequence_level_terms_use_sequence_dimensions_only(tmp_path):
    # GSPO: the clip decision is per sequence (its geometric-mean ratio and mean advantage), so no
    # token holds a term of its own: the explanation is over completions, token_id does not apply
    from tests.explain.runs import random_step

    rng = np.random.default_rng(4)
    cfg = {"loss_type": "gspo", "epsilon": 0.01, "epsilon_high": 0.01, "beta": 0.0, "importance_sampling_level": "sequence"}
    run = write_run(tmp_path / "r", {s: random_step(rng, s) for s in range(2)}, config=cfg)
    e = explain(run, "clip/region", 1, by=["token_id", "completion", "group"])
    d = e.to_dict()
    assert d["units"] == "sequences" and "token_id" not in d["by"] and {"completion", "group"} <= set(d["by"])
    assert any("token_id" in n for n in d["notes"])
    for entries in d["by"].values():
        assert sum(x["contribution"] for x in entries) == pytest.approx(d["delta"], rel=1e-9, abs=1e-15)


def test_nonfinite_tokens_and_an_all_masked_step(tmp_path):
    # a NaN log-prob and an infinite one are left out of kl/k3 (as the metric does); a step whose
    # every token is masked has no kl/k3 at all: said in one line
    lp = -1.0
    a = _c(10, 0, [1, 2, 3], logp=[lp, float("nan"), lp], ref=[lp - 1, lp, lp])
    a.logp[2] = -np.inf
    masked = _c(11, 1, [1, 2], logp=[lp, lp], ref=[lp - 1, lp])
    masked.mask[:] = False
    run = write_run(tmp_path / "r", {0: [_c(9, 0, [1], logp=[lp], ref=[lp])], 1: [a], 2: [masked]}, micro_batches=1)
    d = explain(run, "kl/k3", 1).to_dict()
    assert d["value"] == pytest.approx(math.exp(-1) + 1 - 1) and d["by"]["token_id"][0]["key"] == 1
    assert d["by"]["token_id"][0]["contribution"] == pytest.approx(d["delta"])
    e = explain(run, "kl/k3", 2)
    assert e.to_dict()["by"] == {} and "no value at step 2" in e.headline()
