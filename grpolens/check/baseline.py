"""Baselines: another run (recomputed with the candidate's config overrides) or a golden JSON file.

Golden file (``grpolens check RUN --write-golden FILE``)::

    {"format": "grpolens-golden", "version": 1, "created": "...", "run": "...", "run_name": "...",
     "grpolens_version": "...", "overrides": {...}, "rules": "built-in defaults",
     "steps": [0, 1, ...],
     "metrics": {"kl/k3": {"values": {"0": 0.0011, "1": 0.0012, ...}}, ...}}

Metric keys are canonical names; steps with no value are left out; NaN and ±inf are the strings
``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no such numbers).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolens.check.evaluate import Series
from grpolens.errors import UserError

GOLDEN_FORMAT = "grpolens-golden"
GOLDEN_VERSION = 1


@dataclass
class Baseline:
    label: str  # what the reports call it
    series: dict[str, Series]
    steps: list[int]  # every step the baseline has (for the coverage check)
    overrides: dict | None = None  # the --set a golden was written with (None: a run, same as ours)


#: Tokens that count in the loss, per step: 0 means the step has no data for any token metric.
LOSS_TOKENS = "health/masked_tokens"


def run_series(df) -> dict[str, Series]:
    return {c: Series.from_frame(df, c) for c in df.columns if c != "step"}


def no_data_steps(df) -> list[int]:
    """Steps of a metrics frame without a token in the loss (every token masked, or none at all)."""
    import polars as pl

    if LOSS_TOKENS not in df.columns:
        return []
    sub = df.filter(pl.col(LOSS_TOKENS).fill_null(0) == 0)
    return sorted(int(s) for s in sub["step"].to_list())


_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


def metrics_of(run: Path, overrides: dict | None, engine=None):
    """Current metrics of a run. The per-step cache is refreshed in place when the config is the
    run's own and the directory is writable; what-if overrides (``--set``) never overwrite it."""
    from grpolens.analysis.recompute import recompute

    if not overrides:
        try:
            return recompute(run, write=True, engine=engine)
        except OSError as e:  # a run the user may not write (EACCES, EPERM) or on a read-only mount (EROFS)
            if e.errno not in _READ_ONLY:
                raise
    return recompute(run, overrides=overrides or None, write=False, engine=engine)


def load_baseline(path: Path, overrides: dict | None, engine=None) -> Baseline:
    from grpolens.run.format import is_remote_run, is_run

    remote = is_remote_run(path)  # a run on object storage (a golden file is a local file)
    path = path if remote else Path(path)
    if remote or path.is_dir():
        if not is_run(path):
            what = "" if remote else "a directory but "
            raise UserError(f"--baseline: {path} is {what}not a grpolens run (no grpolens.json)")
        df = metrics_of(path, overrides, engine)
        return Baseline(str(path), run_series(df), sorted(df["step"].to_list()))
    if path.is_file():
        return read_golden(path)
    raise UserError(f"--baseline: no such run directory or golden file {path}")


def _encode(v: float) -> Any:
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _decode(v: Any, where: str) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if v in ("nan", "inf", "-inf"):
        return float(v)
    raise UserError(f"{where}: expected a number (or \"nan\", \"inf\", \"-inf\"), got {v!r}")


def golden_json(df, metrics: list[str], *, run: Path, overrides: dict | None, rules_source: str) -> dict:
    import grpolens
    from grpolens.run.format import read_manifest

    out: dict[str, Any] = {
        "format": GOLDEN_FORMAT,
        "version": GOLDEN_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "run": str(run),
        "run_name": read_manifest(run).run_name,
        "grpolens_version": grpolens.__version__,
        "overrides": overrides or {},
        "rules": rules_source,
        "steps": sorted(int(s) for s in df["step"].to_list()),
        "metrics": {},
    }
    for m in metrics:  # columns of df: the caller picks them from its metrics
        s = Series.from_frame(df, m)
        out["metrics"][m] = {"values": {str(int(k)): _encode(float(v)) for k, v in zip(s.steps, s.values)}}
    return out


def write_golden(path: Path, data: dict) -> None:
    from grpolens.run.format import atomic_write_bytes

    path = Path(path)
    if path.parent and not path.parent.exists():
        raise UserError(f"--write-golden: directory {path.parent} does not exist")
    atomic_write_bytes(path, (json.dumps(data, indent=1, sort_keys=False) + "\n").encode())


def read_golden(path: Path) -> Baseline:
    where = f"--baseline {path}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{where}:{e.lineno}: not valid JSON: {e.msg}") from None
    if not isinstance(data, dict) or data.get("format") != GOLDEN_FORMAT:
        raise UserError(f"{where}: not a grpolens golden file (expected \"format\": \"{GOLDEN_FORMAT}\"; "
                        f"write one with `grpolens check RUN --write-golden FILE`)")
    if not isinstance(data.get("version"), int) or data["version"] > GOLDEN_VERSION:
        raise UserError(f"{where}: golden version {data.get('version')!r} is not one this grpolens reads "
                        f"({GOLDEN_VERSION})")
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        raise UserError(f"{where}: 'metrics' must be an object of metric -> {{\"values\": {{step: value}}}}")
    series: dict[str, Series] = {}
    for name, entry in metrics.items():
        vals = entry.get("values") if isinstance(entry, dict) else None
        if not isinstance(vals, dict):
            raise UserError(f"{where}: metrics.{name}: expected {{\"values\": {{step: value}}}}")
        pairs = {}
        for k, v in vals.items():
            try:
                step = int(k)
            except ValueError:
                raise UserError(f"{where}: metrics.{name}: step {k!r} is not an integer") from None
            pairs[step] = _decode(v, f"{where}: metrics.{name}.values.{k}")
        series[name] = Series.from_pairs(pairs)
    steps = data.get("steps")
    if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        steps = sorted({int(s) for ser in series.values() for s in ser.steps.tolist()})
    label = f"{path} (golden of {data.get('run_name') or data.get('run') or '?'})"
    overrides = data.get("overrides") if isinstance(data.get("overrides"), dict) else {}
    return Baseline(label, series, sorted(steps), overrides)
