"""``grpolens tokens RUN --step N``: the worst tokens of a step, each in its completion's context."""

from __future__ import annotations

from typing import List, Optional

import typer

from grpolens.commands.records import CSV_OPTION, JSON_OPTION
from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote


#: the score column's header where the score's name would repeat another column's ("ratio")
SCORE_HEADERS = {"ratio": "|log ratio|", "adv_ratio": "|adv|·|ratio−1|"}


def tokens_cmd(
    run: str = typer.Argument(..., help="Run directory, or s3://bucket/prefix."),
    step: int = typer.Option(..., "--step", "-s", help="Step to inspect (only its shards are read)."),
    sample: Optional[int] = typer.Option(None, "--sample", help="Show this completion (sample_id) token by token."),
    by: str = typer.Option("kl", "--by", help="Score: kl, mismatch, ratio, entropy, adv_ratio."),
    top: int = typer.Option(10, "--top", "-k", help="How many tokens to list."),
    context: int = typer.Option(3, "--context", help="Completions shown in full, in order of their worst token."),
    as_json: bool = JSON_OPTION,
    as_csv: bool = CSV_OPTION,
    storage_option: List[str] = STORAGE_OPTION,
) -> None:
    """List a step's worst tokens by a score, then show their completions token by token.

    Tokens come from all ranks and micro-batches of the step; each completion is shown with every
    token coloured by the score. Only the step's own shards are read.

    --json/--csv print the listed tokens (with --sample: every token of that completion) as rows
    for scripts: ids, decoded text (null when the run has no tokenizer), score and log-probs.
    """
    refuse_unless_remote(storage_option, {"RUN": run})
    from grpolens.run.no_pandas import pyarrow_without_pandas

    pyarrow_without_pandas()  # the program: pyarrow need not import pandas (0.27 s) on its first read
    from rich.console import Console
    from rich.table import Table

    from grpolens.analysis import drilldown
    from grpolens.run import format as fmt
    from grpolens.run.decode import describe, make_decoder
    from grpolens.errors import UserError
    from grpolens.run.reader import RunReader

    from grpolens.commands.records import output_format, write_records

    out_fmt = output_format(as_json, as_csv)
    if by not in drilldown.SCORES:
        raise UserError(f"--by: unknown score {by!r}; choose one of {', '.join(drilldown.SCORES)}")
    if top < 1:
        raise UserError("--top must be >= 1")
    manifest = fmt.read_manifest(run)
    RunReader(run).check()
    steps = fmt.list_steps(run, fmt.TOKENS)
    if step not in steps:
        near = f" (the run has steps {steps[0]}..{steps[-1]})" if steps else " (the run has no token shards)"
        raise UserError(f"--step: no token shards for step {step} in {run}{near}")
    b = drilldown.load_step(run, step)
    need = drilldown.SCORES[by]
    if not b.has(*need):
        raise UserError(f"--by {by}: the run has no {', '.join(need)} column at step {step}")
    decode, source = make_decoder(run, manifest.resolved_config())
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table to 80 columns
        console = Console(width=max(console.width, 140))

    if sample is not None:
        cols = drilldown.completion_tokens(b, sample, by)
        if cols is None:
            raise UserError(f"--sample: sample {sample} has no tokens at step {step}")
        if out_fmt:
            write_records(({"step": step, "sample_id": sample, "pos": i, "token_id": int(t),
                            "token": decode(int(t)) if t >= 0 and source != "ids" else None, "mask": bool(m), "score": float(v), "by": by}
                           for i, (t, v, m) in enumerate(zip(cols["token_id"], cols["score"], cols["mask"]))), out_fmt)
            return
        _show_completion(console, cols, decode, by, title=f"sample {sample} at step {step}")
        return

    df = drilldown.top_k(b, by, top)
    if out_fmt:
        df = df.sort("score", descending=True)
        write_records(({"step": step, "rank": r["rank"], "micro_batch": r["micro_batch"], "sample_id": r["sample_id"],
                        "pos": r["pos"], "token_id": r["token_id"],
                        "token": decode(r["token_id"]) if r["token_id"] >= 0 and source != "ids" else None, "by": by, "score": r["score"],
                        **{k: r[k] for k in ("logp", "old_logp", "ref_logp", "rollout_logp", "ratio", "advantage")}}
                       for r in df.iter_rows(named=True)), out_fmt,
                      columns=["step", "rank", "micro_batch", "sample_id", "pos", "token_id", "token", "by", "score",
                               "logp", "old_logp", "ref_logp", "rollout_logp", "ratio", "advantage"])
        return
    if df.height == 0:
        console.print(f"step {step}: no masked token with a finite {by} score")
        return
    df = df.sort("score", descending=True)
    from rich import box

    if source == "ids":
        console.print(f"[dim]{describe(source)}[/]", highlight=False)
    t = Table(title=f"step {step}: top {df.height} tokens by {by} (of {int(b.mask.sum())} masked tokens; "
                    f"{'tokens as ids' if source == 'ids' else describe(source)})",
              box=box.SIMPLE_HEAD, padding=(0, 1))
    for c in ("#", "rank/mb", "sample", "pos", "token", SCORE_HEADERS.get(by, by), "logp", "old", "ref", "rollout",
              "ratio", "adv"):
        t.add_column(c, justify="left" if c in ("token", "rank/mb") else "right", no_wrap=True)
    from rich.text import Text

    from grpolens.text import printable

    for i, r in enumerate(df.iter_rows(named=True), 1):
        tok = Text(printable(decode(r["token_id"]), keep_newlines=False)) if r["token_id"] >= 0 else Text("—")
        t.add_row(str(i), f"{r['rank']}/{r['micro_batch']}", str(r["sample_id"]), str(r["pos"]), tok,
                  *[_short(r[k]) for k in ("score", "logp", "old_logp", "ref_logp", "rollout_logp", "ratio", "advantage")])
    console.print(t)
    seen: list[int] = []
    for sid in df["sample_id"].to_list():
        if sid not in seen:
            seen.append(sid)
    for sid in seen[:context]:
        cols = drilldown.completion_tokens(b, sid, by)
        _show_completion(console, cols, decode, by, title=f"sample {sid}")
    console.print(f"[dim]grpolens tokens {run} --step {step} --sample ID --by {by}  shows any completion in full[/]")


def _short(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "—"
    return f"{v:.4g}"


def _show_completion(console, cols, decode, by: str, title: str) -> None:
    """Each token of a completion on a background whose intensity follows the score."""
    import numpy as np
    from rich.panel import Panel
    from rich.text import Text

    from grpolens.text import printable

    s = cols["score"]
    finite = s[np.isfinite(s)]
    hi = float(np.max(finite)) if finite.size else 0.0
    text = Text()
    for tid, score, m in zip(cols["token_id"], s, cols["mask"]):
        piece = printable(decode(int(tid)) if tid >= 0 else "·")
        if not m:
            style = "dim strike"
        elif np.isfinite(score) and hi > 0:
            level = min(1.0, float(score) / hi)
            red = int(80 + 175 * level)
            style = f"on rgb({red},{int(60 * (1 - level))},{int(60 * (1 - level))})"
        else:
            style = ""
        text.append(piece, style=style)
        text.append(" " if piece and not piece.endswith((" ", "\n")) else "")
    console.print(Panel(text, title=f"{title} — coloured by {by} (max {hi:.4g}); struck-through tokens are masked",
                        title_align="left"))


def register(app: typer.Typer) -> None:
    app.command("tokens")(tokens_cmd)
