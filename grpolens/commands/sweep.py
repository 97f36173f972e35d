"""``grpolens sweep RUN --param rollout_is.upper=1.5,2,3``: rollout-IS thresholds over a grid, in one pass."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote


def sweep_cmd(
    run: str = typer.Argument(..., help="Run directory (contains grpolens.json), or s3://bucket/prefix."),
    param: List[str] = typer.Option([], "--param", help="rollout_is.KEY=V1,V2,... (KEY: level, mode, lower, upper, mask_lower, mask_upper, veto_lower, veto_upper; 'none' unsets a bound). Repeatable: the grid is every combination."),
    level: Optional[str] = typer.Option(None, "--level", help="IS level for every grid point: token, sequence or geometric."),
    mode: Optional[str] = typer.Option(None, "--mode", help="Mode for every grid point: none, truncate, truncate_upper, mask, both, icepop."),
    steps: Optional[str] = typer.Option(None, "--steps", help="Step range A:B (inclusive; either end optional) or one step N."),
    set_: List[str] = typer.Option([], "--set", help="Override a config key first: key=value (a.b=v for nested). Repeatable."),
    config: Optional[Path] = typer.Option(None, "--config", help="JSON or TOML file of config overrides (applied before --set)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Parquet table, one row per step and grid point (default: RUN/grpolens/sweep.parquet)."),
    html: Optional[Path] = typer.Option(None, "--html", help="Also write a plotly chart (one line per grid point) to this HTML file."),
    engine: str = typer.Option("default", "--engine", help="default: threads in this process; ray: Ray tasks, one per group of shards (pip install 'grpolens[ray]'; docs/distributed.md)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --engine ray: 'auto' or ray://HOST:PORT joins an existing cluster [default: a local Ray instance]."),
    storage_option: List[str] = STORAGE_OPTION,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary, no progress bar."),
) -> None:
    """Evaluate rollout-IS thresholds on a grid: veto and rejection rates, ESS, IS weights and the
    share of advantage mass removed, per step and grid point -- all points in one pass over the data."""
    refuse_unless_remote(storage_option, {"RUN": run})
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from grpolens.run import format as fmt
    from grpolens.run.reader import parse_overrides
    from grpolens.analysis.sweep import parse_params, summary, sweep, write_html
    from grpolens.commands.ui import progress_bar

    console = Console(stderr=True)
    from grpolens.metrics.engine import make_engine

    params = parse_params(param)
    runner = make_engine(engine, ray_address)
    with progress_bar(console, "sweep", enabled=not quiet) as tick:
        df = sweep(run, params, overrides=parse_overrides(set_), config_file=config, steps=steps, level=level,
                   mode=mode, progress=tick, engine=runner)
    if out is not None:
        path = out
    else:  # RUN/grpolens/, or ./<run name>.grpolens/ for a run on object storage
        path = fmt.derived_dir(run) / "sweep.parquet"
    fmt.atomic_write_table(path, df.to_arrow())
    if html is not None:
        write_html(df, params, html, f"grpolens sweep: {fmt.as_run(run).name}")
    if quiet:
        return
    s = summary(df, params)
    t = Table(title=f"{s.height} grid point(s), {df['step'].n_unique()} step(s): means over steps; worst step, "
                    "min ESS and max weight over steps", title_justify="left")
    for c in s.columns:
        t.add_column(c.removeprefix("rollout_is."), justify="right")
    for row in s.iter_rows():
        t.add_row(*[Text("—" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)) for v in row])
    Console().print(t)
    console.print(f"{df.height} row(s) -> {path}" + (f"; chart -> {html}" if html is not None else ""), highlight=False)


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep_cmd)
