"""Completion/prompt length, truncation and tokens-seen metrics against plain-Python references
of TRL's and MaxEnt-GRPO's rules, on random ragged groups (EOS-truncated and length-clipped
completions differ on purpose), plus the empty and absent cases."""

import json

import numpy as np
import pytest

import grpolens
from tests.refdata import approx, concat_samples, random_calls, random_samples, samples_run, write_rounds

MAX_LEN = 40


def stats(x, prefix, zero=False):
    x = [float(v) for v in x]
    if not x:
        v = 0.0 if zero else None
        return {f"{prefix}/mean": v, f"{prefix}/min": v, f"{prefix}/max": v}
    return {f"{prefix}/mean": sum(x) / len(x), f"{prefix}/min": min(x), f"{prefix}/max": max(x)}


def expected(s, max_len=MAX_LEN, profile="grpolens"):
    n, t = s.completion_len.tolist(), s.truncated.tolist()
    e = {}
    e.update(stats(n, "completions/length"))
    e["completions/truncated_frac"] = sum(t) / len(t)
    e.update(stats([a for a, b in zip(n, t) if not b], "completions/terminated_length", zero=profile == "trl"))
    if max_len is not None:
        e["completions/clipped_frac"] = sum(a >= max_len for a in n) / len(n)
        e.update(stats([a for a in n if a < max_len], "completions/unclipped_length", zero=profile == "maxent"))
    e["completions/tokens"] = float(sum(n))
    p = [v for v in s.prompt_len.tolist() if v == v]
    e.update(stats(p, "prompts/length"))
    return e


def row(df, step):
    (r,) = df.filter(df["step"] == step).iter_rows(named=True)
    return r


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lengths_random(tmp_path, seed):
    rng = np.random.default_rng(seed)
    steps = [random_samples(rng, st, groups=int(rng.integers(1, 7)), max_len=MAX_LEN, first_id=1000 * st)
             for st in range(3)]
    steps[1].prompt_len[0] = np.nan  # one unknown prompt length
    run = samples_run(tmp_path / "run", steps, config={"max_completion_length": MAX_LEN})
    got = grpolens.recompute(run, write=False)
    for s in steps:
        for k, v in expected(s).items():
            assert approx(row(got, s.step)[k], v, rel=1e-12), (s.step, k)


def test_tokens_seen_is_a_running_total(tmp_path):
    rng = np.random.default_rng(3)
    calls = random_calls(rng, steps=(0, 1, 2, 3))
    s0, s2, s3 = (random_samples(rng, st, first_id=100 * st) for st in (0, 2, 3))  # no generation at step 1
    run = samples_run(tmp_path / "run", [s0, s2, s3], calls=calls)
    per_step = {s.step: float((s.completion_len + s.prompt_len).sum()) for s in (s0, s2, s3)}
    got = grpolens.recompute(run, write=False)
    assert got["tokens/seen"].to_list() == [per_step[0], None, per_step[0] + per_step[2],
                                            per_step[0] + per_step[2] + per_step[3]]
    trl = grpolens.recompute(run, profile="trl", write=True)
    assert trl["num_tokens"].to_list() == got["tokens/seen"].to_list()
    lines = [json.loads(x) for x in (run / "grpolens" / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert "num_tokens" not in lines[1] and "completions/mean_length" not in lines[1]  # TRL: absent without generation
    assert lines[3]["num_tokens"] == per_step[0] + per_step[2] + per_step[3]


def test_hand_worked(tmp_path):
    # lengths 10 (EOS), 40 (hit max 40, truncated), 25 (truncated by a stop without EOS), 5 (EOS)
    # mean 80/4 = 20, min 5, max 40; TRL clipped_ratio 2/4; terminated (EOS): 10, 5 -> mean 7.5
    # MaxEnt clipped_frac (len >= 40): 1/4; length-terminated 10, 25, 5 -> mean 40/3, min 5, max 25
    # prompts 7, 7, 3, 3 -> tokens 80 + 20 = 100
    rng = np.random.default_rng(0)
    s = random_samples(rng, 0, groups=2, generations=2, nonfinite=0.0, single_sample_group=False)
    s.completion_len = np.array([10, 40, 25, 5])
    s.truncated = np.array([False, True, True, False])
    s.prompt_len = np.array([7.0, 7.0, 3.0, 3.0])
    run = samples_run(tmp_path / "run", [s], config={"max_completion_length": 40})
    g = row(grpolens.recompute(run, write=False), 0)
    assert (g["completions/length/mean"], g["completions/length/min"], g["completions/length/max"]) == (20, 5, 40)
    assert g["completions/truncated_frac"] == 0.5 and g["completions/terminated_length/mean"] == 7.5
    assert g["completions/clipped_frac"] == 0.25
    assert g["completions/unclipped_length/mean"] == pytest.approx(40 / 3)
    assert (g["completions/unclipped_length/min"], g["completions/unclipped_length/max"]) == (5, 25)
    assert g["tokens/seen"] == 100 and g["completions/tokens"] == 80 and g["prompts/length/mean"] == 5
    t = row(grpolens.recompute(run, profile="trl", write=False), 0)
    assert (t["completions/mean_length"], t["completions/clipped_ratio"], t["completions/max_terminated_length"],
            t["num_tokens"]) == (20, 0.5, 10, 100)
    m = row(grpolens.recompute(run, profile="maxent", write=False), 0)
    assert (m["train/completions/mean_length_sampled"], m["train/completions/clipped_frac"],
            m["train/completions/max_length_terminated"]) == (20, 0.25, 25)


def test_none_terminated(tmp_path):
    rng = np.random.default_rng(4)
    s = random_samples(rng, 0, max_len=MAX_LEN)
    s.completion_len[:] = MAX_LEN
    s.truncated[:] = True
    run = samples_run(tmp_path / "run", [s], config={"max_completion_length": MAX_LEN})
    for profile in ("grpolens", "trl", "maxent"):
        got = row(grpolens.recompute(run, profile=profile, write=False), 0)
        e = expected(s, profile=profile)
        assert e["completions/terminated_length/mean"] == (0.0 if profile == "trl" else None)
        assert e["completions/unclipped_length/max"] == (0.0 if profile == "maxent" else None)
        names = {"trl": {"completions/terminated_length/mean": "completions/mean_terminated_length",
                         "completions/terminated_length/min": "completions/min_terminated_length"},
                 "maxent": {"completions/unclipped_length/max": "train/completions/max_length_terminated",
                            "completions/clipped_frac": "train/completions/clipped_frac"},
                 "grpolens": {k: k for k in e}}[profile]
        for canon, name in names.items():
            assert got[name] == e[canon], (profile, name)


def test_config_and_absent_columns(tmp_path):
    rng = np.random.default_rng(5)
    s = random_samples(rng, 0)
    s.prompt_len = None  # column absent
    run = samples_run(tmp_path / "run", [s])  # no max_completion_length in the config
    g = row(grpolens.recompute(run, write=False), 0)
    assert g["tokens/seen"] is None and g["prompts/length/mean"] is None
    assert "completions/clipped_frac" not in g and "completions/unclipped_length/mean" not in g
    assert g["completions/length/max"] == float(s.completion_len.max())
    m = grpolens.recompute(run, profile="maxent", write=False)
    assert "train/completions/clipped_frac" not in m.columns and "train/completions/mean_length_sampled" in m.columns
    g = row(grpolens.recompute(run, write=False, overrides={"max_completion_length": 20}), 0)
    assert g["completions/clipped_frac"] == pytest.approx(np.mean(s.completion_len >= 20))


def test_empty_samples_shard(tmp_path):
    rng = np.random.default_rng(6)
    s = random_samples(rng, 0)
    run = samples_run(tmp_path / "run", [s], config={"max_completion_length": MAX_LEN})
    import pyarrow.parquet as pq

    (run / "samples" / "step=00000001").mkdir()
    pq.write_table(s.table().slice(0, 0), run / "samples" / "step=00000001" / "rank=00000.parquet")
    g = row(grpolens.recompute(run, write=False), 1)  # a shard with no rows: nothing to average
    assert g["completions/length/mean"] is None and g["completions/truncated_frac"] is None
    assert g["reward/mean"] is None and g["samples/count"] == 0 and g["tokens/seen"] is None
    assert g["completions/clipped_frac"] is None and g["completions/unclipped_length/max"] is None


def test_trl_averages_generation_rounds(tmp_path):
    """TRL computes its completions/* once per generation round and logs the mean over the step's
    rounds; num_tokens is the running total, so the step shows the total after its last round."""
    rng = np.random.default_rng(5)
    step0 = [random_samples(rng, 0, groups=2, max_len=MAX_LEN, first_id=0),
             random_samples(rng, 0, groups=6, max_len=MAX_LEN, first_id=100)]
    step0[0].truncated[:] = True  # no completion of this round ended with EOS: TRL averages its 0.0
    step1 = [random_samples(rng, 1, groups=3, max_len=MAX_LEN, first_id=200)]
    run = write_rounds(tmp_path / "run", step0 + step1, config={"max_completion_length": MAX_LEN})
    trl = grpolens.recompute(run, profile="trl", write=False)
    default = grpolens.recompute(run, write=False)
    names = {"completions/mean_length": "completions/length/mean", "completions/min_length": "completions/length/min",
             "completions/max_length": "completions/length/max", "completions/clipped_ratio": "completions/truncated_frac",
             **{f"completions/{w}_terminated_length": f"completions/terminated_length/{w}" for w in ("mean", "min", "max")}}
    seen = 0.0
    for step, rounds in ((0, step0), (1, step1)):
        t, d = row(trl, step), row(default, step)
        per_round = [expected(s, profile="trl") for s in rounds]
        pooled = expected(concat_samples(rounds))
        for trl_name, canon in names.items():
            assert approx(t[trl_name], float(np.mean([e[canon] for e in per_round])), rel=1e-12), (step, trl_name)
            assert approx(d[canon], pooled[canon], rel=1e-12), (step, canon)
        seen += sum(float((s.completion_len + s.prompt_len).sum()) for s in rounds)
        assert t["num_tokens"] == d["tokens/seen"] == seen
    assert row(trl, 0)["completions/min_terminated_length"] == pytest.approx(
        expected(step0[1])["completions/terminated_length/min"] / 2)
