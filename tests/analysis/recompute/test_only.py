"""``recompute --only``: a recompute restricted to some metrics gives exactly the full run's values.

The restricted run skips producers, visitors, token columns and sample reads that the selected
metrics do not need; a dependency left undeclared (a producer or visitor a family reads but does
not name it) shows up here as a value that differs from the full recompute.
"""

import shutil
from pathlib import Path

import polars as pl
import pytest

from grpolens.analysis.recompute import recompute
from grpolens.errors import UserError
from grpolens.metrics.registry import PLACEHOLDER, PROFILES, REGISTRY, load_families
from grpolens.adapters.synth import synth_run
from tests.sample_runs import copy_sample_run

SAMPLE_RUNS = Path(__file__).resolve().parents[3] / "sample_runs"
#: verl's rejection filters (the rs visitor) and a sequence-level veto, so those paths run too
RS = {"rollout_is": {"level": "token", "mode": "truncate", "lower": 0.5, "upper": 2.0, "veto_lower": 1e-4,
                     "veto_upper": 1e4, "rs": "token_k1,seq_max_k3", "rs_threshold": "0.5_2.0,3.0"}}


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return synth_run(tmp_path_factory.mktemp("only") / "run", steps=2, ranks=2, micro_batches=2, groups=3,
                     generations=4, max_len=64, seed=3, texts=True)


def _families(df: pl.DataFrame, profile: str) -> dict[str, list[str]]:
    load_families()
    by_name, templates = {}, []
    for m in REGISTRY.values():
        name = m.name_in(profile)
        if m.per_column is not None and name:  # rewards/<name>/mean, train/<name>_reward_std, ...
            head, _, tail = name.partition(PLACEHOLDER)
            templates.append((head, tail, m.family))
        by_name[name] = m.family
    fams: dict[str, list[str]] = {}
    for c in df.columns[1:]:
        fam = by_name.get(c)
        if fam is None:  # an expanded template: the template whose name pattern fits, most specific first
            fits = [(len(h) + len(t), f) for h, t, f in templates
                    if c.startswith(h) and c.endswith(t) and len(c) > len(h) + len(t)]
            fam = max(fits)[1]
        fams.setdefault(fam, []).append(c)
    return fams


def _check_every_family(run: Path, profile: str, overrides=None) -> None:
    full = recompute(run, profile=profile, write=False, incremental=False, overrides=overrides)
    fams = _families(full, profile)
    if profile == "grpolens":  # grpolens names every metric: every family that applies is checked there
        from grpolens.run.reader import RunReader

        cfg = RunReader(run).config(overrides)
        assert set(fams) == {m.family for m in REGISTRY.values() if m.applies(cfg)}
    assert fams
    for fam, cols in fams.items():
        sub = recompute(run, profile=profile, write=False, only=[fam], overrides=overrides)
        assert sub.columns == ["step", *cols], fam
        assert sub.equals(full.select("step", *cols)), fam


def test_every_producer_and_visitor_names_registered_families():
    """``--only`` runs a producer or visitor only for the families it names: one naming no family
    that exists runs in full recomputes only (the token-level advantage fallback's producer once
    named a family ``advantage``, and ``--only rewards`` gave null)."""
    from grpolens.metrics.engine import VISITOR_FAMILIES
    from grpolens.metrics.partials import PRODUCERS

    load_families()
    families = {m.family for m in REGISTRY.values()}
    for name, p in PRODUCERS.items():
        assert p.families and set(p.families) <= families, f"producer {name}: {p.families}"
    for name, fams in VISITOR_FAMILIES.items():  # () is an output-only visitor (histograms, top tokens)
        assert set(fams) <= families, f"visitor {name}: {fams}"


@pytest.mark.parametrize("profile", PROFILES)
def test_each_family_alone_equals_the_full_recompute(synth, profile):
    _check_every_family(synth, profile)


def test_with_rejection_filters(synth):
    _check_every_family(synth, "verl", overrides=RS)


@pytest.mark.parametrize("profile", ["grpolens", "maxent"])
def test_samples_without_advantages(synth, tmp_path, profile):
    """Without the samples' ``advantage`` column the zero-advantage-group fraction reads each
    completion's token-level advantage: a partial column of another producer than the rewards
    family's own (``--only rewards`` once gave null where the full recompute gave a value)."""
    import pyarrow.parquet as pq

    from grpolens.run import format as fmt

    run = tmp_path / "run"
    shutil.copytree(synth, run)
    shards = sorted((run / fmt.SAMPLES).rglob("*.parquet"))
    assert shards
    for shard in shards:
        t = pq.read_table(shard)
        pq.write_table(t.drop_columns(["advantage"]), shard)
    full = recompute(run, profile=profile, write=False, incremental=False)
    name = "advantage/frac_zero_groups" if profile == "grpolens" else "train/frac_reward_zero_std"
    assert full[name].null_count() == 0
    _check_every_family(run, profile)


def test_trl_run_with_generation_rounds(tmp_path):
    run = tmp_path / "trl-tiny"
    copy_sample_run("trl-tiny", run)
    _check_every_family(run, "trl")


def test_names_and_globs_and_profile_names(synth):
    full = recompute(synth, write=False, incremental=False)
    sub = recompute(synth, write=False, only=["clip/low,kl/k3", "rollout_is/applied/*"])
    cols = ["clip/low", "kl/k3"] + [c for c in full.columns if c.startswith("rollout_is/applied/")]
    assert sorted(sub.columns[1:]) == sorted(cols)
    assert sub.equals(full.select(sub.columns))
    trl = recompute(synth, profile="trl", write=False, only=["entropy", "clip_ratio/low_mean"])
    assert trl.columns == ["step", "entropy", "clip_ratio/low_mean"]


def test_writes_its_own_file_and_leaves_the_cache_alone(synth, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(synth, run)
    recompute(run, only=["entropy"])
    assert pl.read_parquet(run / "grpolens" / "only" / "metrics.parquet").columns == ["step", "entropy"]
    assert not (run / "grpolens" / "metrics.parquet").exists()
    assert not (run / "grpolens" / "cache").exists()
    assert not (run / "grpolens" / "top_tokens.parquet").exists()


def test_unknown_selection_is_a_user_error(synth):
    with pytest.raises(UserError, match="--only: 'nope'"):
        recompute(synth, write=False, only=["entropy", "nope"])
    with pytest.raises(UserError, match="--only"):
        recompute(synth, write=False, only=[" , "])
