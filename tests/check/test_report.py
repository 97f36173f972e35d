"""Reporters: JUnit XML structure (and the JUnit schema when lxml is installed), GitHub workflow
annotations, the appended Markdown summary, the rich table's drill-down lines (the terminal
table's rows and colours: test_report_terminal.py)."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from grpolens.check import report as rep
from grpolens.check.evaluate import evaluate
from grpolens.check.rules import Rule
from grpolens.check.runner import CheckReport

from tests.check.report_cases import (ENTROPY_DETAIL, ERROR_MSG, KL_DETAIL, NO_DATA_MSG, SKIP_MSG,
                                      every_status_report, make_report, outcome, s)


XSD = Path(__file__).parents[1] / "data" / "junit-check.xsd"


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
                                       ("clip/high", "ratio"), ("policy/ratio_max", "ratio"), ("entropy", "entropy"),
                                       ("health/nonfinite/logp", "kl")])
def test_drilldown_score(metric, by):
    from grpolens.check.runner import drilldown_score

    assert drilldown_score(metric) == by


# -- what the reports say, worked by hand ------------------------------------------------------

@pytest.mark.parametrize("statuses,no_data,word,line", [
    (["PASS", "SKIP"], [], "PASSED", "1 passed, 0 failed, 1 skipped in 0.25s"),
    (["PASS", "FAIL", "NO DATA"], [3], "REGRESSION", "1 passed, 1 failed, 1 without data, 1 step (3) had no data in 0.25s"),
    (["NO DATA", "PASS"], [0, 1], "NO DATA", "1 passed, 0 failed, 1 without data, 2 steps (0, 1) had no data in 0.25s"),
    (["ERROR", "FAIL"], [], "ERROR", "0 passed, 1 failed, 1 error(s) in 0.25s"),
])
def test_verdict_and_summary_line(statuses, no_data, word, line):
    r = CheckReport(Path("run"), [outcome(s) for s in statuses], "rules.toml", None, seconds=0.25, no_data_steps=no_data)
    assert rep.verdict(r) == word and rep.summary_line(r) == line


@pytest.mark.parametrize("steps,text", [
    ([3], "1 step (3)"),
    ([0, 1, 2, 3, 4], "5 steps (0, 1, 2, 3, 4)"),
    ([0, 1, 2, 3, 4, 9], "6 steps (0, 1, 2, 3, 4, ...)"),
])
def test_no_data_text(steps, text):
    assert rep.no_data_text(steps) == text


def test_how_names_reducer_and_window():
    from grpolens.check.rules import Window
    from grpolens.check.runner import COVERAGE_RULE
    from grpolens.check.evaluate import Outcome

    assert rep.how(Outcome(COVERAGE_RULE, "PASS", "step")) == "every step"
    assert rep.how(outcome("PASS")) == "all steps"
    assert rep.how(Outcome(Rule("r", "m", reduce="mean", max=1.0, window=Window(last=20)), "PASS", "m")) == "mean, last 20"


def test_detail_gives_the_value_step_baseline_limit_and_margin():
    # baseline 1.0, tolerance 0.01 + 0.1 * 1.0: limit 1.11, and 1.3 is 0.19 (17 % of 1.11) above it
    o = evaluate(Rule("r", "m", abs=0.01, rel=0.1, direction="upper"), {"m": s([0.0, 1.3])}, {"m": s([0.0, 1.0])})
    assert rep.detail(o) == ("1/2 step(s) outside the limit; first at step 1; "
                             "value 1.3 at step 1, baseline 1, limit ≤ 1.11, above by 0.19 (17%)")
    # a reduced rule: no step, no baseline
    o = evaluate(Rule("r", "m", reduce="mean", max=1.0), {"m": s([0.25, 0.75])}, None)
    assert rep.detail(o) == "mean over all steps (2 step(s)); value 0.5, limit ≤ 1, headroom 0.5 (50%)"
    # no value: the message alone
    o = evaluate(Rule("r", "m", max=1.0), {}, None)
    assert rep.detail(o) == "m has no values in this run"
    assert rep.detail(outcome("SKIP", message="skipped", value=0.5)) == "skipped"


def test_markdown_row_of_a_rule_without_baseline():
    o = evaluate(Rule("r", "m", reduce="mean", max=1.0), {"m": s([0.25, 0.75])}, None)
    md = rep.markdown_summary(CheckReport(Path("run"), [o], "rules.toml", None, seconds=0.25))
    assert "| ✅ PASS | r | m | mean, all steps | 0.5 |  | ≤ 1 | headroom 0.5 (50%) |  |" in md.splitlines()


def test_detail_of_a_failing_reduced_rule_names_no_step_in_the_value():
    # mean 0.5 against max 0.3: 0.2 above, 67 % of 0.3; the step is in the message, not after the value
    o = evaluate(Rule("r", "m", reduce="mean", max=0.3), {"m": s([0.25, 0.75])}, None)
    assert rep.detail(o) == ("mean over all steps (2 step(s)) is outside the limit; first step beyond it: 1; "
                             "value 0.5, limit ≤ 0.3, above by 0.2 (67%)")


def test_rich_table_title_names_the_run_and_baseline():
    from rich.console import Console

    buf = io.StringIO()
    rep.print_report(make_report("runs/cand"), Console(file=buf, width=200, color_system=None))
    assert buf.getvalue().splitlines()[0].strip() == "grpolens check runs/cand vs golden.json"


# -- every status once, built by hand: the whole JUnit document, every annotation --------------

def test_junit_document_of_every_status():
    import re
    import socket

    data = rep.junit_xml(every_status_report())
    # a declaration naming the encoding (what pytest writes too), one document, a final newline
    assert re.match(rb"<\?xml version='1\.0' encoding='utf-8'\?>\n<testsuites ", data, re.IGNORECASE), data[:80]
    assert data.endswith(b"</testsuites>\n")
    root = ET.fromstring(data)
    # NO DATA counts as a failure; 5 rules in 1.5 s
    counts = {"tests": "5", "failures": "2", "errors": "1", "skipped": "1", "time": "1.500"}
    assert root.tag == "testsuites" and root.attrib == {"name": "grpolens check", **counts}
    [suite] = list(root)
    assert suite.tag == "testsuite"
    stamp = suite.attrib.pop("timestamp")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", stamp), stamp  # ISO 8601 to the second
    assert suite.attrib == {"name": "grpolens check runs/cand", **counts, "hostname": socket.gethostname()}
    props, *cases = list(suite)
    assert props.tag == "properties"
    assert [(p.tag, p.attrib) for p in props] == [
        ("property", {"name": "run", "value": "runs/cand"}), ("property", {"name": "baseline", "value": "golden.json"}),
        ("property", {"name": "rules", "value": "rules.toml"})]
    names = ["kl rises", "entropy floor", "clip high", "mismatch vs golden", "veto"]
    assert [(c.tag, c.attrib) for c in cases] == [
        ("testcase", {"classname": "grpolens.check", "name": n, "time": "0.000"}) for n in names]
    children = [[(el.tag, el.attrib, el.text) for el in c] for c in cases]
    assert children == [
        [("failure", {"message": KL_DETAIL, "type": "regression"},
          KL_DETAIL + "\ndrill down: grpolens tokens runs/cand --step 3 --by kl\nwhy this rule: KL must stay low")],
        [("system-out", {}, ENTROPY_DETAIL)],  # a pass: its numbers, no drill-down, no "why"
        [("failure", {"message": NO_DATA_MSG, "type": "no-data"}, NO_DATA_MSG)],
        [("error", {"message": ERROR_MSG, "type": "bad-baseline"}, ERROR_MSG)],
        [("skipped", {"message": SKIP_MSG}, None)],
    ]


def test_junit_without_baseline_has_an_empty_baseline_property():
    root = ET.fromstring(rep.junit_xml(every_status_report(baseline=None)))
    props = {p.get("name"): p.get("value") for p in root.find("testsuite/properties")}
    assert props == {"run": "runs/cand", "baseline": "", "rules": "rules.toml"}


def test_junit_carries_hostile_text_and_drops_what_xml_cannot_hold():
    """Markup, quotes and newlines are escaped and come back intact; C0 controls, lone surrogates (a run path
    that is not UTF-8, as Python decodes argv) and U+FFFF cannot be written in XML 1.0 at all and are dropped."""
    from grpolens.check.evaluate import Outcome

    hostile = 'a<b>&amp;"q\' ]]>\nline2\t\x07\x1b\ufffftail'
    kept = 'a<b>&amp;"q\' ]]>\nline2\ttail'
    o = Outcome(Rule(hostile, "kl/k3", max=0.5, why=hostile), "FAIL", "kl/k3", value=1.0, upper=0.5, step=0,
                failing=1, checked=1, message=hostile)
    run = "runs/x\x07y\udcff<&"  # a bell and a byte that is not UTF-8 in the directory's name
    r = CheckReport(Path(run), [o], hostile, hostile, seconds=0.0)
    root = ET.fromstring(rep.junit_xml(r))  # well-formed
    suite = root.find("testsuite")
    assert suite.get("name") == "grpolens check runs/xy<&"
    assert {p.get("name"): p.get("value") for p in suite.find("properties")} == {
        "run": "runs/xy<&", "baseline": kept, "rules": kept}
    case = suite.find("testcase")
    assert case.get("name") == kept
    fail = case.find("failure")
    message = kept + "; value 1 at step 0, limit ≤ 0.5, above by 0.5 (100%)"
    assert fail.get("message") == message
    assert fail.text == message + "\ndrill down: grpolens tokens 'runs/xy<&' --step 0 --by kl\nwhy this rule: " + kept


def _parse_workflow_command(line: str):
    """How the Actions runner reads a line (actions/runner ActionCommand.TryParseV2): ``::name k=v,k=v::data``,
    the header ending at the first ``::`` after the leading one; then it undoes the escapes of @actions/core
    (properties: %0D %0A %3A %2C, data: %0D %0A; %25 last)."""
    assert line.startswith("::") and "\n" not in line and "\r" not in line
    end = line.index("::", 2)
    name, _, props = line[2:end].partition(" ")
    out = {}
    for kv in filter(None, props.split(",")):
        k, v = kv.split("=", 1)
        out[k] = v.replace("%0D", "\r").replace("%0A", "\n").replace("%3A", ":").replace("%2C", ",").replace("%25", "%")
    data = line[end + 2:].replace("%0D", "\r").replace("%0A", "\n").replace("%25", "%")
    return name, out, data


def test_github_lines_of_every_status():
    lines = rep.github_lines(every_status_report(notes=["a note, with: colon", "100% done\r\nnext"]))
    assert lines == [
        "::error title=grpolens check FAIL%3A kl rises::kl/k3: " + KL_DETAIL.replace("(50%)", "(50%25)")
        + "%0Adrill down: grpolens tokens runs/cand --step 3 --by kl",
        "::error title=grpolens check NO DATA%3A clip high::clip/high: " + NO_DATA_MSG,
        "::error title=grpolens check ERROR%3A mismatch vs golden::mismatch/kl_k3: " + ERROR_MSG,
        # passes and skips say nothing; notes are warnings
        "::warning title=grpolens check::a note, with: colon",
        "::warning title=grpolens check::100%25 done%0D%0Anext",
    ]


def test_github_escaping_follows_the_workflow_command_rules():
    # % first (else the escapes themselves would be escaped), then CR and LF; properties also : and ,
    assert rep._gh_data("50% a:b,c\r\nd %0A") == "50%25 a:b,c%0D%0Ad %250A"
    assert rep._gh_prop("50% a:b,c\r\nd %0A") == "50%25 a%3Ab%2Cc%0D%0Ad %250A"


def test_github_annotation_of_hostile_text_reads_back_exactly():
    """What the runner reads back is what grpolens meant: no text can end the header early, add a property or
    start a second command on a new line."""
    from grpolens.check.evaluate import Outcome

    hostile = "x::error title=pwned::boom,file=a.py\r\n::warning::y 100%0A%2C"
    o = Outcome(Rule(hostile, "kl/k3", max=0.5), "FAIL", "kl/k3", value=1.0, upper=0.5, step=0, failing=1,
                checked=1, message=hostile)
    run = "runs/a,b:c\n::d"
    [line, warn] = rep.github_lines(CheckReport(Path(run), [o], "rules.toml", None, notes=[hostile]))
    name, props, data = _parse_workflow_command(line)
    assert name == "error" and props == {"title": f"grpolens check FAIL: {hostile}"}
    assert data == (f"kl/k3: {hostile}; value 1 at step 0, limit ≤ 0.5, above by 0.5 (100%)\n"
                    "drill down: grpolens tokens 'runs/a,b:c\n::d' --step 0 --by kl")
    assert _parse_workflow_command(warn) == ("warning", {"title": "grpolens check"}, hostile)


# -- the Markdown job summary ------------------------------------------------------------------

def test_markdown_summary_of_every_status():
    md = rep.markdown_summary(every_status_report(notes=["a note, with: colon"]))
    assert md == "\n".join([
        "### grpolens check: ⚠️ error — runs/cand vs golden.json",
        "",
        "1 passed, 1 failed, 1 without data, 1 skipped, 1 error(s) in 1.50s; rules: rules.toml",
        "",
        "| | rule | metric | steps | value | baseline | limit | margin | step |",
        "|---|---|---|---|--:|--:|---|---|--:|",
        "| ❌ FAIL | kl rises | kl/k3 | all steps | 0.75 | 0.25 | ≤ 0.5 | above by 0.25 (50%) | 3 |",
        # a reduced rule that passes has no step to show; rules without a value show no numbers
        "| ✅ PASS | entropy floor | entropy | mean, all steps | 2 |  | ≥ 1 | headroom 1 (100%) |  |",
        "| 🚫 NO DATA | clip high | clip/high | all steps |  |  |  |  | 2 |",
        r"| ⚠️ ERROR | mismatch vs golden | mismatch/kl\_k3 | all steps |  |  |  |  |  |",
        r"| ⏭️ SKIP | veto | rollout\_is/veto/seq\_fraction | all steps |  |  |  |  |  |",
        "",
        "- **kl rises**: 1/4 step(s) outside the limit; first at step 3",
        "- **clip high**: " + NO_DATA_MSG,
        r"- **mismatch vs golden**: the baseline has no values for mismatch/kl\_k3 (write the golden with these "
        "rules, or drop the rule)",
        "",
        "Drill down:",
        "",
        "```",
        "grpolens tokens runs/cand --step 3 --by kl",
        "```",
        "",
        "> a note, with: colon",
    ]) + "\n\n"  # a blank line after, so the next step's summary starts a block of its own


@pytest.mark.parametrize("statuses,heading", [
    (["PASS", "SKIP"], "### grpolens check: ✅ passed — run"),
    (["PASS", "FAIL", "NO DATA"], "### grpolens check: ❌ regression — run"),
    (["NO DATA", "PASS"], "### grpolens check: 🚫 no data — run"),
    (["ERROR", "FAIL"], "### grpolens check: ⚠️ error — run"),
])
def test_markdown_heading_names_the_verdict(statuses, heading):
    md = rep.markdown_summary(CheckReport(Path("run"), [outcome(s) for s in statuses], "rules.toml", None))
    assert md.splitlines()[0] == heading  # no baseline: no " vs ..."
    assert "Drill down:" not in md  # no failure here has a step to drill into


def test_markdown_rows_show_the_step_unless_a_reduced_rule_passed_and_numbers_only_of_judged_rules():
    from grpolens.check.evaluate import Outcome

    per_step_pass = Outcome(Rule("p", "m", max=1.0), "PASS", "m", value=0.5, upper=1.0, step=4)  # the step nearest
    reduced_fail = Outcome(Rule("f", "m", reduce="max", max=1.0), "FAIL", "m", value=2.0, upper=1.0, step=6)
    # an outcome built by hand may carry a value on a rule that did not judge: no numbers then, as in detail()
    skipped = Outcome(Rule("s", "m", max=1.0), "SKIP", "m", value=2.0, baseline=1.0, upper=1.0, message="skipped")
    md = rep.markdown_summary(CheckReport(Path("run"), [per_step_pass, reduced_fail, skipped], "rules.toml", None))
    rows = [ln for ln in md.splitlines() if ln.startswith(("| ✅", "| ❌", "| ⏭️"))]
    assert rows == ["| ✅ PASS | p | m | all steps | 0.5 |  | ≤ 1 | headroom 0.5 (50%) | 4 |",
                    "| ❌ FAIL | f | m | max, all steps | 2 |  | ≤ 1 | above by 1 (100%) | 6 |",
                    "| ⏭️ SKIP | s | m | all steps |  |  |  |  |  |"]


def _render(md: str):
    """The summary as a CommonMark renderer with GitHub's tables reads it (markdown-it-py, which rich uses)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table").parse(md)


def test_markdown_summary_of_hostile_names_renders_one_table_and_one_code_block():
    """Rule names, messages and notes are text: no HTML, link, emphasis, extra cell or row; the drill-down
    commands come back exactly, even from a run path that holds a newline and a code fence."""
    from grpolens.check.evaluate import Outcome

    hostile = "a|b <img src=x> [l](http://x) **bold** `c` \\| _i_ # ~s~ &amp;\n| --- |\n```"
    o = Outcome(Rule(hostile, "kl/k3", max=0.5), "FAIL", "kl/k3", value=1.0, upper=0.5, step=0, failing=1,
                checked=1, message=hostile)
    run = "runs/a\n```\n<img src=x>\n````"
    report = CheckReport(Path(run), [o, o], "rules.toml", None, notes=[hostile])
    tokens = _render(rep.markdown_summary(report))
    kinds = [t.type for t in tokens] + [c.type for t in tokens for c in (t.children or [])]
    assert not set(kinds) & {"html_block", "html_inline", "link_open", "image", "em_open", "s_open", "code_inline"}
    assert kinds.count("strong_open") == 2  # the two failures' names in the list, in bold as meant
    assert [t.tag for t in tokens if t.type == "heading_open"] == ["h3"]  # the summary's own heading only
    flat = " ".join(hostile.split())
    cells = []
    for i, t in enumerate(tokens):
        if t.type == "tr_open":
            cells.append([])
        elif t.type == "inline" and tokens[i - 1].type in ("th_open", "td_open"):
            cells[-1].append(t.content)
    assert len(cells) == 3 and all(len(row) == 9 for row in cells)  # the header and two rows of nine cells
    for row in cells[1:]:
        assert _render(row[1])[1].children[0].content == flat  # the escaped name reads back as written
    fences = [t for t in tokens if t.type == "fence"]
    assert len(fences) == 1
    cmd = "grpolens tokens 'runs/a\n```\n<img src=x>\n````' --step 0 --by kl"
    assert fences[0].content == f"{cmd}\n{cmd}\n"


def test_append_markdown_creates_then_appends(tmp_path):
    f = tmp_path / "summary.md"
    rep.append_markdown(f, "one ✅\n")  # a file that does not exist yet is created
    rep.append_markdown(f, "two\n")
    assert f.read_bytes() == "one ✅\ntwo\n".encode()
    missing = tmp_path / "no"
    with pytest.raises(Exception) as e:
        rep.append_markdown(missing / "x.md", "x")
    assert str(e.value) == f"--summary-md: directory {missing} does not exist"


def test_append_markdown_writes_utf8_under_an_ascii_locale(tmp_path):
    """The summary is UTF-8 (GitHub reads it so) whatever the locale: here the C locale with Python's UTF-8 mode
    off, whose encoding is ASCII and cannot hold the icons (the subprocess asserts so, or the test proves nothing)."""
    import os
    import subprocess
    import sys

    f = tmp_path / "summary.md"
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONPATH": str(Path(rep.__file__).parents[2])}
    code = ("import locale, sys; from grpolens.check.report import append_markdown; "
            "assert locale.getpreferredencoding(False) == 'ANSI_X3.4-1968', locale.getpreferredencoding(False); "
            "append_markdown(sys.argv[1], '\\u2705 \\u26a0\\ufe0f \\U0001f6ab \\u2264\\n')")
    subprocess.run([sys.executable, "-c", code, str(f)], env=env, check=True)
    assert f.read_bytes() == "✅ ⚠️ 🚫 ≤\n".encode("utf-8")


@pytest.mark.parametrize("text,escaped", [
    ("a & b <c> &amp;", "a &amp; b &lt;c&gt; &amp;amp;"),  # HTML cannot start; an entity is shown as typed
    ("\\ ` * _ [ ] | # ~", r"\\ \` \* \_ \[ \] \| \# \~"),  # what Markdown and a table cell read as syntax
    ("  one\ttwo\n\nthree \r\n", "one two three"),  # one line: a newline would end the table row
])
def test_md_escapes_markup_and_joins_lines(text, escaped):
    assert rep._md(text) == escaped
