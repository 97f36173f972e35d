"""Small rich helpers shared by commands: a progress bar and the metrics summary table."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from grpolens.text import format_value


@contextlib.contextmanager
def progress_bar(console, label: str, enabled: bool = True, min_total: int = 2) -> Iterator[Callable[[int, int], None]]:
    """Yield ``tick(done, total)``; a bar appears only on a terminal and for more than ``min_total`` units."""
    if not enabled or not console.is_terminal:
        yield lambda done, total: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as prog:
        task = None

        def tick(done: int, total: int) -> None:
            nonlocal task
            if total <= min_total:
                return
            if task is None:
                task = prog.add_task(label, total=total)
            prog.update(task, completed=done)

        yield tick


def summary_table(df, last: int = 5, columns: list[str] | None = None, title: str | None = None):
    """Metrics as rows, the last ``last`` steps as columns (wide runs read better transposed)."""
    from rich.table import Table

    tail = df.tail(last)
    t = Table(title=title or f"last {tail.height} step(s)", show_lines=False)
    t.add_column("metric", style="bold", no_wrap=True)
    for s in tail["step"].to_list():
        t.add_column(f"step {s}", justify="right", no_wrap=True)
    for c in columns or [c for c in df.columns if c != "step"]:
        vals = tail[c].to_list()
        if all(v is None for v in vals):
            continue
        t.add_row(c, *[format_value(v) for v in vals])
    return t
