"""What-if variants (``recompute --set/--config``) are runs of their own: they write under
``RUN/grpolens/variants/<key>/`` with ``variant.json``, never over the run's own metrics, and the
readers (check, export, serve) name them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from grpolens.analysis.recompute import recompute
from grpolens.errors import UserError
from grpolens.run.variants import (
    VARIANT_FILE, Variant, find_variant, list_variants, variant_key, variant_label, variant_run,
)
from tests.refdata import random_calls, write_run


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "grpolens.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.fixture
def run(tmp_path):
    # wide ratios, so that the clip fractions differ between epsilon=0.2 and a what-if's epsilon
    return write_run(tmp_path / "run", random_calls(np.random.default_rng(3), steps=(0, 1, 2), spread=1.5))


def _own(run):
    d = run / "grpolens"
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != "recompute.lock"}


def test_key_is_the_overrides_not_their_spelling():
    a = {"rollout_is": {"upper": 3, "lower": 0.5}, "epsilon": 0.1}
    b = {"epsilon": 0.1, "rollout_is": {"lower": 0.5, "upper": 3}}
    assert variant_key(a) == variant_key(b)
    assert variant_key(a) != variant_key({**a, "epsilon": 0.2})
    assert variant_label(a) == "epsilon=0.1, rollout_is.lower=0.5, rollout_is.upper=3"
    assert variant_label({"loss_type": "dr_grpo", "x": None, "y": [1, 2]}) == 'loss_type=dr_grpo, x=null, y=[1, 2]'


def test_what_if_writes_its_own_directory_and_leaves_the_runs_metrics(run):
    plain = recompute(run, result=True)
    before = _own(run)
    res = recompute(run, overrides={"epsilon": 0.05}, result=True)
    v = Variant.of(run, {"epsilon": 0.05})
    assert res.out_dir == run / "grpolens" / "variants" / v.key and res.variant == v
    assert _own(run) == before  # not one byte of the run's own outputs changed
    on_disk = pl.read_parquet(res.out_dir / "metrics.parquet")
    assert_frame_equal(on_disk, recompute(run, overrides={"epsilon": 0.05}, write=False, incremental=False))
    # the what-if is a what-if: a narrower clip range clips more tokens
    assert (on_disk["clip/region"] >= plain.metrics["clip/region"]).all()
    assert not on_disk["clip/region"].equals(plain.metrics["clip/region"])
    rec = json.loads((res.out_dir / VARIANT_FILE).read_text())
    assert rec == {"key": v.key, "label": "epsilon=0.05", "overrides": {"epsilon": 0.05}}
    lines = [json.loads(x) for x in (res.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert {"top_tokens.parquet", "completions.parquet"} <= {p.name for p in res.out_dir.iterdir()}
    assert not list((run / "grpolens").rglob("*.tmp"))


def test_plain_recompute_after_a_what_if_reuses_its_own_cache(run):
    recompute(run)
    recompute(run, overrides={"epsilon": 0.05})
    again = recompute(run, result=True)
    assert again.out_dir == run / "grpolens" and again.computed_steps == [] and again.reused_steps == [0, 1, 2]
    # and the what-if its own: each keeps a per-step cache
    what_if = recompute(run, overrides={"epsilon": 0.05}, result=True)
    assert what_if.computed_steps == [] and what_if.reused_steps == [0, 1, 2]
    assert (what_if.out_dir / "cache" / "steps-grpolens.parquet").is_file()


def test_config_file_and_set_spelling_the_same_overrides_are_one_variant(run, tmp_path):
    f = tmp_path / "eps.json"
    f.write_text(json.dumps({"epsilon": 0.05}))
    a = recompute(run, config_file=f, result=True)
    b = recompute(run, overrides={"epsilon": 0.05}, result=True)
    assert a.out_dir == b.out_dir and b.computed_steps == []
    # --set over --config: the merged mapping is the variant
    c = recompute(run, config_file=f, overrides={"epsilon_high": 0.3}, result=True)
    assert c.variant.overrides == {"epsilon": 0.05, "epsilon_high": 0.3}
    assert sorted(v.label for v in list_variants(run)) == ["epsilon=0.05", "epsilon=0.05, epsilon_high=0.3"]


def test_profile_of_a_variant_goes_below_it(run):
    res = recompute(run, profile="verl", overrides={"epsilon": 0.05}, result=True)
    assert res.out_dir == run / "grpolens" / "variants" / variant_key({"epsilon": 0.05}) / "verl"
    assert not (run / "grpolens" / "verl").exists()


def test_explicit_out_keeps_its_meaning(run, tmp_path):
    recompute(run)
    before = _own(run)
    res = recompute(run, out=tmp_path / "mine", overrides={"epsilon": 0.05}, result=True)
    assert res.out_dir == tmp_path / "mine" and (tmp_path / "mine" / "metrics.parquet").is_file()
    assert _own(run) == before and not (run / "grpolens" / "variants").exists()
    # nor is the run's per-step cache replaced by the what-if's rows
    assert recompute(run, result=True).computed_steps == []


def test_variant_run_recomputes_and_reads_as_the_variant(run):
    recompute(run, overrides={"epsilon": 0.05})
    (v,) = list_variants(run)
    p = variant_run(v)
    assert p == p and p != run and hash(p) != hash(run)  # a run and its variant are two dictionary keys
    res = recompute(p, result=True)  # the dashboard's refresh of a variant
    assert res.out_dir == v.dir and res.computed_steps == []
    assert (p / "tokens").exists() and getattr(p / "tokens", "variant", None) is None


def test_find_variant_by_key_prefix_or_label_and_one_line_otherwise(run):
    recompute(run, overrides={"epsilon": 0.05})
    recompute(run, overrides={"epsilon": 0.3})
    a, b = list_variants(run)
    assert find_variant(run, a.key) == a and find_variant(run, a.key[:6]) == a
    assert find_variant(run, "epsilon=0.3") == b
    with pytest.raises(UserError) as e:
        find_variant(run, "epsilon=9")
    assert "no such variant" in str(e.value) and "epsilon=0.05" in str(e.value) and "\n" not in str(e.value)


def test_damaged_or_moved_variant_directories_are_not_listed(run):
    recompute(run, overrides={"epsilon": 0.05})
    (v,) = list_variants(run)
    other = v.dir.parent / "0123456789ab"
    other.mkdir()
    (other / VARIANT_FILE).write_bytes(v.record())  # its record names another key
    (v.dir.parent / "junk").mkdir()
    (v.dir.parent / "junk" / VARIANT_FILE).write_text("{not json")
    assert list_variants(run) == [v]


def test_is_weights_of_a_what_if_go_beside_it(tmp_path):
    run = write_run(tmp_path / "run", random_calls(np.random.default_rng(4), steps=(0,)),
                    config={"rollout_is": {"mode": "truncate", "upper": 2.0}})
    r = _cli("recompute", run, "--set", "rollout_is.upper=1.5", "--is-weights", "-q")
    assert r.returncode == 0, r.stderr
    v = Variant.of(run, {"rollout_is": {"upper": 1.5}})
    assert list((v.dir / "is_weights").rglob("*.parquet"))
    assert not (run / "grpolens" / "is_weights").exists()


def test_cli_what_if_then_check_and_errors(run):
    r = _cli("recompute", run, "--set", "epsilon=0.05", "--last", "1")
    assert r.returncode == 0, r.stderr
    key = variant_key({"epsilon": 0.05})
    assert f"what-if variant {key} (epsilon=0.05)" in r.stderr
    assert (run / "grpolens" / "variants" / key / "metrics.parquet").is_file()
    assert not (run / "grpolens" / "metrics.parquet").exists()  # no plain recompute was asked for
    r = _cli("check", run, "--variant", "epsilon=0.05", "--json")
    assert r.returncode in (0, 1), r.stderr
    assert json.loads(r.stdout)
    r = _cli("check", run, "--variant", "nope")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "'nope'" in r.stderr and "no such variant" in r.stderr
    r = _cli("check", run, "--variant", key, "--set", "epsilon=0.1")
    assert r.returncode == 2 and "choose one" in r.stderr


def test_check_of_a_variant_is_the_check_of_its_overrides(run):
    from grpolens.check.runner import check

    recompute(run, overrides={"epsilon": 0.05})
    (v,) = list_variants(run)
    by_set = check(run, overrides={"epsilon": 0.05})
    plain = check(run)
    from grpolens.commands.variant_option import variant_overrides

    overrides, got = variant_overrides(str(run), v.key, [])
    assert got == v and overrides == {"epsilon": 0.05}
    via = check(run, overrides=overrides)
    assert [(o.rule.name, o.status, o.value) for o in via.outcomes] == [(o.rule.name, o.status, o.value) for o in by_set.outcomes]
    assert [o.value for o in via.outcomes] != [o.value for o in plain.outcomes]
