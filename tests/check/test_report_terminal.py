"""The terminal report (``grpolens.check.report.print_report``): every status's row, the step
and numbers it shows, and the colours that say what failed."""

from __future__ import annotations

import io
from pathlib import Path

from grpolens.check import report as rep
from grpolens.check.rules import Rule
from grpolens.check.runner import CheckReport

from tests.check.report_cases import ERROR_MSG, NO_DATA_MSG, SKIP_MSG, every_status_report, outcome


def _rendered(report: CheckReport) -> list[str]:
    """What `grpolens check` prints, as plain text (a wide terminal, no colour)."""
    from rich.console import Console

    console = Console(width=200, color_system=None, record=True, file=io.StringIO())
    rep.print_report(report, console)
    return [ln.rstrip() for ln in console.export_text().splitlines()]


def _cells(line: str, bar: str, right: set[int]) -> list[str]:
    """The cells of one table line, each checked to be padded by one space and justified as its column is."""
    out = []
    for i, raw in enumerate(line.split(bar)[1:-1]):
        inner = raw[1:-1]
        text = inner.strip()
        assert raw[0] == raw[-1] == " " and inner == (text.rjust if i in right else text.ljust)(len(inner)), (i, raw)
        out.append(text)
    return out


def test_terminal_report_of_every_status():
    r = every_status_report(notes=["a note, with: colon"])
    r.golden_written = Path("out/golden.json")
    lines = _rendered(r)
    assert lines[0] == "grpolens check runs/cand vs golden.json"  # the title, flush left
    right = {4, 5, 8}  # value, baseline and step are numbers: right-aligned
    assert _cells(lines[2], "┃", right) == ["", "rule", "metric", "steps", "value", "baseline", "limit", "margin",
                                            "step"]
    # borders above and below the header, one line per rule, no rule between rows, the bottom border
    assert [set(lines[i]) for i in (1, 3, 9)] == [set("┏━┳┓"), set("┡━╇┩"), set("└─┴┘")]
    assert [_cells(ln, "│", right) for ln in lines[4:9]] == [
        ["FAIL", "kl rises", "kl/k3", "all steps", "0.75", "0.25", "≤ 0.5", "above by 0.25 (50%)", "3"],
        ["PASS", "entropy floor", "entropy", "mean, all steps", "2", "", "≥ 1", "headroom 1 (100%)", ""],
        ["NO DATA", "clip high", "clip/high", "all steps", "", "", "", "", "2"],
        ["ERROR", "mismatch vs golden", "mismatch/kl_k3", "all steps", "", "", "", "", ""],
        ["SKIP", "veto", "rollout_is/veto/seq_fraction", "all steps", "", "", "", "", ""],
    ]
    # every rule that did not pass says why, a failure with its drill-down command; then notes, the golden
    # file written and the verdict
    assert lines[10:] == [
        "FAIL kl rises: 1/4 step(s) outside the limit; first at step 3",
        "  drill down: grpolens tokens runs/cand --step 3 --by kl",
        "NO DATA clip high: " + NO_DATA_MSG,
        "ERROR mismatch vs golden: " + ERROR_MSG,
        "SKIP veto: " + SKIP_MSG,
        "note: a note, with: colon",
        "wrote golden values to out/golden.json",
        "ERROR: 1 passed, 1 failed, 1 without data, 1 skipped, 1 error(s) in 1.50s",
    ]


def test_terminal_rows_show_the_step_unless_a_reduced_rule_passed_and_numbers_only_of_judged_rules():
    from grpolens.check.evaluate import Outcome

    outcomes = [Outcome(Rule("p", "m", max=1.0), "PASS", "m", value=0.5, upper=1.0, step=4),
                Outcome(Rule("f", "m", reduce="max", max=1.0), "FAIL", "m", value=2.0, upper=1.0, step=6,
                        message="too high"),
                Outcome(Rule("s", "m", max=1.0), "SKIP", "m", value=2.0, baseline=1.0, upper=1.0, message="skipped")]
    lines = _rendered(CheckReport(Path("run"), outcomes, "rules.toml", None, seconds=0.25))
    assert lines[0] == "grpolens check run"  # no baseline
    assert [_cells(ln, "│", {4, 5, 8}) for ln in lines[4:7]] == [
        ["PASS", "p", "m", "all steps", "0.5", "", "≤ 1", "headroom 0.5 (50%)", "4"],
        ["FAIL", "f", "m", "max, all steps", "2", "", "≤ 1", "above by 1 (100%)", "6"],
        ["SKIP", "s", "m", "all steps", "", "", "", "", ""],
    ]
    assert lines[8:] == ["FAIL f: too high", "  drill down: grpolens tokens run --step 6 --by kl", "SKIP s: skipped",
                         "REGRESSION: 1 passed, 1 failed, 1 skipped in 0.25s"]


def test_terminal_report_that_passed():
    lines = _rendered(CheckReport(Path("run"), [outcome("PASS", message="fine")], "rules.toml", None, seconds=0.25))
    assert lines[0] == "grpolens check run" and lines[-1] == "PASSED: 1 passed, 0 failed in 0.25s"
    assert len(lines) == 1 + 5 + 1  # title, table (three borders, header, one row), verdict: no line for a pass


def _styles(report: CheckReport) -> dict[str, list[str]]:
    """Each styled piece of text the terminal report prints, with its ANSI SGR codes (1 bold, 31 red, 32 green,
    33 yellow, 35 magenta, 36 cyan) wherever it appears, in order."""
    import re

    from rich.console import Console

    buf = io.StringIO()
    rep.print_report(report, Console(width=200, color_system="standard", force_terminal=True, file=buf))
    out: dict[str, list[str]] = {}
    for codes, text in re.findall("\x1b\\[([0-9;]+)m([^\x1b]*)", buf.getvalue()):
        if text.strip() and codes != "0":  # 0: a reset, what follows is plain
            out.setdefault(text.strip(), []).append(codes)
    return out


def test_terminal_colours_say_what_failed():
    styles = _styles(every_status_report(notes=["a note"]))
    # failures and rules without data in bold red, errors bold magenta, skips yellow, passes green: in the table,
    # and (but passes) on the line that says why below it
    assert {s: styles[s] for s in ("FAIL", "NO DATA", "ERROR", "SKIP", "PASS")} == {
        "FAIL": ["1;31"] * 2, "NO DATA": ["1;31"] * 2, "ERROR": ["1;35"] * 2, "SKIP": ["33"] * 2, "PASS": ["32"]}
    assert styles["above by 0.25 (50%)"] == ["1;31"] and "headroom 1 (100%)" not in styles  # a failure's margin
    assert styles["kl rises"] == styles["kl rises:"] == ["1"]  # rule names in bold, in the table and below it
    assert "1/4 step(s) outside the limit; first at step 3" not in styles  # the message itself is plain
    assert styles["drill down: grpolens tokens runs/cand --step 3 --by kl"] == ["36"]
    assert styles["note: a note"] == ["33"]
    assert styles["ERROR:"] == ["1;35"]
    assert "1 passed, 1 failed, 1 without data, 1 skipped, 1 error(s) in 1.50s" not in styles
    passed = CheckReport(Path("run"), [outcome("PASS")], "rules.toml", None)
    assert _styles(passed)["PASSED:"] == ["1;32"]
    for status, word in (("FAIL", "REGRESSION:"), ("NO DATA", "NO DATA:")):
        assert _styles(CheckReport(Path("run"), [outcome(status)], "rules.toml", None))[word] == ["1;31"]
