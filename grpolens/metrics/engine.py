"""One streaming pass over a run's token shards.

For each step, the step's shards are read (only the columns needed), turned into
:class:`~grpolens.metrics.batch.TokenBatch` es and handed to *visitors*. A visitor extracts a
mergeable piece per shard (``shard``) and combines the pieces of a step (``combine``). The
per-sequence partial table that every metric reduces is one visitor; token histograms, the top-K
tokens and the IS-weight writer are others, all fed by the same read. Only one step's tokens are
in memory at a time (two shards per worker), so memory stays bounded however long the run is.
"""

from __future__ import annotations

import functools
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


class Visitor:
    """What one pass over a run's token shards feeds: a mergeable piece per shard, combined per step.

    Every visitor subclasses this class (built-in or from a plugin): ``name``, :meth:`shard` and
    :meth:`combine` are its own; a visitor that writes an output file sets ``collect`` and
    overrides :meth:`at_step` and :meth:`finish`, the others keep the defaults below (recompute
    calls all of them, without probing).
    """

    name: str
    #: recompute keeps each step's :meth:`at_step` output and hands them all to :meth:`finish`
    collect: bool = False

    def shard(self, batch: TokenBatch, shard: fmt.Shard) -> Any:
        """The piece of one token shard (any picklable value; None for nothing)."""
        raise NotImplementedError

    def combine(self, step: int, pieces: list[Any]) -> Any:
        """The step's value from the pieces of its shards (in shard order)."""
        raise NotImplementedError

    def at_step(self, step: int, piece: Any, samples, run) -> Any:
        """The step's output to keep (a collecting visitor's; the step's samples are at hand):
        by default the combined piece itself."""
        return piece

    def finish(self, run, out_dir, by_step, kept_steps: set[int]) -> None:
        """Write the kept outputs (``by_step``: each recomputed step's :meth:`at_step`, a mapping),
        once the run's steps are done; by default nothing."""
        return None


#: Visitors every recompute runs, registered by families like producers are: name -> factory(cfg).
#: Their combined piece for a step is available to metrics as ``sd.extra["pieces"][name]``.
VISITORS: dict[str, Callable[[dict], "Visitor"]] = {}
#: visitor name -> the metric families whose values read its pieces; empty for a visitor that
#: only writes an output file (top tokens, completions, IS histograms), which a recompute
#: restricted to some families (``recompute --only``) skips
VISITOR_FAMILIES: dict[str, tuple[str, ...]] = {}


def visitor(name: str, families: tuple[str, ...] = ()):
    """Decorator registering a visitor factory ``factory(cfg) -> Visitor`` run by every recompute
    (``families``: the metric families that read its pieces; none for an output-only visitor)."""

    def deco(factory):
        if name in VISITORS:
            raise ValueError(f"visitor {name} registered twice")
        VISITORS[name] = factory
        VISITOR_FAMILIES[name] = tuple(families)
        return factory

    return deco


def visitor_factories(families: frozenset[str] | None = None) -> list[Callable[[dict], "Visitor"]]:
    """The registered visitors a recompute runs: all of them, or those ``families`` need."""
    if families is None:
        return list(VISITORS.values())
    return [f for n, f in VISITORS.items() if not families.isdisjoint(VISITOR_FAMILIES[n])]


class SequencePartials(Visitor):
    """The per-sequence partial table of each step (see :mod:`grpolens.metrics.partials`)."""

    name = "sequences"

    def __init__(self, cfg: dict, families: frozenset[str] | None = None):
        self.cfg = cfg
        self.families = families

    def shard(self, batch: TokenBatch, shard: fmt.Shard) -> tuple[dict[str, np.ndarray], set[str]]:
        cols = sequence_partials(batch, self.cfg, self.families)
        if self.families is None:  # complete: other visitors of the pass may reuse them
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
    pieces: dict[str, Any]  # visitor name -> combined value


def _threads() -> int:
    from grpolens.errors import env_int

    env = env_int("GRPOLENS_THREADS")
    if env is not None:
        return env
    return max(1, min(4, os.cpu_count() or 1))


def shard_pieces(sh: fmt.Shard, visitors: tuple[Visitor, ...], columns: tuple[str, ...]) -> dict[str, Any]:
    """The per-shard work of every engine: read one tokens shard and run each visitor on it.
    Returns ``{visitor name: piece}``; pieces are merged per step by the visitors' ``combine``."""
    batch = TokenBatch.from_arrow(read_tokens(sh.path, columns))
    # a change of step or rank starts a sequence, so every row has its sequence's first row's
    # step and rank: comparing the sequences' keys compares every row's
    keys = batch.seq_keys
    if batch.n and (np.any(keys["step"] != sh.step) or np.any(keys["rank"] != sh.rank)):
        raise RunFormatError(sh.path, f"rows disagree with the path (step={sh.step}, rank={sh.rank})", column="step")
    return {v.name: v.shard(batch, sh) for v in visitors}


class Engine(Protocol):
    """Runs ``work`` on every shard; yields ``(step, results)`` in step order, results in shard order."""

    def map_steps(self, by_step: dict[int, list[fmt.Shard]],
                  work: Callable[[fmt.Shard], dict[str, Any]]) -> Iterator[tuple[int, list[dict[str, Any]]]]: ...


class ThreadEngine:
    """The default engine: a thread pool in this process, one step ahead of the reduction (reading
    overlaps reducing; one or two steps' shards in memory).

    Nothing is imported under the pool's threads: the first shard is computed in the calling
    thread before any pool thread starts, and the next step is read ahead only once the caller is
    done with the first, so the lazy imports of the per-shard work (pyarrow's, the families') and
    of the caller's per-step work (the samples' read, the reductions) all run with no pool thread
    working. A Ctrl-C landing in an import while another thread imported could leave the main
    thread waiting on importlib's lock for ever. On an error or Ctrl-C the pool is left without
    waiting: its threads finish the shard they hold and end."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or _threads()

    def map_steps(self, by_step, work):
        pool = ThreadPoolExecutor(max_workers=self.threads)
        futures: dict[int, list] = {}
        ahead = finished = False  # ahead: read the next step ahead (once the caller is done with a first step)

        def submit(step: int, shards: list) -> None:
            futures[step] = [pool.submit(work, sh) for sh in shards]

        try:
            order = sorted(by_step)
            for i, step in enumerate(order):
                shards, here = by_step[step], []
                if not ahead and shards:  # the imports, with no pool thread working
                    here = [work(shards[0])]
                    submit(step, shards[1:])
                elif step not in futures:
                    submit(step, shards)
                if ahead and i + 1 < len(order):
                    submit(order[i + 1], by_step[order[i + 1]])
                yield step, here + [f.result() for f in futures.pop(step)]
                ahead = ahead or bool(shards)
            finished = True
        finally:
            pool.shutdown(wait=finished, cancel_futures=not finished)


class InlineEngine:
    """The per-shard work in the calling thread, shard after shard: for a process that computes
    one step at a time beside others (:mod:`grpolens.analysis.step_workers`). No pool thread, so
    no second malloc arena: glibc gives each new thread its own, which kept ~200 MB more per
    process when every step started a pool thread."""

    def map_steps(self, by_step, work):
        for step in sorted(by_step):
            yield step, [work(sh) for sh in by_step[step]]


#: ``--engine`` choices.
ENGINES = ("default", "ray")


def make_engine(name: str = "default", ray_address: str | None = None) -> Engine:
    """The engine ``--engine NAME`` names (``ray`` imports Ray, from the ``ray`` extra, only here)."""
    if name == "default":
        if ray_address:
            from grpolens.errors import UserError

            raise UserError("--ray-address needs --engine ray")
        return ThreadEngine()
    if name == "ray":
        from grpolens.metrics.engine_ray import RayEngine

        return RayEngine(ray_address)
    from grpolens.errors import UserError

    raise UserError(f"--engine: unknown engine {name!r}; choose one of {', '.join(ENGINES)}")


def iter_steps(
    run: os.PathLike | str,
    steps: list[int],
    visitors: list[Visitor],
    columns: Iterable[str] = READ_COLUMNS,
    on_step: Callable[[int], None] | None = None,
    engine: Engine | None = None,
) -> Iterator[StepResult]:
    """Yield each step's combined visitor results, in step order. ``engine`` runs the per-shard
    work (:func:`shard_pieces`): threads here by default, Ray tasks with ``--engine ray``; the
    merge of the pieces (the visitors' ``combine``) always runs here."""
    all_shards = fmt.list_shards(run, fmt.TOKENS, steps=steps)
    by_step: dict[int, list[fmt.Shard]] = {s: [] for s in steps}
    for sh in all_shards:
        by_step[sh.step].append(sh)  # list_shards lists the steps asked for only
    work = functools.partial(shard_pieces, visitors=tuple(visitors), columns=tuple(columns))
    for step, results in (engine or ThreadEngine()).map_steps(by_step, work):
        pieces = {v.name: v.combine(step, [r[v.name] for r in results]) for v in visitors}
        if on_step:
            on_step(step)
        yield StepResult(step, pieces)
