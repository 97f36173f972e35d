"""The bundled ``sample_runs/trl-tiny`` (recorded from real TRL training by
``sample_runs/make_trl_tiny.py``) recomputes to exactly what TRL logged in it. Needs no TRL."""

from pathlib import Path

from tests.integration import trl_parity

RUN = Path(__file__).resolve().parents[2] / "sample_runs" / "trl-tiny"


def test_sample_run_matches_its_trl_log():
    rows = trl_parity.compare(RUN)
    keys = {r.key for r in rows}
    assert {"kl", "entropy", "clip_ratio/region_mean", "clip_ratio/high_max", "reward", "num_tokens",
            "completions/clipped_ratio", "frac_reward_zero_std"} <= keys
    # TRL's default logging_steps=10 over 24 steps: two windows and the end-of-training summary
    assert sorted({r.step for r in rows}) == [10, 20, 24]
    bad = [r for r in rows if r.status != "ok"]
    assert not bad, trl_parity.summary(rows)
