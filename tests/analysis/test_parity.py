"""``grpolens parity``: the comparison itself, on logs written by hand from a recompute."""

import json
import subprocess
import sys

import numpy as np
import pytest

import grpolens
from grpolens.errors import UserError
from grpolens.analysis.parity import close, compare, read_log
from tests.refdata import random_calls, write_run


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "grpolens.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture
def run_and_log(tmp_path):
    rng = np.random.default_rng(21)
    run = write_run(tmp_path / "run", random_calls(rng, steps=(0, 1, 2)), config={"beta": 0.04})
    df = grpolens.recompute(run, profile="trl", write=False)
    lines = []
    for row in df.iter_rows(named=True):
        rec = {k: v for k, v in row.items() if v is not None}
        rec["grad_norm"] = 1.0  # the optimiser's: never compared
        lines.append(json.dumps(rec))
    lines.append(json.dumps({"train_runtime": 1.0, "step": 2}))
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(lines) + "\n")
    return run, log


def test_identical_log_agrees(run_and_log):
    run, log = run_and_log
    rows = compare(run, log)
    assert rows and all(r.status == "ok" for r in rows)
    assert "grad_norm" not in {r.key for r in rows}
    r = _cli("parity", run, "--log", log)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_changed_value_is_a_mismatch_and_exit_1(run_and_log):
    run, log = run_and_log
    recs = [json.loads(l) for l in log.read_text().splitlines()]
    recs[1]["entropy"] *= 1.001
    del recs[2]["kl"]
    log.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    by = {(r.step, r.key): r.status for r in compare(run, log)}
    assert by[(1, "entropy")] == "mismatch"
    assert by[(2, "kl")] == "extra"  # grpolens has a value where the trainer logged none
    r = _cli("parity", run, "--log", log)
    assert r.returncode == 1 and "entropy" in r.stdout


def test_bad_logs_are_user_errors(tmp_path, run_and_log):
    run, _ = run_and_log
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0}\nnot json\n')
    with pytest.raises(UserError, match="bad.jsonl:2"):
        read_log(bad)
    r = _cli("parity", run, "--log", tmp_path / "none.jsonl")
    assert r.returncode == 2 and "no such file" in r.stderr
    r = _cli("parity", run, "--profile", "xtuner")
    assert r.returncode == 2 and "--log" in r.stderr


def test_close():
    assert close(1.0, 1.0 + 1e-7) and not close(1.0, 1.001)
    assert close(None, None) and not close(None, 1.0)
    assert close(float("nan"), float("nan"))


def test_close_nan_matches_only_nan():
    """A NaN agrees with a NaN (both sides undefined) and with nothing else, on either side."""
    nan = float("nan")
    assert not close(nan, 1.0) and not close(1.0, nan)
    assert not close(nan, 0.0, rtol=1.0, atol=1.0) and not close(nan, float("inf"))


def test_close_tolerance_is_relative_to_the_larger_magnitude():
    """|a - b| <= atol + rtol * max(|a|, |b|), symmetric: probed right at the bound, where the larger
    and the smaller magnitude disagree (exact binary fractions, no rounding)."""
    rtol = 0.25
    # |1 - 1.25| = 0.25 <= 0.25 * 1.25 (the larger) but > 0.25 * 1 (the smaller)
    assert close(1.0, 1.25, rtol=rtol, atol=0.0) and close(1.25, 1.0, rtol=rtol, atol=0.0)
    # exactly on the bound (inclusive), and just inside it
    assert close(-2.0, -2.5, rtol=0.2, atol=0.0)  # 0.5 <= 0.2 * 2.5 = 0.5
    assert not close(-2.0, -2.5, rtol=0.1875, atol=0.0)  # 0.5 > 0.1875 * 2.5 = 0.46875
    assert close(0.0, 0.125, rtol=0.0, atol=0.125) and not close(0.0, 0.25, rtol=0.0, atol=0.125)


def test_verl_file_logger_layout(run_and_log, tmp_path):
    """verl's file logger writes {"step": N, "data": {...}} per line: read as the flat layout."""
    run, log = run_and_log
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    nested = tmp_path / "verl.jsonl"
    nested.write_text("\n".join(json.dumps({"step": r.pop("step"), "data": r}) for r in lines if "train_runtime" not in r) + "\n")
    assert set(read_log(nested)) == set(read_log(log))
    rows = compare(run, nested)
    assert rows and all(r.status == "ok" for r in rows)
    changed = [json.loads(x) for x in nested.read_text().splitlines()]
    changed[1]["data"]["loss"] += 1e-3
    nested.write_text("\n".join(map(json.dumps, changed)) + "\n")
    bad = [r for r in compare(run, nested) if r.status != "ok"]
    assert [(r.step, r.key, r.status) for r in bad] == [(1, "loss", "mismatch")]


def test_formatted_values_compare_at_their_rounding(run_and_log, tmp_path):
    """Twinkle's LossMetric logs f"{loss:.4f}": equal at 4 decimals is ok, one unit off is not."""
    run, log = run_and_log
    recs = [json.loads(x) for x in log.read_text().splitlines() if "train_runtime" not in x]
    exact = {r["step"]: r["loss"] for r in recs}
    for r in recs:
        r["loss"] = f"{r['loss']:.4f}"
    text = tmp_path / "twinkle.jsonl"
    text.write_text("\n".join(map(json.dumps, recs)) + "\n")
    rows = [r for r in compare(run, text) if r.key == "loss"]
    assert len(rows) == 3 and all(r.status == "ok" for r in rows)
    recs[0]["loss"] = f"{exact[recs[0]['step']] + 2e-4:.4f}"
    text.write_text("\n".join(map(json.dumps, recs)) + "\n")
    assert [r.status for r in compare(run, text) if r.key == "loss"] == ["mismatch", "ok", "ok"]


def test_openrlhf_console_and_wandb_layouts(tmp_path):
    """OpenRLHF's console line per global step (a Python dict, its keys without the loggers'
    ``train/`` prefix) and an exported wandb history (``train/global_step``, no ``step``)."""
    console = tmp_path / "driver.log"
    console.write_text("(PPOTrainer pid=1) loading\n"
                       "(PPOTrainer pid=1) ✨ Global step 3: {'policy_loss': -0.25, 'rollout/reward_mean': 0.5, "
                       "'timing/ppo_train': 1.0}\n"
                       "not JSON, and skipped: the file is a console log\n")
    assert read_log(console) == {3: {"step": 3, "train/policy_loss": -0.25, "train/rollout/reward_mean": 0.5,
                                     "train/timing/ppo_train": 1.0}}
    wandb = tmp_path / "history.jsonl"
    wandb.write_text(json.dumps({"_step": 0, "train/global_step": 3, "train/policy_loss": -0.25}) + "\n")
    assert read_log(wandb)[3]["train/policy_loss"] == -0.25
    bad = tmp_path / "bad.log"
    bad.write_text("✨ Global step 3: {'policy_loss': __import__('os').getcwd()}\n")
    with pytest.raises(UserError, match="bad.log:1: an OpenRLHF status line whose dict is not plain literals"):
        read_log(bad)


def test_a_value_the_run_does_not_determine_is_undetermined_with_why_and_exit_0(tmp_path):
    """verl's Clip-Cov zeroes a random choice of its candidates when it has more than clip_num: the
    logged pg_loss is reported as undetermined with the reason, not as a failure; a missing value
    without such a reason still fails."""
    from tests.metrics.test_verl_actor import verl_run

    # one call of 5 tokens, Ā = 0.4, l̄ = −1.3: cov = [1.92, −2.72, 1.76, 4.32, −2.88], 3 in (0.5, 5):
    # clip_num = max(int(0.2 · 5), 1) = 1 of them zeroed, verl's draw
    nan = np.nan
    logp = [[-0.1, -3.0, -0.2], [-3.1, -0.1, nan]]
    old = [[-0.1, -3.0, -0.2], [-3.1, -0.1, nan]]
    adv = [[2.0, 2.0, 2.0], [-2.0, -2.0, nan]]
    actor = {"policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.2, "clip_cov_lb": 0.5}}
    run = verl_run(tmp_path / "run", actor, logp, old, adv, [(0, [0, 1])])
    res = grpolens.recompute(run, profile="verl", write=False, result=True)
    row = res.metrics.row(0, named=True)
    assert row["actor/pg_loss"] is None and row["actor/pg_clipfrac"] is not None
    assert row["grpolens/pg_loss_random_calls"] == 1.0
    assert any("depends on verl's random choice" in n for n in res.notes)
    log = tmp_path / "verl.jsonl"
    logged = {"actor/pg_loss": 0.5, "actor/loss": 0.5, "actor/pg_clipfrac": row["actor/pg_clipfrac"],
              "actor/ppo_kl": row["actor/ppo_kl"]}
    log.write_text(json.dumps({"step": 1, "data": logged}) + "\n")
    by = {r.key: r for r in compare(run, log, profile="verl")}
    assert by["actor/pg_loss"].status == "undetermined" and "random choice" in by["actor/pg_loss"].why
    assert by["actor/pg_clipfrac"].status == "ok"
    r = _cli("parity", run, "--log", log, "--profile", "verl")
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())  # rich wraps lines
    assert "2 not determined by the run" in out and "torch.randperm" in out
    # where the run determines the value (clip_cov_ratio 0.6: clip_num 3, every candidate) it is compared
    actor["policy_loss"]["clip_cov_ratio"] = 0.6
    run2 = verl_run(tmp_path / "run2", actor, logp, old, adv, [(0, [0, 1])])
    assert {r.key: r.status for r in compare(run2, log, profile="verl")}["actor/pg_loss"] == "mismatch"
