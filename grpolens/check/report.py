"""Reporters for a :class:`~grpolens.check.runner.CheckReport`: a rich table for people, JUnit XML
for CI test views, GitHub workflow annotations, and a Markdown table for ``$GITHUB_STEP_SUMMARY``."""

from __future__ import annotations

import datetime as _dt
import re
import socket
import xml.etree.ElementTree as ET

from grpolens.check.evaluate import ERROR, FAIL, NO_DATA, PASS, SKIP, Outcome
from grpolens.check.runner import CheckReport
from grpolens.text import format_value

_STYLE = {PASS: "green", FAIL: "bold red", NO_DATA: "bold red", SKIP: "yellow", ERROR: "bold magenta"}
_ICON = {PASS: "✅", FAIL: "❌", NO_DATA: "🚫", SKIP: "⏭️", ERROR: "⚠️"}


def _v(v) -> str:
    return "" if v is None else format_value(float(v))


def how(o: Outcome) -> str:
    """Reducer and window, e.g. ``all steps`` or ``mean, last 20``."""
    r = o.rule
    if o.metric == "step":
        return "every step"
    win = r.window.describe()
    return win if r.reduce == "all" else f"{r.reduce}, {win}"


def detail(o: Outcome) -> str:
    """One line that says what happened, with the numbers."""
    parts = [o.message]
    if o.value is not None and o.status in (FAIL, PASS):  # the coverage rule ("step") has no value
        at = f" at step {o.step}" if o.rule.reduce == "all" and o.step is not None else ""
        base = f", baseline {_v(o.baseline)}" if o.baseline is not None else ""
        parts.append(f"value {_v(o.value)}{at}{base}, limit {o.limit_text()}, {o.margin_text()}")
    return "; ".join(p for p in parts if p)


def summary_line(report: CheckReport) -> str:
    c = report.counts()
    words = [f"{c[PASS]} passed", f"{c[FAIL]} failed"]
    if c[NO_DATA]:
        words.append(f"{c[NO_DATA]} without data")
    if c[SKIP]:
        words.append(f"{c[SKIP]} skipped")
    if c[ERROR]:
        words.append(f"{c[ERROR]} error(s)")
    if report.no_data_steps:
        words.append(f"{no_data_text(report.no_data_steps)} had no data")
    return ", ".join(words) + f" in {report.seconds:.2f}s"


def verdict(report: CheckReport) -> str:
    """PASSED, REGRESSION (a rule failed), NO DATA (only rules without data failed) or ERROR."""
    if report.exit_code == 0:
        return "PASSED"
    if report.exit_code == 2:
        return "ERROR"
    return "REGRESSION" if report.counts()[FAIL] else "NO DATA"


def no_data_text(steps: list[int]) -> str:
    """``1 step (3)`` / ``12 steps (0, 1, 2, 3, 4, ...)``."""
    shown = ", ".join(str(s) for s in steps[:5]) + (", ..." if len(steps) > 5 else "")
    return f"{len(steps)} step{'s' if len(steps) != 1 else ''} ({shown})"


# The rule table of the terminal and Markdown reports: after each rule's status, these columns (True: a number,
# right-aligned). The margin is how far past its bound a value lies, or its headroom.
_COLUMNS = (("rule", False), ("metric", False), ("steps", False), ("value", True), ("baseline", True),
           ("limit", False), ("margin", False), ("step", True))
_MARGIN = [name for name, _ in _COLUMNS].index("margin")


def _row(o: Outcome) -> list[str]:
    """``o``'s cells in ``_COLUMNS`` order. Numbers only where the rule judged a value (PASS or FAIL: the
    coverage rule has none); the step is the first failing one, or the one a per-step rule's value is from
    (a reduced rule that passed has none to show)."""
    judged = o.status in (PASS, FAIL) and o.value is not None
    numbers = [_v(o.value), _v(o.baseline), o.limit_text(), o.margin_text()] if judged else ["", "", "", ""]
    step = "" if o.step is None or o.status == PASS and o.rule.reduce != "all" else str(o.step)
    return [o.rule.name, o.metric, how(o), *numbers, step]


# ---------------------------------------------------------------------------------------------
# Terminal
# ---------------------------------------------------------------------------------------------

def print_report(report: CheckReport, console) -> None:
    from rich.table import Table
    from rich.text import Text

    title = Text(f"grpolens check {report.run}")
    if report.baseline:
        title.append(f" vs {report.baseline}")
    t = Table(title=title, title_justify="left")
    t.add_column("")
    for name, numeric in _COLUMNS:
        t.add_column(name, justify="right" if numeric else "left", style="bold" if name == "rule" else "")
    for o in report.outcomes:
        cells = [Text(c) for c in _row(o)]
        if o.status == FAIL:
            cells[_MARGIN].stylize(_STYLE[FAIL])
        t.add_row(Text(o.status, style=_STYLE[o.status]), *cells)
    console.print(t)
    for o in report.outcomes:
        if o.status in (FAIL, NO_DATA, ERROR, SKIP):
            # assembled, not appended: a Text's own style would colour the whole line, message included
            console.print(Text.assemble((f"{o.status} ", _STYLE[o.status]), (f"{o.rule.name}: ", "bold"), o.message))
            why = report.why(o)
            if why:
                console.print(Text(f"  why: {why}"))
            cmd = report.drilldown(o)
            if cmd:
                console.print(Text(f"  drill down: {cmd}", style="cyan"))
    for n in report.notes:
        console.print(Text(f"note: {n}", style="yellow"))
    if report.golden_written:
        console.print(Text(f"wrote golden values to {report.golden_written}"))
    word = verdict(report)
    style = {"PASSED": "bold green", "ERROR": "bold magenta"}.get(word, "bold red")
    console.print(Text.assemble((f"{word}: ", style), summary_line(report)))


# ---------------------------------------------------------------------------------------------
# JUnit XML
# ---------------------------------------------------------------------------------------------

def junit_xml(report: CheckReport) -> bytes:
    """One ``<testcase>`` per rule inside one ``<testsuite>``, the layout pytest, Jenkins, GitLab and
    GitHub test reporters read."""
    c = report.counts()
    total = len(report.outcomes)
    t = f"{report.seconds:.3f}"
    counts = {"tests": str(total), "failures": str(c[FAIL] + c[NO_DATA]), "errors": str(c[ERROR]),
              "skipped": str(c[SKIP])}
    root = ET.Element("testsuites", {"name": "grpolens check", **counts, "time": t})
    suite = ET.SubElement(root, "testsuite", {
        "name": _xml_text(f"grpolens check {report.run}"), **counts, "time": t,
        "timestamp": _dt.datetime.now().isoformat(timespec="seconds"), "hostname": _xml_text(socket.gethostname()),
    })
    props = ET.SubElement(suite, "properties")
    for k, v in (("run", str(report.run)), ("baseline", report.baseline or ""), ("rules", report.rules_source)):
        ET.SubElement(props, "property", {"name": k, "value": _xml_text(v)})
    for o in report.outcomes:
        case = ET.SubElement(suite, "testcase", {
            "classname": "grpolens.check", "name": _xml_text(o.rule.name), "time": "0.000",
        })
        text = _xml_text(detail(o))
        cmd = report.drilldown(o)
        why = report.why(o)
        body = text + (f"\nwhy: {_xml_text(why)}" if why else "") + (f"\ndrill down: {_xml_text(cmd)}" if cmd else "") + \
            (f"\nwhy this rule: {_xml_text(o.rule.why)}" if o.rule.why else "")
        if o.status == FAIL:
            ET.SubElement(case, "failure", {"message": text, "type": "regression"}).text = body
        elif o.status == NO_DATA:
            ET.SubElement(case, "failure", {"message": text, "type": "no-data"}).text = body
        elif o.status == ERROR:
            ET.SubElement(case, "error", {"message": text, "type": "bad-baseline"}).text = body
        elif o.status == SKIP:
            ET.SubElement(case, "skipped", {"message": text})
        else:
            ET.SubElement(case, "system-out").text = body
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


# XML 1.0's Char production leaves out most C0 controls, the surrogates (a path that is not UTF-8 reaches
# Python as lone surrogates) and U+FFFE/U+FFFF
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_text(s: str) -> str:
    """XML 1.0 cannot carry these characters even escaped; drop them."""
    return _XML_BAD.sub("", s)


# ---------------------------------------------------------------------------------------------
# GitHub Actions
# ---------------------------------------------------------------------------------------------

def _gh_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_prop(s: str) -> str:
    return _gh_data(s).replace(":", "%3A").replace(",", "%2C")


def github_lines(report: CheckReport) -> list[str]:
    """``::error title=...::message`` for each failure or error, ``::warning`` for each note."""
    lines = []
    for o in report.outcomes:
        if o.status not in (FAIL, NO_DATA, ERROR):
            continue
        msg = f"{o.metric}: {detail(o)}"
        why = report.why(o)
        if why:
            msg += f"\nwhy: {why}"
        cmd = report.drilldown(o)
        if cmd:
            msg += f"\ndrill down: {cmd}"
        lines.append(f"::error title={_gh_prop(f'grpolens check {o.status}: {o.rule.name}')}::{_gh_data(msg)}")
    for n in report.notes:
        lines.append(f"::warning title={_gh_prop('grpolens check')}::{_gh_data(n)}")
    return lines


# ---------------------------------------------------------------------------------------------
# Markdown (job summary)
# ---------------------------------------------------------------------------------------------

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|#~])")


def _md(s: str) -> str:
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", " ".join(s.split()))


def markdown_summary(report: CheckReport) -> str:
    icon = {"PASSED": "✅", "ERROR": "⚠️", "NO DATA": "🚫"}.get(verdict(report), "❌")
    head = f"### grpolens check: {icon} {verdict(report).lower()} — {_md(str(report.run))}"
    if report.baseline:
        head += f" vs {_md(report.baseline)}"
    out = [head, "", f"{_md(summary_line(report))}; rules: {_md(report.rules_source)}", "",
           "| | " + " | ".join(name for name, _ in _COLUMNS) + " |",
           "|" + "|".join(["---"] + ["--:" if numeric else "---" for _, numeric in _COLUMNS]) + "|"]
    for o in report.outcomes:
        cells = [f"{_ICON[o.status]} {o.status}", *(_md(c) for c in _row(o))]
        out.append("| " + " | ".join(cells) + " |")
    problems = [o for o in report.outcomes if o.status in (FAIL, NO_DATA, ERROR)]
    if problems:
        out.append("")
        for o in problems:
            out.append(f"- **{_md(o.rule.name)}**: {_md(o.message)}")
            why = report.why(o)
            if why:
                out.append(f"  - why: {_md(why)}")
        cmds = [cmd for o in problems if (cmd := report.drilldown(o))]
        if cmds:
            # a run path may hold backticks and newlines: a fence longer than any run of backticks in the
            # commands is one that no line of theirs can close
            longest = max((len(m) for c in cmds for m in re.findall("`+", c)), default=0)
            fence = "`" * max(3, longest + 1)
            out += ["", "Drill down:", "", fence, *cmds, fence]
    for n in report.notes:
        out += ["", f"> {_md(n)}"]
    return "\n".join(out) + "\n\n"


def append_markdown(path, text: str) -> None:
    """Append (never truncate): ``$GITHUB_STEP_SUMMARY`` collects every step's summary."""
    from pathlib import Path

    from grpolens.errors import UserError

    p = Path(path)
    if not p.parent.exists():
        raise UserError(f"--summary-md: directory {p.parent} does not exist")
    with open(p, "a", encoding="utf-8") as f:
        f.write(text)
