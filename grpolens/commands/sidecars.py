"""``grpolens sidecars RUN``: MaxEnt-GRPO-compatible rich-completion JSON files, one per step."""

from __future__ import annotations

from typing import List, Optional

import typer

from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote


def sidecars_cmd(
    run: str = typer.Argument(..., help="Run directory (contains grpolens.json), or s3://bucket/prefix (files go to ./<run name>.grpolens/)."),
    steps: Optional[str] = typer.Option(None, "--steps", help="Step range A:B (inclusive; either end optional) or one step N."),
    nan_literals: bool = typer.Option(False, "--nan-literals", help="Write missing numbers as bare NaN (and ±inf as Infinity), "
                                      "byte for byte what the reference's json.dump writes; default: strict JSON with null."),
    key: str = typer.Option("rich_completions", "--key", help="File name prefix: <key>_step_<step:06d>.json (the reference's rich_log_completions_key)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, no summary."),
    storage_option: List[str] = STORAGE_OPTION,
) -> None:
    """Write RUN/grpolens/rich_completions/<key>_step_<step>.json for every step with samples.

    Each file holds all completions generated at the step, across all ranks, with the reference's
    columns. completions.parquet is brought up to date first (an incremental recompute).
    """
    refuse_unless_remote(storage_option, {"RUN": run})
    import polars as pl
    from rich.console import Console

    from grpolens.run import format as fmt
    from grpolens.analysis import sidecars
    from grpolens.analysis.recompute import recompute
    from grpolens.run.reader import parse_steps
    from grpolens.errors import UserError
    from grpolens.commands.ui import progress_bar

    key = sidecars.check_key(key)
    fmt.read_manifest(run)
    lo, hi = parse_steps(steps)
    console = Console(stderr=True)
    with progress_bar(console, "recompute", enabled=not quiet) as tick:
        recompute(run, progress=tick)
    path = sidecars.completions_path(run)
    table = pl.read_parquet(path) if path.is_file() else sidecars.empty_table()
    sample_steps = [s for s in fmt.list_steps(run, fmt.SAMPLES) if (lo is None or s >= lo) and (hi is None or s <= hi)]
    if not sample_steps:
        have = fmt.list_steps(run, fmt.SAMPLES)
        where = f"; the run has samples for steps {have[0]}..{have[-1]}" if have else "; the run has no samples shards"
        raise UserError(f"--steps: no step with samples in {steps or 'the run'}{where}")
    # steps the recompute cache kept but completions.parquet lacks (written before it existed)
    gaps = sorted(set(sample_steps) - set(table["step"].unique().to_list()))
    if gaps:
        with progress_bar(console, "completions", enabled=not quiet) as tick:
            extra = sidecars.build_steps(run, gaps, progress=tick)
        if extra.height:
            table = sidecars.concat([table, extra])
            fmt.atomic_write_table(path, table.to_arrow())
    sel = table.filter(pl.col("step").is_in(sample_steps))
    with progress_bar(console, "sidecars", enabled=not quiet) as tick:
        paths = sidecars.write_sidecars(run, sel, key=key, nan_literals=nan_literals, progress=tick)
    if not quiet:
        where = paths[0].parent if paths else fmt.derived_dir(run) / sidecars.SIDECAR_DIR
        console.print(f"{len(paths)} sidecar file(s), {sel.height} completion(s) -> {where}", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("sidecars")(sidecars_cmd)
