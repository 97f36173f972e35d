"""Profiles as registered objects: what the CLI and docs say comes from the registry, families never
branch on a trainer, and a profile from another package loads through the ``grpolens.plugins``
entry-point group without editing grpolens."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpolens import plugins
from grpolens.metrics.catalogue import PROFILES_BEGIN, PROFILES_END, profiles_markdown
from grpolens.metrics.profile import PROFILES, Profile
from grpolens.metrics.registry import REGISTRY
from grpolens.profiles import builtin_names

ROOT = Path(__file__).resolve().parents[2]


def test_docs_profiles_table_is_generated():
    text = (ROOT / "docs" / "profiles.md").read_text()
    block = text[text.index(PROFILES_BEGIN):text.index(PROFILES_END) + len(PROFILES_END)]
    assert block == profiles_markdown(), (
        "docs/profiles.md is stale: replace its table with the output of `grpolens metrics --profiles`")


def test_profile_help_and_choices_come_from_the_registry():
    plugins.load_plugins()
    assert set(builtin_names()) <= set(PROFILES)
    assert builtin_names()[0] == "grpolens"
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "recompute", "--help"], capture_output=True, text=True,
                       env={"COLUMNS": "400", "PATH": "", "PYTHONPATH": str(ROOT)})
    for name in builtin_names():
        assert name in r.stdout, name
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "metrics", "--profile", "nosuch"],
                       capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--profile: unknown profile 'nosuch'; choose one of grpolens" in r.stderr + r.stdout


def test_families_never_branch_on_a_trainer():
    names = "|".join(re.escape(n) for n in PROFILES if n != "grpolens")
    pattern = re.compile(rf"sd\.profile\s*(==|!=|in)\s|[\"']({names})[\"']")
    hits = []
    for p in sorted((ROOT / "grpolens" / "metrics").glob("*.py")):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and not code.lstrip().startswith(("\"", "'")):
                hits.append(f"{p.name}:{i}: {line.strip()}")
    assert not hits, "trainer branches in the metrics layer:\n" + "\n".join(hits)


def test_a_profile_may_only_name_registered_metrics():
    from grpolens.metrics.registry import apply_profiles

    bad = Profile("tests-bad", "a profile naming a metric that does not exist", names={"no/such/metric": "x"})
    PROFILES[bad.name] = bad
    try:
        with pytest.raises(ValueError, match="names unknown metrics"):
            apply_profiles()
    finally:
        del PROFILES[bad.name]


def test_a_third_party_profile_loads_through_the_entry_point_group(tmp_path):
    pkg = tmp_path / "site"
    (pkg / "acme_grpolens").mkdir(parents=True)
    (pkg / "acme_grpolens" / "__init__.py").write_text(
        "from grpolens.metrics.profile import Profile, register_profile\n"
        "register_profile(Profile('acme', 'Acme trainer', names={'entropy': 'acme/entropy', 'kl/k3': 'acme/kl'}))\n")
    dist = pkg / "acme_grpolens-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-grpolens\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[grpolens.plugins]\nacme = acme_grpolens\n")
    code = ("import grpolens, sys\n"
            "from grpolens.adapters.synth import synth_run\n"
            f"run = synth_run({str(tmp_path / 'run')!r}, steps=2, max_len=8)\n"
            "df = grpolens.recompute(run, profile='acme', write=False)\n"
            "print(sorted(df.columns))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": f"{ROOT}:{pkg}", "PATH": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "['acme/entropy', 'acme/kl', 'step']"


def test_profile_registry_rules():
    from grpolens.metrics.profile import get_profile, register_profile

    with pytest.raises(ValueError, match=r"^profile tests-x: unknown token_mean 'per_rank'$"):
        Profile("tests-x", "t", token_mean="per_rank")
    p = Profile("tests-x", "t", token_mean="pack_mean", names={"entropy": "x/entropy"})
    # the names a profile logs are Metric.name_in's (test_a_canonical_profile_names_every_metric_by_its_own_name)
    assert REGISTRY["kl/k3"].name_in("grpolens") == "kl/k3"  # the default profile: every name is its own
    try:
        assert register_profile(p) is p and register_profile(p) is p  # a module imported again: the same object
        assert get_profile("tests-x") is p
        with pytest.raises(ValueError, match=r"^profile tests-x registered twice$"):
            register_profile(Profile("tests-x", "another"))
        assert PROFILES["tests-x"] is p
    finally:
        del PROFILES["tests-x"]
    with pytest.raises(KeyError, match=r"unknown profile 'tests-x'; choose one of grpolens, "):
        get_profile("tests-x")


@pytest.fixture
def registry():
    """The loaded metric registry, restored after the test (a test profile or metric must not leak)."""
    from grpolens.metrics import registry as reg

    plugins.load_plugins()
    saved, origin = dict(reg.REGISTRY), dict(reg._ORIGIN)
    yield reg
    reg.REGISTRY.clear()
    reg.REGISTRY.update(saved)
    reg._ORIGIN.clear()
    reg._ORIGIN.update(origin)


def test_a_profile_naming_unknown_metrics_is_refused_with_the_first_five(registry, monkeypatch):
    names = {f"no/such/{i}": f"x/{i}" for i in range(7)}  # seven: the message lists the first five, sorted
    monkeypatch.setitem(PROFILES, "tests-bad", Profile("tests-bad", "t", names={"entropy": "x/entropy", **names}))
    with pytest.raises(ValueError) as e:
        registry.apply_profiles()
    assert str(e.value) == ("profile tests-bad: names unknown metrics "
                            "['no/such/0', 'no/such/1', 'no/such/2', 'no/such/3', 'no/such/4']")


@pytest.mark.parametrize("rule", [
    {"reductions": {"kl/k3": lambda sd: 0.0}},
    {"zero_when_empty": frozenset({"kl/k3"})},
    {"generation_only": frozenset({"kl/k3"})},
], ids=["reductions", "zero_when_empty", "generation_only"])
def test_a_profile_rule_for_a_metric_it_does_not_name_is_refused(registry, monkeypatch, rule):
    # each rule set on its own: a rule in any one of them needs the metric in the profile's names
    monkeypatch.setitem(PROFILES, "tests-bad", Profile("tests-bad", "t", names={"entropy": "x/entropy"}, **rule))
    with pytest.raises(ValueError) as e:
        registry.apply_profiles()
    assert str(e.value) == "profile tests-bad: kl/k3 has a rule but no name in the profile"


def test_a_profile_name_for_a_template_must_keep_the_placeholder(registry, monkeypatch):
    monkeypatch.setitem(PROFILES, "tests-bad",
                        Profile("tests-bad", "t", names={"rewards/<name>/mean": "x/accuracy_mean"}))
    with pytest.raises(ValueError) as e:
        registry.apply_profiles()
    assert str(e.value) == "profile tests-bad: template rewards/<name>/mean needs <name> in 'x/accuracy_mean'"


def _metric_named_by_itself(registry):
    """A plugin metric that declares its own name for profile tests-p."""
    return registry.register(registry.Metric("tests/own", family="health", doc="t", kind="custom",
                                             fn=lambda sd: 0.0, names={"tests-p": "x/own"}))


def test_a_profile_must_agree_with_the_name_a_metric_declares_for_it(registry, monkeypatch):
    _metric_named_by_itself(registry)
    monkeypatch.setitem(PROFILES, "tests-p", Profile("tests-p", "t", names={"tests/own": "x/other"}))
    with pytest.raises(ValueError) as e:
        registry.apply_profiles()
    assert str(e.value) == "profile tests-p: tests/own is named 'x/other' and 'x/own'"


def test_applying_the_profiles_again_keeps_every_metric_as_it_is(registry, monkeypatch):
    # load_plugins applies the profiles on every call: a metric that already carries a profile's name
    # (declared by itself, or given by an earlier call) is kept, not rebuilt
    own = _metric_named_by_itself(registry)
    monkeypatch.setitem(PROFILES, "tests-p", Profile("tests-p", "t", names={"tests/own": "x/own"}))
    registry.apply_profiles()
    assert registry.REGISTRY["tests/own"] is own
    before = dict(registry.REGISTRY)
    registry.apply_profiles()
    assert [k for k, m in registry.REGISTRY.items() if m is not before[k]] == []


def test_a_malformed_metric_is_refused_naming_it_and_leaves_the_registry_as_it_was(registry):
    # what a plugin author sees for each mistake, word for word
    Metric = registry.Metric
    cases = [
        (Metric("tests/k", "health", "t", kind="mean", num="x"), "metric tests/k: unknown kind 'mean'"),
        (Metric("tests/c", "health", "t", kind="custom"), "metric tests/c: custom metrics need fn"),
        (Metric("tests/s", "health", "t", kind="sum"), "metric tests/s: kind sum needs num"),
        (Metric("entropy", "health", "t", kind="custom", fn=lambda sd: 0.0), "metric entropy registered twice"),
        # a template must be custom (its fn takes the column) and keep <name> in every name
        (Metric("tests/<name>/n", "rewards", "t", kind="sum", num="x", per_column="reward/"),
         "metric tests/<name>/n: a template must be custom and have <name> in every name"),
        (Metric("tests/<name>/c", "rewards", "t", kind="custom", fn=lambda sd, column: 0.0, per_column="reward/",
                names={"trl": "x/c"}),
         "metric tests/<name>/c: a template must be custom and have <name> in every name"),
    ]
    before = dict(registry.REGISTRY)
    for metric, message in cases:
        with pytest.raises(ValueError) as e:
            registry.register(metric)
        assert str(e.value) == message
    assert registry.REGISTRY == before
    assert registry.REGISTRY["entropy"] is before["entropy"]


def test_a_family_is_registered_once_on_a_page_of_the_dashboard():
    from grpolens.metrics.registry import FAMILIES, Family, register_family

    with pytest.raises(ValueError) as e:
        Family("tests-f", page="overview")
    assert str(e.value) == "family tests-f: page must be one of policy, mismatch, rewards, health, got 'overview'"
    health = FAMILIES["health"]
    assert register_family(health) is health  # the module imported again: the same object
    with pytest.raises(ValueError) as e:
        register_family(Family("health", page="policy"))
    assert str(e.value) == "family health registered twice"
    assert FAMILIES["health"] is health


def test_a_canonical_profile_names_every_metric_by_its_own_name(registry, monkeypatch):
    # a plugin profile may log everything under the canonical names, as the default profile does
    monkeypatch.setitem(PROFILES, "tests-canon", Profile("tests-canon", "t", canonical=True))
    monkeypatch.setitem(PROFILES, "tests-p", Profile("tests-p", "t", names={"entropy": "x/entropy"}))
    registry.apply_profiles()
    entropy, kl = registry.REGISTRY["entropy"], registry.REGISTRY["kl/k3"]
    assert (entropy.name_in("tests-canon"), kl.name_in("tests-canon")) == ("entropy", "kl/k3")
    assert (entropy.name_in("tests-p"), kl.name_in("tests-p")) == ("x/entropy", None)
    assert entropy.name_in("no-such-profile") is None  # not registered: logs nothing


def test_the_default_profiles_names_before_any_profile_is_loaded():
    # the metrics layer alone (no plugins loaded, so no profile registered): "grpolens" is still
    # the canonical names
    code = ("from grpolens.metrics.registry import PROFILES, load_families\n"
            "reg = load_families()\n"
            "assert not PROFILES, PROFILES\n"
            "print(reg['entropy'].name_in('grpolens'), reg['kl/k3'].name_in('grpolens'), reg['kl/k3'].name_in('trl'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["entropy", "kl/k3", "None"]
