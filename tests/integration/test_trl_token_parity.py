"""TRL parity of the token-side metrics: train TRL's real GRPOTrainer on CPU through the grpolens
hook (``trl_tiny.py``), then compare ``recompute(profile="trl")`` with what TRL itself logged."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

import grpolens  # noqa: E402

KEYS = ("loss", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
        "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio")
SCRIPT = Path(__file__).with_name("trl_tiny.py")


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    [],  # dapo, beta 0.04 with the bias-corrected kl, 2 iterations (old log-probs exist)
    ["--loss-type", "grpo", "--delta", "1.03"],
    ["--loss-type", "grpo", "--importance-sampling-level", "sequence", "--mask-truncated-completions",
     "--epsilon", "0.003", "--epsilon-high", "0.004"],
    ["--loss-type", "cispo", "--epsilon-high", "1.01"],
], ids=["dapo", "grpo-delta", "gspo-masked", "cispo"])
def test_trl_profile_matches_trl_logs(tmp_path, args):
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *args], check=True, capture_output=True, timeout=600)
    run = tmp_path / "run"
    got = grpolens.recompute(run, profile="trl", write=False)
    logged = [json.loads(line) for line in (run / "grpolens" / "trl_log.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "loss" in r and "entropy" in r]  # per-step logs, not the final summary
    assert len(logged) == got.height
    seen = 0
    for want, row in zip(logged, got.iter_rows(named=True)):
        for k in KEYS:
            assert (k in want) == (k in row), k  # the same keys appear
            if k in want:
                assert row[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (row["step"], k)
                seen += want[k] != 0.0
    assert seen > 0
