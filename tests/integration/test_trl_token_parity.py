"""TRL parity of the token-side metrics: ``recompute(profile="trl")`` against what TRL itself logged,
on the session's real TRL runs (the ``trl_run`` fixture: each configuration trains once per session)."""

import json

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # real TRL training on CPU

import grpolens  # noqa: E402

KEYS = ("loss", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
        "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio")


@pytest.mark.parametrize("name", [
    "dapo",         # TRL's default loss, beta 0.04 with the bias-corrected kl, 2 iterations (old log-probs exist)
    "grpo_masked",  # grpo with delta (and masked truncated completions)
    "gspo_masked",  # sequence-level ratio, tight epsilons, masked truncated completions
    "cispo",        # cispo's absolute cap epsilon_high
])
def test_trl_profile_matches_trl_logs(trl_run, name):
    run = trl_run(name) / "run"
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
