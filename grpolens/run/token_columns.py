"""A tokens shard's Arrow columns as numpy arrays, and its per-token checks in compiled passes.

:func:`~grpolens.run.reader.read_tokens` must refuse what ``grpolens validate`` refuses on the rows
it holds (:func:`~grpolens.run.validate.refuse_bad_values`, :func:`~grpolens.run.validate.key_order_problems`):
negative keys, positive log-probabilities, rejected tokens in the loss, keys out of order or twice.
Done with Arrow compute and numpy that is about ten passes over the shard, each writing a
temporary; :func:`refuse_bad_tokens` makes one compiled pass over the three order keys and one
over each log-prob column, and asks the reference functions only when a pass finds something, so
that the message (and which problem is named first) is validate's own, from one definition.

:func:`values` and :func:`bools` hand a column's Arrow buffers to numpy without a copy where the
layout allows (one chunk, no nulls), and never through ``to_numpy``: that path imports pandas
(~0.25 s CPU) for nothing a tokens shard needs.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from grpolens.functional.jit import kernel

_NUMPY = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
          pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64,
          pa.float32(): np.float32, pa.float64(): np.float64}


def _one_chunk(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def numeric(col: pa.ChunkedArray | pa.Array) -> bool:
    """Whether :func:`values` can read ``col`` (a fixed-width integer or float column)."""
    return col.type in _NUMPY


def values(col: pa.ChunkedArray | pa.Array, null=None) -> np.ndarray:
    """The values of a numeric column as numpy (its own dtype): a read-only view of the Arrow
    buffer when the column is one chunk without nulls, else a copy with each null as ``null``
    (required then)."""
    arr = _one_chunk(col)
    if arr.null_count:
        if null is None:
            raise ValueError("a column with nulls needs a value for them")
        arr = arr.fill_null(null)
    dtype = _NUMPY[arr.type]
    if len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize)


def bools(col: pa.ChunkedArray | pa.Array, null: bool = False) -> np.ndarray:
    """A boolean column as a numpy bool array (Arrow packs 8 a byte: one unpacking pass), each
    null as ``null``."""
    arr = _one_chunk(col)
    if arr.null_count:
        arr = arr.fill_null(null)
    n = len(arr)
    if n == 0:
        return np.zeros(0, bool)
    if not pa.types.is_boolean(arr.type):  # e.g. 0/1 integers from a writer of another type
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=bool)
    first = arr.offset
    packed = np.frombuffer(arr.buffers()[1], dtype=np.uint8, count=(first + n + 7) // 8)
    return np.unpackbits(packed, bitorder="little", count=first + n)[first:].view(bool)


def _validity(arr: pa.Array) -> tuple[np.ndarray, int]:
    """(the validity bitmap as bytes, the array's bit offset); an empty bitmap: no nulls."""
    if not arr.null_count:
        return np.zeros(0, np.uint8), 0
    bitmap = arr.buffers()[0]
    return np.frombuffer(bitmap, dtype=np.uint8), arr.offset


@kernel
def _keys_clean(micro_batch, sample_id, pos):
    """True when no key is negative and every row's (micro_batch, sample_id, pos) is above the
    previous row's: what refuse_bad_values and key_order_problems accept. Without a branch per
    row (a shard is clean nearly always, so nothing is gained by stopping early), the compiler
    vectorises the loop: ~5x faster than with early exits."""
    n = len(pos)
    if n == 0:
        return True
    bad = (micro_batch[0] < 0) | (sample_id[0] < 0) | (pos[0] < 0)
    for i in range(1, n):
        m, pm, s, ps, p, pp = micro_batch[i], micro_batch[i - 1], sample_id[i], sample_id[i - 1], pos[i], pos[i - 1]
        bad |= (m < 0) | (s < 0) | (p < 0)
        bad |= (m < pm) | ((m == pm) & ((s < ps) | ((s == ps) & (p <= pp))))
    return not bad


@kernel
def _count_above(x, bound, validity, offset):
    """Finite values above ``bound`` (compared in x's own type, as numpy compares them), nulls
    (a 0 bit in ``validity``, when it is not empty) skipped."""
    count = 0
    nulls = len(validity) > 0
    for i in range(len(x)):
        v = x[i]
        if v > bound and v < np.inf:
            if nulls:
                j = offset + i
                if not (validity[j >> 3] >> (j & 7)) & 1:
                    continue
            count += 1
    return count


def refuse_bad_tokens(path, table: pa.Table) -> None:
    """Raise validate's first error about the values and the key order of one tokens shard just
    read (what :func:`~grpolens.run.validate.refuse_bad_values` and
    :func:`~grpolens.run.validate.key_order_problems` refuse, with their messages); the compiled
    passes decide whether anything is wrong, the reference functions say what."""
    from grpolens.run import format as fmt
    from grpolens.run.validate import (
        POSITIVE_LOGP_TOLERANCE, _LOGP_COLUMNS, _ORDER, _count_rejected_in_loss, key_order_problems,
        refuse_bad_values)

    names = set(table.column_names)
    clean = all(not (c.name in names and not c.nullable and table.column(c.name).null_count)
                for c in fmt.TOKEN_COLUMNS)
    keys = [table.column(c) for c in _ORDER]
    clean = clean and all(numeric(k) and pa.types.is_integer(k.type) for k in keys)
    if clean and table.num_rows:
        clean = _keys_clean(*(values(k) for k in keys))
    for c in _LOGP_COLUMNS:
        if not clean or c not in names:
            continue
        col = table.column(c)
        if not pa.types.is_floating(col.type) or not numeric(col):
            clean = False
            break
        if col.null_count == len(col):
            continue
        arr = _one_chunk(col)
        x = np.frombuffer(arr.buffers()[1], dtype=_NUMPY[arr.type], count=arr.offset + len(arr))[arr.offset:]
        valid, offset = _validity(arr)
        clean = not _count_above(x, x.dtype.type(POSITIVE_LOGP_TOLERANCE), valid, offset)
    if clean and {"rollout_rejected", "mask"} <= names:
        clean = not _count_rejected_in_loss(table.column("rollout_rejected"), table.column("mask"))
    if clean:
        return
    refuse_bad_values(path, fmt.TOKENS, table)
    problems = key_order_problems(*(table.column(c).to_numpy() for c in _ORDER))
    if problems:
        raise fmt.RunFormatError(path, problems[0])
