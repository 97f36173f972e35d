"""A recompute's steps computed (here, or in worker processes when there is enough to do) and
tabulated: one row per step, renamed to the profile's names, cumulative metrics as running totals."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import polars as pl

from grpolens.run.step_table import StepSpill
from grpolens.analysis import step_workers
from grpolens.analysis.recompute.outputs import cumulative_offsets, finalize
from grpolens.analysis.recompute.plan import Plan
from grpolens.analysis.recompute.steps import StepWork, WorkerSpec, serial_steps


@dataclass
class Computed:
    """The selected steps' rows, the cached ones and the computed ones, and what computing found."""

    rows: dict[int, dict]
    todo: list[int]                                   # the steps computed (none of them cached)
    present: set[str] = field(default_factory=set)    # token columns present in some computed step
    computed: set[int] = field(default_factory=set)   # the steps computed from token shards


def compute_steps(plan: Plan, work: StepWork, cached: dict[int, dict], todo: list[int],
                  spill: StepSpill | None) -> Computed:
    """Every step of ``todo``, with progress: in worker processes when there is enough to do
    (:mod:`grpolens.analysis.step_workers`), else in this process alone."""
    req = plan.request
    out = Computed(dict(cached), todo)
    done = 0

    def tick(_step: int) -> None:
        nonlocal done
        done += 1
        if req.progress:
            req.progress(done, len(todo))

    n_workers = 1
    if plan.decide.may_use_workers:
        n_workers = step_workers.count(req.workers, len(todo), sum(f[1] for s in todo for f in plan.cache.fingerprints[s]))
    if n_workers > 1:
        _in_workers(plan, work, todo, spill, n_workers, tick, out)
    else:
        serial_steps(work, todo, set(plan.token_steps), req.engine, out.rows, out.present, out.computed, spill, tick,
                     req.on_step)
    return out


def _in_workers(plan: Plan, work: StepWork, todo: list[int], spill: StepSpill | None, n_workers: int, tick,
                out: Computed) -> None:
    """``todo`` over ``n_workers`` processes, this one among them; the step-table rows a worker sends go to the spill here."""
    spec = WorkerSpec(plan.run, plan.cfg, plan.profile.name, [m.name for m in plan.metrics], sorted(plan.sample_columns),
                      plan.families, plan.columns, plan.need_samples, bool(plan.sample_steps), plan.schedule,
                      frozenset(plan.token_steps), spill is not None)
    here = functools.partial(work.one_step, token_steps=spec.token_steps, spill=spill, engine=step_workers.engine())
    # closed (its workers stopped) before the spill is removed, whatever happens here
    with contextlib.closing(step_workers.map_steps(spec, todo, n_workers, here)) as results:
        for step, row, present, spilled in results:
            out.rows[step] = row
            if present is not None:  # a step with token shards
                out.present |= present
                out.computed.add(step)
            for name, rows in spilled.items():  # a worker process's step-table rows
                spill.put(name, step, rows)
            tick(step)


def tabulate(plan: Plan, rows: dict[int, dict], valid: dict[int, dict]) -> tuple[pl.DataFrame, pl.DataFrame, list[str], dict]:
    """``(raw, final, names, schema)``: the rows as a table of raw values (what the cache keeps:
    ``names`` in ``schema``), and the final one (the profile's names, running totals from the
    steps before ``--steps``, a log schedule's rows unless ``per_step``)."""
    metrics, schedule = plan.metrics, plan.schedule
    names = ["step"] + [m.name for m in metrics]
    schema = {"step": pl.Int64, **{m.name: pl.Float64 for m in metrics}}
    if schedule is not None:  # the hidden counts of appended values
        counts = [m.name + suffix for m in metrics for suffix in schedule.hidden]
        names += counts
        schema.update({c: pl.Int64 for c in counts})
    records = [{k: rows[s].get(k) for k in names} for s in sorted(rows)]
    raw = pl.DataFrame(records, schema=schema, orient="row")
    offsets = cumulative_offsets(plan.run, metrics, plan.all_steps, plan.lo, valid, plan.cfg, plan.profile)
    final = finalize(raw, metrics, plan.name, offsets)
    if schedule is not None and not plan.request.per_step:
        final = schedule.log_view(final, raw, metrics)
    return raw, final, names, schema
