"""`--config FILE` and `--set` merge into the run's config key by key (docs/rollout-is.md says so).

Where the run spells the rollout-IS band in a trainer's keys, an override in the same keys wins; an
override in grpolens's own keys next to it gives the band twice and is refused with the remedy.
"""

import json
import subprocess
import sys

import numpy as np
import polars as pl

from tests.refdata import random_calls, write_run

VERL_RUN_CONFIG = {"loss_type": "grpo", "rollout_is": {"rollout_is": "token", "rollout_is_threshold": 2.0}}


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "grpolens.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def _applied_max(tmp_path, run, *extra):
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    r = _cli("recompute", run, "--out", out, *extra, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return pl.read_parquet(out / "metrics.parquet")["rollout_is/applied/max"].max()


def test_config_file_merges_into_the_runs_mapping(tmp_path):
    calls = random_calls(np.random.default_rng(0), spread=1.5)
    run = write_run(tmp_path / "run", calls, config=VERL_RUN_CONFIG)
    base = _applied_max(tmp_path, run)
    assert base <= 2.0 + 1e-12           # the run's own cap applies
    cfg = tmp_path / "cap.json"
    cfg.write_text(json.dumps({"rollout_is": {"rollout_is_threshold": 1.2}}))
    merged = _applied_max(tmp_path, run, "--config", cfg)
    assert merged <= 1.2 + 1e-12 and merged < base  # the same trainer key, overridden
    assert _applied_max(tmp_path, run, "--set", "rollout_is.rollout_is_threshold=1.2") == merged


def test_band_in_other_keys_is_given_twice(tmp_path):
    run = write_run(tmp_path / "run", random_calls(np.random.default_rng(1)), config=VERL_RUN_CONFIG)
    cfg = tmp_path / "band.json"
    cfg.write_text(json.dumps({"rollout_is": {"upper": 3.0, "lower": 0.5}}))
    r = _cli("recompute", run, "--out", tmp_path / "x", "--config", cfg, cwd=tmp_path)
    assert r.returncode == 2
    assert "given twice" in r.stderr and "rollout_is_threshold" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()
    # the documented remedy: null the run's trainer key in the same override
    cfg.write_text(json.dumps({"rollout_is": {"rollout_is_threshold": None, "upper": 3.0, "lower": 0.5}}))
    r = _cli("recompute", run, "--out", tmp_path / "y", "--config", cfg, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
