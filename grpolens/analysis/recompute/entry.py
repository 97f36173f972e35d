"""The entry point, :func:`recompute`, and the lock a writing recompute holds."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import polars as pl

from grpolens.run import format as fmt
from grpolens.metrics.engine import READ_COLUMNS, ThreadEngine
from grpolens import plugins
from grpolens.run.reader import RunReader
from grpolens.run.step_table import StepSpill
from grpolens.run.variants import Variant, effective_overrides
from grpolens.analysis import fresh, step_workers
from grpolens.analysis.fresh import output_files
from grpolens.analysis.recompute.cache import _config_hash, _fingerprint, _key
from grpolens.analysis.recompute.outputs import (_absent_notes, _cumulative_offsets, _output_dirs, _rejection_notes,
                                                 _upload, finalize, key_columns, to_jsonl)
from grpolens.analysis.recompute.steps import StepWork, WorkerSpec, _serial_steps, metrics_for, select_metrics, step_visitors


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
    given = getattr(run, "variant", None)  # a VariantRun (the dashboard's): recompute that variant
    if given is not None and overrides is None and config_file is None:
        overrides = given.overrides
    reader = RunReader(run, storage_options)
    run = reader.path
    what_if = effective_overrides(overrides, config_file)
    variant = Variant.of(run, what_if) if what_if else None
    prof = plugins.get(profile)
    # what `grpolens recompute RUN` checks, before importing the engine, to find its outputs fresh
    # (grpolens.analysis.fresh): recorded for the plain request, as the run is before it is read
    stamped = (write and incremental and only is None and not extra_visitors and variant is None and not overrides
               and config_file is None and not fmt.is_remote_run(run) and (out is None or "://" not in str(out)))
    out_for_stamp = Path(out) if out is not None else reader.out_dir(profile)
    stamp = fresh.stamp(run, fresh.request_key(profile, steps, out_for_stamp, per_step, None)) if stamped else None
    # refuse what `grpolens validate` would reject, from the Parquet footers; a recompute that keeps
    # its cache remembers the files that passed, so a re-run opens only new or changed ones
    memo_path = fmt.derived_dir(run) / "cache" / "checked.json" \
        if write and incremental and only is None and not fmt.is_remote_run(run) else None
    # one walk of the run serves both the stamp and the check memo
    reader.check(memo_path, stamp["tree"] if stamp is not None else None)
    cfg = reader.config(overrides, config_file)
    schedule = None
    if prof.log_schedule is not None:  # the trainer's logging schedule and release rules, from the run
        schedule, cfg = prof.log_schedule(reader, cfg, overrides, config_file)
    sel, lo, hi = reader.select_steps(steps)
    token_steps = reader.steps(fmt.TOKENS)
    sample_steps = reader.steps(fmt.SAMPLES)
    all_steps = reader.steps()

    # a what-if reads (and writes) its own cache even when not writing, unless staged from object storage
    if write or fmt.is_remote_run(run) or (variant is not None and (out is None or not fmt.is_remote_run(out))):
        out_dir, cache_root, remote_out = _output_dirs(reader, out, profile, variant)
    else:
        out_dir, cache_root, remote_out = Path(out) if out is not None else reader.out_dir(profile), fmt.derived_dir(run), None
    chash = _config_hash({**cfg, "_trainer": reader.manifest.trainer}, profile)

    # -- incremental: reuse rows whose shards and config are unchanged ----------------------------
    cache_path = cache_root / "cache" / f"steps-{profile}.parquet"
    state_path = cache_root / "cache" / f"state-{profile}.json"
    # one listing per table (not one per step: a 1,000-step run would list 2,000 directories)
    token_shards, sample_shards = fmt.list_shards(run, fmt.TOKENS), fmt.list_shards(run, fmt.SAMPLES)
    fingerprints: dict[int, list] = {s: [] for s in all_steps}
    for sh in token_shards + sample_shards:
        if sh.step in fingerprints:
            fingerprints[sh.step].append(sh.fingerprint())
    samples_fp = _fingerprint(sample_shards)
    state: dict = {}
    if incremental and state_path.is_file():
        try:
            state = json.loads(state_path.read_text())
        except Exception:  # noqa: BLE001 - a damaged cache is simply rebuilt
            state = {}
    # the sample columns come from every samples shard's footer: reused while no shard changed
    # (on object storage that is one GET per shard saved on every run)
    if state.get("samples") == samples_fp and isinstance(state.get("sample_columns"), list):
        sample_cols = set(state["sample_columns"])
    else:
        sample_cols = reader.sample_columns()
    metrics = metrics_for(profile, cfg, sample_cols)
    families: frozenset[str] | None = None
    if only is not None:
        metrics = select_metrics(metrics, only, profile)
        families = frozenset(m.family for m in metrics)
        incremental = False
        if out is None:  # beside the full outputs, never over them
            out_dir = out_dir / "only"
    need_samples = families is None or any(m.needs_samples(prof) for m in metrics)
    # token_id feeds only diversity (and the top-tokens output): a restricted run may skip it
    columns = READ_COLUMNS if families is None or "diversity" in families else tuple(c for c in READ_COLUMNS if c != "token_id")
    # the outputs of exactly this recompute (config, selection, shards, destination) are already
    # there, untouched since they were written: a re-run with nothing new writes nothing
    manifest = None if fmt.is_remote_run(run) else output_files(Path(run)).get(fmt.MANIFEST_NAME)
    outputs_key = _key([chash, sel, lo, hi, str(out_dir.resolve()), fingerprints, manifest, per_step])
    if (write and incremental and only is None and not extra_visitors and remote_out is None
            and state.get("outputs") == {"key": outputs_key, "files": output_files(out_dir)}):
        # ... and nothing to compute: the written metrics are the answer (a 1,000-step re-run
        # would otherwise rebuild every row from the cache to find it has nothing to do)
        try:
            final = pl.read_parquet(out_dir / "metrics.parquet")
        except Exception:  # noqa: BLE001 - unreadable after all: the ordinary path rewrites it
            final = None
        if final is not None:
            _save_memo(reader, memo_path)
            fresh_state = None if stamp is None else {**stamp, "reused": sorted(sel), "key_columns": key_columns(final.columns, profile)}
            if fresh_state is not None and state.get("fresh") != fresh_state:  # a state from before stamps
                fmt.atomic_write_bytes(state_path, json.dumps({**state, "fresh": fresh_state}).encode())
            if result:
                return RecomputeResult(final, out_dir, [], list(sel), list(state.get("notes") or []), variant)
            return final
    # every step of the run whose cached row is still valid (not only the selected ones: the
    # cache is rewritten whole, and cumulative metrics need the steps before --steps)
    valid_cache: dict[int, dict] = {}
    if incremental and not extra_visitors and cache_path.is_file() and state:
        try:
            if state.get("config_hash") == chash:
                old = pl.read_parquet(cache_path)
                for row in old.iter_rows(named=True):
                    s = row["step"]
                    if s in fingerprints and state.get("steps", {}).get(str(s)) == fingerprints[s]:
                        valid_cache[s] = row
        except Exception:  # noqa: BLE001 - a damaged cache is simply rebuilt
            valid_cache = {}
    cached_rows = {s: valid_cache[s] for s in sel if s in valid_cache}
    todo = [s for s in sel if s not in cached_rows]

    work = StepWork(run, cfg, prof, metrics, step_visitors(cfg, families, extra_visitors), columns, need_samples,
                    bool(sample_steps), schedule)
    rows: dict[int, dict] = dict(cached_rows)
    present_any: set[str] = set()
    done = 0

    def tick(_step: int) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, len(todo))

    computed: set[int] = set()
    # the step outputs of visitors with collect=True (completions, top tokens, IS histograms) go to
    # disk as each step is done (grpolens.run.step_table), so memory does not grow with the steps
    spill = StepSpill(cache_root / "cache") if write and only is None else None
    try:
        # worker processes when there is enough to do (grpolens.analysis.step_workers); this
        # process alone for other engines, extra visitors and on_step (their pieces are here)
        # and a run on object storage
        n_workers = 1
        if (engine is None or isinstance(engine, ThreadEngine)) and not extra_visitors and on_step is None \
                and not fmt.is_remote_run(run):
            n_workers = step_workers.count(workers, len(todo), sum(f[1] for s in todo for f in fingerprints[s]))
        if n_workers > 1:
            spec = WorkerSpec(run, cfg, prof.name, [m.name for m in metrics], sorted(sample_cols), families, columns,
                              need_samples, bool(sample_steps), schedule, frozenset(token_steps),
                              spill.folder() if spill is not None else None)
            here = functools.partial(work.one_step, token_steps=spec.token_steps, spill=spill,
                                     engine=step_workers.engine())
            # closed (its workers stopped) before the spill is removed, whatever happens here
            with contextlib.closing(step_workers.map_steps(spec, todo, n_workers, here)) as results:
                for step, row, present, spilled in results:
                    rows[step] = row
                    if present is not None:  # a step with token shards
                        present_any |= present
                        computed.add(step)
                    for name, schema in spilled.items():  # the files a worker process wrote
                        spill.table(name).adopt(step, schema)
                    tick(step)
        else:
            _serial_steps(work, todo, set(token_steps), engine, rows, present_any, computed, spill, tick, on_step)

        names = ["step"] + [m.name for m in metrics]
        schema = {"step": pl.Int64, **{m.name: pl.Float64 for m in metrics}}
        if schedule is not None:  # the hidden counts of appended values
            counts = [m.name + suffix for m in metrics for suffix in schedule.hidden]
            names += counts
            schema.update({c: pl.Int64 for c in counts})
        records = [{k: rows[s].get(k) for k in names} for s in sorted(rows)]
        raw = pl.DataFrame(records, schema=schema, orient="row")
        final = finalize(raw, metrics, profile, _cumulative_offsets(run, metrics, all_steps, lo, valid_cache, cfg, prof))
        if schedule is not None and not per_step:
            final = schedule.log_view(final, raw, metrics)

        notes = _absent_notes(run, metrics, raw, present_any, computed) + _rejection_notes(cfg, present_any, computed)
        from grpolens.metrics.rollout_is.offset import offset_notes  # constant train-rollout offset diagnosis

        run_notes = offset_notes(raw)  # about the whole selection: a re-run with nothing new repeats them
        notes += run_notes
        unchanged = (only is None and not computed and not (set(todo) - computed) and bool(valid_cache)
                     and state.get("outputs") == {"key": outputs_key, "files": output_files(out_dir)})
        if write and not unchanged:
            out_dir.mkdir(parents=True, exist_ok=True)
            fmt.atomic_write_table(out_dir / "metrics.parquet", final.to_arrow())
            fmt.atomic_write_bytes(out_dir / "metrics.jsonl", to_jsonl(final).encode())
        if write and only is None and variant is not None and out is None:
            variant.write_record()  # what this directory is: the overrides and their label (serve lists it)
        if write and only is None and not unchanged:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            kept = set(cached_rows)
            for v in work.visitors:
                if getattr(v, "collect", False) and hasattr(v, "finish"):
                    v.finish(run, out_dir, spill.table(v.name), kept)
            spill.close()  # before an upload of the staged outputs, which must not carry it
            # the state goes last: if anything above fails, the next run recomputes these steps
            keep = {s: r for s, r in valid_cache.items() if s not in rows}
            cache = pl.DataFrame([{k: r.get(k) for k in names} for _, r in sorted({**keep, **rows}.items())],
                                 schema=schema, orient="row")
            fmt.atomic_write_table(cache_path, cache.to_arrow())
            state = {"config_hash": chash, "steps": {str(s): fingerprints[s] for s in sorted({*keep, *rows})},
                     "samples": samples_fp, "sample_columns": sorted(sample_cols),
                     "outputs": {"key": outputs_key, "files": output_files(out_dir)}, "notes": run_notes}
            if stamp is not None:
                state["fresh"] = {**stamp, "reused": sorted(sel), "key_columns": key_columns(final.columns, profile)}
            fmt.atomic_write_bytes(state_path, json.dumps(state).encode())
            if remote_out is not None:
                _upload(out_dir, remote_out)
                out_dir = remote_out
    finally:
        if spill is not None:
            spill.close()
    _save_memo(reader, memo_path)  # last: this recompute succeeded
    if result:
        return RecomputeResult(final, out_dir if write else None, sorted(computed | (set(todo) - computed)),
                               sorted(cached_rows), notes, variant)
    return final


def _save_memo(reader: RunReader, memo_path: Path | None) -> None:
    """Remember the files that passed the checks (see :func:`grpolens.run.validate.check_before_reading`)."""
    memo = reader.check_report.memo if reader.check_report is not None else None
    if memo_path is not None and memo is not None and memo.changed:
        memo.save(memo_path)
