"""Reward, group and advantage metrics against plain-Python references of the published rules
(TRL ``nanmean``/``nanstd``/``isclose``, MaxEnt-GRPO ``_mean_std``/``_quantile_stats``/zero-advantage
groups), on random prompt groups with null/NaN/inf rewards, single-completion groups, all-equal
groups and unscorable groups."""

import json
import math

import numpy as np
import pytest

import grpolens
from grpolens.metrics.registry import PLACEHOLDER, REGISTRY, Metric, register
from grpolens.metrics.rewards import QUANTILES, quantile_key
from tests.refdata import Samples, approx, concat_samples, random_calls, random_samples, samples_run, write_rounds

QS = {"p00": 0.0, "p05": 0.05, "p25": 0.25, "p50": 0.5, "p75": 0.75, "p95": 0.95, "p100": 1.0}


# -- references (plain Python on lists) ---------------------------------------------------------

def finite(x):
    return [float(v) for v in x if math.isfinite(v)]


def ref_mean(x):
    v = finite(x)
    return sum(v) / len(v) if v else None


def ref_sample_std(x):
    v = finite(x)
    if len(v) <= 1:
        return None
    m = sum(v) / len(v)
    return math.sqrt(sum((a - m) ** 2 for a in v) / len(v) * len(v) / (len(v) - 1))


def ref_pop_std(x):
    v = finite(x)
    if not v:
        return None
    m = sum(v) / len(v)
    return math.sqrt(sum((a - m) ** 2 for a in v) / len(v))


def ref_quantile(x, q):
    v = sorted(finite(x))
    if not v:
        return None
    if q <= 0:
        return v[0]
    if q >= 1:
        return v[-1]
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] if lo == hi else v[lo] * (1 - (pos - lo)) + v[hi] * (pos - lo)


def total(s):
    return np.where(s.reward_null, np.nan, s.reward)


def fn_values(s, name):
    return np.where(s.fn_null[name], np.nan, s.rewards[name])


def ref_frac_zero_std(s, scale="group", num_generations=None):
    r = total(s)
    if scale == "batch":
        if len(r) == 1:
            return 1.0
        sd = ref_sample_std(r)
        return float(sd is not None and sd <= 1e-8)
    if num_generations == 1:
        return 1.0
    zero = []
    for g in s.group_id:
        sd = ref_sample_std(r[s.group_id == g])
        zero.append(sd is not None and sd <= 1e-8)
    return sum(zero) / len(zero)


def ref_frac_zero_adv_groups(s):
    n = z = 0
    for g in np.unique(s.group_id):
        a = finite(s.advantage[s.group_id == g])
        if not a:
            continue
        n += 1
        z += all(abs(v) < 1e-8 for v in a)
    return z / n if n else None


def expected(s, cfg=None):
    """Every canonical rewards-family value at one step."""
    cfg = cfg or {}
    r = total(s)
    e = {
        "reward/mean": ref_mean(r), "reward/std": ref_sample_std(r), "reward/std_pop": ref_pop_std(r),
        "reward/count": float(len(finite(r))), "reward/nonfinite": float(len(r) - len(finite(r))),
        "reward/frac_zero_std": ref_frac_zero_std(s, cfg.get("scale_rewards", "group"), cfg.get("num_generations")),
        "advantage/frac_zero_groups": ref_frac_zero_adv_groups(s),
        "samples/count": float(len(r)), "samples/groups": float(len(set(s.group_id.tolist()))),
        "advantage/mean": ref_mean(s.advantage), "advantage/std": ref_sample_std(s.advantage),
        "advantage/min": min(finite(s.advantage)), "advantage/max": max(finite(s.advantage)),
    }
    for k, q in QS.items():
        e[f"reward/{k}"] = ref_quantile(r, q)
    for name in s.rewards:
        x = fn_values(s, name)
        e[f"rewards/{name}/mean"] = ref_mean(x)
        e[f"rewards/{name}/std"] = ref_sample_std(x)
        e[f"rewards/{name}/std_pop"] = ref_pop_std(x)
        e[f"rewards/{name}/nonfinite"] = float(np.count_nonzero(~np.isfinite(x)))
        for k, q in QS.items():
            e[f"rewards/{name}/{k}"] = ref_quantile(x, q)
    return e


def row(df, step):
    (r,) = df.filter(df["step"] == step).iter_rows(named=True)
    return r


# -- tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_rewards_random_groups(tmp_path, seed):
    rng = np.random.default_rng(seed)
    steps = [random_samples(rng, st, groups=int(rng.integers(2, 8)), generations=int(rng.integers(2, 6)),
                            first_id=1000 * st) for st in range(3)]
    run = samples_run(tmp_path / "run", steps)
    got = grpolens.recompute(run, write=False)
    for s in steps:
        r = row(got, s.step)
        for name, want in expected(s).items():
            assert approx(r[name], want, rel=1e-12), (s.step, name, r[name], want)


@pytest.mark.parametrize("scale, num_generations", [("batch", None), ("none", None), ("group", 1), ("batch", 1)])
def test_frac_zero_std_config(tmp_path, scale, num_generations):
    rng = np.random.default_rng(7)
    s = random_samples(rng, 0)
    cfg = {"scale_rewards": scale, "num_generations": num_generations}
    got = grpolens.recompute(samples_run(tmp_path / "run", [s], config=cfg), profile="trl", write=False)
    assert got["frac_reward_zero_std"][0] == ref_frac_zero_std(s, scale, num_generations)
    # all rewards equal: every group's std is zero except the one-completion group's (undefined)
    s.reward[:] = 1.0
    s.reward_null[:] = False
    got = grpolens.recompute(samples_run(tmp_path / "run2", [s], config=cfg), profile="trl", write=False)
    single = np.count_nonzero(s.group_id == s.group_id[-1])
    want = 1.0 if scale == "batch" or num_generations == 1 else 1 - single / len(s.reward)
    assert got["frac_reward_zero_std"][0] == pytest.approx(want) == ref_frac_zero_std(s, scale, num_generations)


def test_rewards_hand_worked(tmp_path):
    # Two groups. g0: rewards 1, 0, null, 1 (one unscorable); g1: 0.5, 0.5 (all equal).
    # finite rewards: 1, 0, 1, 0.5, 0.5 -> mean 3/5 = 0.6
    # sample var = ((.4)^2 + (.6)^2 + (.4)^2 + (.1)^2 + (.1)^2) / 4 = (0.16+0.36+0.16+0.01+0.01)/4 = 0.175
    # population var = 0.7 / 5 = 0.14
    # sorted 0, .5, .5, 1, 1: p25 at pos 1 -> 0.5; p05 at pos 0.2 -> 0.1; p95 at pos 3.8 -> 1.0
    # TRL frac_reward_zero_std: g0 std > 0, g1 std 0 -> 2 of 6 completions = 1/3
    # MaxEnt frac by advantages: g0 advantages (.5, -.5, 0, .5) nonzero, g1 (0, 0) zero -> 1/2 groups
    rng = np.random.default_rng(0)
    s = random_samples(rng, 0, groups=2, generations=4, reward_fns=("acc",), nonfinite=0.0,
                       single_sample_group=False, equal_group=False, unscored_group=False)
    keep = np.array([0, 1, 2, 3, 4, 5])
    for f in ("rank", "sample_id", "group_id", "completion_len", "truncated", "prompt_len", "reward",
              "reward_null", "advantage"):
        setattr(s, f, getattr(s, f)[keep])
    s.rewards = {"acc": np.array([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])}  # finite: five 1s -> mean 1, std 0
    s.fn_null = {"acc": np.array([False, False, True, False, False, False])}
    s.reward = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    s.reward_null = np.array([False, False, True, False, False, False])
    s.advantage = np.array([0.5, -0.5, 0.0, 0.5, 0.0, 0.0])
    run = samples_run(tmp_path / "run", [s])
    g = row(grpolens.recompute(run, write=False), 0)
    assert g["reward/mean"] == pytest.approx(0.6)
    assert g["reward/std"] == pytest.approx(math.sqrt(0.175))
    assert g["reward/std_pop"] == pytest.approx(math.sqrt(0.14))
    assert (g["reward/p05"], g["reward/p25"], g["reward/p95"]) == pytest.approx((0.1, 0.5, 1.0))
    assert g["reward/nonfinite"] == 1 and g["reward/count"] == 5
    assert g["reward/frac_zero_std"] == pytest.approx(1 / 3)
    assert g["advantage/frac_zero_groups"] == pytest.approx(0.5)
    assert g["rewards/acc/mean"] == pytest.approx(1.0) and g["rewards/acc/std"] == 0.0
    assert g["rewards/acc/nonfinite"] == 1
    assert (g["samples/count"], g["samples/groups"]) == (6, 2)
    t = row(grpolens.recompute(run, profile="trl", write=False), 0)
    assert (t["reward"], t["reward_std"], t["frac_reward_zero_std"]) == pytest.approx((0.6, math.sqrt(0.175), 1 / 3))
    m = row(grpolens.recompute(run, profile="maxent", write=False), 0)
    assert m["train/reward_std"] == pytest.approx(math.sqrt(0.14))
    assert m["train/frac_reward_zero_std"] == pytest.approx(0.5)


def hand_samples(step, reward, advantage, group_id, acc=None):
    """One step's completions from plain lists (rank 0, sample ids from 10 * step), with one reward
    function ``acc`` (its values, or the total reward's)."""
    n = len(reward)
    reward = np.array(reward, dtype=float)
    acc = reward if acc is None else np.array(acc, dtype=float)
    return Samples(step, np.zeros(n, dtype=int), np.arange(10 * step, 10 * step + n), np.array(group_id),
                   np.full(n, 5), np.zeros(n, dtype=bool), np.full(n, 7.0), reward, np.zeros(n, dtype=bool),
                   np.array(advantage, dtype=float), {"acc": acc}, {"acc": np.zeros(n, dtype=bool)})


def test_step_of_one_completion_and_step_with_an_empty_samples_table(tmp_path):
    """Step 0 generated one completion (reward 0.7, advantage 0): every statistic of one value.
    Step 1's samples shard has the columns and no row: nothing was generated, so the reward
    statistics are null (MaxEnt's 0.0 for "nothing to average" included: no value was logged) and
    the counts are 0."""
    import pyarrow.parquet as pq

    from grpolens.run import format as fmt

    run = samples_run(tmp_path / "run", [hand_samples(0, [0.7], [0.0], [3], acc=[1.0]),
                                         hand_samples(1, [0.5], [0.0], [4])])
    shard = run / fmt.shard_relpath(fmt.SAMPLES, 1, 0)
    pq.write_table(pq.read_table(shard).slice(0, 0), shard)
    got = grpolens.recompute(run, write=False)
    one, empty = row(got, 0), row(got, 1)
    assert (one["reward/mean"], one["reward/std"], one["reward/std_pop"]) == (0.7, None, 0.0)
    assert all(one[f"reward/{k}"] == 0.7 for k in QS) and (one["reward/count"], one["reward/nonfinite"]) == (1, 0)
    assert (one["rewards/acc/mean"], one["rewards/acc/std"], one["rewards/acc/p50"]) == (1.0, None, 1.0)
    assert one["rewards/acc/nonfinite"] == 0
    assert (one["samples/count"], one["samples/groups"]) == (1, 1)
    assert one["reward/frac_zero_std"] == 0.0  # the std of one value is undefined, so not zero (TRL)
    assert one["advantage/frac_zero_groups"] == 1.0 and one["advantage/mean"] == 0.0
    assert (empty["samples/count"], empty["samples/groups"]) == (0, 0)
    nulls = [k for k in expected(hand_samples(1, [0.5], [0.0], [4])) if k not in ("samples/count", "samples/groups")]
    assert [k for k in nulls if empty[k] is not None] == []
    m = grpolens.recompute(run, profile="maxent", write=False)
    assert (row(m, 0)["train/reward_std"], row(m, 0)["train/frac_reward_zero_std"]) == (0.0, 1.0)
    assert row(m, 1)["train/reward"] is None and row(m, 1)["train/rewards/acc/std"] is None


def test_reward_std_exactly_on_the_zero_tolerance_is_zero(tmp_path):
    """TRL's ``isclose(σ, 0)`` is |σ| <= 1e-8: rewards -1e-8, 0, 1e-8 have a sample std of exactly
    1e-8 (mean 0, Σd² / 2 = 1e-16), so their group is a zero-std one. Step 0: that group and
    0, 1 -> 3 of 5 completions; under ``scale_rewards=batch`` the step's std decides: step 1 holds
    the three values alone (in two groups) -> 1.0, step 0 -> 0.0, and step 2's single completion
    -> 1.0 (TRL sets σ = 0 for a batch of one)."""
    assert float(np.std([-1e-8, 0.0, 1e-8], ddof=1)) == 1e-8
    steps = [hand_samples(0, [-1e-8, 0.0, 1e-8, 0.0, 1.0], [0.0] * 5, [1, 1, 1, 2, 2]),
             hand_samples(1, [-1e-8, 0.0, 1e-8], [0.0] * 3, [3, 3, 4]),
             hand_samples(2, [0.3], [0.0], [5])]  # TRL: a batch of one completion has std 0 (zeros_like)
    got = grpolens.recompute(samples_run(tmp_path / "run", steps), write=False)
    assert row(got, 0)["reward/frac_zero_std"] == pytest.approx(3 / 5)
    assert row(got, 1)["reward/frac_zero_std"] == pytest.approx(2 / 3)  # group 4 has one value: no std
    assert row(got, 2)["reward/frac_zero_std"] == 0.0
    batch = grpolens.recompute(samples_run(tmp_path / "batch", steps, config={"scale_rewards": "batch"}),
                               profile="trl", write=False)
    assert batch["frac_reward_zero_std"].to_list() == [0.0, 1.0, 1.0]


def test_reward_std_just_above_the_zero_tolerance_is_not_zero(tmp_path):
    """Rewards 0 and 2e-8: mean 1e-8, Σd² = 2e-16, sample std sqrt(2e-16 / 1) = 1.414e-8 > 1e-8, so
    TRL's ``isclose(σ, 0)`` is false and the group is not a zero-std one; group 2 (rewards 0, 0) is.
    Dividing Σd² by n + 1 instead of n - 1 would give 0.816e-8 and count the first group too."""
    assert float(np.std([0.0, 2e-8], ddof=1)) > 1e-8
    steps = [hand_samples(0, [0.0, 2e-8, 0.0, 0.0], [0.0] * 4, [1, 1, 2, 2])]
    got = grpolens.recompute(samples_run(tmp_path / "run", steps), write=False)
    assert row(got, 0)["reward/frac_zero_std"] == pytest.approx(2 / 4)


def test_step_whose_samples_lack_the_reward_column(tmp_path):
    """Step 0 logged no total reward (the column is absent from its samples): its reward statistics
    are null, its advantages still count; step 1 has both."""
    s0 = hand_samples(0, [1.0, 0.0], [0.0, 0.0], [1, 1])
    s0.reward = None
    run = samples_run(tmp_path / "run", [s0, hand_samples(1, [1.0, 0.0], [0.5, -0.5], [2, 2])])
    got = grpolens.recompute(run, write=False)
    assert [row(got, 0)[k] for k in ("reward/mean", "reward/frac_zero_std", "reward/nonfinite")] == [None] * 3
    assert (row(got, 0)["advantage/frac_zero_groups"], row(got, 0)["samples/groups"]) == (1.0, 1)
    assert (row(got, 1)["reward/mean"], row(got, 1)["reward/frac_zero_std"]) == (0.5, 0.0)


def test_profile_names(tmp_path):
    rng = np.random.default_rng(1)
    s = random_samples(rng, 0, reward_fns=("accuracy", "format"))
    run = samples_run(tmp_path / "run", [s])
    trl = grpolens.recompute(run, profile="trl", write=False)
    want = {"reward", "reward_std", "frac_reward_zero_std", "rewards/accuracy/mean", "rewards/accuracy/std",
            "rewards/format/mean", "rewards/format/std"}
    assert want <= set(trl.columns)
    assert not [c for c in trl.columns if "p50" in c or "std_pop" in c]
    e = expected(s)
    t = row(trl, 0)
    for trl_name, canon in [("reward", "reward/mean"), ("reward_std", "reward/std"),
                            ("frac_reward_zero_std", "reward/frac_zero_std"),
                            ("rewards/format/std", "rewards/format/std")]:
        assert approx(t[trl_name], e[canon], rel=1e-12)
    mx = grpolens.recompute(run, profile="maxent", write=False)
    m = row(mx, 0)
    for k in QS:
        assert approx(m[f"train/reward_{k}"], e[f"reward/{k}"], rel=1e-12)
        assert approx(m[f"train/rewards/accuracy/{k}"], e[f"rewards/accuracy/{k}"], rel=1e-12)
    assert approx(m["train/reward"], e["reward/mean"], rel=1e-12)
    assert approx(m["train/rewards/format/std"], e["rewards/format/std_pop"], rel=1e-12)
    assert approx(m["train/frac_reward_zero_std"], e["advantage/frac_zero_groups"], rel=1e-12)
    tw = grpolens.recompute(run, profile="twinkle", write=False)
    # Twinkle's CompletionRewardMetric: per reward function mean and sample std, mean length
    assert {c for c in tw.columns if "reward" in c} == {"train/accuracy_reward", "train/accuracy_reward_std",
                                                          "train/format_reward", "train/format_reward_std"}
    w = row(tw, 0)
    import polars as pl

    table = pl.from_arrow(s.table())
    for name in ("accuracy", "format"):
        x = table[f"reward/{name}"].drop_nulls().to_numpy()
        assert approx(w[f"train/{name}_reward"], float(np.mean(x)), rel=1e-12)
        assert approx(w[f"train/{name}_reward_std"], float(np.std(x, ddof=1)), rel=1e-12)
    assert approx(w["train/completion_length"], float(table["completion_len"].mean()), rel=1e-12)


def test_quantile_keys_truncate_like_maxent():
    assert [quantile_key(q) for q in QUANTILES] == ["p00", "p05", "p25", "p50", "p75", "p95", "p100"]
    assert quantile_key(0.29) == "p28" and quantile_key(0.57) == "p56"  # int() of 28.999...
    names = {m.names.get("maxent") for m in REGISTRY.values() if m.family == "rewards"}
    assert "train/reward_p100" in names and "train/rewards/<name>/p05" in names


def test_steps_without_samples_and_without_tokens(tmp_path):
    rng = np.random.default_rng(4)
    calls = random_calls(rng, steps=(0, 1, 2))
    s0, s2 = random_samples(rng, 0), random_samples(rng, 2, first_id=500)
    s3 = random_samples(rng, 3, first_id=900)  # step 3: samples, no tokens
    run = samples_run(tmp_path / "run", [s0, s2, s3], calls=calls)
    got = grpolens.recompute(run, write=False)
    assert got["step"].to_list() == [0, 1, 2, 3]
    assert all(row(got, 1)[k] is None for k in expected(s0))  # no samples at step 1: null
    assert row(got, 3)["entropy"] is None
    for st, s in ((2, s2), (3, s3)):
        for k, v in expected(s).items():
            assert approx(row(got, st)[k], v, rel=1e-12), (st, k)
    trl = grpolens.recompute(run, profile="trl", write=True)
    lines = [json.loads(x) for x in (run / "grpolens" / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert "reward" not in lines[1] and "frac_reward_zero_std" not in lines[1] and "entropy" in lines[1]
    assert "reward" in lines[3] and "entropy" not in lines[3]
    assert trl.height == 4


def test_nothing_scorable(tmp_path):
    # every total reward and every value of one function null: grpolens/TRL null, MaxEnt 0.0
    rng = np.random.default_rng(5)
    s = random_samples(rng, 0, reward_fns=("acc",))
    s.reward_null[:] = True
    s.fn_null["acc"][:] = True
    s.advantage[:] = np.nan
    run = samples_run(tmp_path / "run", [s])
    g = row(grpolens.recompute(run, write=False), 0)
    assert g["reward/mean"] is None and g["reward/std"] is None and g["reward/p50"] is None
    assert g["reward/frac_zero_std"] == 0.0  # no group has a std, so none has a zero one (TRL: isclose(NaN) False)
    assert g["advantage/frac_zero_groups"] is None and g["advantage/mean"] is None
    assert g["rewards/acc/mean"] is None and g["rewards/acc/nonfinite"] == len(s.reward)
    t = row(grpolens.recompute(run, profile="trl", write=False), 0)
    assert t["reward"] is None and t["rewards/acc/mean"] is None
    m = row(grpolens.recompute(run, profile="maxent", write=False), 0)
    assert (m["train/reward"], m["train/reward_std"], m["train/frac_reward_zero_std"]) == (0.0, 0.0, 0.0)
    assert (m["train/rewards/acc/mean"], m["train/rewards/acc/std"]) == (0.0, 0.0)
    assert m["train/reward_p50"] is None and m["train/rewards/acc/p50"] is None  # MaxEnt: quantile keys absent


def test_templates_expand_per_run(tmp_path):
    rng = np.random.default_rng(6)
    a = random_samples(rng, 0, reward_fns=("acc",))
    b = random_samples(rng, 1, reward_fns=("acc", "len"), first_id=100)  # a reward function added at step 1
    got = grpolens.recompute(samples_run(tmp_path / "run", [a, b]), write=False)
    assert row(got, 0)["rewards/len/mean"] is None
    assert approx(row(got, 1)["rewards/len/mean"], ref_mean(fn_values(b, "len")), rel=1e-12)
    assert approx(row(got, 0)["rewards/acc/p95"], ref_quantile(fn_values(a, "acc"), 0.95), rel=1e-12)
    none = grpolens.recompute(samples_run(tmp_path / "r2", [random_samples(rng, 0, reward_fns=())]), write=False)
    assert not [c for c in none.columns if c.startswith("rewards/")]
    assert not [c for c in got.columns if PLACEHOLDER in c]


def test_template_registration_rules():
    with pytest.raises(ValueError, match="template"):
        register(Metric("rewards/x/bad", "t", "doc", kind="custom", fn=lambda sd, column: 0.0, per_column="reward/"))
    with pytest.raises(ValueError, match="template"):
        register(Metric(f"rewards/{PLACEHOLDER}/bad", "t", "doc", kind="custom", fn=lambda sd, column: 0.0,
                        per_column="reward/", names={"trl": "bad"}))
    m = REGISTRY[f"rewards/{PLACEHOLDER}/mean"]
    (c,) = m.expand(["reward", "reward/", "reward/acc", "group_id"])  # "reward/" alone names no reward function
    assert c.name == "rewards/acc/mean" and c.names["maxent"] == "train/rewards/acc/mean" and c.per_column is None


def test_large_group_ids_stay_apart(tmp_path):
    # hash-like ids: 2**60 + k are equal once cast to float64; groups must still be told apart
    rng = np.random.default_rng(8)
    s = random_samples(rng, 0, groups=5, generations=3)
    s.group_id = s.group_id + 2**60
    got = row(grpolens.recompute(samples_run(tmp_path / "run", [s]), write=False), 0)
    assert got["samples/groups"] == 5
    assert approx(got["reward/frac_zero_std"], ref_frac_zero_std(s), rel=1e-12)
    assert approx(got["advantage/frac_zero_groups"], ref_frac_zero_adv_groups(s), rel=1e-12)


# TRL's generation-side metrics, per generation round and averaged over the step's rounds.
TRL_ROUND_KEYS = {"reward": "reward/mean", "reward_std": "reward/std", "frac_reward_zero_std": "reward/frac_zero_std",
                  "rewards/accuracy/mean": "rewards/accuracy/mean", "rewards/accuracy/std": "rewards/accuracy/std",
                  "rewards/format/mean": "rewards/format/mean", "rewards/format/std": "rewards/format/std"}


def ref_round_mean(rounds, canon):
    """TRL's log(): the mean of the rounds' values, None/NaN ones dropped; None when none is left."""
    vals = [v for s in rounds if (v := expected(s)[canon]) is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else None


def test_trl_averages_generation_rounds(tmp_path):
    rng = np.random.default_rng(11)
    step0 = [random_samples(rng, 0, groups=3, first_id=0), random_samples(rng, 0, groups=5, first_id=100)]
    dead = random_samples(rng, 1, groups=3, first_id=200)  # a round nothing could score: NaN, dropped
    dead.reward_null[:] = True
    for name in dead.fn_null:
        dead.fn_null[name][:] = True
    step1 = [dead, random_samples(rng, 1, groups=4, first_id=300)]
    step2 = [random_samples(rng, 2, groups=4, first_id=400)]  # one round: the same as pooling
    run = write_rounds(tmp_path / "run", step0 + step1 + step2)
    trl = grpolens.recompute(run, profile="trl", write=False)
    default = grpolens.recompute(run, write=False)
    for step, rounds in ((0, step0), (1, step1), (2, step2)):
        t, d, pooled = row(trl, step), row(default, step), expected(concat_samples(rounds))
        for trl_name, canon in TRL_ROUND_KEYS.items():
            assert approx(t[trl_name], ref_round_mean(rounds, canon), rel=1e-12), (step, trl_name)
            assert approx(d[canon], pooled[canon], rel=1e-12), (step, canon)  # grpolens pools
    assert row(trl, 1)["reward"] == pytest.approx(expected(step1[1])["reward/mean"])
    assert not approx(row(trl, 0)["reward"], expected(concat_samples(step0))["reward/mean"])  # rounds differ
    # without the column the trl profile pools the rounds, as before
    flat = grpolens.recompute(samples_run(tmp_path / "flat", [concat_samples(step0)]), profile="trl", write=False)
    assert approx(row(flat, 0)["reward_std"], expected(concat_samples(step0))["reward/std"], rel=1e-12)


# -- MaxEnt-GRPO's frac_reward_zero_std: by advantages, token-level ones when samples have none -------

def maxent_frac_zero_std_groups(groups):
    """MaxEnt-GRPO's rule (``_fraction_zero_std_groups``), written out: every non-empty group counts;
    it is zero when every advantage has abs < 1e-8 (a NaN does not); 0.0 when no group counts."""
    total = zero = 0
    for g in groups:
        if not g:
            continue
        total += 1
        zero += all(abs(v) < 1e-8 for v in g)
    return zero / total if total > 0 else 0.0


def _token_adv_run(tmp_path, seed, drop_tokens_of=()):
    """16 completions in loss calls (sample ids 0..15) plus 4 without token rows (16..19); groups of
    4 consecutive ids; group 1 all-zero advantages, group 2 below 1e-8; the samples carry no
    advantage column."""
    rng = np.random.default_rng(seed)
    calls = random_calls(rng, steps=(0,), ranks=2, micro_batches=2, batch=4, zero_adv=False)
    for c in calls:
        c.advantages = np.where(c.sample_ids // 4 == 1, 0.0, c.advantages)
        c.advantages = np.where(c.sample_ids // 4 == 2, 5e-9, c.advantages)
    calls = [c for c in calls if not set(c.sample_ids.tolist()) & set(drop_tokens_of)]
    s = random_samples(rng, 0, groups=5, generations=4, single_sample_group=False)
    s.sample_id = np.arange(20)
    s.group_id = s.sample_id // 4
    s.advantage = None
    run = samples_run(tmp_path / f"run{seed}", [s], calls=calls)
    adv = {int(i): float(a) for c in calls for i, a in zip(c.sample_ids, c.advantages)}
    groups = [[adv[i] for i in range(4 * g, 4 * g + 4) if i in adv] for g in range(5)]
    return run, groups


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_maxent_frac_zero_std_from_token_advantages(tmp_path, seed):
    run, groups = _token_adv_run(tmp_path, seed)
    m = row(grpolens.recompute(run, profile="maxent", write=False), 0)
    assert m["train/frac_reward_zero_std"] == pytest.approx(maxent_frac_zero_std_groups(groups), rel=1e-12)
    assert m["train/frac_reward_zero_std"] == pytest.approx(0.5)  # hand count: groups 1 and 2 of 0..3
    g = row(grpolens.recompute(run, write=False), 0)
    assert g["advantage/frac_zero_groups"] == pytest.approx(0.5)


@pytest.mark.parametrize("advantages, want", [([0.0], 1.0), ([0.0, 1.0], 0.0), ([1.0, 0.0], 0.0)])
def test_token_advantages_of_a_small_step(tmp_path, advantages, want):
    """Samples without an ``advantage`` column, one group of one or two completions (sample ids 0,
    1), each with token rows: the group is a zero group exactly when every completion's token-level
    advantage is 0. A step of one completion has a value (1.0), and the completion with the largest
    sample id counts as much as the others."""
    rng = np.random.default_rng(7)
    n = len(advantages)
    calls = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=n, zero_adv=False,
                         all_masked_row=False, single_token=False)
    for c in calls:
        c.advantages = np.array(advantages, dtype=c.advantages.dtype)
    s = random_samples(rng, 0, groups=1, generations=n, single_sample_group=False)
    s.sample_id = np.arange(n)
    s.group_id = np.zeros(n, dtype=int)
    s.advantage = None
    run = samples_run(tmp_path / "run", [s], calls=calls)
    assert sorted(int(i) for c in calls for i in c.sample_ids) == list(range(n))
    assert row(grpolens.recompute(run, write=False), 0)["advantage/frac_zero_groups"] == want


def test_maxent_frac_zero_std_no_group_is_zero(tmp_path):
    """No completion has an advantage anywhere: MaxEnt logs 0.0, grpolens null."""
    run, groups = _token_adv_run(tmp_path, 3, drop_tokens_of=range(20))
    assert maxent_frac_zero_std_groups(groups) == 0.0
    m = grpolens.recompute(run, profile="maxent", write=False)
    assert m["train/frac_reward_zero_std"].to_list() == [0.0]
    assert grpolens.recompute(run, write=False)["advantage/frac_zero_groups"].to_list() == [None]


def test_maxent_frac_zero_std_nan_advantage_is_not_zero(tmp_path):
    """A group holding a NaN advantage is not a zero group for MaxEnt (abs(nan) < 1e-8 is false);
    grpolens' own metric judges the group by its finite advantages."""
    rng = np.random.default_rng(4)
    s = random_samples(rng, 0, groups=3, generations=4, single_sample_group=False, equal_group=False)
    s.advantage = np.array([0.0, 0.0, np.nan, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    run = samples_run(tmp_path / "run", [s])
    groups = [list(s.advantage[s.group_id == g]) for g in np.unique(s.group_id)]
    m = row(grpolens.recompute(run, profile="maxent", write=False), 0)
    assert m["train/frac_reward_zero_std"] == pytest.approx(maxent_frac_zero_std_groups(groups)) == pytest.approx(1 / 3)
    g = row(grpolens.recompute(run, write=False), 0)
    assert g["advantage/frac_zero_groups"] == pytest.approx(2 / 3)


def test_twinkle_reward_metric_on_null_values_and_missing_samples(tmp_path):
    """Twinkle's CompletionRewardMetric (``statistics`` over the values it was given; ``_mean`` of
    nothing is -1.0, ``_std`` of fewer than two is 0.0) on the edges of a recorded run. Step 0:
    ``acc`` = 1.0, null, 0.5: the unscorable value is left out: mean 0.75, std √0.125. Step 1: every
    ``acc`` null: -1.0 and 0.0. Step 2: its samples lack ``acc`` (other steps have it): no value.
    Step 3: tokens, no samples at all: no reward and no completion length."""
    s0 = hand_samples(0, [1.0, 0.0, 0.5], [0.0] * 3, [1, 1, 1], acc=[1.0, 0.0, 0.5])
    s0.fn_null["acc"][1] = True
    s1 = hand_samples(1, [1.0, 0.0], [0.0] * 2, [2, 2])
    s1.fn_null["acc"][:] = True
    s2 = hand_samples(2, [1.0, 0.0], [0.0] * 2, [3, 3])
    s2.rewards, s2.fn_null = {}, {}
    calls = random_calls(np.random.default_rng(6), steps=(0, 1, 2, 3), ranks=1)
    tw = grpolens.recompute(samples_run(tmp_path / "run", [s0, s1, s2], calls=calls), profile="twinkle", write=False)
    r = [row(tw, st) for st in range(4)]
    assert (r[0]["train/acc_reward"], r[0]["train/acc_reward_std"]) == (0.75, pytest.approx(math.sqrt(0.125), rel=1e-12))
    assert (r[1]["train/acc_reward"], r[1]["train/acc_reward_std"]) == (-1.0, 0.0)
    assert (r[2]["train/acc_reward"], r[2]["train/acc_reward_std"]) == (None, None)
    assert [r[st]["train/completion_length"] for st in range(4)] == [5.0, 5.0, 5.0, None]
    assert (r[3]["train/acc_reward"], r[3]["train/acc_reward_std"]) == (None, None)
    assert r[3]["train/entropy"] is not None  # step 3 has its token metrics


def test_token_advantages_of_a_step_whose_tokens_shard_has_no_rows(tmp_path):
    """Samples without an ``advantage`` column, and the step's only tokens shard empty (the rank
    stored no token): no completion has an advantage, so there is no zero-group fraction."""
    import pyarrow.parquet as pq

    from grpolens.run import format as fmt
    from tests.refdata import call_table

    rng = np.random.default_rng(11)
    calls = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=2)
    s = random_samples(rng, 0, groups=1, generations=2, single_sample_group=False)
    s.sample_id = np.arange(2)
    s.group_id = np.zeros(2, dtype=int)
    s.advantage = None
    run = samples_run(tmp_path / "run", [s], calls=calls)
    shards = sorted((run / fmt.TOKENS).rglob("*.parquet"))
    assert len(shards) == 1
    pq.write_table(call_table(calls[0]).slice(0, 0), shards[0])
    got = row(grpolens.recompute(run, write=False), 0)
    assert got["samples/count"] == 2.0
    assert got["advantage/frac_zero_groups"] is None
