"""The person's view of a doctor report: findings worst first, each with its evidence and fix,
then every detector's status. Every string from the run (metric and reward names, token text)
goes in as rich ``Text``, never as markup."""

from __future__ import annotations

import shlex

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from grpolens.text import format_value

STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
STATUS_STYLE = {"fired": "bold", "passed": "green", "skipped": "dim"}


def _steps(steps: list[int]) -> str:
    if not steps:
        return "—"
    if len(steps) == 1:
        return f"step {steps[0]}"
    contiguous = steps == list(range(steps[0], steps[0] + len(steps)))
    return f"steps {steps[0]}–{steps[-1]}" if contiguous else f"{len(steps)} steps, {steps[0]}…{steps[-1]}"


def _numbers(evidence: dict) -> Text:
    parts = [f"{k}={format_value(v) if isinstance(v, float) else v}" for k, v in evidence.items()
             if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    return Text("  ".join(parts), style="dim")


def _explained(ex: dict) -> list:
    out = []
    if ex.get("headline"):
        out.append(Text("why: ") + Text(str(ex["headline"])))
    elif ex.get("note"):
        out.append(Text(f"why (step {ex.get('step')}): ") + Text(str(ex["note"])))
    for dim, rows in (ex.get("by") or {}).items():
        top = [r for r in rows if r.get("key") != "other"][:3]
        if top:
            line = Text(f"  top {dim}: ", style="dim")
            for i, r in enumerate(top):
                share = r.get("share")
                line.append(("" if i == 0 else ", ") + str(r.get("label", r.get("key"))))
                if isinstance(share, (int, float)):
                    line.append(f" {share:.0%}", style="dim")
            out.append(line)
    conc = ex.get("concentration") or {}
    if conc:
        out.append(Text("  concentration: " + "  ".join(f"{k}={format_value(v)}" for k, v in conc.items()), style="dim"))
    return out


def print_report(report, console: Console) -> None:
    worst = report.worst_severity()
    head = Text(f"{report.run}: ")
    head.append(f"{len(report.findings)} finding(s)", style=STYLE.get(worst, "green"))
    head.append(f", worst {worst}" if worst else ", nothing wrong found")
    head.append(f"  (steps {report.steps[0]}–{report.steps[-1]}, suggestions in {report.profile} terms)", style="dim")
    console.print(head)
    for f in report.findings:
        title = Text(f.severity.upper(), style=STYLE[f.severity]) + Text(f"  {f.id}  ") + Text(f.metric, style="bold") \
            + Text(f"  {_steps(f.steps)}", style="dim")
        body = [Text(f.summary), _numbers({k: v for k, v in f.evidence.items() if k != "explain"})]
        if "explain" in f.evidence:
            body += _explained(f.evidence["explain"])
        if f.suggestion:
            body.append(Text("fix: ", style="bold") + Text(f.suggestion))
        if f.worst_step is not None:
            body.append(Text(f"more: grpolens explain {shlex.quote(report.run)} --metric {shlex.quote(f.metric)} "
                             f"--step {f.worst_step}", style="dim"))
        console.print(Panel(Group(*body), title=title, title_align="left", border_style=STYLE[f.severity]))
    t = Table(title="detectors", title_justify="left", show_lines=False)
    for col in ("detector", "status", "why"):
        t.add_column(col)
    for d in report.detectors:
        t.add_row(Text(d.id), Text(d.status, style=STATUS_STYLE.get(d.status, "")), Text(d.why))
    console.print(t)
    for note in report.notes:
        console.print(Text("note: ", style="yellow") + Text(note))
