"""``grpolens check``: a failing rule is explained at its first failing step -- the planted token
named in the terminal, JUnit, GitHub and Markdown reports -- and a passing one is not."""

from __future__ import annotations

import json

import numpy as np

from grpolens.cli import main
from tests.explain.runs import random_step, write_run
from tests.explain.test_explain_recall import PLANTED, _kl, _plant_tokens

RULES = '''
[[rule]]
name = "KL bound"
metric = "kl/k3"
direction = "upper"
max = {bound}
'''


def _check(capsys, *args):
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().out


def test_a_failing_rule_names_its_top_contributors_everywhere(tmp_path, capsys):
    rng = np.random.default_rng(5)
    steps = {s: random_step(rng, s, groups=6, max_len=40) for s in range(3)}
    _plant_tokens(_kl)(steps[2])
    run = write_run(tmp_path / "run", steps)
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES.format(bound=0.02))
    junit, md = tmp_path / "junit.xml", tmp_path / "summary.md"
    code, out = _check(capsys, "check", run, "--rules", rules, "--junit", junit, "--summary-md", md, "--github")
    assert code == 1
    said = f"from token `⟨{PLANTED}⟩` in 3 completions of 3 prompts"
    assert "kl/k3" in out and said in out  # the ::error annotation and the table's why line
    assert "why: kl/k3" in out and "at step 2 (+" in out
    assert said in junit.read_text()
    assert "why:" in md.read_text() and f"⟨{PLANTED}⟩" in md.read_text()
    code, out = _check(capsys, "check", run, "--rules", rules, "--json")
    rows = json.loads(out)
    assert said in rows[0]["why"]
    code, out = _check(capsys, "check", run, "--rules", rules, "--no-explain", "--json")
    assert json.loads(out)[0]["why"] is None


def test_a_passing_rule_is_not_explained(tmp_path, capsys):
    rng = np.random.default_rng(5)
    run = write_run(tmp_path / "run", {s: random_step(rng, s) for s in range(2)})
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES.format(bound=10.0))
    code, out = _check(capsys, "check", run, "--rules", rules, "--json")
    assert code == 0 and json.loads(out)[0]["why"] is None
