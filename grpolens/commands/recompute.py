"""``grpolens recompute RUN``: recompute every metric per step."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote
from grpolens.profiles import profile_help


def recompute_cmd(
    run: str = typer.Argument(..., help="Run directory (contains grpolens.json), or s3://bucket/prefix (docs/distributed.md)."),
    out: Optional[str] = typer.Option(None, "--out", help="Output directory or s3:// prefix [default: RUN/grpolens, or RUN/grpolens/<profile>; for an s3:// run ./<run name>.grpolens; with --set/--config RUN/grpolens/variants/<key>]."),
    profile: str = typer.Option("grpolens", "--profile", "-p", help=profile_help()),
    steps: Optional[str] = typer.Option(None, "--steps", help="Step range A:B (inclusive; either end optional) or one step N."),
    set_: List[str] = typer.Option([], "--set", help="Override a config key: key=value (JSON value; a.b=v for nested). Repeatable."),
    config: Optional[Path] = typer.Option(None, "--config", help="JSON or TOML file of config overrides (applied before --set)."),
    full: bool = typer.Option(False, "--full", help="Ignore the per-step cache and recompute every step."),
    last: int = typer.Option(5, "--last", help="Steps shown in the summary table."),
    show_all: bool = typer.Option(False, "--all", help="Show every metric in the summary, not only the key ones."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary, no progress bar."),
    engine: str = typer.Option("default", "--engine", help="default: this machine, on --workers processes; ray: Ray tasks, one per group of shards (pip install 'grpolens[ray]'; docs/distributed.md)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --engine ray: 'auto' or ray://HOST:PORT joins an existing cluster [default: a local Ray instance]."),
    storage_option: List[str] = STORAGE_OPTION,
    only: List[str] = typer.Option([], "--only", help="Compute only these metrics: families (clip, kl, ...), metric names or globs ('rollout_is/applied/*'), comma-separated or repeated. Only the work they need runs; no cache, no other outputs; written to --out [default: RUN/grpolens/only]."),
    per_step: bool = typer.Option(False, "--per-step", help="--profile trl: one row per optimizer step (what TRL logs with logging_steps=1) instead of one per TRL log (its logging windows, from the manifest)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Worker processes computing steps in parallel [default: GRPOLENS_WORKERS, else the CPU count, at most 8]; 1 computes in this process. Workers start only for at least 2 steps each; --engine ray and --is-weights compute in this process (docs/distributed.md)."),
    is_weights: bool = typer.Option(False, "--is-weights", help="Also write per-token rollout IS weights and the modified loss mask to RUN/grpolens/is_weights/ (./<run name>.grpolens/is_weights/ for an s3:// run), or OUT/is_weights/ with --out (a directory or s3:// prefix: each file uploaded atomically); see docs/rollout-is.md."),
) -> None:
    """Recompute every GRPO/GSPO/CISPO metric per step from the run's token and sample shards.

    Writes metrics.parquet (one row per step) and metrics.jsonl (one JSON object per step). Under
    --profile trl a row is one of TRL's logs (the mean over its logging window, at the step TRL
    logged), unless --per-step.

    With --set or --config the recompute is a what-if variant of the run: it writes under
    RUN/grpolens/variants/<key>/ (key: a hash of the overrides, recorded with a label in
    variant.json there), never over the run's own metrics; serve lists it as a run of its own
    (docs/variants.md).
    """
    refuse_unless_remote(storage_option, {"RUN": run, "--out": out})
    console = None if quiet else _stderr()  # --quiet: rich (~35 ms) only for a warning
    res = _fresh(run, out, profile, steps, per_step, quiet) if not (
        full or only or is_weights or set_ or config is not None or engine != "default" or "://" in run
        or (out is not None and "://" in out)) else None
    extra = None  # the --is-weights writer (a fresh re-run never has one)
    if res is None:
        from grpolens.run.no_pandas import pyarrow_without_pandas

        pyarrow_without_pandas()  # the program: pyarrow need not import pandas (0.27 s) on its first read
        from grpolens.analysis.recompute import recompute
        from grpolens.run.reader import parse_overrides
        from grpolens.commands.ui import progress_bar

        from grpolens.metrics.engine import make_engine

        if console is not None:
            from grpolens.functional.jit import on_first_compile

            on_first_compile(lambda: console.print(
                "note: compiling grpolens' per-token kernels, once after an install or upgrade (about 15 s of "
                "CPU; later runs load them from numba's cache)", style="yellow", highlight=False, markup=False))
        overrides = parse_overrides(set_)
        runner = make_engine(engine, ray_address)
        if is_weights:
            from grpolens.analysis.is_weights import is_weight_writer

            extra = [is_weight_writer(run, overrides, config, out)]
        with progress_bar(console, "recompute", enabled=not quiet) as tick:
            res = recompute(run, out=out, profile=profile, steps=steps, overrides=overrides, config_file=config,
                            incremental=not full, progress=tick, result=True, extra_visitors=extra, engine=runner,
                            only=only or None, per_step=per_step, workers=workers)
    if extra and extra[0].without_rollout:  # shown with --quiet too: the weights are incomplete
        gaps = extra[0].without_rollout
        console = console or _stderr()
        console.print(f"warning: --is-weights: {len(gaps)} token shard(s) have no rollout_logp values, so their "
                      f"tokens have no IS weights (first: {gaps[0]})", style="yellow", highlight=False, markup=False,
                      soft_wrap=True)
    if quiet:
        return
    from grpolens.commands.ui import summary_table
    for note in res.notes:
        console.print(f"[yellow]note:[/] {note}", markup=True, highlight=False)

    from rich.console import Console

    out_console = Console()
    if not out_console.is_terminal:  # piped or captured: do not squeeze the table to 80 columns
        out_console = Console(width=max(out_console.width, 120))
    if show_all:
        cols = None
    elif getattr(res, "key_columns", None):  # a re-run with nothing new: as the writing run found them
        cols = res.key_columns
    else:
        from grpolens.analysis.recompute import key_columns

        cols = key_columns(res.metrics.columns, profile)
    n_metrics = res.metrics.width - 1
    title = f"last {min(last, res.metrics.height)} step(s): " + (
        f"all {n_metrics} metrics" if show_all else f"{len(cols)} key metrics of {n_metrics} (--all for every one)")
    out_console.print(summary_table(res.metrics, last=last, columns=cols or None, title=title))
    console.print(
        f"{len(res.computed_steps)} step(s) computed, {len(res.reused_steps)} reused from cache -> "
        f"{res.out_dir / 'metrics.parquet'}", highlight=False, markup=False,
    )
    if res.variant is not None and out is None:
        console.print(f"what-if variant {res.variant.key} ({res.variant.label}): the run's own metrics are untouched; "
                      f"grpolens serve lists it, check/export take --variant {res.variant.key}",
                      highlight=False, markup=False)


def _stderr():
    from rich.console import Console

    return Console(stderr=True)


def _fresh(run: str, out: Optional[str], profile: str, steps: Optional[str], per_step: bool, quiet: bool):
    """A re-run with nothing new: the written outputs, found without importing the engine
    (``grpolens.analysis.fresh``); None when the recompute has work to do."""
    from types import SimpleNamespace

    from grpolens.analysis.fresh import fresh_outputs

    hit = fresh_outputs(run, out, profile, steps, per_step)
    if hit is None:
        return None
    metrics = None
    if not quiet:  # the summary needs the table; --quiet needs nothing
        import polars as pl

        try:
            metrics = pl.read_parquet(hit.out_dir / "metrics.parquet")
        except Exception:  # noqa: BLE001 - unreadable after all: the ordinary path rewrites it
            return None
    return SimpleNamespace(metrics=metrics, out_dir=hit.out_dir, computed_steps=[], reused_steps=hit.reused_steps,
                           notes=hit.notes, key_columns=hit.key_columns, variant=None)


def register(app: typer.Typer) -> None:
    app.command("recompute")(recompute_cmd)
