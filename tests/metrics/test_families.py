"""Family metadata lives next to the formulas: every family is on a dashboard page, and what it
declares (key metrics, overview slots, check rules) names metrics that exist."""

import fnmatch
import re

from grpolens.check.rules import default_rules
from grpolens.metrics.registry import FAMILIES, PAGES, REGISTRY
from grpolens.plugins import load_plugins


def test_every_family_is_on_a_page():
    load_plugins()
    families = {m.family for m in REGISTRY.values()}
    missing = sorted(families - set(FAMILIES))
    assert not missing, f"families with metrics but no register_family(Family(..., page=...)): {missing}"
    assert all(f.page in PAGES for f in FAMILIES.values())


def test_declared_metadata_names_registered_metrics():
    load_plugins()
    for f in FAMILIES.values():
        for k in f.key_metrics:
            assert k in REGISTRY and REGISTRY[k].family == f.name, (f.name, k)
        for _, label, patterns in f.overview:
            assert any(re.search(p, n) for p in patterns for n in REGISTRY), (f.name, label)
    for rule in default_rules().rules:
        assert fnmatch.filter(REGISTRY, rule.metric), rule.name


def test_overview_slots_and_rules_come_from_the_families():
    from grpolens.check.defaults import DEFAULT_RULES_TOML
    from grpolens.serve import data

    load_plugins()
    assert [label for label, _ in data.overview_slots()][:2] == ["reward", "KL to reference"]
    for f in FAMILIES.values():
        for name in re.findall(r'^name = "(.*)"$', f.rules, re.M):
            assert f'name = "{name}"' in DEFAULT_RULES_TOML, name
    assert data.page_families()["mismatch"] == ("rollout_is",)
