"""MaxEnt-GRPO's rich-completion sidecars: one JSON file per step, written as the reference
writes them and read from either of its writers."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable

import polars as pl

from grpolens.run import format as fmt
from grpolens.run.format import RunFormatError
from grpolens.analysis.sidecars.table import (DEFAULT_KEY, INT_COLUMNS, REFERENCE_COLUMNS, SIDECAR_DIR, TEXT_COLUMNS,
                                              _STEP_FILE, column_order, concat)


# ---------------------------------------------------------------------------------------------
# Sidecar JSON: writing
# ---------------------------------------------------------------------------------------------

def sidecar_name(key: str, step: int) -> str:
    return f"{key}_step_{int(step):06d}.json"


def check_key(key: str) -> str:
    """``--key`` (stripped) when it and the file names made of it are each one path component
    (:mod:`grpolens.run.names`, the one place a name becomes one); else a UserError naming ``--key``
    and why."""
    from grpolens.run.names import path_component

    k = path_component((key or "").strip() or key, "--key")  # a blank key is shown as given
    path_component(sidecar_name(k, 0), "--key")  # the shortest of its file names fits too
    return k


def sidecar_columns(df: pl.DataFrame) -> list[str]:
    return [*REFERENCE_COLUMNS, *sorted(c for c in df.columns if c.startswith(fmt.REWARD_PREFIX))]


def sidecar_payload(df: pl.DataFrame, nan_literals: bool = False) -> dict:
    """``{"columns": [...], "data": [[...]]}`` for one step's rows. Missing floats are None, or
    float('nan') with ``nan_literals`` (what the reference's ``json.dump`` writes)."""
    cols = sidecar_columns(df)
    missing = [c for c in cols if c not in df.columns]
    if missing:
        df = df.with_columns([pl.lit(None).alias(c) for c in missing])
    df = df.sort(["prompt_index", "completion_index"]) if df.height else df
    floats = [i for i, c in enumerate(cols) if c not in INT_COLUMNS and c not in TEXT_COLUMNS]
    data = []
    for row in df.select(cols).iter_rows():
        row = list(row)
        for i in floats:
            v = row[i]
            if v is None:
                row[i] = math.nan if nan_literals else None
            elif not nan_literals and not math.isfinite(v):
                row[i] = None
            else:
                row[i] = float(v)
        data.append(row)
    return {"columns": cols, "data": data}


def sidecar_bytes(df: pl.DataFrame, nan_literals: bool = False) -> bytes:
    """The file's bytes: ``json.dumps`` defaults (the reference's ``json.dump``); strict JSON
    (``allow_nan=False``: null, never NaN/Infinity) unless ``nan_literals``."""
    return json.dumps(sidecar_payload(df, nan_literals), allow_nan=nan_literals).encode()


def write_sidecars(run: os.PathLike | str, table: pl.DataFrame, key: str = DEFAULT_KEY, nan_literals: bool = False,
                   out_dir: os.PathLike | str | None = None,
                   progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """One file per step of ``table`` under ``RUN/grpolens/rich_completions/`` (atomic writes)."""
    from grpolens.run.names import child

    key = check_key(key)
    d = Path(out_dir) if out_dir is not None else fmt.derived_dir(run) / SIDECAR_DIR
    paths = []
    steps = sorted(table["step"].unique().to_list()) if table.height else []
    files = [child(d, sidecar_name(key, step), "--key") for step in steps]  # all checked before one is written
    for i, (step, p) in enumerate(zip(steps, files), 1):
        fmt.atomic_write_bytes(p, sidecar_bytes(table.filter(pl.col("step") == step), nan_literals))
        paths.append(p)
        if progress:
            progress(i, len(steps))
    return paths


# ---------------------------------------------------------------------------------------------
# Sidecar JSON: reading (ours and the reference's)
# ---------------------------------------------------------------------------------------------

def _typed(name: str, values: list, path: Path) -> pl.Series:
    if name in INT_COLUMNS:
        out = []
        for i, v in enumerate(values):
            if v is None or (isinstance(v, float) and math.isnan(v)):
                out.append(None)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer():
                out.append(int(v))
            else:
                raise RunFormatError(path, f"row {i}: expected an integer, got {v!r}", column=name)
        return pl.Series(name, out, dtype=pl.Int64)
    if name in TEXT_COLUMNS or any(isinstance(v, str) for v in values):
        return pl.Series(name, [None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values],
                         dtype=pl.Utf8)
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
        elif isinstance(v, (int, float)):
            out.append(None if (isinstance(v, float) and math.isnan(v)) else float(v))
        else:
            raise RunFormatError(path, f"row {i}: expected a number or null, got {type(v).__name__}", column=name)
    return pl.Series(name, out, dtype=pl.Float64)


def read_sidecar(path: os.PathLike | str) -> pl.DataFrame:
    """A rich-completion sidecar (grpolens' or MaxEnt-GRPO's, either writer) as a DataFrame.

    Lenient where the reference is: bare ``NaN``/``Infinity`` literals parse (NaN becomes null,
    ±inf stay), the TRL-path writer's files without ``reward/*`` columns load, and reference
    columns a file lacks are added as nulls (``step`` from the file name when absent). Integer
    columns are Int64, text Utf8, the rest Float64.
    """
    path = Path(path)
    try:
        payload = json.loads(path.read_bytes())
    except OSError as e:
        raise RunFormatError(path, f"unreadable: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RunFormatError(path, f"not valid JSON: {e}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("columns"), list):
        raise RunFormatError(path, 'expected a JSON object with "columns" (a list) and "data" (a list of rows)')
    columns, data = payload["columns"], payload.get("data", [])
    if not isinstance(data, list):
        raise RunFormatError(path, '"data" must be a list of rows')
    if not all(isinstance(c, str) for c in columns) or len(set(columns)) != len(columns):
        raise RunFormatError(path, '"columns" must be distinct strings')
    for i, row in enumerate(data):
        if not isinstance(row, list) or len(row) != len(columns):
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise RunFormatError(path, f"data row {i} has {got} values for {len(columns)} columns")
    series = {c: _typed(c, [row[j] for row in data], path) for j, c in enumerate(columns)}
    n = len(data)
    for c in REFERENCE_COLUMNS:
        if c in series:
            continue
        if c == "step" and (m := _STEP_FILE.search(path.name)):
            series[c] = pl.Series(c, [int(m.group(1))] * n, dtype=pl.Int64)
        else:
            dtype = pl.Int64 if c in INT_COLUMNS else pl.Utf8 if c in TEXT_COLUMNS else pl.Float64
            series[c] = pl.Series(c, [None] * n, dtype=dtype)
    df = pl.DataFrame(list(series.values()))
    return df.select(column_order(df.columns))


def sidecar_files(directory: os.PathLike | str, key: str | None = None) -> list[Path]:
    """Sidecar files in ``directory`` (or its ``rich_completions/``) sorted by step: ``<key>_step_N.json``;
    without ``key``, ``rich_completions_*`` files, else ``completions_*`` (the reference's fallback)."""
    d = Path(directory)
    if (d / SIDECAR_DIR).is_dir():
        d = d / SIDECAR_DIR
    if not d.is_dir():
        return []
    keys = [key] if key else [DEFAULT_KEY, "completions"]
    for k in keys:
        files = [p for p in d.iterdir() if p.name.startswith(f"{k}_step_") and _STEP_FILE.search(p.name)]
        if files:
            return sorted(files, key=lambda p: int(_STEP_FILE.search(p.name).group(1)))
    return []


def read_sidecars(directory: os.PathLike | str, key: str | None = None, steps: Iterable[int] | None = None) -> pl.DataFrame:
    """Every sidecar of a directory as one table (see :func:`sidecar_files`)."""
    wanted = None if steps is None else set(steps)
    files = [p for p in sidecar_files(directory, key)
             if wanted is None or int(_STEP_FILE.search(p.name).group(1)) in wanted]
    return concat([read_sidecar(p) for p in files])
