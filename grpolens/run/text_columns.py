"""Text columns written by other tools may hold bytes that are not UTF-8.

Parquet declares them strings, but nothing stops a foreign writer from storing arbitrary bytes, and
polars cannot take such a column (it panics). Every reader of samples text goes through
:func:`checked_text`, which either refuses the file with the message ``grpolens validate`` prints
(file, column, first row), or replaces each invalid byte sequence by U+FFFD, as the user chooses:
``grpolens --invalid-utf8 replace COMMAND ...`` (or ``GRPOLENS_INVALID_UTF8=replace``); the default
is to refuse. The check is one validation pass over bytes already in memory; only a column that
fails it is decoded row by row.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from grpolens.errors import RunFormatError, UserError

#: Environment variable holding the policy (the global ``--invalid-utf8`` option sets it).
ENV = "GRPOLENS_INVALID_UTF8"
REFUSE, REPLACE = "refuse", "replace"
POLICIES = (REFUSE, REPLACE)


def policy() -> str:
    value = os.environ.get(ENV, REFUSE).strip().lower() or REFUSE
    if value not in POLICIES:
        raise UserError(f"{ENV}={value!r}: choose one of {', '.join(POLICIES)}")
    return value


def invalid_utf8_message(n: int, first_row: int) -> str:
    return (f"{n:,} value(s) are not valid UTF-8 (first at row {first_row:,}); pass "
            f"--invalid-utf8 replace to read them with the bad bytes replaced")


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _chunk_is_valid(chunk: pa.Array) -> bool:
    try:
        chunk.validate(full=True)  # checks UTF-8 of string arrays, vectorised
        return True
    except pa.ArrowInvalid:
        return False


def invalid_rows(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Row numbers whose value is not valid UTF-8 (empty for a valid or non-string column)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    bad, offset = [], 0
    for chunk in chunks:
        if _is_string(chunk.type) and not _chunk_is_valid(chunk):
            raw = chunk.view(pa.large_binary() if pa.types.is_large_string(chunk.type) else pa.binary())
            for i, b in enumerate(raw.to_pylist()):
                if b is not None:
                    try:
                        b.decode("utf-8")
                    except UnicodeDecodeError:
                        bad.append(offset + i)
        offset += len(chunk)
    return np.asarray(bad, dtype=np.int64)


def _replaced(column: pa.ChunkedArray) -> pa.Array:
    binary = pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
    values = [None if b is None else b.decode("utf-8", errors="replace")
              for c in column.chunks for b in c.view(binary).to_pylist()]
    return pa.array(values, type=column.type)


def checked_text(table: pa.Table, path: os.PathLike | str, row0: int = 0) -> pa.Table:
    """``table`` (rows of ``path`` from ``row0``) with every string column valid UTF-8, or
    RunFormatError naming file, column and row under the default policy."""
    how = None
    for i, field in enumerate(table.schema):
        if not _is_string(field.type):
            continue
        bad = invalid_rows(table.column(i))
        if not len(bad):
            continue
        how = how or policy()
        if how == REFUSE:
            raise RunFormatError(Path(path), invalid_utf8_message(len(bad), row0 + int(bad[0])), column=field.name)
        table = table.set_column(i, field, _replaced(table.column(i)))
    return table
