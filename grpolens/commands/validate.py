"""``grpolens validate RUN``: check a run against the format and list every problem at once."""

from __future__ import annotations

from typing import List

import typer

from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote


def validate_cmd(
    run: str = typer.Argument(..., help="Run directory (contains grpolens.json), or s3://bucket/prefix (docs/distributed.md)."),
    as_json: bool = typer.Option(False, "--json", help="Print the problems as JSON lines instead of a table."),
    storage_option: List[str] = STORAGE_OPTION,
) -> None:
    """Check a run's manifest, layout, schemas and keys; report every problem, naming file and column.

    Exit status: 0 when there are no errors (warnings allowed), 1 when problems were found,
    2 for a usage error (the path is not a directory).
    """
    refuse_unless_remote(storage_option, {"RUN": run})
    from grpolens.run.no_pandas import pyarrow_without_pandas

    pyarrow_without_pandas()  # the program: pyarrow need not import pandas (0.27 s) on its first read
    import json

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from grpolens.run.validate import ERROR, validate_run

    report = validate_run(run)  # RunFormatError (not a directory) -> exit 2 in cli.main
    console = Console()
    if as_json:
        for p in report.problems:
            print(json.dumps({"severity": p.severity, "path": p.path, "column": p.column, "message": p.message}))
    elif report.problems:
        table = Table(show_lines=False, pad_edge=False)
        for name in ("severity", "file", "column", "problem"):
            table.add_column(name, overflow="fold")
        for p in report.problems:
            style = "bold red" if p.severity == ERROR else "yellow"
            # File names and messages may carry text from the run: never interpret them as markup.
            table.add_row(Text(p.severity, style=style), Text(p.path), Text(p.column or ""), Text(p.message))
        console.print(table)
    n_err, n_warn = len(report.errors), len(report.warnings)
    verdict = Text("OK", style="bold green") if report.ok else Text("FAILED", style="bold red")
    summary = Text.assemble(
        verdict, f" {run}: {report.files['tokens']:,} token files ({report.rows['tokens']:,} rows), "
                 f"{report.files['samples']:,} samples files ({report.rows['samples']:,} rows); "
                 f"{n_err} error(s), {n_warn} warning(s)",
    )
    Console(stderr=True, soft_wrap=True).print(summary, highlight=False)
    if not report.ok:
        # SystemExit, not typer.Exit: click returns typer.Exit's code in non-standalone mode and
        # cli.main would drop it.
        raise SystemExit(1)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate_cmd)
