"""``grpolens completions RUN --step N``: a step's completions with their per-sequence token columns."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from grpolens.commands.records import CSV_OPTION, JSON_OPTION
from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote

#: --sort choice -> (column, descending)
SORTS = {
    "group": (None, False),
    "reward": ("reward_total", True),
    "kl": ("kl_mean", True),
    "mismatch": ("mismatch_mean", True),
    "entropy": ("entropy_mean", True),
    "length": ("completion_len", True),
}
#: (header, column, kind) of the table, left to right; columns without any value are left out
VIEW = (
    ("group", "prompt_index", "int"), ("idx", "completion_index", "int"), ("reward#", "reward_rank_desc", "int"),
    ("sample", "sample_id", "int"), ("rank", "rank", "int"), ("reward", "reward_total", "num"),
    ("adv", "advantage", "num"), ("mass", "update_mass_proxy", "num"), ("len", "completion_len", "int"),
    ("trunc", "truncated", "bool"), ("kl", "kl_mean", "num"), ("kl max", "kl_max", "num"),
    ("|Δ|", "mismatch_mean", "num"), ("|Δ| max", "mismatch_max", "num"), ("IS max", "is_weight_max", "num"),
    ("H", "entropy_mean", "num"), ("clip", "clip_frac", "num"),
)


def completions_cmd(
    run: str = typer.Argument(..., help="Run directory, s3://bucket/prefix, or a directory of rich-completion sidecar JSON files."),
    step: int = typer.Option(..., "--step", "-s", help="Step to show."),
    sort: str = typer.Option("group", "--sort", help="Order: group, reward, kl, mismatch, entropy, length (largest first)."),
    group: Optional[int] = typer.Option(None, "--group", "-g", help="Only this prompt group: a group_id, else the prompt_index shown."),
    limit: int = typer.Option(50, "--limit", "-n", help="Rows shown (0: all)."),
    chars: int = typer.Option(60, "--chars", help="Characters of each completion shown."),
    as_json: bool = JSON_OPTION,
    as_csv: bool = CSV_OPTION,
    storage_option: List[str] = STORAGE_OPTION,
) -> None:
    """Show the completions generated at a step: rewards, ranks, update mass and, from the tokens,
    KL to the reference, train–rollout mismatch, IS weight, entropy and clipping per completion.

    Reads RUN/grpolens/completions.parquet when it is newer than the step's shards, otherwise
    computes that step only. Text is shown as plain text (markup and control characters escaped).
    --json/--csv print the rows (every column, full prompt and completion text) for scripts.
    """
    refuse_unless_remote(storage_option, {"RUN": run})
    from grpolens.run.no_pandas import pyarrow_without_pandas

    pyarrow_without_pandas()  # the program: pyarrow need not import pandas (0.27 s) on its first read
    import polars as pl
    from rich.console import Console

    from grpolens.errors import UserError

    from grpolens.commands.records import output_format, write_records

    out_fmt = output_format(as_json, as_csv)
    if sort not in SORTS:
        raise UserError(f"--sort: unknown order {sort!r}; choose one of {', '.join(SORTS)}")
    if limit < 0 or chars < 1:
        raise UserError("--limit must be >= 0 and --chars >= 1")
    df, source = _load(run, step)
    total = df.height
    note = None
    if group is not None:
        hit = df.filter(pl.col("group_id") == group) if "group_id" in df.columns and df["group_id"].null_count() < total else df.clear()
        if hit.height == 0:
            hit = df.filter(pl.col("prompt_index") == group)
            if hit.height == 0:
                raise UserError(f"--group: step {step} has no group with group_id or prompt_index {group}")
            note = f"no group_id {group} at step {step}: showing prompt_index {group}"
        df = hit
    col, desc = SORTS[sort]
    if col is not None:
        if col not in df.columns or df[col].null_count() == df.height:
            raise UserError(f"--sort {sort}: no {col} values at step {step} ({source})")
        df = df.sort([col, "prompt_index", "completion_index"], descending=[desc, False, False], nulls_last=True)
    if out_fmt:
        shown = df if limit == 0 else df.head(limit)
        write_records(shown.iter_rows(named=True), out_fmt, columns=shown.columns)
        return
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table to 80 columns
        console = Console(width=max(console.width, 200))
    if "generated_at_step" in df.columns:
        earlier = sorted({g for g in df["generated_at_step"].drop_nulls().to_list() if g != step})
        if earlier:
            n = int((df["generated_at_step"] != step).sum())
            console.print(f"{n} completion(s) trained at step {step} were generated at step(s) "
                          f"{', '.join(map(str, earlier))} (found by sample_id)", markup=False, highlight=False)
    if note:
        console.print(note, markup=False, highlight=False)
    if group is not None and df.height:
        _show_prompt(console, df)
    shown = df if limit == 0 else df.head(limit)
    console.print(_table(shown, step, total, df.height, source, chars))


def _load(run: Path, step: int):
    """The step's rows and a word on where they came from."""
    from grpolens.run import format as fmt
    from grpolens.analysis import sidecars
    from grpolens.errors import UserError

    if not fmt.is_remote_run(run) and not fmt.is_run(run) and sidecars.sidecar_files(run):
        df = sidecars.read_sidecars(run, steps=[step])
        if df.height == 0:
            have = [int(sidecars._STEP_FILE.search(p.name).group(1)) for p in sidecars.sidecar_files(run)]
            raise UserError(f"--step: no sidecar file for step {step} in {run} (steps {have[0]}..{have[-1]})")
        return df, "sidecar files"
    fmt.read_manifest(run)  # a precise error when RUN is not a run
    from grpolens.run.reader import RunReader

    RunReader(run).check()
    sample_steps = fmt.list_steps(run, fmt.SAMPLES)
    # a step trains on the completions generated at it and, when rollouts are reused, at earlier steps
    steps = sorted(set(sample_steps) | set(fmt.list_steps(run, fmt.TOKENS)))
    if step not in steps:
        near = f" (the run has steps {steps[0]}..{steps[-1]})" if steps else " (the run has no shards)"
        raise UserError(f"--step: no samples for step {step} in {run}, nor tokens trained at it{near}")
    df = sidecars.fresh_rows(run, step)
    source = "completions.parquet"
    if df is None:
        df, source = sidecars.build_steps(run, [step]), "computed from the shards"
    if df.height == 0 and step not in sample_steps:
        why = ("the run has no samples shards" if not sample_steps else
               f"none of the completions it trains on is in the samples of step {step} or of the "
               f"{sidecars.REUSE_LOOKBACK} steps with samples before it")
        raise UserError(f"--step: no completions for step {step} in {run}: {why}")
    return df, source


def _cell(v, kind: str) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "—"
    if kind == "bool":
        return "yes" if v else ""
    if kind == "int":
        return str(int(v))
    return f"{v:.3g}"


def _table(df, step: int, total: int, matched: int, source: str, chars: int):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from grpolens.text import printable

    cols = [(h, c, k) for h, c, k in VIEW if c in df.columns and df[c].null_count() < df.height]
    has_is = "is_vetoed" in df.columns and df["is_vetoed"].null_count() < df.height
    title = f"step {step}: {df.height} of {matched} completion(s)" + (f" ({total} at the step)" if matched != total else "")
    t = Table(title=Text(f"{title} — {source}"), box=box.SIMPLE_HEAD, padding=(0, 1))
    rows, texts = [], []
    for r in df.iter_rows(named=True):
        cells = [_cell(r[c], k) for _, c, k in cols]
        if has_is:
            cells.append("—" if r["is_vetoed"] is None else "veto" if r["is_vetoed"]
                         else f"{r['is_masked_tokens']} masked" if r.get("is_masked_tokens") else "")
        rows.append(cells)
        text = r.get("completion")
        if text is None:
            texts.append(Text("—", style="dim"))
        else:
            s = printable(text, keep_newlines=False)
            texts.append(Text(s if len(s) <= chars else s[: chars - 1] + "…"))
    heads = [(h, k) for h, _, k in cols] + ([("IS", "bool")] if has_is else [])
    for i, (h, k) in enumerate(heads):
        # numbers keep their full width; only the completion text gives way on a narrow terminal
        width = max([len(h), *(len(r[i]) for r in rows)])
        t.add_column(h, justify="left" if k == "bool" else "right", no_wrap=True, min_width=width)
    t.add_column("completion", no_wrap=True, overflow="ellipsis")
    for cells, text in zip(rows, texts):
        t.add_row(*[Text(c) for c in cells], text)
    if df.height == 0:
        t.caption = Text("no completions")
    elif df.height < matched:
        t.caption = Text(f"{matched - df.height} more; --limit 0 shows all")
    return t


def _show_prompt(console, df) -> None:
    from rich.panel import Panel
    from rich.text import Text

    from grpolens.text import printable

    prompts = [p for p in df["prompt"].unique(maintain_order=True).to_list() if p is not None] if "prompt" in df.columns else []
    if prompts:
        console.print(Panel(Text(printable(prompts[0])), title=Text("prompt"), title_align="left"))


def register(app: typer.Typer) -> None:
    app.command("completions")(completions_cmd)
