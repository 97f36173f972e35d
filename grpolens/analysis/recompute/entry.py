"""The entry point, :func:`recompute`: a plan (:mod:`.plan`: every decision, once), then its steps
in order: reuse the written outputs if nothing changed, compute the steps the cache lacks, tabulate,
write. And the lock a writing recompute holds."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import polars as pl

from grpolens.run import format as fmt
from grpolens.run.step_table import StepSpill
from grpolens.run.variants import Variant
from grpolens.analysis.recompute.compute import Computed, compute_steps, tabulate
from grpolens.analysis.recompute.outputs import absent_notes, rejection_notes, to_jsonl, upload
from grpolens.analysis.recompute.plan import Plan, Request, plan_recompute
from grpolens.analysis.recompute.steps import StepWork, step_visitors


@dataclass
class RecomputeResult:
    metrics: pl.DataFrame
    out_dir: Path | None
    computed_steps: list[int]
    reused_steps: list[int]
    notes: list[str] = field(default_factory=list)
    variant: Variant | None = None  # the what-if this recompute was (config overrides), else None


def recompute_lock(run: Path):
    """The lock that one writing recompute of ``run`` holds from reading its cache to writing its
    outputs: two recomputes of one run (two terminals, a CI job and the dashboard) would otherwise
    interleave their atomic writes, e.g. one's step cache under the other's config hash, which a
    later run would reuse as valid. A second writer waits; it then finds the cache fresh and reuses
    it. ``filelock`` takes an OS lock (flock), released when the process dies."""
    from filelock import FileLock

    # beside the outputs, not in cache/: a recompute that keeps away from the cache (--only) still takes turns
    path = fmt.derived_dir(run) / "recompute.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path)


def _locked_when_writing(fn):
    """Run ``fn`` under :func:`recompute_lock` when it writes a local run."""
    import functools

    @functools.wraps(fn)
    def wrapper(run, **kwargs):
        if not kwargs.get("write", True) or "://" in str(run):  # nothing written, or a remote run
            return fn(run, **kwargs)
        fmt.read_manifest(Path(run))  # a precise error for a path that is not a run, before creating the lock's directory
        derived = fmt.derived_dir(Path(run))
        fresh = not derived.exists()
        try:
            with recompute_lock(Path(run)):
                return fn(run, **kwargs)
        except BaseException:
            # a recompute that failed before writing anything leaves no trace: not even the lock's folder
            if fresh and derived.is_dir() and {p.name for p in derived.iterdir()} <= {"recompute.lock"}:
                shutil.rmtree(derived, ignore_errors=True)
            raise

    return wrapper


@_locked_when_writing
def recompute(
    run: os.PathLike | str,
    *,
    out: os.PathLike | str | None = None,
    profile: str = "grpolens",
    steps: str | tuple[int | None, int | None] | None = None,
    overrides: dict[str, Any] | None = None,
    config_file: os.PathLike | str | None = None,
    write: bool = True,
    incremental: bool = True,
    progress: Callable[[int, int], None] | None = None,
    extra_visitors: list | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    result: bool = False,
    engine: Any = None,
    storage_options: dict[str, str] | None = None,
    only: Iterable[str] | None = None,
    per_step: bool = False,
    workers: int | None = None,
) -> pl.DataFrame | RecomputeResult:
    """Recompute every metric of ``run`` per step; returns a polars DataFrame (one row per step).

    ``profile`` picks names and reductions (a registered profile: see ``docs/profiles.md``);
    ``overrides`` (and ``config_file``) replace manifest config keys (what-if analysis): such a
    recompute is a *variant* of the run and writes under ``RUN/grpolens/variants/<key>/``
    (:mod:`grpolens.run.variants`; ``out`` when given), never over the run's own metrics;
    ``steps`` is ``"A:B"``. ``run`` may be ``s3://bucket/prefix`` (``storage_options``: see
    :mod:`grpolens.run.storage`), and so may ``out``. ``extra_visitors`` join the same pass over the tokens (see
    :mod:`grpolens.metrics.engine`); ``on_step(step, pieces)`` receives their combined results.
    With ``write``, concurrent recomputes of one run take turns (:func:`recompute_lock`).
    ``workers``: how many processes compute the steps, this one among them
    (:mod:`grpolens.analysis.step_workers`; default ``GRPOLENS_WORKERS``, else the CPU count, at
    most 8), started only when there is enough to do; 1 computes here. Values and outputs do not
    depend on it.

    ``only`` restricts the work to some metrics (families, names or globs, see
    :func:`select_metrics`): only the producers and visitors those need run, token columns no
    selected metric reads are not read, and neither the per-step cache nor the other outputs
    (top tokens, completions, IS histograms) are read or written; the metrics go to ``out``
    (default ``RUN/grpolens/only/``, so the full set is not replaced). Values are the full
    recompute's, computed by the same code.

    >>> import grpolens                                                   # doctest: +SKIP
    >>> grpolens.recompute("sample_runs/tiny").select("step", "entropy")   # doctest: +SKIP

    A profile with a log schedule (``trl``: TRL's logging windows, from the manifest) gives one row
    per log of the trainer; ``per_step=True`` keeps one row per optimizer step (for TRL: what it
    would log with ``logging_steps=1``).
    """
    plan = plan_recompute(run, Request(
        out=out, profile=profile, steps=steps, overrides=overrides, config_file=config_file, write=write,
        incremental=incremental, progress=progress, extra_visitors=extra_visitors, on_step=on_step, result=result,
        engine=engine, storage_options=storage_options, only=only, per_step=per_step, workers=workers))
    # 1. nothing new since this request last wrote its outputs: they are the answer (a 1,000-step
    #    re-run would otherwise rebuild every row from the cache to find it has nothing to do)
    if plan.decide.skips_when_fresh and plan.outputs_unchanged():
        final = _written_metrics(plan.out_dir)
        if final is not None:
            plan.save_memo()
            plan.cache.restamp(plan.fresh_state(final.columns))  # a state from before stamps
            return _answer(plan, final, plan.out_dir, [], list(plan.selected), list(plan.cache.state.get("notes") or []))
    # 2. the rows still valid in the cache; the selected steps without one are computed
    valid = plan.cache.valid_rows(plan.config_hash) if plan.decide.reuses_rows else {}
    # a cached step's rows of the step tables (completions, top tokens...) are those of the files in
    # out_dir: a step they do not hold (another --out, a table removed or replaced, an earlier
    # --steps A:B) is computed again, not left out of the tables
    held = plan.steps_in_tables()
    cached = {s: valid[s] for s in plan.selected if s in valid and (held is None or s in held)}
    todo = [s for s in plan.selected if s not in cached]
    work = StepWork(plan.run, plan.cfg, plan.profile, plan.metrics,
                    step_visitors(plan.cfg, plan.families, plan.request.extra_visitors), plan.columns,
                    plan.need_samples, bool(plan.sample_steps), plan.schedule)
    # the step outputs of visitors with collect=True (completions, top tokens, IS histograms) go to
    # disk as each step is done (grpolens.run.step_table), so memory does not grow with the steps
    spill = StepSpill(plan.cache_root / "cache") if plan.decide.keeps_step_outputs else None
    try:
        # 3. the steps computed, here or in worker processes
        done = compute_steps(plan, work, cached, todo, spill)
        # 4. one row per step under the profile's names
        raw, final, names, schema = tabulate(plan, done.rows, valid)
        # 5. what the run lacks for some metrics, and a constant train-rollout offset
        from grpolens.metrics.rollout_is.offset import offset_notes
        from grpolens.metrics.verl_cov import notes as cov_notes

        run_notes = offset_notes(raw)  # about the whole selection: a re-run with nothing new repeats them
        notes = (absent_notes(plan.run, plan.metrics, raw, done.present, done.computed)
                 + rejection_notes(plan.cfg, done.present, done.computed) + run_notes + cov_notes(raw))
        # 6. the outputs, each atomically, the cache's state last
        out_dir = _write(plan, work, done, valid, final, names, schema, run_notes, spill)
    finally:
        if spill is not None:
            spill.close()
        if plan.staging is not None:  # uploaded by now, or not to be: nothing staged stays behind
            shutil.rmtree(plan.staging, ignore_errors=True)
    plan.save_memo()  # last: this recompute succeeded
    return _answer(plan, final, out_dir if plan.decide.writes else None, sorted(set(todo)), sorted(cached), notes)


def _written_metrics(out_dir: Path) -> pl.DataFrame | None:
    try:
        return pl.read_parquet(out_dir / "metrics.parquet")
    except Exception:  # noqa: BLE001 - unreadable after all: the ordinary path rewrites it
        return None


def _answer(plan: Plan, final: pl.DataFrame, out_dir, computed: list[int], reused: list[int], notes: list[str]):
    if plan.request.result:
        return RecomputeResult(final, out_dir, computed, reused, notes, plan.variant)
    return final


def _write(plan: Plan, work: StepWork, done: Computed, valid: dict[int, dict], final: pl.DataFrame,
           names: list[str], schema: dict, run_notes: list[str], spill: StepSpill | None):
    """The outputs a writing recompute leaves, each atomically: the metrics (unless those of this
    very request are there, untouched), a what-if's record, the visitors' step outputs, the cache
    and, last, its state; then the upload of staged outputs. Returns where the metrics are."""
    decide, out_dir = plan.decide, plan.out_dir
    if not decide.writes:
        return out_dir
    unchanged = not decide.selective and not done.todo and bool(valid) and plan.outputs_unchanged()
    if not unchanged:
        out_dir.mkdir(parents=True, exist_ok=True)
        fmt.atomic_write_table(out_dir / "metrics.parquet", final.to_arrow())
        fmt.atomic_write_bytes(out_dir / "metrics.jsonl", to_jsonl(final).encode())
    if decide.records_variant:
        plan.variant.write_record()  # what this directory is: the overrides and their label (serve lists it)
    if decide.keeps_step_outputs and not unchanged:
        plan.cache.rows_path.parent.mkdir(parents=True, exist_ok=True)
        # the tables keep the rows they hold of valid steps not computed now, those outside --steps too
        held = plan.steps_in_tables()
        kept = {s for s in valid if s not in done.todo and (held is None or s in held)}
        for v in work.visitors:
            if v.collect:
                v.finish(plan.run, out_dir, spill.table(v.name), kept)
        spill.close()  # before an upload of the staged outputs, which must not carry it
        # the state goes last: if anything above fails, the next run recomputes these steps
        plan.cache.write(done.rows, valid, names, schema, plan.config_hash, plan.sample_columns,
                         plan.outputs_record(kept | set(plan.selected)), run_notes,
                         plan.fresh_state(final.columns))
    if plan.remote_out is not None:  # --only's metrics too (they were left in the staging folder)
        upload(out_dir, plan.remote_out)
        return plan.remote_out
    return out_dir
