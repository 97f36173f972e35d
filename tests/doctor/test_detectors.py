"""Each detector's branches that no synth injection plants, on hand-made metric series: the
ESS bands and vetoed shares of rollout-drift, a gradual KL drift, entropy's projected floor,
clip-inactive's three readings, and every detector's silence on flat noise."""

import numpy as np
import polars as pl
import pytest

from grpolens import plugins
from grpolens.analysis.doctor import Skip, load_detectors
from grpolens.analysis.doctor.context import Context


def ctx(cols: dict, config: dict | None = None, profile: str = "grpolens") -> Context:
    n = len(next(iter(cols.values())))
    return Context("run", pl.DataFrame({"step": np.arange(n), **cols}), config or {}, plugins.get(profile))


def run(det: str, c: Context):
    return load_detectors()[det].fn(c)


def noise(n, level, rel=0.05, seed=0):
    return level * (1 + rel * np.random.default_rng(seed).standard_normal(n))


def test_ess_falling_through_its_bands():
    ess = np.r_[np.full(20, 0.99), np.full(5, 0.8), np.full(5, 0.4)]
    got = run("rollout-drift", ctx({"mismatch/kl_k3": noise(30, 1e-3), "rollout_is/raw/ess": ess}))
    assert [(f.severity, f.metric, f.steps) for f in got] == [("critical", "rollout_is/raw/ess", list(range(25, 30)))]
    got = run("rollout-drift", ctx({"mismatch/kl_k3": noise(30, 1e-3), "rollout_is/raw/ess": np.r_[np.full(26, 0.99), np.full(4, 0.8)]}))
    assert [(f.severity, f.steps) for f in got] == [("warning", [26, 27, 28, 29])]
    # two steps below a band are noise
    assert run("rollout-drift", ctx({"mismatch/kl_k3": noise(30, 1e-3), "rollout_is/raw/ess": np.r_[np.full(28, 0.99), 0.3, 0.3]})) == []


def test_vetoed_and_rejected_shares():
    veto = np.r_[np.zeros(25), np.full(5, 0.08)]
    got = run("rollout-drift", ctx({"mismatch/kl_k3": noise(30, 1e-3), "rollout_is/veto/seq_fraction": veto,
                                    "rollout_is/rejected/seq_fraction": np.zeros(30)}))
    assert [(f.metric, f.steps[0], f.severity) for f in got] == [("rollout_is/veto/seq_fraction", 25, "warning")]


def test_no_rollout_logp_is_skipped_with_why():
    with pytest.raises(Skip, match="no rollout log-probs"):
        run("rollout-drift", ctx({"kl/k3": noise(30, 1e-3)}))


def test_gradual_kl_drift_is_a_trend_finding():
    kl = np.linspace(0.001, 0.2, 40) * (1 + 0.02 * np.random.default_rng(1).standard_normal(40))
    (f,) = run("kl-drift", ctx({"kl/k3": kl}))
    assert f.severity == "warning" and f.evidence["after"] >= 0.05 and f.steps[-1] == 39
    assert run("kl-drift", ctx({"kl/k3": kl * 0.1})) == []  # the same shape below 0.05: a healthy rise


def test_entropy_projected_to_reach_its_floor():
    e = np.linspace(1.0, 0.3, 40)  # -0.018/step; the floor 0.1 is ~11 steps past the end
    (f,) = run("entropy-collapse", ctx({"entropy": e}))
    assert f.severity == "warning" and 40 <= f.evidence["projected_step"] <= 55
    slow = np.linspace(1.0, 0.9, 40)  # the floor is hundreds of steps away
    assert run("entropy-collapse", ctx({"entropy": slow})) == []


@pytest.mark.parametrize("iters,severity", [(1, "info"), (None, "info"), (2, "warning")])
def test_clip_inactive_at_every_step(iters, severity):
    cfg = {} if iters is None else {"num_iterations": iters}
    (f,) = run("clip-inactive", ctx({"policy/ratio_max": np.ones(12), "policy/ratio_min": np.ones(12)}, cfg))
    assert f.severity == severity and len(f.steps) == 12


def test_clip_inactive_alternating_is_info():
    hi = np.where(np.arange(20) % 2 == 0, 1.0, 1.2)
    (f,) = run("clip-inactive", ctx({"policy/ratio_max": hi, "policy/ratio_min": np.where(hi == 1.0, 1.0, 0.8)},
                                    {"num_iterations": 2}))
    assert f.severity == "info" and f.steps == list(range(0, 20, 2))


def test_gradual_advantage_collapse_without_samples():
    frac = np.clip(np.linspace(0.0, 0.8, 30) + 0.05 * np.random.default_rng(2).standard_normal(30), 0, 1)
    c = ctx({"advantage/frac_zero_groups": frac})
    c._samples = {s: None for s in range(30)}  # no samples table at those steps: no split, still a finding
    (f,) = run("advantage-collapse", c)
    assert f.severity == "warning" and "all_correct" not in f.evidence


@pytest.mark.parametrize("det", ["kl-spike", "kl-drift", "rollout-drift", "entropy-collapse", "clip-drift",
                                 "advantage-collapse", "length-pathology", "reward-hacking"])
@pytest.mark.parametrize("seed", range(3))
def test_flat_noise_is_silent(det, seed):
    n = 60
    cols = {"kl/k3": noise(n, 2e-3, 0.1, seed), "mismatch/kl_k3": noise(n, 1e-3, 0.1, seed + 1),
            "rollout_is/raw/ess": np.full(n, 0.99), "entropy": noise(n, 0.8, 0.03, seed + 2),
            "clip/low": noise(n, 0.02, 0.2, seed + 3), "clip/high": noise(n, 0.02, 0.2, seed + 4),
            "policy/ratio_max": np.full(n, 1.3), "policy/ratio_min": np.full(n, 0.7),
            "advantage/frac_zero_groups": np.random.default_rng(seed).choice([0, 0.25], n),
            "completions/length/mean": noise(n, 120, 0.05, seed + 5), "completions/truncated_frac": noise(n, 0.04, 0.3, seed),
            "reward/mean": noise(n, 0.5, 0.1, seed + 6), "rewards/a/mean": noise(n, 0.3, 0.1, seed + 7)}
    assert run(det, ctx(cols)) == []


def test_reward_hacking_by_entropy_halving_at_the_rewards_jump():
    r = np.r_[noise(20, 0.5, 0.05, 3), noise(20, 0.9, 0.05, 4)]
    locked = np.r_[noise(20, 0.8, 0.03, 5), noise(20, 0.25, 0.03, 6)]
    (f,) = run("reward-hacking", ctx({"reward/mean": r, "entropy": locked}))
    assert f.steps[0] == 20 and "entropy fell" in f.summary
    # the same jump with a healthy, gradual entropy decay: nothing diverges
    decay = 0.8 * np.exp(-np.arange(40) / 80) * (1 + 0.02 * np.random.default_rng(7).standard_normal(40))
    assert run("reward-hacking", ctx({"reward/mean": r, "entropy": decay})) == []


def test_reward_hacking_by_a_falling_component():
    r = np.r_[noise(20, 0.5, 0.05, 8), noise(20, 0.9, 0.05, 9)]
    judge = np.r_[noise(20, 0.2, 0.05, 10), noise(20, 0.7, 0.05, 11)]
    correct = np.r_[noise(20, 0.6, 0.05, 12), noise(20, 0.3, 0.05, 13)]
    (f,) = run("reward-hacking", ctx({"reward/mean": r, "rewards/judge/mean": judge, "rewards/correct/mean": correct}))
    assert "rewards/correct/mean fell" in f.summary and f.steps[0] == 20
