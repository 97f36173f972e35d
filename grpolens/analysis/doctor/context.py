"""What a detector sees: the run's recomputed metrics (canonical names, one row per step), its
config, the profile whose setting names the suggestions use, and the samples of a step on demand."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from grpolens.analysis.doctor import stats
from grpolens.analysis.doctor.catalogue import Skip
from grpolens.metrics.profile import SETTINGS, Profile

#: the fewest steps with a value a trend statistic is computed from
MIN_TREND_STEPS = 8


@dataclass
class Context:
    run: Any  # a local Path or an s3:// run
    metrics: pl.DataFrame  # recompute's per-step frame (grpolens profile), restricted to --steps
    config: dict
    profile: Profile
    storage_options: dict | None = None
    #: what the running detector looked at, in words (the ``why`` of a detector that passed)
    checks: list[str] = field(default_factory=list)
    _samples: dict = field(default_factory=dict)
    _reader: Any = None  # the run's RunReader, made on the first samples read (its manifest read once)

    def checked(self, what: str) -> None:
        """Record what a detector looked at and found unremarkable (its ``why`` when it passes)."""
        self.checks.append(what)

    def has(self, metric: str) -> bool:
        return metric in self.metrics.columns and self.metrics[metric].drop_nulls().len() > 0

    def series(self, metric: str, min_steps: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of ``metric`` at the steps where it is finite; :class:`Skip` (naming the
        metric) when the run lacks it or has fewer than ``min_steps`` such steps."""
        if metric not in self.metrics.columns:
            raise Skip(f"the run has no {metric} (its data lacks what that metric needs)")
        x, y = stats.finite(self.metrics["step"].to_numpy(), self.metrics[metric].to_list())
        if len(y) < min_steps:
            raise Skip(f"{metric} has a value at {len(y)} step(s); this detector needs {min_steps}")
        return x.astype(np.int64), y

    def setting(self, key: str) -> str:
        """How to name a training setting to a user of this run's trainer: its key in backticks
        (TRL's ``epsilon_high``), or what it is in words when the profile has no key for it."""
        name = self.profile.settings.get(key)
        return f"`{name}`" if name else SETTINGS[key]

    def samples(self, step: int) -> pl.DataFrame | None:
        """The samples table of ``step`` (None when the step has none); read once."""
        if step not in self._samples:
            from grpolens.run.reader import RunReader

            self._reader = self._reader or RunReader(self.run)
            self._samples[step] = self._reader.samples(step)
        return self._samples[step]
