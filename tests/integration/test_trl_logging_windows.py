"""TRL as users configure it: logging windows, defaults first, judged by TRL's own log.

Each case trains TRL's real GRPOTrainer (the installed release) on CPU through the integration
(``trl_tiny.DEFAULT_CONFIGS``: GRPOConfig's defaults, logging_steps=10 among them;
``trl_tiny.WINDOW_CONFIGS``: every loss type, GSPO, several generation rounds per step, vLLM-IS,
with clipping and logging windows that cut generation rounds unevenly), then checks that
``grpolens parity`` reproduces every value TRL logged, including the end-of-training summary's.
"""

from __future__ import annotations

import pytest

from grpolens.profiles import trl as trl_profile
from grpolens.analysis import parity
from grpolens.run.format import read_manifest
from tests.integration import trl_parity, trl_tiny

pytest.importorskip("trl")

SINGLE_DEFAULTS = [n for n in trl_tiny.DEFAULT_CONFIGS if n != "defaults_ddp"]
SINGLE_WINDOWS = [n for n in trl_tiny.WINDOW_CONFIGS if n != "window_ddp"]
FAST = {"defaults_first_step"}  # one real windowed run in the fast suite


def _cases(names):
    return [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in names]


def _assert_all_reproduced(run, name: str) -> list:
    rows = trl_parity.compare(run)
    assert rows, f"{name}: nothing compared"
    bad = [r for r in rows if r.status != "ok"]
    assert not bad, f"{name}: {trl_parity.summary(rows)}"
    return rows


def _assert_schedule(run, name: str) -> None:
    """The steps TRL logged at (summary included) are those of grpolens' reading of the manifest."""
    m = read_manifest(run)
    rules = trl_profile.Rules.from_run(m.trainer, m.resolved_config(), trl_profile.read_state(run))
    import polars as pl

    steps = sorted(pl.read_parquet(run / "tokens" / "*" / "*.parquet", hive_partitioning=False)["step"].unique().to_list())
    expected = [s for s, _, _ in trl_profile.windows(steps, rules)]
    logged = sorted(trl_parity.trl_log(run))
    assert logged == expected, f"{name}: TRL logged at {logged}, grpolens expects {expected}"
    assert len(logged) < len(steps), f"{name}: no logging window spans several steps"


@pytest.mark.parametrize("name", _cases(SINGLE_DEFAULTS))
def test_defaults(trl_run, name):
    run = trl_run(name) / "run"
    _assert_schedule(run, name)
    rows = _assert_all_reproduced(run, name)
    keys = {r.key for r in rows}
    assert {"entropy", "reward", "num_tokens", "completions/mean_length", "frac_reward_zero_std"} <= keys
    # logging_strategy="no": only the end-of-training summary, which has train_loss, not loss
    assert ("loss" in keys) == (name != "defaults_no_logging")
    if "beta" in name:
        assert "kl" in keys


@pytest.mark.parametrize("name", _cases(SINGLE_WINDOWS))
def test_windows_every_loss_type(trl_run, name):
    run = trl_run(name) / "run"
    _assert_schedule(run, name)
    logs = trl_parity.trl_log(run).values()
    clip_key = "cispo_clip_ratio" if "cispo" in name else "clip_ratio/region_mean"
    # sapo and vespo log no clip metric; two rounds per step with num_iterations=1 never computes old log-probs
    vespo = name.startswith("window_vespo")
    if name not in ("window_sapo", "window_two_generations_per_step") and not vespo:
        assert max(r.get(clip_key) or 0.0 for r in logs) > 0, f"{name}: TRL never clipped"
    assert max(r.get("kl") or 0.0 for r in logs) > 0, f"{name}: no KL"
    rows = _assert_all_reproduced(run, name)
    if vespo:  # VESPO's own metric, and its weights off 1 once the policy moved
        assert {"vespo/phi_seq_mean", "loss"} <= {r.key for r in rows}
        assert any(abs((r.get("vespo/phi_seq_mean") or 1.0) - 1.0) > 1e-3 for r in logs), "VESPO never reweighted"
    if name == "window_vespo_is_token_truncate":  # the band cut weights that φ then holds
        assert min(r["sampling/importance_sampling_ratio/min"] for r in logs) == pytest.approx(0.97)
        assert max(r["sampling/importance_sampling_ratio/max"] for r in logs) == pytest.approx(1.03)
    if name == "window_vespo_is_token_mask":  # some tokens masked: ln 1e-8 in their sequence's φ
        assert min(r["sampling/importance_sampling_ratio/min"] for r in logs) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["defaults_ddp", "window_ddp"])
def test_two_processes(trl_run, name):
    out = trl_run(name, nproc=2)
    run = out / "run"
    assert read_manifest(run).world_size == 2
    _assert_schedule(run, name)
    _assert_all_reproduced(run, name)


def test_windows_are_what_makes_it_match(trl_run):
    """The per-step view (what TRL would log with logging_steps=1) does not match TRL's windowed
    log: the window rule is what parity checks, not a tautology."""
    run = trl_run("defaults_first_step") / "run"
    import grpolens

    per_step = grpolens.recompute(run, profile="trl", write=False, per_step=True)
    windowed = grpolens.recompute(run, profile="trl", write=False)
    assert per_step.height == 12 and windowed["step"].to_list() == [1, 10, 12]
    logged = trl_parity.trl_log(run)
    at10 = per_step.filter(per_step["step"] == 10).row(0, named=True)
    differ = [k for k in ("loss", "entropy", "reward", "completions/mean_length")
              if not parity.close(at10[k], logged[10][k])]
    assert differ, "step 10's own values equal the window's: the case does not test windows"
