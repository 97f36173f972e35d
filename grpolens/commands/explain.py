"""``grpolens explain RUN --metric M --step S``: why a metric moved, decomposed exactly."""

from __future__ import annotations

from typing import List, Optional

import typer

from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote
from grpolens.profiles import profile_help


def explain_cmd(
    run: str = typer.Argument(..., help="Run directory, or s3://bucket/prefix."),
    metric: str = typer.Option(..., "--metric", "-m", help="Metric to explain: a grpolens name or the profile's name for it (kl/k3, kl, entropy...)."),
    step: int = typer.Option(..., "--step", "-s", help="The step whose value is explained."),
    baseline: Optional[str] = typer.Option(None, "--baseline", "-b", help="What the step is compared with: a step S0, or A:B (the mean over those steps, inclusive) [default: the previous step]."),
    by: Optional[str] = typer.Option(None, "--by", help="Dimensions, comma-separated: token_id, completion, group, position, length, rank, micro_batch, outcome [default: all that apply]."),
    profile: str = typer.Option("grpolens", "--profile", "-p", help=profile_help()),
    top: int = typer.Option(10, "--top", "-k", help="Keys listed per dimension; the rest are summed as 'other'."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (keys in docs/explain.md) instead of tables."),
    storage_option: List[str] = STORAGE_OPTION,
) -> None:
    """Decompose a metric's change at a step, value(S) − baseline, into exact contributions.

    Contributions of token ids (decoded when the run has a tokenizer), completions, prompt groups,
    positions, completion lengths, ranks, micro-batches and outcomes each sum to the change; a key
    present at both steps splits into mix (its share changed) and rate (its mean changed). The
    profile's own reduction is explained (TRL's per-micro-batch means, verl's seq-mean-token-mean);
    an extremum is explained by the unit that attains it; a standard deviation or a quantile gets
    one line saying so. Only the two steps' shards are read.
    """
    refuse_unless_remote(storage_option, {"RUN": run})
    import json
    import sys

    from grpolens.analysis.explain import explain, parse_baseline

    e = explain(run, metric, step, baseline=parse_baseline(baseline), by=by, profile=profile, top=top)
    if as_json:
        from grpolens.commands.records import _clean

        sys.stdout.write(json.dumps(_deep_clean(e.to_dict(), _clean), ensure_ascii=False, allow_nan=False) + "\n")
        return
    from rich.console import Console

    from grpolens.analysis.explain.render import render

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 140))
    render(e, console)


def _deep_clean(v, clean):
    if isinstance(v, dict):
        return {k: _deep_clean(x, clean) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_deep_clean(x, clean) for x in v]
    return clean(v)


def register(app: typer.Typer) -> None:
    app.command("explain")(explain_cmd)
