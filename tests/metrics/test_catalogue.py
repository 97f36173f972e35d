"""The metric catalogue: every registered metric is documented, and ``docs/metrics.md`` is exactly
what ``grpolens metrics --markdown`` prints (regenerate it with
``grpolens metrics --markdown > docs/metrics.md`` after adding or changing a metric)."""

import json
import subprocess
import sys
from pathlib import Path

from grpolens.metrics.catalogue import catalogue_markdown, catalogue_rows
from grpolens.metrics.registry import PLACEHOLDER, PROFILES
from grpolens.plugins import load_plugins

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_every_metric_is_documented():
    reg = load_plugins()
    assert reg, "no metric registered"
    undocumented = [m.name for m in reg.values() if len((m.doc or "").strip()) < 10]
    assert not undocumented, f"metrics without a doc: {undocumented}"
    nameless = [m.name for m in reg.values() if not m.family or not m.name]
    assert not nameless, f"metrics without a family: {nameless}"
    for m in reg.values():
        assert set(m.names) <= set(PROFILES), m.name
        if m.per_column is not None:
            assert all(PLACEHOLDER in n for n in (m.name, *m.names.values())), m.name


def test_catalogue_lists_every_metric_once():
    reg = load_plugins()
    rows = catalogue_rows()
    assert sorted(r["name"] for r in rows) == sorted(reg)
    md = catalogue_markdown(rows)
    for name in reg:
        assert md.count(f"\n| `{name}` |") == 1, name


def test_docs_metrics_md_is_generated():
    # A fresh process, as a user runs it: inside pytest, a test that imported one family module
    # early would change the registry's order.
    out = subprocess.run([sys.executable, "-m", "grpolens.cli", "metrics", "--markdown"],
                         capture_output=True, text=True, cwd=DOC.parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# Metric catalogue\n") and out.stdout.endswith("|\n\n")
    assert DOC.is_file(), "docs/metrics.md missing: run `grpolens metrics --markdown > docs/metrics.md`"
    assert DOC.read_text() == out.stdout, (
        "docs/metrics.md is stale: regenerate it with `grpolens metrics --markdown > docs/metrics.md`")


_ORDER = """
import importlib, json, sys
from grpolens.metrics import FAMILY_MODULES
from grpolens.metrics.registry import Metric, load_families, register
for m in FAMILY_MODULES[::int(sys.argv[1])]:
    importlib.import_module(f"grpolens.metrics.{m}")
register(Metric("tests/plugin", "health", "a metric registered outside the built-in modules", kind="sum", num="x"))
print(json.dumps(list(load_families())))
"""


def test_registry_order_does_not_depend_on_import_order():
    # Fresh processes importing the family modules first to last and last to first: the same
    # order, family module by family module (as FAMILY_MODULES lists them), then a plugin's metric.
    def order(step: int) -> list[str]:
        r = subprocess.run([sys.executable, "-c", _ORDER, str(step)], capture_output=True, text=True,
                           env={"PYTHONPATH": str(DOC.parents[1])})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    forward, backward = order(1), order(-1)
    assert backward == forward
    # health is the first family module, and within a module the metrics keep the order it registers them in
    assert forward[:3] == ["health/tokens", "health/masked_tokens", "health/sequences"]
    assert forward[-1] == "tests/plugin"


def test_resolve_finds_aliases_and_template_instances():
    import pytest

    from grpolens.metrics.registry import resolve

    assert resolve("entropy").name == "entropy"
    assert resolve("train/entropy").name == "entropy"
    m = resolve("rewards/accuracy/mean")
    assert m.name == "rewards/accuracy/mean" and m.per_column is None
    from grpolens import plugins

    plugins.load_plugins()  # the profiles' names are suggested too
    with pytest.raises(KeyError) as e:
        resolve("entropyy")
    head, _, close = e.value.args[0].partition("; did you mean ")
    suggested = close.removesuffix("?").split(", ")
    assert head == "unknown metric 'entropyy'" and suggested[0] == "entropy"
    assert len(suggested) == 3 and len(set(suggested)) == 3  # each name once (it was "entropy, entropy, ...")
    with pytest.raises(KeyError) as e:
        resolve("no such thing at all")
    assert e.value.args[0] == "unknown metric 'no such thing at all'"


def test_the_catalogue_filters_by_family_and_by_profile():
    from grpolens import plugins

    plugins.load_plugins()  # the profiles' names, as `grpolens metrics` loads them
    every = catalogue_rows()
    families = list(dict.fromkeys(r["family"] for r in every))
    # the first, a middle and the last family: a filter that stopped at the first mismatch would
    # return nothing for the later ones
    for family in (families[0], families[len(families) // 2], families[-1]):
        got = catalogue_rows(family=family)
        assert got and got == [r for r in every if r["family"] == family]
    trl = catalogue_rows(profile="trl")
    assert trl == [r for r in every if "trl" in r["names"]] and 0 < len(trl) < len(every)
    # each profile's own name for a metric, and only the profiles that log it
    by_name = {r["name"]: r for r in every}
    assert by_name["entropy"]["names"]["maxent"] == "train/policy_entropy"
    assert by_name["entropy"]["names"]["trl"] == "entropy"
    assert by_name["kl/k1"]["names"] == {"grpolens": "kl/k1"}
    assert [r["name"] for r in catalogue_rows(family="kl", profile="trl")] == [
        r["name"] for r in trl if r["family"] == "kl"]


def test_the_markdown_catalogue_of_one_family_lists_that_family_only():
    out = subprocess.run([sys.executable, "-m", "grpolens.cli", "metrics", "--family", "kl", "--markdown"],
                         capture_output=True, text=True, cwd=DOC.parents[1])
    assert out.returncode == 0, out.stderr
    headings = [line for line in out.stdout.splitlines() if line.startswith("## ")]
    listed = [line.split("`")[1] for line in out.stdout.splitlines() if line.startswith("| `")]
    assert headings == ["## kl"]
    assert listed == [r["name"] for r in catalogue_rows(family="kl")] and "kl/k3" in listed


def test_resolve_an_ambiguous_trainer_name_prefers_the_first_profile_that_uses_it(monkeypatch):
    import pytest

    from grpolens import plugins
    from grpolens.metrics import registry
    from grpolens.metrics.profile import PROFILES, Profile

    plugins.load_plugins()
    saved = dict(registry.REGISTRY)
    # twinkle logs two metrics as train/clip_ratio_low: the first of them in the registry
    assert registry.resolve("train/clip_ratio_low").name == "clip/low"
    # two profiles, one name for different metrics: the profile registered first wins, though the
    # other's metric (entropy) comes first in the registry
    assert list(registry.REGISTRY).index("entropy") < list(registry.REGISTRY).index("kl/k3")
    monkeypatch.setitem(PROFILES, "tests-first", Profile("tests-first", "t", names={"kl/k3": "x/shared"}))
    monkeypatch.setitem(PROFILES, "tests-second", Profile("tests-second", "t", names={"entropy": "x/shared"}))
    try:
        registry.apply_profiles()
        assert registry.resolve("x/shared").name == "kl/k3"
    finally:
        registry.REGISTRY.clear()
        registry.REGISTRY.update(saved)
    with pytest.raises(KeyError, match="^\"unknown metric 'x/shared'"):
        registry.resolve("x/shared")


def test_resolve_a_template_name_needs_a_column_part():
    import pytest

    from grpolens import plugins
    from grpolens.metrics.registry import resolve

    plugins.load_plugins()
    m = resolve("train/accuracy_reward")  # twinkle's name of twinkle/reward/<name>
    assert (m.name, m.column, m.template) == ("twinkle/reward/accuracy", "reward/accuracy", "twinkle/reward/<name>")
    m = resolve("train/rewards/format/std")  # maxent's name of rewards/<name>/std_pop
    assert (m.name, m.column) == ("rewards/format/std_pop", "reward/format")
    # the template's head and tail with nothing (or less than nothing: they share a "/") between them
    for name in ("rewards//mean", "rewards/mean"):
        with pytest.raises(KeyError) as e:
            resolve(name)
        assert e.value.args[0].startswith(f"unknown metric {name!r}; did you mean "), e.value.args[0]


def test_resolve_suggests_the_three_closest_names():
    import pytest

    from grpolens import plugins
    from grpolens.metrics.registry import resolve

    plugins.load_plugins()
    with pytest.raises(KeyError) as e:
        resolve("clip_ratio")  # more than three names are close to it
    assert e.value.args[0] == ("unknown metric 'clip_ratio'; did you mean "
                               "train/clip_ratio, cispo_clip_ratio, clip_ratio/low_min?")
