"""A recompute's plan: every decision about what it reads, reuses, computes and writes, taken once
from the request and the run before a step is computed, and named.

:class:`Request` is what the caller asked (the keywords of :func:`grpolens.recompute`),
:class:`Decisions` the yes/no answers derived from it (each in one place, under a name the steps
read), and :class:`Plan` the resolved run: config, steps, metrics, where the outputs and the
per-step cache go, and which cached rows are still valid.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from grpolens import plugins
from grpolens.metrics.engine import READ_COLUMNS, ThreadEngine
from grpolens.metrics.profile import Profile
from grpolens.metrics.registry import Metric
from grpolens.run import format as fmt
from grpolens.run.reader import RunReader
from grpolens.run.variants import Variant, effective_overrides
from grpolens.analysis import fresh
from grpolens.analysis.fresh import output_files
from grpolens.analysis.recompute.cache import StepCache, config_hash, key
from grpolens.analysis.recompute.outputs import output_dirs
from grpolens.analysis.recompute.steps import metrics_for, select_metrics


#: outputs a recompute writes whole every time (no cached step's rows are read from them)
_REWRITTEN = frozenset({"metrics.parquet", "metrics.jsonl"})


@dataclass(frozen=True)
class Request:
    """What the caller asked: the keywords of :func:`grpolens.analysis.recompute.recompute`, as given
    (a dashboard's ``VariantRun`` lends its overrides when none are given)."""

    out: os.PathLike | str | None = None
    profile: str = "grpolens"
    steps: str | tuple[int | None, int | None] | None = None
    overrides: dict[str, Any] | None = None
    config_file: os.PathLike | str | None = None
    write: bool = True
    incremental: bool = True
    progress: Callable[[int, int], None] | None = None
    extra_visitors: list | None = None
    on_step: Callable[[int, dict[str, Any]], None] | None = None
    result: bool = False
    engine: Any = None
    storage_options: dict[str, str] | None = None
    only: Iterable[str] | None = None
    per_step: bool = False
    workers: int | None = None


@dataclass(frozen=True)
class Decisions:
    """Every yes/no of a recompute, from the request and two facts about the run (on object storage?
    a what-if?). The steps read these names; none of them re-derives a condition."""

    writes: bool              # outputs, the per-step cache and its state, the check memo are written
    selective: bool           # --only: some metrics, beside the full outputs, away from the cache
    reads_state: bool         # the cache's state is read (sample columns of unchanged shards)
    reuses_rows: bool         # cached rows of steps whose shards and config are unchanged are reused
    keeps_step_outputs: bool  # the visitors' step outputs (completions, top tokens...) and the cache are written
    remote_out: bool          # --out s3://... (or another object-storage location)
    stages_remote_out: bool   # ... staged here (earlier outputs copied, the new ones uploaded at the end)
    skips_when_fresh: bool    # outputs of exactly this request, untouched since: read back, nothing computed
    stamps: bool              # a plain local request: its stamp lets `grpolens recompute` find the outputs fresh
    remembers_checks: bool    # the files that passed the checks are remembered (a re-run opens only new ones)
    records_variant: bool     # a what-if writing its own folder records what it is (serve lists it)
    may_use_workers: bool     # worker processes may compute steps (their pieces need not come back here)

    @classmethod
    def of(cls, req: Request, remote_run: bool, variant: Variant | None) -> Decisions:
        plain = req.only is None and not req.extra_visitors  # every metric, no visitor of the caller's
        remote_out = req.out is not None and fmt.is_remote_run(req.out)
        stages = remote_out and (req.write or remote_run)
        return cls(
            writes=req.write,
            selective=req.only is not None,
            reads_state=req.incremental,
            reuses_rows=req.incremental and plain,
            keeps_step_outputs=req.write and req.only is None,
            remote_out=remote_out,
            stages_remote_out=stages,
            skips_when_fresh=req.write and req.incremental and plain and not stages,
            stamps=(req.write and req.incremental and plain and variant is None and not req.overrides
                    and req.config_file is None and not remote_run and (req.out is None or "://" not in str(req.out))),
            remembers_checks=req.write and req.incremental and req.only is None and not remote_run,
            records_variant=req.write and req.only is None and variant is not None and req.out is None,
            may_use_workers=((req.engine is None or isinstance(req.engine, ThreadEngine)) and not req.extra_visitors
                             and req.on_step is None and not remote_run),
        )


@dataclass
class Plan:
    """A recompute, resolved: the run read and checked, the decisions, the steps and metrics, where
    everything goes, and the per-step cache as found."""

    request: Request
    decide: Decisions
    reader: RunReader
    profile: Profile
    variant: Variant | None
    stamp: dict | None
    memo_path: Path | None
    cfg: dict
    schedule: Any                  # the profile's log schedule (TRL's logging windows), else None
    selected: list[int]            # the steps --steps selects
    lo: int | None
    hi: int | None
    token_steps: list[int]
    sample_steps: list[int]
    all_steps: list[int]
    out_dir: Path                  # where the metrics go (a staging folder for --out s3://...)
    cache_root: Path               # the folder holding cache/ (step rows, state, spilled step outputs)
    remote_out: Any                # --out s3://...: where the staged outputs are uploaded, else None
    config_hash: str
    cache: StepCache
    sample_columns: set[str]       # the run's sample columns (metric templates expand over them)
    metrics: list[Metric]
    families: frozenset[str] | None  # with --only: the families the selected metrics need
    need_samples: bool
    columns: tuple[str, ...]       # the token columns read
    outputs_key: str               # this request's outputs: config, selection, shards, destination

    @property
    def run(self):
        return self.reader.path

    @property
    def name(self) -> str:
        """The profile's name (outputs and cache files are per profile)."""
        return self.request.profile

    def outputs_unchanged(self) -> bool:
        """The outputs in ``out_dir`` are the ones the cache's state says this request wrote, untouched since."""
        written = self.cache.state.get("outputs") or {}
        return (written.get("key"), written.get("files")) == (self.outputs_key, output_files(self.out_dir))

    def outputs_record(self, table_steps: set[int]) -> dict:
        """What the cache's state records of the outputs just written: this request's key, the files
        (size, time) and the steps whose rows the step tables hold."""
        return {"key": self.outputs_key, "files": output_files(self.out_dir), "table_steps": sorted(table_steps)}

    def steps_in_tables(self) -> set[int] | None:
        """The steps whose rows the step tables in ``out_dir`` hold (None: any, as nothing is
        written). The per-step cache is the run's, shared by every ``--out``, and its state records
        the last recompute's outputs: the steps its tables hold, while every file it wrote (the metrics aside, rewritten whole) is there at the size it had.
        The size, not the time: a staged ``--out s3://...`` copies the files anew on every run."""
        if not self.decide.keeps_step_outputs:
            return None
        written = self.cache.state.get("outputs") or {}
        files, steps = written.get("files"), written.get("table_steps")
        if not isinstance(files, dict) or not isinstance(steps, list):
            return set()
        here = output_files(self.out_dir)
        if not all(isinstance(st, list) and name in here and here[name][:1] == st[:1]
                   for name, st in files.items() if name not in _REWRITTEN):
            return set()
        return {s for s in steps if isinstance(s, int)}

    def fresh_state(self, columns) -> dict | None:
        """The stamp the cache's state keeps for ``grpolens recompute``'s freshness check, or None."""
        from grpolens.analysis.recompute.outputs import key_columns

        if self.stamp is None:
            return None
        return {**self.stamp, "reused": sorted(self.selected), "key_columns": key_columns(columns, self.name)}

    @property
    def staging(self) -> Path | None:
        """The local folder staging the outputs for ``--out s3://...`` (removed at the end), else None."""
        return self.cache_root if self.remote_out is not None else None

    def save_memo(self) -> None:
        """Remember the files that passed the checks (see :func:`grpolens.run.validate.check_before_reading`)."""
        memo = self.reader.check_report.memo if self.reader.check_report is not None else None
        if self.memo_path is not None and memo is not None and memo.changed:
            memo.save(self.memo_path)


def plan_recompute(run, req: Request) -> Plan:
    """Read and check the run, and decide everything about ``req`` (see :class:`Plan`); the only
    thing written on the way is a staging copy of earlier outputs for ``--out s3://...``."""
    given = getattr(run, "variant", None)  # a VariantRun (the dashboard's): recompute that variant
    if given is not None and req.overrides is None and req.config_file is None:
        req = dataclasses.replace(req, overrides=given.overrides)
    reader = RunReader(run, req.storage_options)
    run = reader.path
    what_if = effective_overrides(req.overrides, req.config_file)
    variant = Variant.of(run, what_if) if what_if else None
    prof = plugins.get(req.profile)
    decide = Decisions.of(req, fmt.is_remote_run(run), variant)
    # what `grpolens recompute RUN` checks, before importing the engine, to find its outputs fresh
    # (grpolens.analysis.fresh): recorded for the plain request, as the run is before it is read
    stamp = None
    if decide.stamps:
        out_for_stamp = Path(req.out) if req.out is not None else reader.out_dir(req.profile)
        stamp = fresh.stamp(run, fresh.request_key(req.profile, req.steps, out_for_stamp, req.per_step, None))
    # refuse what `grpolens validate` would reject, from the Parquet footers; a recompute that keeps
    # its cache remembers the files that passed, so a re-run opens only new or changed ones
    memo_path = fmt.derived_dir(run) / "cache" / "checked.json" if decide.remembers_checks else None
    reader.check(memo_path, stamp["tree"] if stamp is not None else None)  # one walk serves stamp and memo
    cfg = reader.config(req.overrides, req.config_file)
    schedule = None
    if prof.log_schedule is not None:  # the trainer's logging schedule and release rules, from the run
        schedule, cfg = prof.log_schedule(reader, cfg, req.overrides, req.config_file)
    selected, lo, hi = reader.select_steps(req.steps)
    token_steps, sample_steps, all_steps = reader.steps(fmt.TOKENS), reader.steps(fmt.SAMPLES), reader.steps()

    if decide.remote_out and not decide.stages_remote_out:
        # nothing is written: the remote outputs are not staged, the run's own cache is read
        out_dir, cache_root, remote_out = Path(req.out), fmt.derived_dir(run), None
    else:
        # --only reuses nothing of what is there: its two files are the only ones staged and uploaded
        out_dir, cache_root, remote_out = output_dirs(reader, req.out, req.profile, variant, fetch=not decide.selective)
    try:
        chash = config_hash({**cfg, "_trainer": reader.manifest.trainer}, req.profile)
        cache = StepCache.open(cache_root, req.profile, run, all_steps, decide.reads_state)

        sample_columns = cache.sample_columns(reader)
        metrics = metrics_for(req.profile, cfg, sample_columns)
        families: frozenset[str] | None = None
        if decide.selective:
            metrics = select_metrics(metrics, req.only, req.profile)
            families = frozenset(m.family for m in metrics)
            if req.out is None:  # beside the full outputs, never over them
                out_dir = out_dir / "only"
        # token_id feeds only diversity (and the top-tokens output): a restricted run may skip it
        columns = READ_COLUMNS if families is None or "diversity" in families else tuple(c for c in READ_COLUMNS if c != "token_id")
        # the outputs of exactly this recompute (config, selection, shards, destination): a re-run with
        # nothing new finds them in the cache's state and writes nothing
        manifest = None if fmt.is_remote_run(run) else output_files(Path(run)).get(fmt.MANIFEST_NAME)
        outputs_key = key([chash, selected, lo, hi, str(out_dir.resolve()), cache.fingerprints, manifest, req.per_step])
    except BaseException:
        if remote_out is not None:  # the staging folder goes with the failed plan
            shutil.rmtree(cache_root, ignore_errors=True)
        raise
    return Plan(request=req, decide=decide, reader=reader, profile=prof, variant=variant, stamp=stamp,
                memo_path=memo_path, cfg=cfg, schedule=schedule, selected=selected, lo=lo, hi=hi,
                token_steps=token_steps, sample_steps=sample_steps, all_steps=all_steps, out_dir=out_dir,
                cache_root=cache_root, remote_out=remote_out, config_hash=chash, cache=cache,
                sample_columns=sample_columns, metrics=metrics, families=families,
                need_samples=families is None or any(m.needs_samples(prof) for m in metrics), columns=columns,
                outputs_key=outputs_key)
