"""Synthetic runs: valid, reproducible, realistic, and pathologies confined to their steps/columns."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from grpolens.run import format as fmt
from grpolens.cli import main
from grpolens.errors import UserError
from grpolens.adapters.synth import SynthSpec, generate_samples, generate_tokens, parse_injection, synth_run
from grpolens.run.validate import validate_run

SMALL = dict(steps=6, ranks=2, micro_batches=3, groups=3, generations=4, max_len=48)


def _tokens(run) -> pl.DataFrame:
    return pl.read_parquet(f"{run}/tokens/*/*.parquet")


def _samples(run) -> pl.DataFrame:
    return pl.read_parquet(f"{run}/samples/*/*.parquet")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return synth_run(tmp_path_factory.mktemp("synth") / "clean", seed=7, texts=True, **SMALL)


def test_clean_run_is_valid_without_warnings(clean):
    report = validate_run(clean)
    assert report.problems == []
    assert report.files == {"tokens": 12, "samples": 12}
    m = fmt.read_manifest(clean)
    assert m.world_size == 2 and m.trainer["name"] == "grpolens-synth"
    cfg = m.config
    assert (cfg["loss_type"], cfg["epsilon"], cfg["epsilon_high"], cfg["beta"]) == ("grpo", 0.2, 0.28, 0.04)
    assert (cfg["max_completion_length"], cfg["num_generations"], cfg["gradient_accumulation_steps"]) == (48, 4, 3)
    assert cfg["rollout_is"] == {"level": "token", "mode": "truncate", "lower": 0.5, "upper": 2.0,
                                 "veto_lower": 1e-4, "veto_upper": 1e4}


def test_structure_lengths_groups_and_advantages(clean):
    tok, smp = _tokens(clean), _samples(clean)
    K = SMALL["generations"]
    assert smp["sample_id"].is_unique().all() and smp.height == 6 * 2 * 3 * K
    # every group: K completions, from one (step, rank)
    g = smp.group_by("group_id").agg(pl.len(), pl.col("step").n_unique().alias("s"), pl.col("rank").n_unique().alias("r"))
    assert (g["len"] == K).all() and (g["s"] == 1).all() and (g["r"] == 1).all()
    # truncated completions have the maximal length; lengths are ragged
    assert (smp.filter("truncated")["completion_len"] == SMALL["max_len"]).all()
    assert smp["completion_len"].n_unique() > 10 and smp["completion_len"].min() >= 1
    # tokens: pos 0..len-1 per (sample, micro_batch), exactly completion_len rows, one micro_batch per sample
    per = tok.group_by("sample_id").agg(pl.len().alias("n"), pl.col("pos").min().alias("lo"),
                                        pl.col("pos").max().alias("hi"), pl.col("micro_batch").n_unique().alias("mbs"),
                                        pl.col("advantage").first().alias("adv"))
    j = smp.join(per, on="sample_id", how="left")
    assert j["n"].null_count() == 0
    assert (j["n"] == j["completion_len"]).all() and (j["lo"] == 0).all() and (j["hi"] == j["completion_len"] - 1).all()
    assert (j["mbs"] == 1).all()
    assert np.array_equal(j["adv"].to_numpy(), j["advantage"].to_numpy())
    # every (step, rank) uses all micro-batches 0..M-1
    assert set(tok["micro_batch"].unique().to_list()) == {0, 1, 2}
    # rewards: total = 1.0 * accuracy + 0.5 * format; advantages group-normalised (unbiased std)
    r = smp.sort("sample_id")
    total = r["reward/accuracy"].to_numpy() + 0.5 * r["reward/format"].to_numpy()
    np.testing.assert_allclose(r["reward"].to_numpy(), total)
    assert set(r["reward/accuracy"].unique().to_list()) <= {0.0, 1.0}
    assert r["reward/format"].min() >= 0 and r["reward/format"].max() <= 1
    grp = total.reshape(-1, K)
    ref = (grp - grp.mean(1, keepdims=True)) / (grp.std(1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(r["advantage"].to_numpy(), ref.reshape(-1), rtol=1e-6, atol=1e-6)
    # texts present, including markup that display code must escape
    texts = " ".join(r["prompt"].to_list() + r["completion"].to_list())
    assert r["prompt"].null_count() == 0 and ("[" in texts or "<" in texts)


def _k3(a, b):
    d = b - a
    return float(np.mean(np.exp(d) - d - 1))


def test_token_statistics_look_like_training():
    spec = SynthSpec(steps=400, groups=8, generations=8, max_len=512, micro_batches=2, seed=3)

    def step_tokens(step):
        s = generate_samples(spec, step, 0)
        parts = [generate_tokens(spec, step, 0, mb, s) for mb in range(2)]
        return {k: np.concatenate([p[k] for p in parts]).astype(np.float64) for k in ("logp", "old_logp", "ref_logp",
                                                                                       "rollout_logp", "entropy", "mask")}
    early, late = step_tokens(0), step_tokens(399)
    for t in (early, late):
        assert (t["logp"] <= 0).all() and np.isfinite(t["logp"]).all()
        ratio = np.exp(t["logp"] - t["old_logp"])
        clipped = np.mean((ratio < 0.8) | (ratio > 1.28))
        assert 0.01 < clipped < 0.08, clipped
        assert 3e-4 < _k3(t["old_logp"], t["rollout_logp"]) < 3e-3
        assert 0.90 < t["mask"].mean() < 0.99
        assert abs(np.mean(-t["logp"]) - np.mean(t["entropy"])) < 0.1 * np.mean(t["entropy"])
    assert 5e-4 < _k3(early["logp"], early["ref_logp"]) < _k3(late["logp"], late["ref_logp"]) < 2e-2
    assert 0.5 < late["entropy"].mean() < early["entropy"].mean() < 2.0


def test_same_seed_same_bytes_other_seed_other_data(tmp_path, clean):
    again = synth_run(tmp_path / "again", seed=7, texts=False, **SMALL)
    for shard in fmt.list_shards(clean):
        other = again / shard.path.relative_to(clean)
        assert other.read_bytes() == shard.path.read_bytes(), shard.path  # texts do not touch token data
    for shard in fmt.list_shards(clean, fmt.SAMPLES):
        a = pq.read_table(shard.path).drop_columns(["prompt", "completion"])
        assert a.equals(pq.read_table(again / shard.path.relative_to(clean)))
    other_seed = synth_run(tmp_path / "seed8", seed=8, **SMALL)
    assert not _tokens(other_seed)["logp"].equals(_tokens(clean)["logp"])


def test_a_shorter_run_is_a_prefix(tmp_path, clean):
    short = synth_run(tmp_path / "short", seed=7, **{**SMALL, "steps": 2})
    for shard in fmt.list_shards(short):
        assert shard.path.read_bytes() == (clean / shard.path.relative_to(short)).read_bytes()


# which columns each pathology may change, and whether it lasts from its step on
AFFECTS = {
    "kl-spike": ({"ref_logp"}, False),
    "rollout-drift": ({"rollout_logp"}, True),
    "entropy-collapse": ({"entropy", "logp", "old_logp", "rollout_logp"}, True),
    "nan": ({"logp"}, False),
}


@pytest.mark.parametrize("kind", list(AFFECTS))
def test_injection_changes_only_its_steps_and_columns(tmp_path, clean, kind):
    S = 3
    run = synth_run(tmp_path / kind, seed=7, texts=True, inject=[f"{kind}@{S}"], **SMALL)
    cols, persistent = AFFECTS[kind]
    for shard in fmt.list_shards(clean):
        a = pq.read_table(shard.path)
        b = pq.read_table(run / shard.path.relative_to(clean))
        hit = shard.step == S or (persistent and shard.step > S)
        for name in a.column_names:
            same = a.column(name).equals(b.column(name))
            if not hit or name not in cols:
                assert same, (kind, shard.step, name)
            else:
                assert not same, (kind, shard.step, name)
    for shard in fmt.list_shards(clean, fmt.SAMPLES):
        assert pq.read_table(shard.path).equals(pq.read_table(run / shard.path.relative_to(clean)))
    tok = _tokens(run)
    at = tok.filter(pl.col("step") == S)
    before = tok.filter(pl.col("step") == S - 1)
    if kind == "kl-spike":
        assert _k3(at["logp"].to_numpy(), at["ref_logp"].to_numpy()) > 50 * _k3(before["logp"].to_numpy(), before["ref_logp"].to_numpy())
    elif kind == "rollout-drift":
        after = tok.filter(pl.col("step") >= S)
        gap = (after["old_logp"] - after["rollout_logp"]).mean()
        assert 0.08 < gap < 0.12
    elif kind == "entropy-collapse":
        assert tok.filter(pl.col("step") >= S)["entropy"].mean() < 0.02 < before["entropy"].mean()
        assert tok.filter(pl.col("step") >= S)["logp"].mean() > -0.02
    elif kind == "nan":
        lp = at["logp"].to_numpy()
        assert np.isnan(lp).any() and np.isneginf(lp).any() and np.isposinf(lp).any()
        assert np.isfinite(tok.filter(pl.col("step") != S)["logp"].to_numpy()).all()
        report = validate_run(run)
        assert report.ok and len(report.warnings) == 1
        w = report.warnings[0]
        assert w.column == "logp" and f"{int((~np.isfinite(lp)).sum()):,} non-finite" in w.message


def test_spec_rejects_bad_parameters():
    with pytest.raises(UserError, match="--generations"):
        SynthSpec(generations=1)
    with pytest.raises(UserError, match="--micro-batches"):
        SynthSpec(groups=1, generations=2, micro_batches=3)
    with pytest.raises(UserError, match="outside the run"):
        SynthSpec(steps=3, inject=(parse_injection("nan@3"),))
    for bad in ("nan", "nan@x", "spike@1", "nan@-1"):
        with pytest.raises(UserError, match="KIND@STEP"):
            parse_injection(bad)


def test_cli_synth_and_errors(cli, tmp_path):
    out = tmp_path / "cli"
    args = ["synth", str(out), "--steps", "2", "--groups", "2", "--generations", "2", "--max-len", "8",
            "--inject", "kl-spike@1", "--seed", "1"]
    assert cli(*args).code == 0 and validate_run(out).ok
    assert json.loads((out / fmt.MANIFEST_NAME).read_text())["synth"]["inject"] == ["kl-spike@1"]
    # existing output: refused without --overwrite, replaced with it
    r = cli(*args)
    assert r.code == 2 and "--overwrite" in r.err
    assert cli(*args, "--overwrite").code == 0 and validate_run(out).ok
    # a directory that is not a run is never overwritten
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("x")
    assert cli("synth", tmp_path / "precious", "--overwrite").code == 2
    assert (tmp_path / "precious" / "thesis.tex").exists()
    r = cli("synth", tmp_path / "x", "--inject", "bogus@1")
    assert r.code == 2 and "bogus@1" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "x").exists()


def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    import grpolens.adapters.synth as synth

    real = synth.generate_tokens

    def failing(spec, step, rank, mb, samples=None):
        if step == 2:
            raise RuntimeError("disk on fire")
        return real(spec, step, rank, mb, samples)

    monkeypatch.setattr(synth, "generate_tokens", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        synth.synth_run(tmp_path / "run", steps=4)
    assert list(tmp_path.iterdir()) == []


def test_the_bundled_synthetic_run_is_what_its_documented_command_makes(tmp_path):
    """sample_runs/README.md's command regenerates sample_runs/tiny: the same rows and values in
    every shard (the Parquet bytes follow the writer's settings of the day, and the manifest's
    `created`, name and completion markers are the new run's)."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "sample_runs" / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^grpolens synth sample_runs/tiny .*$", readme, re.M)
    assert command, "sample_runs/README.md no longer shows the command that makes sample_runs/tiny"
    args = shlex.split(command.group(0))[1:]
    args[1] = str(tmp_path / "tiny")
    main(args)
    bundled = root / "sample_runs" / "tiny"
    shards = sorted(p.relative_to(bundled) for p in bundled.rglob("*.parquet"))
    assert shards == sorted(p.relative_to(tmp_path / "tiny") for p in (tmp_path / "tiny").rglob("*.parquet"))
    for shard in shards:
        assert pl.read_parquet(bundled / shard).equals(pl.read_parquet(tmp_path / "tiny" / shard)), shard
    made = json.loads((tmp_path / "tiny" / "grpolens.json").read_text())
    kept = json.loads((bundled / "grpolens.json").read_text())
    assert {k: v for k, v in made.items() if k not in ("created", "run_name", "completion_markers")} == \
        {k: v for k, v in kept.items() if k not in ("created", "run_name")}
