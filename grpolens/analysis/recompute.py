"""``grpolens recompute`` (and ``grpolens.recompute()``): every registered metric, per step, from a run's shards.

The work is one streaming pass (:func:`grpolens.metrics.engine.iter_steps`): per step, the
per-sequence partials of all shards are merged and every metric is reduced from them under the
chosen profile. Results are cached per step with a fingerprint of the step's shards and of the
config, so that re-running on a run that has grown reads only the new (or changed) steps.

Outputs (atomically, under ``RUN/grpolens/`` for the default profile, ``RUN/grpolens/<profile>/``
otherwise): ``metrics.parquet`` (one row per step, one column per metric) and ``metrics.jsonl``
(one JSON object per step, null keys omitted, like a trainer's log).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import polars as pl

from grpolens.run import format as fmt
from grpolens.errors import UserError
from grpolens.metrics import reduce
from grpolens.metrics.engine import READ_COLUMNS, SequencePartials, ThreadEngine, iter_steps, visitor_factories
from grpolens.metrics.profile import Profile
from grpolens.metrics.registry import REGISTRY, Metric
from grpolens import plugins
from grpolens.run.reader import RunReader, read_samples
from grpolens.run.step_table import StepSpill
from grpolens.run.variants import Variant, effective_overrides
from grpolens.analysis import fresh, step_workers
from grpolens.analysis.fresh import output_files

CACHE_VERSION = 2  # 2: rows of a profile with a log schedule carry appended-value counts


@dataclass
class RecomputeResult:
    metrics: pl.DataFrame
    out_dir: Path | None
    computed_steps: list[int]
    reused_steps: list[int]
    notes: list[str] = field(default_factory=list)
    variant: Variant | None = None  # the what-if this recompute was (config overrides), else None


# ---------------------------------------------------------------------------------------------
# Per-step computation
# ---------------------------------------------------------------------------------------------

def metrics_for(profile: str | Profile, cfg: dict, columns: Iterable[str] = ()) -> list[Metric]:
    """The metrics ``profile`` logs under ``cfg``, templates expanded over the run's sample ``columns``.

    When two applicable metrics carry the same name in ``profile``, the first registered keeps it
    (e.g. Twinkle's ``train/clip_ratio_low`` is the gated clip fraction, or under CISPO, where that
    metric does not apply, the unconditional one)."""
    plugins.load_plugins()
    profile = profile.name if isinstance(profile, Profile) else profile
    columns = list(columns)
    out, taken = [], set()
    for m in REGISTRY.values():
        if m.name_in(profile) is None or not m.applies(cfg):
            continue
        for c in m.expand(columns):
            if c.name_in(profile) not in taken:
                taken.add(c.name_in(profile))
                out.append(c)
    return out


def select_metrics(metrics: list[Metric], only: Iterable[str], profile: str = "grpolens") -> list[Metric]:
    """The metrics named by ``only``: each item a family (``clip``), a metric name or a glob over
    names (``rollout_is/applied/*``), under grpolens' names or ``profile``'s. An item that matches
    nothing is a user error."""
    from fnmatch import fnmatchcase

    items = [i.strip() for spec in only for i in spec.split(",") if i.strip()]
    if not items:
        raise UserError("--only: expected a family, a metric name or a pattern (e.g. --only clip,kl/k3)")
    picked: set[str] = set()
    for item in items:
        hit = [m.name for m in metrics if m.family == item or fnmatchcase(m.name, item)
               or (m.name_in(profile) is not None and fnmatchcase(m.name_in(profile), item))]
        if not hit:
            families = sorted({m.family for m in metrics})
            raise UserError(f"--only: {item!r} is no metric family ({', '.join(families)}), metric name or "
                            f"pattern of this run under profile {profile!r} (see grpolens metrics)")
        picked.update(hit)
    return [m for m in metrics if m.name in picked]


def step_values(sd: reduce.StepData, metrics: list[Metric], schedule: Any = None) -> dict[str, Any]:
    """One step's row. With a profile's log ``schedule`` (TRL's logging windows) each value is what
    the schedule says the step contributes, plus hidden columns counting the values it appended."""
    row: dict[str, Any] = {"step": sd.step}
    for m in metrics:
        skip = ((m.source == "tokens" and m.requires and not all(c in sd.present for c in m.requires))
                or (m.source == "samples" and sd.samples is None)
                or ((m.template or m.name) in sd.profile.generation_only and sd.samples is None
                    and sd.extra.get("run_has_samples")))
        if schedule is not None:
            val, *counts = (None, 0, 0) if skip else schedule.step_value(m, sd)
            row.update({m.name + suffix: c for suffix, c in zip(schedule.hidden, counts)})
        else:
            val = None if skip else reduce.compute(m, sd)
        row[m.name] = val
    return row


def step_visitors(cfg: dict, families: frozenset[str] | None = None, extra: list | None = None) -> list:
    """The visitors of a recompute's pass over the tokens: the per-sequence partials first, then the
    registered visitors (those ``families`` need), then ``extra``."""
    return [SequencePartials(cfg, families), *(factory(cfg) for factory in visitor_factories(families)), *(extra or [])]


@dataclass
class StepWork:
    """The per-step body of a recompute, the same in this process and in a worker process
    (:mod:`grpolens.analysis.step_workers`): from a step's combined visitor pieces (or, for a step
    without token shards, its samples alone) to its row of metrics and its rows of the step tables."""

    run: Any
    cfg: dict
    profile: Profile
    metrics: list[Metric]
    visitors: list  # step_visitors(...): the per-sequence partials first
    columns: tuple[str, ...]
    need_samples: bool
    run_has_samples: bool
    schedule: Any = None

    def token_step(self, step: int, pieces: dict[str, Any], spill: StepSpill | None) -> tuple[dict[str, Any], set[str]]:
        """``(row, present token columns)`` of a step with token shards; with ``spill``, each
        collecting visitor's step output (made while the step's samples are here) goes to it."""
        seqs, present = pieces[self.visitors[0].name]
        samples = read_samples(self.run, step) if self.need_samples else None
        sd = reduce.StepData(step, seqs, self.cfg, self.profile, samples, present, {})
        sd.extra["pieces"] = pieces
        sd.extra["run_has_samples"] = self.run_has_samples
        sd.extra["schedule"] = self.schedule
        row = step_values(sd, self.metrics, self.schedule)
        for v in self.visitors:
            if spill is not None and getattr(v, "collect", False):
                piece = pieces[v.name]
                if hasattr(v, "at_step"):
                    piece = v.at_step(step, piece, samples, self.run)
                spill.put(v.name, step, piece)
        return row, present

    def one_step(self, step: int, token_steps: frozenset[int], spill: StepSpill | None, engine
                 ) -> tuple[dict[str, Any], set[str] | None]:
        """``(row, present)`` of one step computed on its own, here or in a worker process
        (:mod:`grpolens.analysis.step_workers`; ``present``: None for a step without token shards)."""
        if step in token_steps:
            res = next(iter_steps(self.run, [step], self.visitors, columns=self.columns, engine=engine))
            return self.token_step(step, res.pieces, spill)
        return self.samples_step(step), None

    def samples_step(self, step: int) -> dict[str, Any]:
        """The row of a step with samples but no token shards: sample-side metrics only."""
        samples = read_samples(self.run, step) if self.need_samples else None
        return step_values(reduce.StepData(step, {}, self.cfg, self.profile, samples, set(), {}), self.metrics,
                           self.schedule)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build the recompute's :class:`StepWork` (picklable: the
    metrics by name, rebuilt there from the registries the plugins fill)."""

    run: Path
    cfg: dict
    profile: str
    metric_names: list[str]
    sample_columns: list[str]
    families: frozenset[str] | None
    columns: tuple[str, ...]
    need_samples: bool
    run_has_samples: bool
    schedule: Any
    token_steps: frozenset[int]
    spill_dir: Path | None  # the recompute's spill folder: a worker writes its steps' files there

    def work(self) -> StepWork:
        """The :class:`StepWork`, built in the worker; :class:`KeyError` names a metric this
        process does not know (one registered at run time in the parent, not by a plugin)."""
        prof = plugins.get(self.profile)
        by_name = {m.name: m for m in metrics_for(self.profile, self.cfg, self.sample_columns)}
        missing = [n for n in self.metric_names if n not in by_name]
        if missing:
            raise KeyError(missing[0])
        return StepWork(self.run, self.cfg, prof, [by_name[n] for n in self.metric_names],
                        step_visitors(self.cfg, self.families), self.columns, self.need_samples,
                        self.run_has_samples, self.schedule)


def _serial_steps(work: StepWork, todo: list[int], token_steps: set[int], engine, rows: dict, present_any: set,
                  computed: set, spill: StepSpill | None, tick, on_step) -> None:
    """The steps ``todo`` in this process, one after another (the per-shard work on ``engine``)."""
    for res in iter_steps(work.run, [s for s in todo if s in token_steps], work.visitors, columns=work.columns,
                          on_step=tick, engine=engine):
        rows[res.step], present = work.token_step(res.step, res.pieces, spill)
        present_any |= present
        computed.add(res.step)
        if on_step:
            on_step(res.step, res.pieces)
    for s in todo:
        if s not in computed:
            rows[s] = work.samples_step(s)
            tick(s)


def _fingerprint(shards: list[fmt.Shard]) -> list:
    return [sh.fingerprint() for sh in shards]


def _output_dirs(reader: RunReader, out, profile: str, variant: Variant | None = None) -> tuple[Path, Path, Any]:
    """``(out_dir, cache_root, remote_out)``: where outputs and the per-step cache go. A local run
    keeps both under ``RUN/grpolens/`` unless ``--out``; a run on object storage writes locally by
    default (``./<run name>.grpolens/``); ``--out s3://...`` stages locally and uploads at the end.
    A what-if (``variant``) keeps both in its own directory, ``RUN/grpolens/variants/<key>/``, or
    in ``--out`` when given: never in the run's own, whose metrics and cache it would replace."""
    from grpolens.run.storage import is_remote, location

    if out is not None and (is_remote(str(out)) if isinstance(out, str) else fmt.is_remote_run(out)):
        import tempfile

        remote_out = location(out, reader.path.settings.storage_options() if fmt.is_remote_run(reader.path) else None) \
            if isinstance(out, str) else out
        staging = Path(tempfile.mkdtemp(prefix="grpolens-out-"))
        for rel, _ in remote_out.walk():  # earlier outputs and the cache: kept steps are reused
            if rel.split("/", 1)[0] == "is_weights":
                # written in place by recompute --is-weights (ISWeightWriter), not staged: a staged copy
                # would go back up at the end over the new weights and restore the stale parts removed
                continue
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes((remote_out / rel).read_bytes())
        return staging, staging, remote_out
    if variant is not None:
        root = Path(out) if out is not None else variant.dir
        return (root if out is not None or profile == "grpolens" else root / profile), root, None
    if fmt.is_remote_run(reader.path):  # the local fmt.derived_dir of the run (./<run name>.grpolens)
        root = Path(out) if out is not None else fmt.derived_dir(reader.path)
        return (root if out is not None or profile == "grpolens" else root / profile), root, None
    return (Path(out) if out is not None else reader.out_dir(profile)), fmt.derived_dir(reader.path), None


def _upload(staging: Path, remote_out) -> None:
    """Every staged file to its key under ``remote_out``, each atomically (temporary key, copy)."""
    import shutil

    try:
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        # the cache state last: an upload cut short leaves a state that does not vouch for new rows
        for f in sorted(files, key=lambda p: (p.parent.name == "cache" and p.name.startswith("state-"), str(p))):
            (remote_out / f.relative_to(staging).as_posix()).write_bytes(f.read_bytes())
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _config_hash(cfg: dict, profile: str) -> str:
    blob = json.dumps({"cfg": cfg, "profile": profile, "cache": CACHE_VERSION, "metrics": sorted(REGISTRY)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

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


def key_columns(columns, profile: str = "grpolens") -> list[str]:
    """The profile's names of the families' key metrics (``Family.key_metrics``) that ``columns`` has (the summary's rows)."""
    from grpolens.metrics.registry import FAMILIES

    plugins.load_plugins()
    out = []
    for name in (k for f in FAMILIES.values() for k in f.key_metrics):
        m = REGISTRY.get(name)
        alias = m.name_in(profile) if m is not None else None
        if alias is not None and alias in columns:
            out.append(alias)
    return out


def _save_memo(reader: RunReader, memo_path: Path | None) -> None:
    """Remember the files that passed the checks (see :func:`grpolens.run.validate.check_before_reading`)."""
    memo = reader.check_report.memo if reader.check_report is not None else None
    if memo_path is not None and memo is not None and memo.changed:
        memo.save(memo_path)


def _cumulative_offsets(run, metrics, all_steps, lo, valid_cache, cfg, prof) -> dict[str, float]:
    """Totals of cumulative metrics over the steps before ``--steps`` starts (samples only:
    cumulative metrics count generated tokens, so no token shard is read)."""
    cum = [m for m in metrics if m.cumulative]
    if not cum or lo is None:
        return {}
    totals = {m.name: 0.0 for m in cum}
    for s in all_steps:
        if s >= lo:
            break
        row = valid_cache.get(s)
        if row is None:
            row = step_values(reduce.StepData(s, {}, cfg, prof, read_samples(run, s), set(), {}), cum)
        for m in cum:
            totals[m.name] += row.get(m.name) or 0.0
    return totals


def finalize(raw: pl.DataFrame, metrics: list[Metric], profile: str, offsets: dict[str, float] | None = None) -> pl.DataFrame:
    """Rename to the profile's names; cumulative metrics become running totals (from ``offsets``)."""
    exprs = [pl.col("step")]
    for m in metrics:
        e = pl.col(m.name)
        if m.cumulative:
            start = (offsets or {}).get(m.name, 0.0)
            e = pl.when(e.is_not_null()).then(e.fill_null(0).cum_sum() + start).otherwise(None)
        exprs.append(e.alias(m.name_in(profile)))
    return raw.select(exprs)


def to_jsonl(df: pl.DataFrame) -> str:
    lines = []
    for row in df.iter_rows(named=True):
        clean = {}
        for k, v in row.items():
            if v is None or (isinstance(v, float) and not np.isfinite(v)):
                continue
            clean[k] = v
        lines.append(json.dumps(clean))
    return "\n".join(lines) + ("\n" if lines else "")


def _rejection_notes(cfg: dict, present: set[str], computed) -> list[str]:
    """A verl run with rejection filters but no ``rollout_rejected``: its stored mask is the one after
    verl's rejection, so the rollout-correction values cannot be verl's (said once). Bypass mode
    has no rejection before the loss (the loss rejects per call, which the profile replays)."""
    from grpolens.functional.rollout_is import ISConfig
    from grpolens.metrics.verl_actor import bypass

    if not computed or "verl_algorithm" not in cfg or bypass(cfg):
        return []
    if "rollout_rejected" in present or not ISConfig.from_cfg(cfg).rs:
        return []
    return ["no rollout_rejected in this run: verl's rollout_rs is re-applied to the mask after its rejection "
            "(rejection fractions 0, IS and mismatch values over the kept tokens; verl computes them before "
            "rejection: docs/integrations/verl.md)"]


def _absent_notes(run, metrics, raw, present, computed) -> list[str]:
    """One line per optional column the run lacks, naming the metrics that are therefore empty."""
    if not computed:
        return []
    notes = []
    for col in ("old_logp", "ref_logp", "rollout_logp", "entropy", "old_entropy"):
        if col in present:
            continue
        hit = [m.name for m in metrics if col in m.requires]
        if hit:
            notes.append(f"no {col} in this run: {len(hit)} metric(s) left empty ({', '.join(hit[:4])}{', ...' if len(hit) > 4 else ''})")
    return notes
