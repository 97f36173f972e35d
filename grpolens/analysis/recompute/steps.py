"""The per-step body of a recompute: which metrics, which visitors, and one step's row, the same in
this process and in a worker process (:mod:`grpolens.analysis.step_workers`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

from grpolens import plugins
from grpolens.errors import UserError
from grpolens.metrics import reduce
from grpolens.metrics.engine import SequencePartials, iter_steps, visitor_factories
from grpolens.metrics.profile import Profile
from grpolens.metrics.registry import REGISTRY, Metric
from grpolens.run.reader import RunReader
from grpolens.run.step_table import StepSpill


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

    @cached_property
    def reader(self) -> RunReader:
        """The run, its manifest read once, not with each step's samples (a GET each on ``s3://``)."""
        return RunReader(self.run)

    def token_step(self, step: int, pieces: dict[str, Any], spill: StepSpill | None) -> tuple[dict[str, Any], set[str]]:
        """``(row, present token columns)`` of a step with token shards; with ``spill``, each
        collecting visitor's step output (made while the step's samples are here) goes to it."""
        seqs, present = pieces[self.visitors[0].name]
        samples = self.reader.samples(step) if self.need_samples else None
        sd = reduce.StepData(step, seqs, self.cfg, self.profile, samples, present, {})
        sd.extra["pieces"] = pieces
        sd.extra["run_has_samples"] = self.run_has_samples
        sd.extra["schedule"] = self.schedule
        row = step_values(sd, self.metrics, self.schedule)
        for v in self.visitors:
            if spill is not None and v.collect:
                spill.put(v.name, step, v.at_step(step, pieces[v.name], samples, self.run))
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
        samples = self.reader.samples(step) if self.need_samples else None
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
    step_tables: bool  # whether the recompute keeps step tables: a worker sends its steps' rows

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


def serial_steps(work: StepWork, todo: list[int], token_steps: set[int], engine, rows: dict, present_any: set,
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
