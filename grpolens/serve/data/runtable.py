"""The Runs page's table: one row per served run, its manifest's config as columns (flattened:
``config.rollout_is.mode``), its trainer, its steps, and the last value of a few headline
metrics (``reward/mean@last``). A what-if variant's row shows its overrides (``variant``) and the
config they make."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl

from grpolens.run import format as fmt
from grpolens.run.reader import deep_update
from grpolens.serve.data.curves import series

#: Headline metrics shown with their value at the run's last logged step.
LAST_METRICS = ("reward/mean", "kl/k3", "entropy", "mismatch/kl_k3")


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": "[1, 2]"}`` (lists as JSON text)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out


def _last(df: pl.DataFrame, column: str) -> float | None:
    if column not in df.columns:
        return None
    s = df.select("step", column).drop_nulls().sort("step")[column]
    return float(s[-1]) if s.len() else None


def runs_table(runs: dict[str, Path]) -> pl.DataFrame:
    """One row per run; config columns whose value differs between runs come first (what tells
    runs apart), then those all runs share."""
    rows = []
    for name, path in runs.items():
        m = fmt.read_manifest(path)
        raw = m.to_json()
        trainer = raw.get("trainer") or {}
        s = series(path)
        variant = getattr(path, "variant", None)  # a what-if: its config is the run's with its overrides
        config = raw.get("config") or {}
        if variant is not None:
            config = deep_update(config, variant.overrides)
        row: dict[str, Any] = {
            "run": name,
            **({"variant": variant.label} if variant is not None else {}),  # a column only when there are variants
            "trainer": " ".join(str(trainer.get(k)) for k in ("name", "version") if trainer.get(k)) or None,
            "steps": int(s["step"].n_unique()) if s.height else 0,
            "last_step": int(s["step"].max()) if s.height else None,
            "world_size": m.world_size,
        }
        row.update({f"{c}@last": _last(s, c) for c in LAST_METRICS})
        row.update({f"config.{k}": v for k, v in flatten(config).items()})
        rows.append(row)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    config = [k for k in keys if k.startswith("config.")]
    differs = [k for k in config if len({json.dumps(r.get(k), sort_keys=True, default=str) for r in rows}) > 1]
    fixed = [k for k in keys if not k.startswith("config.") and k != "variant"]
    fixed[1:1] = ["variant"] if "variant" in keys else []
    order = fixed + differs + [k for k in config if k not in differs]
    return pl.DataFrame({k: _column([r.get(k) for r in rows]) for k in order})


def _column(values: list[Any]) -> pl.Series:
    """One type per column: numbers (ints and floats together) stay numbers, booleans booleans;
    any other mix (a number in one run, text in another) becomes text."""
    kinds = {type(v) for v in values if v is not None}
    if kinds and kinds <= {int, float}:
        return pl.Series(values, dtype=pl.Float64 if float in kinds else pl.Int64)
    if kinds == {bool}:
        return pl.Series(values, dtype=pl.Boolean)
    return pl.Series([None if v is None else v if isinstance(v, str) else json.dumps(v, default=str)
                      for v in values], dtype=pl.String)
