"""``grpolens doctor RUN``: what is wrong with a run, since which step, why, and what to change."""

from __future__ import annotations

from typing import List, Optional

import typer

from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote
from grpolens.profiles import profile_help

FAIL_ON = ("info", "warning", "critical")


def doctor_cmd(
    run: str = typer.Argument(..., help="Run directory (contains grpolens.json), or s3://bucket/prefix."),
    profile: Optional[str] = typer.Option(None, "--profile", "-p", help=profile_help(
        "Whose setting names the suggestions use [default: the run's trainer]")),
    steps: Optional[str] = typer.Option(None, "--steps", help="Diagnose steps A:B only (inclusive; A: or :B open)."),
    fail_on: Optional[str] = typer.Option(None, "--fail-on", metavar="info|warning|critical",
                                          help="Exit 1 when a finding of this severity or worse exists, else 0."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: the run, its findings and each detector's status (no tables)."),
    explain: bool = typer.Option(True, "--explain/--no-explain", help="Decompose each finding's worst step into "
                                 "tokens, completions and prompts (reads those steps' tokens)."),
    detector: List[str] = typer.Option([], "--detector", "-d", help="Run only this detector (repeatable)."),
    storage_option: List[str] = STORAGE_OPTION,
) -> None:
    """Diagnose a run: each detector passed, skipped (why) or fired; each finding with its steps, evidence and a fix.

    Reads the recomputed metrics (recomputes first, incrementally, when they are missing or
    stale) and reads tokens only at the flagged steps. Exit 0, or with --fail-on 1 when a finding
    of that severity or worse exists; 2 on bad input.
    """
    refuse_unless_remote(storage_option, {"RUN": run})
    from grpolens.errors import UserError

    if fail_on is not None and fail_on not in FAIL_ON:
        raise UserError(f"--fail-on: {fail_on!r} is not one of {', '.join(FAIL_ON)}")
    from rich.console import Console

    from grpolens.analysis.doctor import diagnose
    from grpolens.commands.ui import progress_bar

    err = Console(stderr=True)
    with progress_bar(err, "recompute", enabled=not as_json) as tick:
        report = diagnose(run, profile=profile, steps=steps, explain=explain, progress=tick, only=detector or None)
    if as_json:
        import json

        from grpolens.commands.records import _clean

        typer.echo(json.dumps(_jsonable(report.to_dict(), _clean), ensure_ascii=False, indent=1))
    else:
        from grpolens.commands.doctor_view import print_report

        print_report(report, _console())
    if fail_on is not None and report.fails(fail_on):
        raise SystemExit(1)


def _jsonable(obj, clean):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, clean) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, clean) for v in obj]
    return clean(obj)


def _console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # CI logs: rich would assume 80 columns and squeeze the tables
        console = Console(width=max(console.width, 140))
    return console


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_cmd)
