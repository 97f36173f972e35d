"""Lists the docs give that the code also knows are compared with the code's own lists.

(The catalogue, the CLI reference and the profiles page are generated; these are the lists that
live in prose: a value the code accepts but no page mentions, or a page naming a value the code no
longer has, fails here.)
"""

import re
from pathlib import Path

import pytest

from grpolens.run import config as run_config

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _code_spans(page: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", (DOCS / page).read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", ["run-format.md", "rollout-is.md"])
def test_every_rollout_is_mode_is_documented(page):
    missing = [m for m in run_config.IS_MODES if m not in _code_spans(page)]
    assert not missing, f"docs/{page} does not name the rollout-IS mode(s) {missing}"


def test_every_rollout_is_key_and_filter_is_documented():
    spans = _code_spans("rollout-is.md")
    # a key may be shown alone or as the head of a `key: value` / `key=value` example
    words = spans | {re.split(r"[=:\s]", s, 1)[0] for s in spans} | {s.rsplit(".", 1)[-1] for s in spans}
    missing = sorted(k for k in run_config._RIS_KEYS if k not in words and not any(k in s for s in spans))
    assert not missing, f"docs/rollout-is.md does not name the rollout_is key(s) {missing}"
    text = (DOCS / "rollout-is.md").read_text(encoding="utf-8") + (DOCS / "run-format.md").read_text(encoding="utf-8")
    missing = [o for o in run_config.RS_OPTIONS
               if o not in text and not re.search(re.escape(o.rsplit("_", 1)[0]) + r"_k\d(/k\d)*", text)]
    assert not missing, f"neither docs/rollout-is.md nor docs/run-format.md names the rejection filter(s) {missing}"


def test_every_loss_type_is_documented():
    text = (DOCS / "run-format.md").read_text(encoding="utf-8") + (DOCS / "metrics.md").read_text(encoding="utf-8")
    missing = [t for t in run_config.LOSS_TYPES if f"`{t}`" not in text]
    assert not missing, f"docs/run-format.md and docs/metrics.md do not name the loss type(s) {missing}"


def _bounds(rule) -> list[str]:
    """The table's cells for a rule's thresholds, written from the rule itself."""
    g = "{:g}".format
    cells = []
    if rule.early is not None:
        e = rule.early
        cells.append(f"≤ {g(e.factor)} × early + {g(e.abs)}" if rule.direction == "upper"
                     else f"≥ early / {g(e.factor)}" + (f" + {g(e.abs)}" if e.abs else ""))
    if rule.sustained is not None:
        cells.append(f"sustained: {rule.sustained.count} of any {rule.sustained.window} consecutive steps")
    if rule.rel is not None:
        cells.append(f"≤ {g(1 + rule.rel)} b + {g(rule.abs)}" if rule.direction == "upper" else f"≥ {g(1 - rule.rel)} b")
    if rule.max is not None and rule.min is None and rule.max == 0:
        cells.append("= 0")
    if rule.finite:
        cells.append("finite")
    return cells


def test_builtin_check_rules_are_in_the_table():
    """Every built-in rule has a row naming its metric, and the row's thresholds are the rule's
    (factor, floor, sustained window, baseline bounds); the prose's numbers about them too."""
    from grpolens.check.rules import default_rules

    text = (DOCS / "check.md").read_text(encoding="utf-8")
    table = text.split("## Built-in rules", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    missing, wrong = [], []
    rules = default_rules().rules
    for rule in rules:
        row = next((r for r in rows if f"`{rule.metric}`" in r), None)
        if row is None:
            missing.append(f"{rule.name} ({rule.metric})")
            continue
        wrong += [f"{rule.name}: {cell!r} not in {row[:80]!r}…" for cell in _bounds(rule) if cell not in row]
        if rule.early is not None and rule.direction == "upper" and "leaves room" in row:
            assert f"{rule.early.factor:g}× leaves room" in row, row
    assert not missing, f"docs/check.md's built-in rules table lacks {missing}"
    assert not wrong, "docs/check.md's built-in rules table and the rules differ:\n" + "\n".join(wrong)
    flat = re.sub(r"\s+", " ", text)
    fractions = {r.early.fraction for r in rules if r.early is not None}
    assert len(fractions) == 1 and f"first {100 * fractions.pop():g} % of steps" in flat
    clip = [r for r in rules if r.metric in ("clip/low", "clip/high")]
    assert clip and all(r.sustained and r.early for r in clip)
    assert f"keep their floor of {100 * clip[0].early.abs:g} points" in flat
    assert f"only when {clip[0].sustained.count} of some {clip[0].sustained.window} consecutive steps" in flat


def test_dashboard_pages_match_the_layout():
    from grpolens.serve.layout import PAGES

    section = (DOCS / "serve.md").read_text(encoding="utf-8").split("## Pages", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| \*\*([^*]+)\*\* \|", section, re.M)
    assert documented == [label for _, label in PAGES], "docs/serve.md's Pages table and serve/layout.PAGES differ"


def test_every_storage_option_is_documented():
    from grpolens.run.storage import OPTION_KEYS

    text = re.sub(r"\s+", " ", (DOCS / "distributed.md").read_text(encoding="utf-8"))
    listed = text.split("`--storage-option key=value` (", 1)[1].split(")", 1)[0]
    assert re.findall(r"`(\w+)`", listed) == list(OPTION_KEYS), \
        "docs/distributed.md's list of --storage-option keys and run/storage.OPTION_KEYS differ"


def test_every_export_target_is_documented_with_its_extra():
    import tomllib

    from grpolens.export import TRACKERS

    text = (DOCS / "export.md").read_text(encoding="utf-8")
    synopsis = re.search(r"grpolens export RUN --to ([\w|]+)", text)
    assert synopsis and synopsis.group(1).split("|") == list(TRACKERS), "docs/export.md's --to list and TRACKERS differ"
    extras = tomllib.loads((DOCS.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for tracker in TRACKERS:
        assert f'`pip install "grpolens[{tracker}]"`' in text, f"docs/export.md does not say how to install {tracker}"
        assert tracker in extras, f"pyproject.toml has no extra {tracker!r}, which docs/export.md installs"


def test_families_token_metrics_names_exist():
    from grpolens.metrics.registry import FAMILIES, load_families

    load_families()
    first = (DOCS / "token-metrics.md").read_text(encoding="utf-8").split("metric families are recomputed", 1)[0]
    named = re.findall(r"`(\w+)`", first.rsplit("\n\n", 1)[-1])
    assert named and not set(named) - set(FAMILIES), \
        f"docs/token-metrics.md names families {named}; the registry has {list(FAMILIES)}"


def test_trl_versions_the_docs_name_are_the_ones_recorded_and_trained():
    """The TRL releases docs/integrations/trl.md and the trl profile say were run are the recorded
    runs under tests/data/ plus the release the dev extra pins (the one the suite trains)."""
    import tomllib

    from grpolens.metrics.registry import PROFILES, load_families

    recorded = sorted((p.name.split("-", 1)[1] for p in (DOCS.parent / "tests" / "data").glob("trl-*")),
                      key=lambda v: tuple(map(int, v.split("."))))
    project = tomllib.loads((DOCS.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    dev = project["optional-dependencies"]["dev"]
    trained = next(d.split("==", 1)[1] for d in dev if d.startswith("trl=="))
    text = re.sub(r"\s+", " ", (DOCS / "integrations" / "trl.md").read_text(encoding="utf-8"))
    m = re.search(r"Runs trained by TRL \*\*([\d., and]+)\*\* themselves", text)
    assert m and re.findall(r"\d+\.\d+\.\d+", m.group(1)) == recorded, \
        f"trl.md names {m and m.group(1)}; tests/data has {recorded}"
    assert f"the suite trains TRL **{trained}**" in text, f"the dev extra pins trl=={trained}"
    load_families()
    ran = re.search(r"\(run on ([\d., ]+)\)", PROFILES["trl"].reference)
    assert ran and ran.group(1).split(", ") == [*recorded, trained], PROFILES["trl"].reference
