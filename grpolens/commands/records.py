"""``--json`` / ``--csv``: a command's rows on stdout for scripts, instead of its rich tables.

JSON is one array of objects (keys in column order; NaN and ±inf become null: JSON has no such
numbers); CSV has a header row and the same columns (empty cells for null/NaN), quoted by Python's
``csv`` module so that texts with commas, quotes or newlines stay one cell. Model-generated text is
written as it is: both formats escape it, and nothing is rendered.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable

import typer

JSON_OPTION = typer.Option(False, "--json", help="Print the rows as a JSON array of objects (no tables).")
CSV_OPTION = typer.Option(False, "--csv", help="Print the rows as CSV with a header row (no tables).")


def output_format(as_json: bool, as_csv: bool) -> str | None:
    """``"json"``, ``"csv"`` or None (the rich view); both flags at once is a usage error."""
    from grpolens.errors import UserError

    if as_json and as_csv:
        raise UserError("--json and --csv: choose one")
    return "json" if as_json else "csv" if as_csv else None


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars
        return _clean(v.item())
    return v


def write_records(rows: Iterable[dict[str, Any]], fmt: str, columns: list[str] | None = None, out=None) -> None:
    """Write ``rows`` to ``out`` (stdout) as ``fmt`` ("json" or "csv")."""
    import csv
    import json

    out = out or sys.stdout
    rows = [{k: _clean(v) for k, v in r.items()} for r in rows]
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    if fmt == "json":
        out.write(json.dumps([{c: r.get(c) for c in columns} for r in rows], ensure_ascii=False, allow_nan=False))
        out.write("\n")
        return
    w = csv.writer(out, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r.get(c) is None else r.get(c) for c in columns])
