"""``grpolens export RUN --to TRACKER``: the recomputed metrics into W&B, TensorBoard, MLflow or trackio."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote
from grpolens.commands.variant_option import VARIANT_OPTION
from grpolens.export import TRACKERS

_TRACKERS = f"{', '.join(list(TRACKERS)[:-1])} or {list(TRACKERS)[-1]}"  # the built-ins; plugins may add more


#: the tracker-specific options, checked in this order, and what the refusal adds
_OWNED = {"resume": "", "online": " (the other trackers are local unless given a server)", "logdir": "",
          "tracking_uri": ""}


def export_cmd(
    run: str = typer.Argument(..., help="Run directory (contains grpolens.json), or s3://bucket/prefix (local files go to ./<run name>.grpolens/)."),
    to: str = typer.Option(..., "--to", metavar="TRACKER", help=f"Tracker: {_TRACKERS}."),
    profile: str = typer.Option("grpolens", "--profile", "-p", metavar="PROFILE",
                                help="Metric names and reductions exported (as for recompute)."),
    project: str = typer.Option("grpolens", "--project", metavar="NAME",
                                help="W&B project, MLflow experiment or trackio project."),
    name: Optional[str] = typer.Option(None, "--name", metavar="NAME",
                                       help="The run's name in the tracker [default: the grpolens run's name]."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="RUN_ID",
                                         help="W&B: add the metrics to this existing run (e.g. the trainer's own)."),
    online: bool = typer.Option(False, "--online", help="W&B: send to the W&B server (default: an offline run "
                                                         "directory, unless WANDB_MODE is set)."),
    logdir: Optional[Path] = typer.Option(None, "--logdir", metavar="DIR",
                                          help="TensorBoard: log directory [default: tensorboard/ in the profile's output "
                                               "folder: RUN/grpolens/, RUN/grpolens/PROFILE/, the variant's]."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", metavar="URI",
                                               help="MLflow: tracking store or server [default: MLFLOW_TRACKING_URI, "
                                                    "else mlflow.db in the profile's output folder: "
                                                    "sqlite:///RUN/grpolens/mlflow.db, RUN/grpolens/PROFILE/, "
                                                    "the variant's]."),
    tables: bool = typer.Option(True, "--tables/--no-tables",
                                help="Also export the completions and top-token tables (where the tracker has a table type)."),
    explain: bool = typer.Option(False, "--explain", help="Also export, as a table, the explanation of each step a built-in check rule flags (its top token ids, prompts and completions; grpolens explain). W&B, MLflow and trackio."),
    variant: Optional[str] = VARIANT_OPTION,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, no summary line."),
    storage_option: List[str] = STORAGE_OPTION,
) -> None:
    """Export the run's recomputed metrics (recomputing first when stale) to an experiment tracker,
    as grpolens/<metric> at each training step, with grpolens/step as the x-axis.

    Nothing leaves the machine unless asked: W&B writes an offline run (--online to send), MLflow a
    local SQLite store, TensorBoard and trackio local files, in the folder of the profile's outputs
    (RUN/grpolens/, RUN/grpolens/PROFILE/, or the variant's RUN/grpolens/variants/KEY/). Re-exporting
    never logs a step twice: W&B, MLflow and trackio add only the steps the destination lacks,
    TensorBoard rewrites the whole run and removes its earlier export. --variant exports a what-if
    variant of the run (recompute --set) as a tracker run of its own, named RUN @ LABEL. Each tracker's client is an extra: pip install "grpolens[wandb]" (or
    tensorboard, mlflow, trackio). See docs/export.md.
    """
    refuse_unless_remote(storage_option, {"RUN": run})
    from rich.console import Console

    from grpolens.commands.ui import progress_bar
    from grpolens.errors import UserError
    from grpolens.export import ExportOptions, ExportSource, export_run, exporter_class, exporters

    cls = exporter_class(to)
    # a tracker's own options (Exporter.owns), refused for the others
    given = {"resume": resume is not None, "online": online, "logdir": logdir is not None,
             "tracking_uri": tracking_uri is not None}
    for option, note in _OWNED.items():
        if given[option] and option not in cls.owns:
            owners = " or ".join(n for n, c in exporters().items() if option in c.owns)
            raise UserError(f"--{option.replace('_', '-')} applies to --to {owners} only{note}")
    if explain and not cls.has_tables:
        raise UserError(f"--explain: {to} has no table type; the explanations go to wandb, mlflow or trackio")
    if explain and variant is not None:
        raise UserError("--explain: a variant's steps are not explained (explain reads the run as recorded); drop --variant")
    console = Console(stderr=True)
    what_if = None
    if variant is not None:
        from grpolens.commands.variant_option import variant_overrides

        _, what_if = variant_overrides(run, variant, [])
    with progress_bar(console, "recompute", enabled=not quiet) as tick:
        source = ExportSource.load(run, profile, progress=tick, variant=what_if)
    options = ExportOptions(project=project, name=name, resume=resume, online=online, logdir=logdir,
                            tracking_uri=tracking_uri, tables=tables, explain=explain)
    exporter = cls(source, options)
    with progress_bar(console, f"export to {to}", enabled=not quiet) as tick:
        out = export_run(source, exporter, progress=tick)
    if out["not_exported"]:  # said even with --quiet: a number is missing from the tracker
        from grpolens.export.base import describe_not_exported

        console.print(f"warning: {describe_not_exported(out['not_exported'])}", highlight=False, markup=False)
    if not quiet:
        tabs = f"; tables: {', '.join(out['tables'])}" if out["tables"] else ""
        console.print(f"{out['exported']} step(s) exported, {out['skipped']} already there{tabs} -> {out['where']}",
                      highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
