"""``diagnose(run)``: every detector over the run's recomputed metrics, then the explain
decomposition of each finding's worst step (only those steps: the tokens of the others are never
read)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import polars as pl

from grpolens.analysis.doctor.catalogue import SEVERITIES, Finding, Skip, load_detectors, severity_rank
from grpolens.analysis.doctor.context import Context
from grpolens.errors import UserError

#: what explain is asked for at a finding's worst step
EXPLAIN_DIMS = ("token_id", "completion", "group")
EXPLAIN_TOP = 5


@dataclass
class DetectorStatus:
    id: str
    status: str  # passed / skipped / fired
    why: str

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "status": self.status, "why": self.why}


@dataclass
class Report:
    run: str
    findings: list[Finding]
    detectors: list[DetectorStatus]
    profile: str = "grpolens"
    steps: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def worst_severity(self) -> str | None:
        """None | "info" | "warning" | "critical"."""
        ranks = [severity_rank(f.severity) for f in self.findings]
        return SEVERITIES[max(ranks)] if ranks else None

    def fails(self, at_least: str) -> bool:
        """A finding of severity ``at_least`` or worse exists (``--fail-on``)."""
        return severity_rank(self.worst_severity()) >= severity_rank(at_least)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "findings": [f.to_dict() for f in self.findings],
                "detectors": [d.to_dict() for d in self.detectors]}


def diagnose(run: os.PathLike | str, *, profile: str | None = None, steps: str | tuple | None = None,
             explain: bool = True, storage_options: dict | None = None,
             progress: Callable[[int, int], None] | None = None, only: list[str] | None = None,
             metrics: pl.DataFrame | None = None) -> Report:
    """Diagnose ``run``: its recomputed metrics (recompute's cached outputs; computed first when
    missing or stale, with ``progress(done, total)``) through every registered detector.

    ``metrics``: those metrics when the caller has read them itself (the dashboard: the very file it
    found up to date, so that a step landing in between cannot send it to a second read, or to a
    recompute); they are then neither checked for freshness nor read again.

    ``profile`` names the trainer whose setting names the suggestions use (default: the run's
    trainer when a profile of that name exists, else ``grpolens``); the metrics are always the
    canonical per-step ones. ``steps`` (``"A:B"``) restricts the diagnosis to those steps.
    ``explain`` adds :func:`grpolens.analysis.explain.explain`'s decomposition of each finding's
    worst step to its evidence. ``only``: detector ids to run (default all)."""
    from grpolens import plugins
    from grpolens.run.reader import RunReader, parse_steps

    detectors = load_detectors()
    if only:
        unknown = [d for d in only if d not in detectors]
        if unknown:
            raise UserError(f"--detector: unknown detector {unknown[0]!r}; choose from {', '.join(detectors)}")
    reader = RunReader(run, storage_options)
    run = reader.path
    prof = plugins.get(profile if profile is not None else _trainer_profile(reader))
    lo, hi = parse_steps(steps) if isinstance(steps, (str, type(None))) else steps
    if metrics is not None and "step" not in metrics.columns:
        raise UserError("metrics: the frame has no step column (expected recompute's per-step metrics)")
    df = metrics if metrics is not None else load_metrics(run, storage_options, progress)
    sel = df.filter(pl.col("step").is_between(lo if lo is not None else -2**62, hi if hi is not None else 2**62))
    if sel.height == 0:
        every = df["step"].to_list()
        raise UserError(f"--steps: no steps of the run fall in {lo}:{hi} (the run has steps {every[0]}..{every[-1]})")
    ctx = Context(run, sel, reader.config(), prof, storage_options)
    findings, statuses = [], []
    for det in detectors.values():
        if only and det.id not in only:
            continue
        ctx.checks = []
        try:
            got = det.fn(ctx)
        except Skip as e:
            statuses.append(DetectorStatus(det.id, "skipped", str(e)))
            continue
        findings.extend(got)
        statuses.append(DetectorStatus(det.id, "fired", f"{len(got)} finding(s)") if got else
                        DetectorStatus(det.id, "passed", "; ".join(ctx.checks) or det.title.join(("no sign of ", ""))))
    findings.sort(key=lambda f: (-severity_rank(f.severity), f.steps[0] if f.steps else 0, f.id))
    report = Report(str(run), findings, statuses, prof.name, [int(s) for s in sel["step"].to_list()])
    if explain:
        _explain_findings(report, run, storage_options)
    return report


def _trainer_profile(reader) -> str:
    from grpolens import plugins

    name = str((reader.manifest.trainer or {}).get("name") or "")
    return name if name in plugins.profiles() else "grpolens"


def load_metrics(run, storage_options: dict | None = None, progress: Callable[[int, int], None] | None = None) -> pl.DataFrame:
    """The run's canonical per-step metrics: recompute's outputs when they are up to date (a read of
    one Parquet file), else a recompute (incremental: only new or changed steps are computed; a run
    that may not be written, or on object storage, is recomputed in memory)."""
    import errno

    from grpolens.analysis import fresh
    from grpolens.analysis.recompute import recompute
    from grpolens.run import format as fmt

    if fmt.is_remote_run(run):  # computed in memory: a diagnosis writes nothing beside the bucket or here
        return recompute(run, write=False, progress=progress, storage_options=storage_options)
    up = fresh.fresh_outputs(run, None, "grpolens", None, False)
    if up is not None:
        return pl.read_parquet(Path(up.out_dir) / "metrics.parquet")
    try:
        return recompute(run, write=True, progress=progress, storage_options=storage_options)
    except OSError as e:  # a read-only run (EACCES, EPERM, EROFS): computed, not kept
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
    return recompute(run, write=False, progress=progress, storage_options=storage_options)


def _explain_findings(report: Report, run, storage_options: dict | None) -> None:
    """Attach explain's decomposition of each finding's worst step (one explanation per step and metric)."""
    try:
        from grpolens.analysis.explain import explain as _explain
    except ImportError:  # explain (#30) not installed in this tree
        report.notes.append("token evidence unavailable: grpolens.analysis.explain is not part of this version")
        return
    done: dict[tuple[str, int], dict] = {}
    for f in report.findings:
        if f.worst_step is None:
            continue
        key = (f.metric, f.worst_step)
        if key not in done:
            try:
                e = _explain(run, f.metric, f.worst_step, by=EXPLAIN_DIMS, top=EXPLAIN_TOP,
                             storage_options=storage_options)
                d = e.to_dict()
                done[key] = {"headline": e.headline(k=3), "step": f.worst_step, "value": d.get("value"),
                             "delta": d.get("delta"), "baseline": d.get("baseline"), "by": d.get("by"),
                             "concentration": d.get("concentration"), **({"note": d["note"]} if d.get("note") else {})}
            except UserError as err:
                done[key] = {"step": f.worst_step, "note": err.message}
        f.evidence["explain"] = done[key]
