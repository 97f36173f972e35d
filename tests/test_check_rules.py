"""Rules files: what parses into what, and every malformed file -> a UserError (exit 2) naming the
file, the line at fault, the rule and the key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from grpolens.check.rules import Early, Window, default_rules, load_rules, parse_rules
from grpolens.errors import UserError
from grpolens.metrics.registry import REGISTRY
from grpolens.plugins import load_builtins

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def parse(text: str, kind: str = "toml"):
    return parse_rules(textwrap.dedent(text), source="r.toml", kind=kind)


def error_of(text: str, kind: str = "toml") -> str:
    with pytest.raises(UserError) as e:
        parse(text, kind)
    assert e.value.exit_code == 2
    return e.value.message


def test_full_rule_parses():
    rs = parse("""
        baseline = "golden.json"

        [[rule]]
        name = "kl drift"
        metric = "train/entropy"          # an alias (twinkle's name) -> canonical
        reduce = "p95"
        window = { start = 5, end = -1 }
        direction = "upper"
        abs = 1e-4
        rel = 0.25
        min = 0.0
        max = 2
        finite = true
        early = { factor = 10, fraction = 0.25, abs = 0.01 }
        missing = "skip"
        why = "because"

        [[rule]]
        metric = "health/nonfinite/*"
        max = 0
        window = 20
        allow_fail_fraction = 0.05
    """)
    a, b = rs.rules
    assert (a.name, a.metric, a.reduce, a.direction) == ("kl drift", "entropy", "p95", "upper")
    assert a.window == Window(start=5, end=-1)
    assert (a.abs, a.rel, a.min, a.max, a.finite, a.missing, a.why) == (1e-4, 0.25, 0.0, 2.0, True, "skip", "because")
    assert a.early == Early(factor=10.0, fraction=0.25, abs=0.01)
    assert a.compares and a.absolute
    assert b.name == "health/nonfinite/* all" and b.window == Window(last=20) and b.is_glob
    assert b.allow_fail_fraction == 0.05 and not b.compares
    assert rs.baseline == Path(".") / "golden.json"


def test_builtin_rules_can_be_included():
    rs = parse("""
        builtin_rules = true
        [[rule]]
        metric = "entropy"
        name = "mine"
        min = 0.1
    """)
    assert [r.name for r in rs.rules] == [r.name for r in default_rules().rules] + ["mine"]


@pytest.mark.parametrize("text,line,fragments", [
    ("[[rule]]\nmetric = 'entropy'\nmin = = 1\n", 3, ["invalid TOML"]),
    ("[[rule]]\nmetric = 'entropy'\nreduce = 'avg'\nmin = 0\n", 3, ["rule 1", "reduce", "'avg'", "p95"]),
    ("[[rule]]\nmetric='entropy'\nmin=0\n\n[[rule]]\nname='x'\nmetric = 'entropie'\nmin=0\n", 7,
     ["rule 2 ('x')", "metric", "unknown metric 'entropie'", "did you mean"]),
    ("[[rule]]\nmetric='entropy'\nmaximum = 1\n", 3, ["unknown key 'maximum'", "did you mean 'max'"]),
    ("[[rule]]\nmetric='entropy'\nmin=0\ndirection = 'up'\n", 4, ["direction", "upper"]),
    ("[[rule]]\nmetric='entropy'\nrel = -0.1\n", 3, ["rel", ">= 0"]),
    ("[[rule]]\nmetric='entropy'\nabs = 'x'\n", 3, ["abs"]),
    ("[[rule]]\nmetric='entropy'\nmin = 2\nmax = 1\n", 3, ["min 2 is above max 1"]),
    ("[[rule]]\nmetric='entropy'\nmax=1\nwindow = { first = 3 }\n", 4, ["window", "unknown key 'first'"]),
    ("[[rule]]\nmetric='entropy'\nmax=1\nwindow = { last = 3, start = 1 }\n", 4, ["window", "'last' cannot"]),
    ("[[rule]]\nmetric='entropy'\nmax=1\nwindow = { start = 9, end = 3 }\n", 4, ["start 9 is after end 3"]),
    ("[[rule]]\nmetric='entropy'\nmax=1\nwindow = 'all'\n", 4, ["window"]),
    ("[[rule]]\nmetric='entropy'\nearly = { factor = 3 }\n", 1, ["needs a direction"]),
    ("[[rule]]\nmetric='entropy'\ndirection='upper'\nearly = { fraction = 0.2 }\n", 4, ["factor is required"]),
    ("[[rule]]\nmetric='entropy'\ndirection='upper'\nearly = { factor = 0.5 }\n", 4, ["factor must be"]),
    ("[[rule]]\nmetric='entropy'\nmax=1\nreduce='mean'\nallow_fail_fraction = 0.1\n", 5, ["only applies to reduce"]),
    ("[[rule]]\nmetric='entropy'\nmax=1\nallow_fail_fraction = 1.5\n", 4, ["[0, 1)"]),
    ("[[rule]]\nmetric='entropy'\nfinite = 'yes'\n", 3, ["finite", "true or false"]),
    ("[[rule]]\nmetric='entropy'\nmax=1\nno_data = 'skip'\n", 4, ["no_data", "'fail' or 'allow'"]),
    ("[[rule]]\nmetric='entropy'\nreduce='mean'\n", 1, ["no check"]),
    ("[[rule]]\nmin = 0\n", 1, ["metric", "required"]),
    ("[[rule]]\nmetric='nope/*'\nmax=0\n", 2, ["matches no registered metric"]),
    ("[[rule]]\nname='a'\nmetric='entropy'\nmax=1\n[[rule]]\nname = 'a'\nmetric='entropy'\nmax=2\n", 6, ["duplicate rule name 'a'"]),
    ("rules = 3\n", 1, ["unknown top-level key 'rules'", "did you mean 'rule'"]),
    ("# nothing\n", None, ["no rules"]),
])
def test_malformed_rules_name_the_line(text, line, fragments):
    msg = error_of(text)
    prefix = f"r.toml:{line}:" if line else "r.toml:"
    assert msg.startswith(prefix), msg
    for f in fragments:
        assert f in msg, (f, msg)


def test_generated_names_are_made_unique():
    rs = parse("[[rule]]\nmetric='entropy'\nmin=0\n[[rule]]\nmetric='entropy'\nmax=3\n")
    assert [r.name for r in rs.rules] == ["entropy all", "entropy all #2"]


def test_yaml_rules_and_errors():
    pytest.importorskip("yaml")
    rs = parse("""
        rule:
          - metric: entropy
            reduce: mean
            window: {last: 5}
            min: 0.05
    """, kind="yaml")
    assert rs.rules[0].window == Window(last=5) and rs.rules[0].min == 0.05
    assert error_of("rule:\n  - metric: entropy\n    min: [1\n", kind="yaml").startswith("r.toml:4: invalid YAML")
    msg = error_of("rule:\n  - metric: entropy\n    min: 0\n  - metric: entropy\n    reduce: avg\n    max: 1\n", "yaml")
    assert msg.startswith("r.toml:5: rule 2: reduce:"), msg


def test_load_rules_missing_file(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_rules(tmp_path / "nope.toml")


def test_default_rules_parse_and_name_registered_metrics():
    load_builtins()
    rs = default_rules()
    assert len(rs.rules) >= 3
    for r in rs.rules:
        assert r.why, r.name  # every default says why
        assert r.is_glob or r.metric in REGISTRY


def test_example_rules_files_load():
    files = sorted(EXAMPLES.glob("*.toml"))
    assert files, "docs/examples should hold example rules files"
    for f in files:
        rs = load_rules(f)
        assert rs.rules
