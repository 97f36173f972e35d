"""What the checks share: the messages, the value counts every reader applies
(:func:`refuse_bad_values`, :func:`key_order_problems`), :class:`Problem` and :class:`Report`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from grpolens.run import format as fmt


ERROR, WARNING = "error", "warning"
# what format.atomic_write_* leaves behind when killed; on object storage, a temporary key of an atomic upload
_TMP_RE = re.compile(r"^(\..+\.tmp|\.grpolens-tmp-.+)$")
_FLOAT_TOKEN_COLUMNS = ("logp", "old_logp", "ref_logp", "rollout_logp", "advantage", "entropy", "old_entropy")
_LOGP_COLUMNS = ("logp", "old_logp", "ref_logp", "rollout_logp")
#: A log-probability above this is an error (float32 log_softmax can round a near-certain token a
#: hair above 0; +1e-3 is already a probability of 1.001).
POSITIVE_LOGP_TOLERANCE = 1e-3
_ORDER = ("micro_batch", "sample_id", "pos")
_TEXT_COLUMNS = ("prompt", "completion")


def positive_logp_message(n: int) -> str:
    return (f"{n:,} positive log-probabilities (> {POSITIVE_LOGP_TOLERANCE:g}); a log-probability is <= 0: "
            f"was a probability, a logit or a negated value stored?")


#: Integer columns that count or identify something: a negative value is nonsense, not data.
NON_NEGATIVE = {"tokens": _ORDER, "samples": ("sample_id", "group_id", "prompt_len", "completion_len")}
NEGATIVE_MESSAGE = "negative values (must be >= 0)"


def too_long_message(n: int, limit: int, first: int) -> str:
    return (f"{n:,} completions longer than the manifest's max_completion_length {limit:,} (first: {first:,} "
            f"tokens); a completion has at most that many")


def _count_below(values: pa.Array | pa.ChunkedArray, bound: int) -> int:
    """Values < ``bound`` (nulls skipped: a null is an error of its own)."""
    low = pc.min(values).as_py()  # one pass, no mask, in the usual case: nothing below
    if low is None or low >= bound:
        return 0
    return int(pc.sum(pc.less(values, bound)).as_py() or 0)


def _count_above(values: pa.Array | pa.ChunkedArray, bound: int) -> tuple[int, int | None]:
    """(values > ``bound``, the first of them), nulls skipped."""
    high = pc.max(values).as_py()  # as in _count_below: the mask only when something is above
    if high is None or high <= bound:
        return 0, None
    above = pc.greater(values, bound)
    n = int(pc.sum(above).as_py() or 0)
    return n, (pc.filter(values, above)[0].as_py() if n else None)


def rejected_in_loss_message(n: int) -> str:
    return (f"{n:,} rows are rollout_rejected and still in the loss (mask true); a token the rollout "
            f"correction rejected has mask false")


def _count_rejected_in_loss(rejected: pa.Array, mask: pa.Array) -> int:
    both = pc.and_(rejected, mask)  # a null on either side gives null, which the sum skips
    return int(pc.sum(both).as_py() or 0)


def refuse_bad_values(path, table_name: str, table: pa.Table, max_len: int | None = None) -> None:
    """Raise validate's first error about the values of ``table`` (the columns of one shard a
    reader just read): nulls in a non-nullable column, negative ids, counts and positions, positive
    log-probabilities, rejected tokens left in the loss, completions longer than ``max_len``.

    The footer check (:func:`check_before_reading`) trusts a file's statistics to skip reading it;
    statistics are the file's word, and a file can lie. So every reader refuses on the values it
    holds what ``grpolens validate`` refuses on the rows, with the same messages: the footers only
    save work, they are never the only guard."""
    names = set(table.column_names)
    for c in fmt.COLUMNS[table_name]:
        if c.name in names and not c.nullable and table.column(c.name).null_count:
            raise fmt.RunFormatError(path, f"{table.column(c.name).null_count:,} null values in a non-nullable "
                                           "column", column=c.name)
    for c in sorted(NON_NEGATIVE[table_name]):
        if c in names and _count_below(table.column(c), 0):
            raise fmt.RunFormatError(path, NEGATIVE_MESSAGE, column=c)
    if table_name == fmt.TOKENS:
        for c in _FLOAT_TOKEN_COLUMNS:
            n = _count_positive(table.column(c)) if c in _LOGP_COLUMNS and c in names else 0
            if n:
                raise fmt.RunFormatError(path, positive_logp_message(n), column=c)
        if {"rollout_rejected", "mask"} <= names:
            n = _count_rejected_in_loss(table.column("rollout_rejected"), table.column("mask"))
            if n:
                raise fmt.RunFormatError(path, rejected_in_loss_message(n), column="rollout_rejected")
    elif max_len is not None and "completion_len" in names:
        n, first = _count_above(table.column("completion_len"), max_len)
        if n:
            raise fmt.RunFormatError(path, too_long_message(n, max_len, first), column="completion_len")


def unsorted_message(row: int) -> str:
    return (f"rows are not sorted by (micro_batch, sample_id, pos) as the writer promises "
            f"(first out of order at row {row:,})")


def duplicates_message(n: int) -> str:
    return f"{n:,} duplicate (step, rank, micro_batch, sample_id, pos) keys"


def key_order_problems(micro_batch: np.ndarray, sample_id: np.ndarray, pos: np.ndarray) -> list[str]:
    """Validate's messages for the key order of one tokens shard held in memory (empty: fine).

    One vectorised comparison of each row with the next; only an unsorted shard pays for a sort
    (adjacent comparison undercounts duplicates then)."""
    keys = [np.asarray(micro_batch), np.asarray(sample_id), np.asarray(pos)]
    if len(keys[0]) < 2:
        return []
    lt, eq = _adjacent_order(keys)
    out = []
    if lt.any():
        out.append(unsorted_message(int(np.argmax(lt)) + 1))
        dups = _sorted_duplicates(keys)
    else:
        dups = int(eq.sum())
    if dups:
        out.append(duplicates_message(dups))
    return out


def _adjacent_order(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(row i+1 sorts before row i, row i+1 has the same key) for lexicographic (mb, sample, pos)."""
    d = [k[1:].astype(np.int64, copy=False) - k[:-1] for k in keys]
    lt = d[0] < 0
    lt |= (d[0] == 0) & ((d[1] < 0) | ((d[1] == 0) & (d[2] < 0)))
    return lt, (d[0] == 0) & (d[1] == 0) & (d[2] == 0)


def _sorted_duplicates(keys: list[np.ndarray]) -> int:
    order = np.lexsort(keys[::-1])
    k = [a[order] for a in keys]
    same = np.ones(len(k[0]) - 1, bool)  # callers pass 2 rows or more (an unsorted shard)
    for a in k:
        same &= a[1:] == a[:-1]
    return int(same.sum())


@dataclass(frozen=True)
class Problem:
    severity: str  # ERROR or WARNING
    path: str  # relative to the run ("." for the run itself)
    column: str | None
    message: str

    def __str__(self) -> str:
        col = f" (column {self.column!r})" if self.column else ""
        return f"{self.severity}: {self.path}{col}: {self.message}"


@dataclass
class Report:
    run: Path
    problems: list[Problem] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=lambda: {fmt.TOKENS: 0, fmt.SAMPLES: 0})
    rows: dict[str, int] = field(default_factory=lambda: {fmt.TOKENS: 0, fmt.SAMPLES: 0})
    #: :func:`check_before_reading` with a memo: the memo, updated with what passed (the caller saves it)
    memo: "_CheckMemo | None" = field(default=None, repr=False, compare=False)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_for_errors(self) -> None:
        """Raise :class:`~grpolens.run.format.RunFormatError` for the first error (naming how many more)."""
        errors = self.errors
        if not errors:
            return
        first = errors[0]
        more = f" (and {len(errors) - 1} more problems: run `grpolens validate {self.run}`)" if len(errors) > 1 else ""
        raise fmt.RunFormatError(self.run / first.path, first.message + more, column=first.column)




def _same_type(actual: pa.DataType, expected: pa.DataType) -> bool:
    if actual.equals(expected):
        return True
    if pa.types.is_dictionary(actual):
        return _same_type(actual.value_type, expected)
    strings = (pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", lambda t: False))
    return any(f(expected) for f in strings) and any(f(actual) for f in strings)


def _ints(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Integer values, a null read as -1: callers keep nulls out with :func:`_non_null`."""
    if col.null_count:
        col = col.fill_null(-1)
    return col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _non_null(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per row, whether the value is not null (a null key is an error of its own, not -1)."""
    return col.is_valid().to_numpy(zero_copy_only=False)


class _NonFinite:
    """Run-wide count of NaN / +inf / -inf per float column, to report once per column."""

    def __init__(self):
        self.counts: dict[str, list] = {}

    def add(self, column: str, values: pa.Array, path: str) -> None:
        a = values.fill_null(0).to_numpy(zero_copy_only=False) if values.null_count else values.to_numpy(zero_copy_only=False)
        bad = ~np.isfinite(a)
        if not bad.any():
            return
        c = self.counts.setdefault(column, [0, 0, 0, 0, path, set()])
        c[0] += int(np.isnan(a).sum())
        c[1] += int(np.isposinf(a).sum())
        c[2] += int(np.isneginf(a).sum())
        c[3] += int(bad.sum())
        c[5].add(path)

    def problems(self) -> list[Problem]:
        out = []
        for column, (nan, pinf, ninf, total, first, files) in self.counts.items():
            out.append(Problem(WARNING, first, column, (
                f"{total:,} non-finite values ({nan:,} NaN, {pinf:,} +inf, {ninf:,} -inf) in {len(files)} "
                f"file(s), first in this one; metrics skip or propagate them")))
        return out


def _count_duplicates(pf, columns: list[str]) -> int:
    t = pf.read(columns=columns)
    return _sorted_duplicates([_ints(t.column(c)) for c in columns])


def _count_positive(values: pa.Array) -> int:
    a = values.to_numpy(zero_copy_only=False)
    # null -> NaN, not counted; +inf is a non-finite value (a warning of its own), not counted here
    return int(np.count_nonzero(np.isfinite(a) & (a > POSITIVE_LOGP_TOLERANCE)))


