"""ms-swift's GRPO metrics (grpolens/metrics/swift_grpo.py): its settings and refusals, its float32
entropy quantile against torch's own ``nanquantile``, and a hand-worked run through
``--profile swift``. Every configuration is judged by ms-swift's own code in
tests/reference/test_swift_reference.py (slow); these run in the fast suite."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import grpolens
from grpolens.capture.hook import GRPOLensHook
from grpolens.cli import main
from grpolens.errors import UserError
from grpolens.metrics.swift_grpo import nanquantile32, settings
from grpolens.profiles.swift import swift_config


def test_settings_resolve_as_ms_swift_does():
    s = settings({"swift_args": {}})
    assert (s["loss_type"], s["beta"], s["scale_rewards"], s["kl_in_reward"], s["epsilon_high"]) == ("grpo", 0.04, "group", False, 0.2)
    assert settings({"swift_args": {"advantage_estimator": "rloo", "beta": 0.0}})["scale_rewards"] == "none"
    assert settings({"swift_args": {"advantage_estimator": "reinforce_plus_plus", "beta": 0.0}})["scale_rewards"] == "batch"
    assert settings({"swift_args": {"gradient_accumulation_steps": 3}})["steps_per_generation"] == 3
    assert settings({}) is None


@pytest.mark.parametrize("args, key", [
    ({"loss_type": "gkd"}, "loss_type"),
    ({"use_liger_kernel": True}, "use_liger_kernel"),
    ({"multi_turn_scheduler": "thinking_tips_scheduler"}, "multi_turn_scheduler"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size"),
    ({"teacher_model": "Qwen/Qwen3-8B"}, "teacher_model"),
    ({"rollout_importance_sampling_mode": "both"}, "rollout_importance_sampling_mode"),
    ({"top_entropy_quantile": 0.0}, "top_entropy_quantile"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
])
def test_what_is_not_reproduced_is_refused_by_name(args, key):
    with pytest.raises(UserError, match=f"swift_args.{key}"):
        settings({"swift_args": args})


@pytest.mark.parametrize("seed", range(6))
def test_entropy_quantile_is_torchs_nanquantile(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    x = rng.uniform(0.0, 3.0, n).astype(np.float32)
    x[rng.random(n) < 0.2] = np.nan
    x[rng.random(n) < 0.2] = x[0]  # ties
    for q in (0.0, 0.2, 0.5, 0.8, 1.0, float(rng.random())):
        want = torch.nanquantile(torch.tensor(x), 1 - (1 - q)).item()
        got = nanquantile32(x, 1 - (1 - q))
        assert (math.isnan(want) and math.isnan(got)) or got == want, (q, got, want)


def test_entropy_quantile_of_nothing_is_nan():
    assert math.isnan(nanquantile32(np.array([np.nan, np.nan], dtype=np.float32), 0.8))
    assert nanquantile32(np.array([1.5], dtype=np.float32), 0.8) == 1.5


def _run(path, swift_args: dict, world: int = 1):
    """One optimizer step, one loss call per rank of two completions: row 1 two tokens with
    d = logp − old = (0.3, 0), A = 1, x = ref − logp = (0.5, 0.5); row 2 one token (a second one
    masked) with d = −0.5, A = −1, x = 0. Rewards 1 and 0, one prompt group per rank."""
    cfg = swift_config({"num_generations": 2, "logging_steps": 1, "max_steps": 1, **swift_args})
    for r in range(world):
        hook = GRPOLensHook(path, config=cfg, rank=r, world_size=world, trainer={"name": "ms-swift", "version": "4.6.0"})
        if r == 0:
            hook.log_samples(step=1, sample_ids=torch.arange(2 * world), group_ids=torch.arange(2 * world) // 2,
                             completion_lens=torch.tensor([2, 1] * world), truncated=torch.zeros(2 * world, dtype=torch.bool),
                             reward=torch.tensor([1.0, 0.0] * world), generations=0)
        logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
        hook.log_loss_call(step=1, micro_batch=0, logp=logp, old_logp=logp - torch.tensor([[0.3, 0.0], [-0.5, 0.0]]),
                           ref_logp=logp + torch.tensor([[0.5, 0.5], [0.0, 0.0]]),
                           mask=torch.tensor([[True, True], [True, False]]), advantages=torch.tensor([1.0, -1.0]),
                           sample_ids=torch.tensor([2 * r, 2 * r + 1]))
        hook.end_step(1)
        hook.close()
    return path


def test_hand_worked_step(tmp_path):
    """ms-swift's defaults (grpo, ε 0.2, β 0.04) by hand. kl: k3(0.5) = e^0.5 − 1.5 on two of the three
    masked tokens, 2·k3/3. Clip: e^0.3 = 1.35 > 1.2 with A > 0 (high), e^−0.5 = 0.61 < 0.8 with A < 0
    (low): 1/3 each. Loss: row 1 −min(c·A, clip(c)·A) + β·k3 = (−1.2 + β·k3, −1 + β·k3), its token mean;
    row 2 −min(−0.61, −0.8) = 0.8; grpo takes the mean of the rows."""
    run = _run(tmp_path / "run", {})
    df = grpolens.recompute(run, profile="swift", write=False)
    row = df.row(0, named=True)
    k3 = math.exp(0.5) - 1.5
    beta = 0.04
    assert row["step"] == 1
    assert row["kl"] == pytest.approx(2 * k3 / 3, rel=1e-12)
    assert row["clip_ratio/high_mean"] == pytest.approx(1 / 3) and row["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert row["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    row1 = ((-1.2 + beta * k3) + (-1.0 + beta * k3)) / 2
    row2 = 0.8
    assert row["loss"] == pytest.approx((row1 + row2) / 2, rel=1e-12)
    assert row["reward"] == pytest.approx(0.5)
    assert row["reward_std"] == pytest.approx(math.sqrt(0.5))  # std(ddof=1) of {1, 0}
    assert row["frac_reward_zero_std"] == 0.0
    assert row["completions/mean_length"] == 1.5 and row["completions/clipped_ratio"] == 0.0


def test_a_refused_setting_is_a_one_line_error(tmp_path, capsys):
    run = _run(tmp_path / "run", {"use_liger_kernel": True})
    with pytest.raises(SystemExit) as e:
        main(["recompute", str(run), "--profile", "swift", "-q"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "swift_args.use_liger_kernel" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (run / "grpolens" / "swift").exists()  # nothing half-written


def test_swift_config_records_ms_swift_arguments():
    """From a GRPOConfig-like object or a dict: grpolens' own settings, and ms-swift's under swift_args
    (only those the profile reads)."""
    from types import SimpleNamespace

    args = SimpleNamespace(loss_type="fipo", beta=0.0, epsilon=0.2, epsilon_high=0.28, num_generations=8,
                           gradient_accumulation_steps=4, learning_rate=1e-6, tau_pos=1.0, tau_neg=1.05)
    cfg = swift_config(args)
    assert cfg["loss_type"] == "dapo" and cfg["epsilon_high"] == 0.28 and cfg["num_generations"] == 8
    assert cfg["swift_args"]["loss_type"] == "fipo" and "learning_rate" not in cfg["swift_args"]
    assert swift_config({"importance_sampling_level": "sequence"})["loss_type"] == "gspo"
    assert swift_config({"loss_type": "real"})["loss_type"] == "grpo"
    assert swift_config({})["epsilon_high"] == 0.2 and swift_config({})["beta"] == 0.04
    assert settings(swift_config({"loss_type": "cispo"}))["loss_type"] == "cispo"
