"""Reporters: JUnit XML structure (and the JUnit schema when lxml is installed), GitHub workflow
annotations, the appended Markdown summary, the rich table's drill-down lines."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from grpolens.check import report as rep
from grpolens.check.evaluate import Series, evaluate
from grpolens.check.rules import Rule
from grpolens.check.runner import CheckReport

XSD = Path(__file__).parent / "data" / "junit-check.xsd"
HOSTILE = "kl <b>&amp; ]]> | `x` *y*\n::error::\x07 100%, a:b"


def s(vals):
    return Series(np.arange(len(vals), dtype=np.int64), np.array(vals, np.float64))


def make_report(run="runs/cand") -> CheckReport:
    cand = {"a": s([0.1, 0.2, 0.9]), "b": s([1.0, 1.0, 1.0])}
    base = {"a": s([0.1, 0.2, 0.2]), "b": s([1.0, 1.0, 1.0])}
    rules = [
        Rule("a rises", "a", direction="upper", abs=0.05, rel=0.1, why="KL must not rise"),
        Rule("b steady", "b", abs=0.01),
        Rule(HOSTILE, "b", reduce="mean", max=0.5),
        Rule("only baseline", "c", abs=0.1, missing="skip"),
        Rule("bad baseline", "b2", abs=0.1),
    ]
    cand["b2"] = s([1.0])
    outcomes = [evaluate(r, cand, base) for r in rules]
    outcomes[3] = evaluate(rules[3], cand, None)  # SKIP: no baseline for it
    return CheckReport(Path(run), outcomes, "rules.toml", "golden.json", seconds=0.25, notes=["a note, with: colon"])


def test_report_statuses_and_exit_code():
    r = make_report()
    assert [o.status for o in r.outcomes] == ["FAIL", "PASS", "FAIL", "SKIP", "ERROR"]
    assert r.counts() == {"PASS": 1, "FAIL": 2, "NO DATA": 0, "SKIP": 1, "ERROR": 1}
    assert r.exit_code == 2  # an error in the input outranks regressions
    r.outcomes.pop()
    assert r.exit_code == 1
    r.outcomes = [o for o in r.outcomes if o.status in ("PASS", "SKIP")]
    assert r.exit_code == 0


def test_junit_structure():
    r = make_report()
    root = ET.fromstring(rep.junit_xml(r))
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    for el in (root, suite):
        assert el.get("tests") == "5" and el.get("failures") == "2" and el.get("errors") == "1"
        assert el.get("skipped") == "1" and float(el.get("time")) == pytest.approx(0.25, abs=1e-3)
    assert suite.get("name")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [o.rule.name.replace("\x07", "") for o in r.outcomes]
    for c in cases:
        assert c.get("classname") and float(c.get("time")) >= 0
    fail = cases[0].find("failure")
    assert fail is not None and fail.get("type") == "regression"
    assert "first at step 2" in fail.get("message")
    assert "grpolens tokens runs/cand --step 2 --by kl" in fail.text and "KL must not rise" in fail.text
    assert cases[1].find("failure") is None and cases[1].find("system-out") is not None
    assert cases[3].find("skipped") is not None
    assert cases[4].find("error") is not None and cases[4].find("failure") is None
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props == {"run": "runs/cand", "baseline": "golden.json", "rules": "rules.toml"}
    # counts agree with the children, as CI reporters recompute them
    assert sum(c.find("failure") is not None for c in cases) == int(suite.get("failures"))
    assert sum(c.find("error") is not None for c in cases) == int(suite.get("errors"))
    assert sum(c.find("skipped") is not None for c in cases) == int(suite.get("skipped"))


def test_junit_validates_against_schema():
    etree = pytest.importorskip("lxml.etree")
    schema = etree.XMLSchema(etree.parse(str(XSD)))
    doc = etree.fromstring(rep.junit_xml(make_report()))
    assert schema.validate(doc), schema.error_log
    # the schema is not vacuous: a testcase without a name or a negative count is rejected
    bad = etree.fromstring(b'<testsuites><testsuite name="x" tests="-1"><testcase/></testsuite></testsuites>')
    assert not schema.validate(bad)


def test_github_annotations():
    lines = rep.github_lines(make_report())
    errors = [ln for ln in lines if ln.startswith("::error ")]
    assert len(errors) == 3  # two failures and one error; passes and skips say nothing
    assert all("\n" not in ln for ln in lines)
    first = errors[0]
    assert first.startswith("::error title=grpolens check FAIL%3A a rises::a: ")
    assert "%0Adrill down: grpolens tokens runs/cand --step 2 --by kl" in first
    hostile = errors[1]
    title = hostile.split("::")[1]
    assert "%2C" in title and "%3A" in title and "%25" in title and "%0A" in title  # property escaping
    assert hostile.count("::") == 2  # the message cannot start a new workflow command
    assert lines[-1] == "::warning title=grpolens check::a note, with: colon"


def test_markdown_summary_appends(tmp_path):
    r = make_report()
    f = tmp_path / "summary.md"
    f.write_text("# earlier step\n\n")
    rep.append_markdown(f, rep.markdown_summary(r))
    rep.append_markdown(f, rep.markdown_summary(r))
    text = f.read_text()
    assert text.startswith("# earlier step\n") and text.count("### grpolens check: ⚠️ error") == 2
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert len(table) == 2 * (1 + 5)  # header + one row per rule, twice
    ncols = table[0].count(" | ")
    for row in table:  # hostile names cannot break the table: every row has the same cells
        assert row.replace("\\|", "").count(" | ") == ncols, row
    assert "&lt;b&gt;" in text and "<b>" not in text
    assert "grpolens tokens runs/cand --step 2 --by kl" in text
    with pytest.raises(Exception, match="does not exist"):
        rep.append_markdown(tmp_path / "no" / "x.md", "x")


def test_rich_table_lists_failures_with_drilldown():
    from rich.console import Console

    buf = io.StringIO()
    rep.print_report(make_report("runs/my run"), Console(file=buf, width=200, color_system=None))
    out = buf.getvalue()
    assert "FAIL a rises" in out and "drill down: grpolens tokens 'runs/my run' --step 2 --by kl" in out
    assert "<b>&amp;" in out  # shown literally, not interpreted as markup
    assert "ERROR: 1 passed, 2 failed, 1 skipped, 1 error(s)" in out


@pytest.mark.parametrize("metric,by", [("kl/k3", "kl"), ("mismatch/k3", "mismatch"), ("rollout_is/veto_fraction", "mismatch"),
                                       ("clip/high", "ratio"), ("entropy", "entropy"), ("health/nonfinite/logp", "kl")])
def test_drilldown_score(metric, by):
    from grpolens.check.runner import drilldown_score

    assert drilldown_score(metric) == by
