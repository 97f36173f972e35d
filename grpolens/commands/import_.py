"""``grpolens import SOURCE DIR OUT``: turn existing generation dumps into a grpolens run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

SOURCES = ("verl-jsonl", "maxent-sidecars")


def import_cmd(
    source: str = typer.Argument(..., help="What DIR holds: verl-jsonl (verl's rollout_data_dir) or "
                                           "maxent-sidecars (MaxEnt-GRPO rich_completions/*.json)."),
    src: Path = typer.Argument(..., help="Directory with the dumps."),
    out: Path = typer.Argument(..., help="New run directory to write."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Local tokenizer directory or tokenizer.json: "
                                                                      "count completion lengths in tokens (default: characters)."),
    max_response_length: Optional[int] = typer.Option(None, "--max-response-length", min=1,
                                                      help="verl-jsonl with --tokenizer: completions this long count as truncated."),
    key: Optional[str] = typer.Option(None, "--key", help="maxent-sidecars: the table key (<key>_step_NNNNNN.json) "
                                                          "when the directory holds several."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it is an existing grpolens run."),
) -> None:
    """Import generation dumps (text and scores) into a run's samples table, and say what it can give.

    Such a run has no per-token data: rewards, group statistics, lengths and diversity work;
    policy, KL, clipping, entropy and rollout-IS metrics do not (the command prints the full list).
    """
    from rich.console import Console
    from rich.text import Text

    from grpolens.adapters import importers
    from grpolens.errors import UserError

    if source == "verl-jsonl":
        res = importers.import_verl_jsonl(src, out, tokenizer=tokenizer, max_response_length=max_response_length,
                                          overwrite=overwrite)
    elif source == "maxent-sidecars":
        if max_response_length is not None:
            raise UserError("--max-response-length applies to verl-jsonl only")
        res = importers.import_maxent_sidecars(src, out, key=key, tokenizer=tokenizer, overwrite=overwrite)
    else:
        raise UserError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    Console(soft_wrap=True).print(Text(res.statement()))  # paths and keys come from the user's files


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)
