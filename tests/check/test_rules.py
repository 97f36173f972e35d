"""Rules files: what parses into what, and every malformed file -> a UserError (exit 2) naming the
file, the line at fault, the rule and the key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from grpolens.check.rules import Early, Rule, Sustained, Window, default_rules, load_rules, parse_rules
from grpolens.errors import UserError
from grpolens.metrics.registry import REGISTRY
from grpolens.plugins import load_plugins

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


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
    load_plugins()
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


# -- what a rule says about itself (the reports' "steps" and `check --show-rules --rules`' "checks") --

@pytest.mark.parametrize("window,text", [
    (Window(), "all steps"),
    (Window(last=20), "last 20"),
    (Window(start=5), "steps 5:"),
    (Window(end=-2), "steps :-2"),
    (Window(start=0, end=10), "steps 0:10"),
])
def test_window_describes_itself(window, text):
    assert window.describe() == text


def test_early_reference_label_names_the_steps_or_the_fraction():
    assert Early(factor=2.0, steps=3).reference_label() == "first 3 steps"
    assert Early(factor=2.0, fraction=0.25).reference_label() == "first 25%"


@pytest.mark.parametrize("kw,text", [
    ({"min": 0.05, "max": 2.0, "finite": True}, "≥ 0.05; ≤ 2; finite"),
    ({"direction": "upper", "early": Early(factor=10.0, abs=0.05)}, "≤ 10× median(first 20%) + 0.05"),
    ({"direction": "lower", "early": Early(factor=4.0, steps=3)}, "≥ median(first 3 steps) / 4 − 0"),
    ({"direction": "both", "early": Early(factor=3.0, abs=1.0)},
     "≤ 3× median(first 20%) + 1; ≥ median(first 20%) / 3 − 1"),
    ({"abs": 0.005, "rel": 1.0}, "|x − b| ≤ 0.005 + 1·|b|"),
    ({"direction": "upper", "rel": 0.5}, "≤ b + 0 + 0.5·|b|"),
    ({"direction": "lower", "abs": 0.25}, "≥ b − (0.25 + 0·|b|)"),
    ({"max": 0.05, "sustained": Sustained(count=2, window=4)}, "≤ 0.05; sustained: 2 of 4 consecutive steps"),
])
def test_rule_describes_its_checks(kw, text):
    assert Rule(name="r", metric="m", **kw).describe_checks() == text


# -- windows, early bounds and streaks: every accepted edge, and every refusal in full -------------------

def one_rule(key: str, value: str):
    """A rule whose 6th line is ``key = value``."""
    return f"[[rule]]\nname = 'r'\nmetric = 'entropy'\nmax = 1\ndirection = 'upper'\n{key} = {value}\n"


@pytest.mark.parametrize("value,window", [
    ("1", Window(last=1)),  # the smallest "last N"
    ("2.0", Window(last=2)),  # a whole float is a step count
    ("{ last = 1 }", Window(last=1)),
    ("{ start = 3 }", Window(start=3)),
    ("{ end = 3 }", Window(end=3)),
    ("{ start = 3, end = 3 }", Window(start=3, end=3)),  # one step
    ("{ start = 0, end = -1 }", Window(start=0, end=-1)),  # signs differ: not comparable until the run is known
    ("{ start = 5, end = -1 }", Window(start=5, end=-1)),
    ("{ start = -3, end = -1 }", Window(start=-3, end=-1)),
])
def test_window_values_accepted(value, window):
    assert parse(one_rule("window", value)).rules[0].window == window


@pytest.mark.parametrize("value,msg", [
    ("0", "expected {start = A, end = B} or {last = N} (or a number N for the last N steps)"),
    ("2.5", "expected {start = A, end = B} or {last = N} (or a number N for the last N steps)"),
    ("true", "expected {start = A, end = B} or {last = N} (or a number N for the last N steps)"),
    ("{ first = 3 }", "unknown key 'first'; use start/end or last"),  # nothing close enough to suggest
    ("{ strat = 3 }", "unknown key 'strat' (did you mean 'start'?); use start/end or last"),
    ("{ start = true }", "start must be an integer step, got True"),
    ("{ end = 1.5 }", "end must be an integer step, got 1.5"),
    ("{ last = 0 }", "last must be >= 1, got 0"),
    ("{ last = 2, end = 5 }", "'last' cannot be combined with start/end"),
    ("{ start = 3, end = 0 }", "start 3 is after end 0"),
    ("{ start = 4, end = 3 }", "start 4 is after end 3"),
    ("{ start = -1, end = -3 }", "start -1 is after end -3"),
])
def test_window_values_refused(value, msg):
    assert error_of(one_rule("window", value)) == f"r.toml:6: rule 1 ('r'): window: {msg}"


@pytest.mark.parametrize("value,early", [
    ("{ factor = 1 }", Early(factor=1.0, fraction=0.2, steps=None, abs=0.0)),  # the defaults
    ("{ factor = 2, fraction = 1 }", Early(factor=2.0, fraction=1.0)),
    ("{ factor = 2, fraction = 0.5, abs = 0 }", Early(factor=2.0, fraction=0.5, abs=0.0)),
    ("{ factor = 2, steps = 1, abs = 0.5 }", Early(factor=2.0, steps=1, abs=0.5)),
])
def test_early_values_accepted(value, early):
    got = parse(one_rule("early", value)).rules[0].early
    assert got == early
    assert [type(v) for v in (got.factor, got.fraction, got.abs)] == [float, float, float]


@pytest.mark.parametrize("value,msg", [
    ("3", "expected a table like {factor = 10, fraction = 0.2, abs = 0.001}"),
    ("{ factr = 2 }", "unknown key 'factr' (did you mean 'factor'?); use factor, fraction or steps, abs"),
    ("{ abs = 1 }", "factor is required (e.g. factor = 10: ten times the early median)"),
    ("{ factor = 0.99 }", "factor must be a number >= 1, got 0.99"),
    ("{ factor = inf }", "factor must be a number >= 1, got inf"),
    ("{ factor = true }", "factor must be a number >= 1, got True"),
    ("{ factor = 2, fraction = 0.5, steps = 3 }", "give fraction or steps, not both"),
    ("{ factor = 2, fraction = 0 }", "fraction must be in (0, 1], got 0"),
    ("{ factor = 2, fraction = 1.01 }", "fraction must be in (0, 1], got 1.01"),
    ("{ factor = 2, fraction = 'x' }", "fraction must be in (0, 1], got 'x'"),
    ("{ factor = 2, steps = 0 }", "steps must be an integer >= 1, got 0"),
    ("{ factor = 2, steps = true }", "steps must be an integer >= 1, got True"),
    ("{ factor = 2, steps = 1.5 }", "steps must be an integer >= 1, got 1.5"),
    ("{ factor = 2, abs = -0.5 }", "abs must be a finite number >= 0, got -0.5"),
    ("{ factor = 2, abs = inf }", "abs must be a finite number >= 0, got inf"),
    ("{ factor = 2, abs = 'x' }", "abs must be a finite number >= 0, got 'x'"),
])
def test_early_values_refused(value, msg):
    assert error_of(one_rule("early", value)) == f"r.toml:6: rule 1 ('r'): early: {msg}"


@pytest.mark.parametrize("value,sustained", [
    ("{ count = 1, window = 1 }", Sustained(count=1, window=1)),
    ("{ count = 4, window = 4 }", Sustained(count=4, window=4)),
    ("{ window = 5, count = 2 }", Sustained(count=2, window=5)),
])
def test_sustained_values_accepted(value, sustained):
    assert parse(one_rule("sustained", value)).rules[0].sustained == sustained


@pytest.mark.parametrize("value,msg", [
    ("3", "expected a table like {count = 2, window = 4}"),
    ("{ count = 2, windw = 4 }", "unknown key 'windw' (did you mean 'window'?); use count and window"),
    ("{ count = true, window = 4 }", "count must be an integer >= 1, got True"),
    ("{ count = 2, window = 0 }", "window must be an integer >= 1, got 0"),
    ("{ count = 2, window = 2.5 }", "window must be an integer >= 1, got 2.5"),
    ("{ window = 4 }", "give both count and window (e.g. {count = 2, window = 4}: 2 of any 4 consecutive steps)"),
    ("{ count = 5, window = 4 }", "count 5 is larger than window 4"),
])
def test_sustained_values_refused(value, msg):
    assert error_of(one_rule("sustained", value)) == f"r.toml:6: rule 1 ('r'): sustained: {msg}"


# -- a rule's keys: the defaults, and every refusal in full ------------------------------------------

def test_rule_defaults():
    r = parse("[[rule]]\nmetric = 'entropy'\nmax = 1\n").rules[0]
    assert (r.name, r.metric, r.reduce, r.window, r.direction) == ("entropy all", "entropy", "all", Window(), "both")
    assert (r.abs, r.rel, r.min, r.max, r.finite, r.early, r.sustained) == (None, None, None, 1.0, False, None, None)
    assert (r.allow_fail_fraction, r.missing, r.no_data, r.why) == (0.0, "fail", "fail", "")


def test_rule_values_are_kept_as_given():
    r = parse("""
        [[rule]]
        name = "  padded  "
        metric = "entropy"
        reduce = "p100"
        direction = "both"
        early = { factor = 2 }
        min = 1
        max = 1
        allow_fail_fraction = 0
        missing = "skip"
        no_data = "allow"
        why = "  because  "
    """).rules[0]
    assert (r.name, r.reduce, r.direction, r.early, r.min, r.max) == ("padded", "p100", "both", Early(factor=2.0), 1.0, 1.0)
    assert (r.allow_fail_fraction, r.missing, r.no_data, r.why) == (0.0, "skip", "allow", "because")
    assert isinstance(r.allow_fail_fraction, float) and isinstance(r.min, float)
    r = parse("[[rule]]\nmetric = 'entropy'\nmax = 1\nallow_fail_fraction = 0.99\nfinite = false\n").rules[0]
    assert r.allow_fail_fraction == 0.99 and not r.finite
    assert parse("[[rule]]\nmetric = 'entropy'\nabs = 0\nrel = 0\n").rules[0].compares


RULES = ("name, metric, reduce, window, direction, abs, rel, min, max, finite, early, allow_fail_fraction, "
         "sustained, missing, no_data, why")


@pytest.mark.parametrize("lines,msg", [
    ("name = '  '", "r.toml:2: rule 1 ('  '): name: must be a non-empty string"),
    ("name = 3", "r.toml:2: rule 1: name: must be a non-empty string"),
    ("metric = '  '", "r.toml:2: rule 1: metric: required: a metric name (canonical or any profile's alias) "
                      "or a glob like 'health/nonfinite/*'"),
    ("name = 'r'", "r.toml:1: rule 1 ('r'): metric: required: a metric name (canonical or any profile's alias) "
                   "or a glob like 'health/nonfinite/*'"),
    ("metric = 'entropy'\nmaximum = 1", f"r.toml:3: rule 1: unknown key 'maximum' (did you mean 'max'?); rule keys are {RULES}"),
    ("metric = 'entropy'\nmax = 1\nreduce = 'p101'", "r.toml:4: rule 1: reduce: unknown reducer 'p101'; use all, last, "
                                                   "mean, median, min, max or pNN (p50, p95, p99.9)"),
    ("metric = 'entropy'\nmax = 1\nreduce = 3", "r.toml:4: rule 1: reduce: unknown reducer 3; use all, last, "
                                              "mean, median, min, max or pNN (p50, p95, p99.9)"),
    ("metric = 'entropy'\nmax = 1\ndirection = 'up'", "r.toml:4: rule 1: direction: must be one of upper, lower, both, got 'up'"),
    ("metric = 'entropy'\nmax = 1\nmissing = 'allow'", "r.toml:4: rule 1: missing: must be 'fail' or 'skip', got 'allow'"),
    ("metric = 'entropy'\nmax = 1\nno_data = 'skip'", "r.toml:4: rule 1: no_data: must be 'fail' or 'allow', got 'skip'"),
    ("metric = 'entropy'\nabs = -0.5", "r.toml:3: rule 1: abs: must be a finite number >= 0, got -0.5"),
    ("metric = 'entropy'\nabs = true", "r.toml:3: rule 1: abs: must be a finite number >= 0, got True"),
    ("metric = 'entropy'\nrel = inf", "r.toml:3: rule 1: rel: must be a finite number >= 0, got inf"),
    ("metric = 'entropy'\nrel = nan", "r.toml:3: rule 1: rel: must be a finite number >= 0, got nan"),
    ("metric = 'entropy'\nmin = nan", "r.toml:3: rule 1: min: must be a number, got nan"),
    ("metric = 'entropy'\nmax = 'x'", "r.toml:3: rule 1: max: must be a number, got 'x'"),
    ("metric = 'entropy'\nmax = true", "r.toml:3: rule 1: max: must be a number, got True"),
    ("metric = 'entropy'\nmax = 1\nmin = 1.5", "r.toml:4: rule 1: min: min 1.5 is above max 1"),
    ("metric = 'entropy'\nfinite = 1", "r.toml:3: rule 1: finite: must be true or false, got 1"),
    ("metric = 'entropy'\nmax = 1\nwhy = 3", "r.toml:4: rule 1: why: must be a string"),
    ("metric = 'entropy'\nmax = 1\nallow_fail_fraction = 1", "r.toml:4: rule 1: allow_fail_fraction: must be a number in [0, 1), got 1"),
    ("metric = 'entropy'\nmax = 1\nallow_fail_fraction = -0.1", "r.toml:4: rule 1: allow_fail_fraction: must be a number in [0, 1), got -0.1"),
    ("metric = 'entropy'\nmax = 1\nallow_fail_fraction = true", "r.toml:4: rule 1: allow_fail_fraction: must be a number in [0, 1), got True"),
    ("metric = 'entropy'\nmax = 1\nreduce = 'max'\nallow_fail_fraction = 0.5",
     "r.toml:5: rule 1: allow_fail_fraction: only applies to reduce = \"all\" (per-step checks), not 'max'"),
    ("metric = 'entropy'\nmax = 1\nreduce = 'last'\nsustained = { count = 1, window = 2 }",
     "r.toml:5: rule 1: sustained: only applies to reduce = \"all\" (per-step checks), not 'last'"),
    ("metric = 'entropy'\nearly = { factor = 2 }",
     "r.toml:1: rule 1: direction: an 'early' bound needs a direction: 'upper' (catch a rise) or 'lower' (catch a fall)"),
    ("metric = 'entropy'\nmissing = 'skip'", "r.toml:1: rule 1: no check: give min, max, finite, early, or abs/rel (against the baseline)"),
])
def test_rule_keys_refused(lines, msg):
    assert error_of(f"[[rule]]\n{lines}\n") == msg


@pytest.mark.parametrize("text,msg", [
    ("rule = 3\n", "r.toml:1: rule: 'rule' must be an array of tables ([[rule]] in TOML, a list of mappings in YAML)"),
    ("rule = [1, 2]\n", "r.toml:1: rule: 'rule' must be an array of tables ([[rule]] in TOML, a list of mappings in YAML)"),
    ("builtin_rules = 'yes'\n", "r.toml:1: builtin_rules: must be true or false"),
    ("baseline = 3\n[[rule]]\nmetric = 'entropy'\nmax = 1\n", "r.toml:1: baseline: must be a path (string)"),
    ("# nothing\n", "r.toml: no rules: add [[rule]] tables (or builtin_rules = true)"),
    ("builtin_rules = false\n", "r.toml: no rules: add [[rule]] tables (or builtin_rules = true)"),
    ("rules = 3\n", "r.toml:1: rules: unknown top-level key 'rules' (did you mean 'rule'?); expected [[rule]] tables, "
                    "'baseline' or 'builtin_rules'"),
    ("builtin_rules = true\n[[rule]]\nname = 'finite metrics'\nmetric = 'entropy'\nmax = 1\n",
     "r.toml:3: rule 1 ('finite metrics'): name: duplicate rule name 'finite metrics' (names must be unique: they are "
     "the test case names)"),
])
def test_rules_file_refused(text, msg):
    assert error_of(text) == msg


def test_rules_file_without_a_source_name_says_rules():
    with pytest.raises(UserError) as e:
        parse_rules("[[rule]]\nmetric = 'entropy'\nreduce = 'avg'\nmax = 1\n")
    assert e.value.message.startswith("<rules>:3: rule 1: reduce: unknown reducer 'avg'")


def test_yaml_rules_file_that_is_not_a_mapping():
    pytest.importorskip("yaml")
    assert error_of("- 1\n- 2\n", kind="yaml") == "r.toml: expected a table with [[rule]] entries"


def test_builtin_rules_alone_and_the_baseline_next_to_the_file(tmp_path):
    rs = parse("builtin_rules = true\n")
    assert rs.rules == default_rules().rules and rs.source == "r.toml" and rs.baseline is None
    f = tmp_path / "cfg" / "rules.toml"
    f.parent.mkdir()
    f.write_text("baseline = 'golden.json'\n[[rule]]\nmetric = 'entropy'\nmax = 1\n")
    rs = load_rules(f)
    assert rs.baseline == tmp_path / "cfg" / "golden.json" and rs.source == str(f)


# -- reading the file, and the line an error points at --------------------------------------------

def test_toml_error_without_a_line_names_the_file_only():
    assert error_of("[[rule]]\nmetric =") == "r.toml: invalid TOML: Invalid value (at end of document)"


def test_metric_refusals_in_full():
    assert error_of("[[rule]]\nmetric = 'nope/*'\nmax = 1\n") == (
        "r.toml:2: rule 1: metric: the pattern 'nope/*' matches no registered metric (patterns match canonical "
        "names; see `grpolens metrics`)")
    msg = error_of("[[rule]]\nmetric = 'entropie'\nmax = 1\n")
    assert msg.startswith("r.toml:2: rule 1: metric: unknown metric 'entropie'") and msg.endswith(" (see `grpolens metrics`)")
    # a name is a pattern only by * ? [ (not by any other character)
    msg = error_of("[[rule]]\nmetric = 'entropy_X'\nmax = 1\n")
    assert msg.startswith("r.toml:2: rule 1: metric: unknown metric 'entropy_X'") and msg.endswith(" (see `grpolens metrics`)")


@pytest.mark.parametrize("text,msg", [
    # a quoted key is found like a bare one
    ("[[rule]]\nmetric = 'entropy'\n\"max\" = 'x'\n", "r.toml:3: rule 1: max: must be a number, got 'x'"),
    # the key of the second rule, not the same key in the first
    ("[[rule]]\nmetric = 'entropy'\nmax = 1\n\n[[rule]]\nmetric = 'entropy'\nmax = 'x'\n",
     "r.toml:7: rule 2: max: must be a number, got 'x'"),
    # a key the rule lacks: its [[rule]] line, not the same key of the next rule
    ("[[rule]]\nname = 'a'\nmax = 1\n[[rule]]\nmetric = 'entropy'\nmax = 1\n",
     "r.toml:1: rule 1 ('a'): metric: required: a metric name (canonical or any profile's alias) or a glob like "
     "'health/nonfinite/*'"),
    # a nested table ends the rule: its key is not the rule's
    ("[[rule]]\nname = 'a'\nmax = 1\n[rule.early]\nmetric = 'x'\n",
     "r.toml:1: rule 1 ('a'): metric: required: a metric name (canonical or any profile's alias) or a glob like "
     "'health/nonfinite/*'"),
    # a top-level key
    ("baseline = 1\n", "r.toml:1: baseline: must be a path (string)"),
    # a top-level table: its header line ([[rules]] for [[rule]] is the likely slip)
    ("[[rules]]\nmetric = 'entropy'\nmax = 1\n", "r.toml:1: rules: unknown top-level key 'rules' (did you mean "
     "'rule'?); expected [[rule]] tables, 'baseline' or 'builtin_rules'"),
    ("[[rule]]\nmetric = 'entropy'\nmax = 1\n\n[other.sub]\nx = 1\n", "r.toml:5: other: unknown top-level key "
     "'other'; expected [[rule]] tables, 'baseline' or 'builtin_rules'"),
    ("# one rule\n[ rule ]\nmetric = 'entropy'\nmax = 1\n", "r.toml:2: rule: 'rule' must be an array of tables "
     "([[rule]] in TOML, a list of mappings in YAML)"),
    # a rule without a [[rule]] line of its own (an inline array): no line to point at
    ("rule = [{metric = 'entropy', max = 'x'}]\n", "r.toml: rule 1: max: must be a number, got 'x'"),
    # an empty rule: its own line, not the next rule's key
    ("[[rule]]\n[[rule]]\nmetric = 'entropy'\nmax = 1\n", "r.toml:1: rule 1: metric: required: a metric name "
     "(canonical or any profile's alias) or a glob like 'health/nonfinite/*'"),
    ("\n\n  [[ rule ]]\nmetric = 'entropy'\nreduce = 'x'\nmax = 1\n", "r.toml:5: rule 1: reduce: unknown reducer 'x'; "
     "use all, last, mean, median, min, max or pNN (p50, p95, p99.9)"),
])
def test_errors_point_at_the_line(text, msg):
    assert error_of(text) == msg


def test_yaml_errors_point_at_the_line():
    pytest.importorskip("yaml")
    text = "rule:\n  - metric: entropy\n    max: 1\n  - name: b\n    metric: entropy\n    max: x\n"
    assert error_of(text, "yaml") == "r.toml:6: rule 2 ('b'): max: must be a number, got 'x'"
    assert error_of("rule:\n  - name: b\n    max: 1\n", "yaml").startswith("r.toml:2: rule 1 ('b'): metric: required")
    assert error_of("baseline: 3\nrule: []\n", "yaml") == "r.toml:1: baseline: must be a path (string)"
    # PyYAML's own problem and line, on one line: a syntax error, and a character YAML does not allow
    assert error_of("rule:\n  - metric: a: b\n", "yaml") == "r.toml:2: invalid YAML: mapping values are not allowed here"
    assert error_of("rule: []\nx: \x07\n", "yaml") == (
        "r.toml:2: invalid YAML: unacceptable character #x0007: special characters are not allowed")
    # a key no line starts with (a flow mapping): no line number
    assert error_of("{rule: [], other: 1}\n", "yaml") == (
        "r.toml: other: unknown top-level key 'other'; expected [[rule]] tables, 'baseline' or 'builtin_rules'")



def test_yaml_error_lines_count_the_newlines_before_the_refused_character():
    pytest.importorskip("yaml")
    # the line of a character YAML refuses is counted from the first character, a leading empty line
    # included, and only the newlines before it count (lines after it change nothing)
    bad = "unacceptable character #x0007: special characters are not allowed"
    assert error_of("\nrule: []\nx: \x07\n", "yaml") == f"r.toml:3: invalid YAML: {bad}"
    assert error_of("rule: []\nx: \x07\ny: 1\nz: 2\n", "yaml") == f"r.toml:2: invalid YAML: {bad}"


def test_yaml_error_names_pyyamls_problem_not_its_context():
    pytest.importorskip("yaml")
    # PyYAML's message starts with its context ("while parsing a flow sequence"); the problem is what
    # the user has to fix
    assert error_of("rule: [a, b\n", "yaml") == "r.toml:2: invalid YAML: expected ',' or ']', but got '<stream end>'"
    assert error_of("rule: \"abc\n", "yaml") == "r.toml:2: invalid YAML: found unexpected end of stream"


def test_yaml_top_level_key_line_is_the_keys_own_line_not_a_bracketed_text_line():
    pytest.importorskip("yaml")
    # ``[rules]`` is a TOML table header; in YAML it is text (here in a block scalar), not the key
    text = "rule:\n  - metric: entropy\n    max: 1\n    why: |\n      [rules] is the TOML spelling\nrules: 1\n"
    assert error_of(text, "yaml") == ("r.toml:6: rules: unknown top-level key 'rules' (did you mean 'rule'?); "
                                      "expected [[rule]] tables, 'baseline' or 'builtin_rules'")


def test_yaml_rules_without_pyyaml(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml -> ImportError
    assert error_of("rule: []\n", "yaml") == "r.toml: YAML rules need PyYAML (pip install pyyaml), or write the rules in TOML"


def test_load_rules_reads_yaml_by_suffix_and_names_the_file(tmp_path):
    pytest.importorskip("yaml")
    for name in ("r.yaml", "r.yml", "R.YML"):
        f = tmp_path / name
        f.write_text("rule:\n  - metric: entropy\n    max: 1\n")
        assert load_rules(f).rules[0].max == 1.0 and load_rules(f).source == str(f)
    f = tmp_path / "r.toml"
    f.write_text("[[rule]]\nmetric = 'entropy'\nmax = 'x'\n")
    with pytest.raises(UserError) as e:
        load_rules(str(f))
    assert e.value.message == f"{f}:3: rule 1: max: must be a number, got 'x'"
    with pytest.raises(UserError) as e:
        load_rules(tmp_path / "nope.toml")
    assert e.value.message == f"--rules: no such file {tmp_path / 'nope.toml'}"
    f.write_bytes(b"\xff\xfe[[rule]]")
    with pytest.raises(UserError) as e:
        load_rules(f)
    assert e.value.message.startswith(f"--rules: cannot read {f}: 'utf-8' codec can't decode")
