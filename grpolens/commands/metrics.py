"""``grpolens metrics``: the metric catalogue, generated from the registry."""

from __future__ import annotations

from typing import Optional

import typer

from grpolens.profiles import profile_help


def metrics_cmd(
    family: Optional[str] = typer.Option(None, "--family", help="Only this family."),
    profile: Optional[str] = typer.Option(None, "--profile", "-p", help=profile_help("Only metrics this profile logs, with its names")),
    markdown: bool = typer.Option(False, "--markdown", help="Print the catalogue as Markdown (docs/metrics.md is made this way)."),
    profiles: bool = typer.Option(False, "--profiles", help="Print the table of registered profiles as Markdown (as in docs/profiles.md)."),
) -> None:
    """List every metric: definition, name in each profile, config it depends on."""
    from rich.console import Console
    from rich.table import Table

    from grpolens.errors import UserError
    from grpolens.metrics.catalogue import catalogue_markdown, catalogue_rows, profiles_markdown
    from grpolens import plugins

    plugins.load_plugins()
    if profiles:
        typer.echo(profiles_markdown())
        return
    if profile is not None:
        plugins.get(profile)
    rows = catalogue_rows(family=family, profile=profile)
    if family is not None and not rows:
        raise UserError(f"--family: no metrics in family {family!r}")
    if markdown:
        typer.echo(catalogue_markdown(rows))
        return
    t = Table(show_lines=False)
    t.add_column("metric", style="bold")
    t.add_column("definition")
    t.add_column("names per profile")
    t.add_column("config")
    for r in rows:
        names = ", ".join(f"{p}: {n}" for p, n in r["names"].items() if p != "grpolens")
        t.add_row(r["name"], r["doc"], names or "-", ", ".join(r["config"]) or "-")
    Console().print(t)


def register(app: typer.Typer) -> None:
    app.command("metrics")(metrics_cmd)
