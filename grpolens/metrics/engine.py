"""One streaming pass over a run's token shards.

For each step, the step's shards are read (only the columns needed), turned into
:class:`~grpolens.metrics.batch.TokenBatch` es and handed to *visitors*. A visitor extracts a
mergeable piece per shard (``shard``) and combines the pieces of a step (``combine``). The
per-sequence partial table that every metric reduces is one visitor; token histograms, the top-K
tokens and the IS-weight writer are others, all fed by the same read. Only one step's tokens are
in memory at a time (two shards per worker), so memory stays bounded however long the run is.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np

from grpolens.run import format as fmt
from grpolens.run.format import RunFormatError
from grpolens.run.reader import READ_COLUMNS, read_tokens
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import merge_arrays, sequence_partials


class Visitor(Protocol):
    name: str

    def shard(self, batch: TokenBatch, shard: fmt.Shard) -> Any: ...

    def combine(self, step: int, pieces: list[Any]) -> Any: ...


#: Visitors every recompute runs, registered by families like producers are: name -> factory(cfg).
#: Their combined piece for a step is available to metrics as ``sd.extra["pieces"][name]``.
VISITORS: dict[str, Callable[[dict], "Visitor"]] = {}


def visitor(name: str):
    """Decorator registering a visitor factory ``factory(cfg) -> Visitor`` run by every recompute."""

    def deco(factory):
        if name in VISITORS:
            raise ValueError(f"visitor {name} registered twice")
        VISITORS[name] = factory
        return factory

    return deco


class SequencePartials:
    """The per-sequence partial table of each step (see :mod:`grpolens.metrics.partials`)."""

    name = "sequences"

    def __init__(self, cfg: dict):
        self.cfg = cfg

    def shard(self, batch: TokenBatch, shard: fmt.Shard) -> tuple[dict[str, np.ndarray], set[str]]:
        cols = sequence_partials(batch, self.cfg)
        batch.partials = cols
        return cols, set(batch.present)

    def combine(self, step: int, pieces: list[tuple[dict, set[str]]]) -> tuple[dict[str, np.ndarray], set[str]]:
        """The step's per-sequence partials as column arrays (one row per sequence), and the
        optional token columns present in any of its shards."""
        present: set[str] = set()
        for _, p in pieces:
            present |= p
        return merge_arrays([cols for cols, _ in pieces]), present


@dataclass
class StepResult:
    step: int
    shards: list[fmt.Shard]
    pieces: dict[str, Any]  # visitor name -> combined value


def _threads() -> int:
    env = os.environ.get("GRPOLENS_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


def iter_steps(
    run: os.PathLike | str,
    steps: list[int],
    visitors: list[Visitor],
    columns: Iterable[str] = READ_COLUMNS,
    on_step: Callable[[int], None] | None = None,
    threads: int | None = None,
) -> Iterator[StepResult]:
    """Yield each step's combined visitor results, in step order, reading shards in parallel."""
    columns = tuple(columns)
    threads = threads or _threads()
    all_shards = fmt.list_shards(run, fmt.TOKENS, steps=steps)
    by_step: dict[int, list[fmt.Shard]] = {s: [] for s in steps}
    for sh in all_shards:
        by_step.setdefault(sh.step, []).append(sh)

    def work(sh: fmt.Shard) -> dict[str, Any]:
        table = read_tokens(sh.path, columns)
        batch = TokenBatch.from_arrow(table)
        if batch.n and (np.any(batch.cols["step"] != sh.step) or np.any(batch.cols["rank"] != sh.rank)):
            raise RunFormatError(sh.path, f"rows disagree with the path (step={sh.step}, rank={sh.rank})", column="step")
        return {v.name: v.shard(batch, sh) for v in visitors}

    with ThreadPoolExecutor(max_workers=threads) as pool:
        # Submit one step ahead so reading overlaps reduction without holding the whole run.
        order = sorted(by_step)
        futures: dict[int, list] = {}

        def submit(step: int) -> None:
            futures[step] = [pool.submit(work, sh) for sh in by_step[step]]

        for i, step in enumerate(order):
            if step not in futures:
                submit(step)
            if i + 1 < len(order):
                submit(order[i + 1])
            results = [f.result() for f in futures.pop(step)]
            pieces = {v.name: v.combine(step, [r[v.name] for r in results]) for v in visitors}
            if on_step:
                on_step(step)
            yield StepResult(step, by_step[step], pieces)
