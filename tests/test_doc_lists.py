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


def test_builtin_check_rules_are_in_the_table():
    from grpolens.check.rules import default_rules

    table = (DOCS / "check.md").read_text(encoding="utf-8").split("## Built-in rules", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    missing = []
    for rule in default_rules().rules:
        if rule.metric == "*":  # the general "finite metrics" rule is described in prose
            continue
        if not any(f"`{rule.metric}`" in row for row in rows):
            missing.append(f"{rule.name} ({rule.metric})")
    assert not missing, f"docs/check.md's built-in rules table lacks {missing}"


def test_dashboard_pages_match_the_layout():
    from grpolens.serve.layout import PAGES

    section = (DOCS / "serve.md").read_text(encoding="utf-8").split("## Pages", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| \*\*([^*]+)\*\* \|", section, re.M)
    assert documented == [label for _, label in PAGES], "docs/serve.md's Pages table and serve/layout.PAGES differ"
