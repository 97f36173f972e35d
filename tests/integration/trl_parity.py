"""Test helpers over :mod:`grpolens.analysis.parity`: compare ``recompute(run, profile="trl")`` with the
metrics TRL itself logged in the run (``RUN/grpolens/trl_log.jsonl``, written by the integration).

The product command is ``grpolens parity RUN``; the integration tests use the same comparison.
Both sides use TRL's ``step`` (the integration records ``state.global_step + 1``, the step TRL logs).
"""

from __future__ import annotations

from pathlib import Path

from grpolens.analysis.parity import RTOL, Row, compare as _compare, read_log, summary  # noqa: F401 (re-exported)


def trl_log(run: Path) -> dict[int, dict]:
    """Step -> TRL's logged values (the final summary line is left out)."""
    return read_log(Path(run) / "grpolens" / "trl_log.jsonl")


def compare(run: Path, *, rel: float = RTOL) -> list[Row]:
    return _compare(run, profile="trl", rtol=rel)
