"""``grpolens parity RUN``: compare recomputed metrics with the trainer's own log."""

from __future__ import annotations

from typing import List, Optional

import typer

from grpolens.profiles import profile_help
from grpolens.commands.records import CSV_OPTION, JSON_OPTION
from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote


def parity_cmd(
    run: str = typer.Argument(..., help="Run directory, or s3://bucket/prefix."),
    log: Optional[str] = typer.Option(None, "--log", help="The trainer's JSONL log, a file or s3://... [default: RUN/grpolens/trl_log.jsonl for --profile trl]."),
    profile: str = typer.Option("trl", "--profile", "-p", help=profile_help("Profile whose names and reductions the log uses")),
    rtol: float = typer.Option(1e-5, "--rtol", help="Relative tolerance."),
    atol: float = typer.Option(1e-8, "--atol", help="Absolute tolerance (TRL's float32 kl and loss get floors, see docs)."),
    set_: List[str] = typer.Option([], "--set", help="Override a config key: key=value. Repeatable."),
    show: int = typer.Option(20, "--show", help="Disagreements listed at most."),
    as_json: bool = JSON_OPTION,
    as_csv: bool = CSV_OPTION,
    storage_option: List[str] = STORAGE_OPTION,
) -> None:
    """Check that recompute reproduces every value the trainer logged (exit 1 if any differs).

    Each key the log and the profile both have is compared step by step; keys only the trainer
    knows (grad_norm, learning_rate) are skipped. A value the run does not determine (verl's
    Clip-Cov zeroes a random choice of tokens) is listed as undetermined, with why, and is no failure. --json/--csv print every compared value as a
    row (step, key, logged, grpolens, status); the exit code is the same.
    """
    refuse_unless_remote(storage_option, {"RUN": run, "--log": log})
    from rich.console import Console
    from rich.table import Table

    from grpolens.run.reader import parse_overrides
    from grpolens.errors import UserError
    from grpolens import plugins
    from grpolens.analysis.parity import compare, failed
    from grpolens.text import format_value

    from grpolens.commands.records import output_format, write_records

    output_format(as_json, as_csv)  # both at once: a usage error before the work
    plugins.get(profile)
    rows = compare(run, log, profile=profile, rtol=rtol, atol=atol, overrides=parse_overrides(set_))
    console = Console()
    if not rows:
        raise UserError("nothing to compare: the log has no key that the profile produces "
                        f"(is --profile {profile} the trainer that wrote it?)")
    bad = failed(rows)
    open_ = [r for r in rows if r.status == "undetermined"]
    out_fmt = output_format(as_json, as_csv)
    if out_fmt:
        write_records(({"step": r.step, "key": r.key, "logged": r.logged, "grpolens": r.ours, "status": r.status,
                        "why": r.why} for r in rows), out_fmt, columns=["step", "key", "logged", "grpolens", "status", "why"])
        if bad:
            raise typer.Exit(1)
        return
    keys = {r.key for r in rows}
    bad_keys = {r.key for r in bad}
    t = Table(title=f"{run}: --profile {profile} against the trainer's log")
    for c in ("metric", "steps", "agree", "worst |diff|"):
        t.add_column(c, justify="left" if c == "metric" else "right")
    for k in sorted(keys):
        rs = [r for r in rows if r.key == k]
        diffs = [abs(r.logged - r.ours) for r in rs if r.logged is not None and r.ours is not None]
        style = "red" if k in bad_keys else ""
        t.add_row(k, str(len(rs)), f"{sum(r.status == 'ok' for r in rs)}/{len(rs)}",
                  format_value(max(diffs)) if diffs else "—", style=style)
    console.print(t)
    for r in bad[:show]:
        console.print(str(r), markup=False, highlight=False)
    for r in open_[:show]:  # not a failure: the run does not hold what decided the value
        console.print(str(r), markup=False, highlight=False)
    verdict = (f"{len(rows) - len(bad) - len(open_)}/{len(rows)} logged values reproduced; "
               f"{len(keys - {r.key for r in rows if r.status != 'ok'})}/{len(keys)} metrics agree at every step")
    if open_:
        verdict += f"; {len(open_)} not determined by the run (said why above)"
    console.print(("[green]" if not bad else "[red]") + verdict + "[/]")
    if bad:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("parity")(parity_cmd)
