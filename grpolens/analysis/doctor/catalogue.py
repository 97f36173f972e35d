"""The detector catalogue: what a detector is, what it returns, and the registry they join.

A detector is a function ``fn(ctx) -> list[Finding]`` registered with :func:`detector`: an empty
list means it looked and found nothing (``passed``), :class:`Skip` means it could not look (the
run lacks the metric, too few steps) and says why. The built-ins are the modules of
:mod:`grpolens.analysis.doctor.detectors` (found by listing the package, as profiles are); a
third-party plugin (a ``grpolens.plugins`` entry point, see :mod:`grpolens.plugins`) registers
its own the same way, on import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

SEVERITIES = ("info", "warning", "critical")  # mildest first


def severity_rank(severity: str | None) -> int:
    """-1 for None, then the index in :data:`SEVERITIES`."""
    return -1 if severity is None else SEVERITIES.index(severity)


class Skip(Exception):
    """Raised by a detector that cannot look at this run; the message says why (one line)."""


@dataclass
class Finding:
    """One thing wrong (or worth knowing) about a run."""

    id: str  # the detector's id
    severity: str  # info / warning / critical
    steps: list[int]  # the steps where it holds
    metric: str  # canonical metric name it is read from
    summary: str  # one line for a person
    evidence: dict[str, Any] = field(default_factory=dict)  # numbers (and explain's decomposition)
    suggestion: str = ""  # what to change, in the run's trainer's own setting names
    worst_step: int | None = None  # the step explain decomposes

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"finding {self.id}: severity {self.severity!r} is not one of {SEVERITIES}")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "severity": self.severity, "steps": [int(s) for s in self.steps],
                "metric": self.metric, "summary": self.summary, "evidence": self.evidence,
                "suggestion": self.suggestion}


@dataclass(frozen=True)
class Detector:
    id: str
    title: str  # one line: what it looks for
    metrics: tuple[str, ...]  # canonical metrics it reads (documentation, and the Findings page's links)
    fn: Callable[[Any], list[Finding]]


#: id -> detector, in registration order (the order of the report)
DETECTORS: dict[str, Detector] = {}


def detector(id: str, title: str, metrics: tuple[str, ...] = ()) -> Callable:
    """Decorator: register ``fn(ctx) -> list[Finding]`` as detector ``id``."""

    def wrap(fn: Callable[[Any], list[Finding]]) -> Callable[[Any], list[Finding]]:
        if id in DETECTORS and DETECTORS[id].fn is not fn:
            raise ValueError(f"detector {id} registered twice")
        DETECTORS[id] = Detector(id, title, tuple(metrics), fn)
        return fn

    return wrap


def load_detectors() -> dict[str, Detector]:
    """The built-in detectors and every installed plugin's (once)."""
    import importlib
    import pkgutil
    from pathlib import Path

    from grpolens import plugins

    plugins.load_plugins()  # a third-party plugin registers its detectors on import, with its families
    pkg = Path(__file__).parent / "detectors"
    for m in sorted(pkgutil.iter_modules([str(pkg)]), key=lambda m: m.name):
        if not m.name.startswith("_"):
            importlib.import_module(f"grpolens.analysis.doctor.detectors.{m.name}")
    return DETECTORS
