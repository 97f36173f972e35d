"""One shard's Arrow table: a call's columns checked on the training thread, then converted, sorted and
filled in on the writer thread (:class:`grpolens.capture.writer.ShardWriter`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from grpolens.run import format as fmt

#: Columns the writer fills in itself; callers must not pass them.
FILLED = {fmt.TOKENS: ("step", "rank", "micro_batch"), fmt.SAMPLES: ("step", "rank")}
_INT32 = np.iinfo(np.int32)
_NUMPY_TYPE = {pa.int64(): np.int64, pa.int32(): np.int32, pa.float32(): np.float32, pa.float64(): np.float64,
               pa.bool_(): np.bool_}
_KINDS = {np.int64: "iu", np.int32: "iu", np.float32: "fiu", np.float64: "fiu", np.bool_: "biu"}


def check_columns(table: str, columns: Mapping[str, Any], where: str) -> tuple[dict[str, Any], int]:
    """Validate one call's columns for ``table``: names, 1-D shapes, equal lengths, value kinds.

    Returns ``(columns, rows)`` with ``None`` values dropped, numeric values as numpy arrays (not
    yet converted: that happens on the writer thread) and string columns as lists. Raises
    ``ValueError`` naming the column at fault.
    """
    known = fmt.column_types(table)
    filled = FILLED[table]
    out: dict[str, Any] = {}
    rows: int | None = None
    first = ""
    for name, value in columns.items():
        if value is None:
            continue
        if name in filled:
            raise ValueError(f"{where}: column {name!r} is filled in by the writer; do not pass it")
        if name in known:
            typ = known[name]
        elif table == fmt.SAMPLES and name.startswith(fmt.REWARD_PREFIX) and len(name) > len(fmt.REWARD_PREFIX):
            typ = fmt.REWARD_COLUMN_TYPE
        else:
            allowed = sorted(set(known) - set(filled)) + (["reward/<name>"] if table == fmt.SAMPLES else [])
            raise ValueError(f"{where}: unknown column {name!r}; known columns: {', '.join(allowed)}")
        if typ == pa.string():
            values = value.tolist() if isinstance(value, np.ndarray) else list(value)
            bad = next((v for v in values if v is not None and not isinstance(v, str)), None)
            if bad is not None:
                raise ValueError(f"{where}: column {name!r} must hold strings or None, got {type(bad).__name__}")
            n = len(values)
        else:
            values = np.asarray(value)
            if values.dtype == object and typ in (pa.float32(), pa.float64()):
                try:  # a list with None in it (a reward that could not be computed): None -> NaN
                    values = np.array(value, dtype=np.float64)
                except (TypeError, ValueError):
                    pass
            if values.ndim != 1:
                raise ValueError(f"{where}: column {name!r} must be 1-D (one value per row), got shape {values.shape}")
            if values.dtype.kind not in _KINDS[_NUMPY_TYPE[typ]]:
                raise ValueError(f"{where}: column {name!r} must be {typ}, got numpy dtype {values.dtype}")
            n = len(values)
        if rows is None:
            rows, first = n, name
        elif n != rows:
            raise ValueError(f"{where}: column {name!r} has {n} rows but column {first!r} has {rows}")
        out[name] = values
    missing = [c for c in fmt.REQUIRED[table] if c not in filled and c not in out]
    if missing:
        raise ValueError(f"{where}: missing required column(s) {', '.join(map(repr, missing))}")
    return out, rows or 0


def _nbytes(columns: Mapping[str, Any]) -> int:
    total = 0
    for v in columns.values():
        if isinstance(v, np.ndarray):
            total += v.nbytes
        else:  # list of strings: the text plus a pointer and an offset per row
            total += sum(len(s) for s in v if s) + 16 * len(v)
    return total


def _to_numpy(name: str, values: np.ndarray, typ: pa.DataType) -> np.ndarray:
    target = _NUMPY_TYPE[typ]
    if target is np.int32 and values.dtype != np.int32 and values.size:
        lo, hi = values.min(), values.max()
        if lo < _INT32.min or hi > _INT32.max:
            raise ValueError(f"column {name!r}: values {lo}..{hi} do not fit in int32")
    if target is np.bool_ and values.dtype != np.bool_:
        return values != 0
    return values.astype(target, copy=False)


def _validity(null: np.ndarray | None) -> tuple[pa.Buffer | None, int]:
    if null is None or not null.any():
        return None, 0
    return pa.py_buffer(np.packbits(~null, bitorder="little")), int(null.sum())


def _numeric_array(values: np.ndarray, typ: pa.DataType, null: np.ndarray | None = None) -> pa.Array:
    """Zero-copy Arrow array from a numpy array already of ``typ``'s numpy type.

    Built from buffers rather than with ``pa.array``, which imports pandas on first use (about a
    second, holding the GIL, i.e. stalling the training thread once).
    """
    validity, nulls = _validity(null)
    data = np.packbits(values, bitorder="little") if typ == pa.bool_() else np.ascontiguousarray(values)
    return pa.Array.from_buffers(typ, len(values), [validity, pa.py_buffer(data)], null_count=nulls)


def _string_array(values: list) -> pa.Array:
    """Arrow string array from a list of str/None (see ``_numeric_array`` for why not ``pa.array``).
    Text that is not valid Unicode (lone surrogates) is stored with replacement characters."""
    encoded = [b"" if v is None else v.encode("utf-8", "replace") for v in values]
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
    if offsets[-1] > _INT32.max:
        raise ValueError(f"more than 2 GiB of text in one shard ({offsets[-1]} bytes)")
    validity, nulls = _validity(np.fromiter((v is None for v in values), bool, len(values)))
    buffers = [validity, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(encoded))]
    return pa.Array.from_buffers(pa.string(), len(values), buffers, null_count=nulls)


@dataclass
class _Chunk:
    """The rows of one call: ``columns`` once materialised, or ``load`` to call on the thread."""

    micro_batch: int | None
    nbytes: int
    columns: dict[str, Any] | None = None
    load: Callable[[], Mapping[str, Any]] | None = None
    rows: int = 0


@dataclass
class _Buffer:
    chunks: list[_Chunk]
    rows: int = 0
    nbytes: int = 0


def _sorted_token_order(sample_id: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
    """Stable permutation sorting rows by (sample_id, pos); None when they are sorted already."""
    if len(sample_id) < 2:
        return None
    d = np.diff(sample_id)
    if (d >= 0).all():
        same = d == 0
        if (pos[1:][same] >= pos[:-1][same]).all():
            return None
    return np.lexsort((pos, sample_id))


def build_table(table: str, step: int, rank: int, chunks: Sequence[_Chunk]) -> pa.Table:
    """One shard's Arrow table from materialised chunks: fills step/rank/micro_batch, converts to the
    format's exact types, sorts tokens by (micro_batch, sample_id, pos), nulls for absent columns."""
    if table == fmt.TOKENS:
        chunks = sorted(chunks, key=lambda c: c.micro_batch)  # stable: equal micro_batch keep arrival order
        ordered = []
        for c in chunks:
            perm = _sorted_token_order(np.asarray(c.columns["sample_id"]), np.asarray(c.columns["pos"]))
            cols = c.columns if perm is None else {k: np.asarray(v)[perm] for k, v in c.columns.items()}
            ordered.append(_Chunk(c.micro_batch, c.nbytes, cols, rows=c.rows))
        chunks = ordered
    n = sum(c.rows for c in chunks)
    present = {name for c in chunks for name in c.columns}
    schema = fmt.arrow_schema(table, list(present) + list(FILLED[table]))
    arrays = []
    for f in schema:
        if f.name == "step":
            arrays.append(_numeric_array(np.full(n, step, np.int64), f.type))
        elif f.name == "rank":
            arrays.append(_numeric_array(np.full(n, rank, np.int32), f.type))
        elif f.name == "micro_batch":
            arrays.append(_numeric_array(np.concatenate([np.full(c.rows, c.micro_batch, np.int32) for c in chunks]), f.type))
        elif f.type == pa.string():
            values: list = []
            for c in chunks:
                values += c.columns[f.name] if f.name in c.columns else [None] * c.rows
            arrays.append(_string_array(values))
        else:
            dtype = _NUMPY_TYPE[f.type]
            parts, nulls = [], []
            for c in chunks:
                if f.name in c.columns:
                    parts.append(_to_numpy(f.name, c.columns[f.name], f.type))
                    nulls.append(np.zeros(c.rows, bool))
                else:
                    parts.append(np.zeros(c.rows, dtype))
                    nulls.append(np.ones(c.rows, bool))
            values = np.concatenate(parts) if parts else np.zeros(0, dtype)
            null = np.concatenate(nulls) if nulls else np.zeros(0, bool)
            if table == fmt.SAMPLES and (f.name == "reward" or f.name.startswith(fmt.REWARD_PREFIX)):
                null |= np.isnan(values)  # a reward function that could not score the completion
            arrays.append(_numeric_array(values, f.type, null))
    return pa.Table.from_arrays(arrays, schema=schema)
