"""The training-side shard writer: buffers rows per step, writes Parquet shards on a background thread.

numpy and pyarrow only (no torch: :mod:`grpolens.capture.hook` is the torch front end). One writer per
training rank. The producer (training) thread only validates shapes and queues the arrays; a single
background thread turns them into Arrow tables, sorts them and writes them with
:func:`grpolens.run.format.atomic_write_table`.

Rules the writer follows (``docs/hook.md`` states them for users):

* **One file per (table, step, rank)**, written when the step ends (``end_step``, ``flush`` or
  ``close``). A step whose rows would exceed ``max_part_rows`` is split into parts
  ``rank=RRRRR-0000.parquet``, ``-0001``, ... The split falls only between loss calls: the rows of
  one ``micro_batch`` always share a file (a single call larger than the bound gets a part of its
  own). A step is also written early, as a part, when the memory bound is reached while the step is
  still open, and by ``flush()``.
* **Never overwrite.** The n-th file written for (table, step, rank) is part n; the first one is
  written without a suffix only if it is also the last one known when it is written (the step ended
  and nothing had been written for it before). More rows for a step that already has files (``end_step``
  called twice, a later process writing into the same run) go into the next free part number, after
  the highest already on disk; a lone unsuffixed file is first renamed to part 0, so a step always
  has either one unsuffixed file or only parts. Readers take all parts of a step together.
* **Order.** Rows in a tokens file are sorted by (micro_batch, sample_id, pos), stable: rows with equal
  keys keep their arrival order. Samples rows keep their arrival order.
* **Atomic.** Every file appears under its final name only once complete (temp file in the same
  directory, fsync, rename); a killed process leaves complete shards and, at worst, ``.*.tmp`` files
  that :func:`grpolens.run.format.list_shards` ignores. On object storage (``run_dir`` an
  ``s3://bucket/prefix``, through :mod:`grpolens.run.storage`): each file is uploaded under a
  temporary key beside its final one, then copied onto the final key (the copy is the atomic step)
  and the temporary key deleted; the markers below still go last. Uploads run on the writer
  thread, like local writes.
* **Bounded memory.** ``bytes_pending`` counts every byte handed to the writer and not yet on disk.
  A call that would push it over ``max_queue_bytes`` blocks until the thread has written enough
  (a call larger than the whole bound waits until nothing else is pending).
* **Completion markers.** When a step ends (``end_step``, or ``close()`` for a step still open),
  after its shards are on disk, the writer writes the marker ``complete/step=S.rank=R.json``; a
  normal ``close()`` then writes ``complete/finished.rank=R.json``. A killed process leaves
  neither for what it had not finished, and readers skip such steps (:func:`grpolens.run.format.read_completion`).
  The interpreter's exit (a forgotten ``close()``) and a ``with`` block left by an exception write
  the rows but no marker for a step still open, and no finished record.
* **An existing run is never mixed into.** ``mode="new"`` (default) refuses a directory that
  already holds a run; ``"resume"`` keeps its complete steps (rows logged again for them are
  dropped), deletes its incomplete ones and continues; ``"overwrite"`` deletes it first. Rank 0
  decides and does the deleting; the other ranks only drop what is already complete.
* **Errors are never swallowed.** An exception on the thread stops the writer; the next call (and
  ``close()``) raises :class:`WriterError` with the original exception as ``__cause__``.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import shutil
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from grpolens.run import format as fmt
from grpolens.run.format import atomic_write_table  # module-level name: tests slow it down to test back-pressure

#: Columns the writer fills in itself; callers must not pass them.
FILLED = {fmt.TOKENS: ("step", "rank", "micro_batch"), fmt.SAMPLES: ("step", "rank")}
_INT32 = np.iinfo(np.int32)
_NUMPY_TYPE = {pa.int64(): np.int64, pa.int32(): np.int32, pa.float32(): np.float32, pa.float64(): np.float64,
               pa.bool_(): np.bool_}
_KINDS = {np.int64: "iu", np.int32: "iu", np.float32: "fiu", np.float64: "fiu", np.bool_: "biu"}
#: How many ended steps the writer remembers to catch a micro_batch index reused within a step.
_REMEMBERED_STEPS = 256


MODES = ("new", "resume", "overwrite")


class RunExistsError(FileExistsError):
    """``mode="new"`` and the directory already holds a grpolens run."""


class WriterError(RuntimeError):
    """The background writer thread failed. Raised by the next call after the failure and by
    ``close()``; the original exception is the ``__cause__``. The writer accepts nothing afterwards."""


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


class ShardWriter:
    """Writes one training rank's rows of a grpolens run (see the module docstring for the rules).

    ``add_tokens``/``add_samples`` take flat columns, one element per row. The writer keeps the
    arrays it is given until they are written: do not modify them afterwards (pass copies).
    """

    def __init__(self, run_dir, rank: int = 0, world_size: int = 1, *, manifest: fmt.Manifest | None = None,
                 max_part_rows: int = 8_000_000, max_queue_bytes: int = 512 * 2**20, compression: str = "zstd",
                 mode: str = "new"):
        if not all(isinstance(v, (int, np.integer)) for v in (rank, world_size)) or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r} world_size={world_size!r}")
        if max_part_rows < 1 or max_queue_bytes < 1:
            raise ValueError(f"max_part_rows and max_queue_bytes must be positive, got {max_part_rows}, {max_queue_bytes}")
        self.run_dir = fmt.as_run(run_dir)  # a local Path, or a storage Location for s3://
        self.rank, self.world_size = rank, world_size
        self.max_part_rows, self.max_queue_bytes, self.compression = max_part_rows, max_queue_bytes, compression
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        #: Steps complete on disk when a resumed writer opened: rows logged for them are dropped.
        self.kept_steps: frozenset[int] = frozenset()
        existing = prepare_run_dir(self.run_dir, mode, rank)
        if existing is not None:
            self.kept_steps = existing
        for table in fmt.TABLES:
            (self.run_dir / table).mkdir(parents=True, exist_ok=True)
        if manifest is not None and rank == 0 and not (mode == "resume" and fmt.is_run(self.run_dir)):
            fmt.write_manifest(self.run_dir, dataclasses.replace(manifest, completion_markers=True))
        self._dropped_warned = False

        # Shared between the producer and the thread, guarded by _cond.
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._pending = 0  # bytes handed over and not yet on disk (queued, buffered or being written)
        self._held = 0  # of which: buffered on the thread in open steps
        self._blocked = 0  # producers waiting for room
        self._flush_asked = self._flush_done = 0
        self._error: BaseException | None = None
        self._closed = False
        # Producer side only: micro_batch indices seen per step, to refuse a reused index.
        self._seen: collections.OrderedDict[int, set[int]] = collections.OrderedDict()
        # Thread side only.
        self._buffers: dict[tuple[str, int], _Buffer] = {}
        self._next_part: dict[tuple[str, int], int] = {}
        self._marked: list[int] = []  # steps this writer has marked complete

        self._thread = threading.Thread(target=self._run, name=f"grpolens-writer-rank{rank}", daemon=True)
        self._thread.start()
        # Daemon thread (a forgotten close() must not hang the interpreter at exit); close at exit instead.
        ref = weakref.ref(self)
        self._atexit = lambda: (w := ref()) is not None and w._close(finished=False)
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ producer API

    def add_tokens(self, step: int, micro_batch: int, columns: Mapping[str, Any]) -> None:
        """Queue one loss call's token rows (flat arrays, one element per stored token)."""
        where = f"add_tokens(step={step}, micro_batch={micro_batch})"
        self._check_step(step, where)
        if self._kept(step):
            return
        cols, rows = check_columns(fmt.TOKENS, columns, where)
        self._claim_micro_batch(step, micro_batch, where)
        self._put(("data", fmt.TOKENS, step, _Chunk(micro_batch, _nbytes(cols), cols, rows=rows)))

    def add_tokens_deferred(self, step: int, micro_batch: int, load: Callable[[], Mapping[str, Any]],
                            nbytes: int) -> None:
        """Like :meth:`add_tokens`, but the columns come from ``load()``, called on the writer thread.

        For producers that must not touch the data yet (an asynchronous device-to-host copy still in
        flight) or that leave the conversion work to the thread. ``nbytes`` is what the call holds in
        memory until written (counted against ``max_queue_bytes``). Errors in ``load`` or in the
        columns it returns surface as :class:`WriterError` on a later call.
        """
        where = f"add_tokens(step={step}, micro_batch={micro_batch})"
        self._check_step(step, where)
        if self._kept(step):
            return
        self._claim_micro_batch(step, micro_batch, where)
        self._put(("data", fmt.TOKENS, step, _Chunk(micro_batch, int(nbytes), load=load)))

    def add_samples(self, step: int, columns: Mapping[str, Any]) -> None:
        """Queue per-completion rows for ``step`` (the step in which they were generated)."""
        where = f"add_samples(step={step})"
        self._check_step(step, where)
        if self._kept(step):
            return
        cols, rows = check_columns(fmt.SAMPLES, columns, where)
        self._put(("data", fmt.SAMPLES, step, _Chunk(None, _nbytes(cols), cols, rows=rows)))

    def add_samples_deferred(self, step: int, load: Callable[[], Mapping[str, Any]], nbytes: int) -> None:
        """:meth:`add_samples` with columns from ``load()`` on the writer thread (see ``add_tokens_deferred``)."""
        self._check_step(step, f"add_samples(step={step})")
        if self._kept(step):
            return
        self._put(("data", fmt.SAMPLES, step, _Chunk(None, int(nbytes), load=load)))

    def end_step(self, step: int) -> None:
        """The step is complete on this rank: write its rows (tokens and samples) in the background."""
        self._check_step(step, f"end_step({step})")
        if self._kept(step):
            return
        self._put(("end", step))

    def flush(self) -> None:
        """Write every row received so far and wait until it is on disk. Steps still open are
        written as parts; their later rows go to further parts."""
        with self._cond:
            self._raise_if_unusable()
            self._flush_asked += 1
            ticket = self._flush_asked
            self._queue.append(("flush", ticket))
            self._cond.notify_all()
            while self._flush_done < ticket:
                self._cond.wait()
                self._raise_if_unusable(closing=True)

    def close(self) -> None:
        """End every open step, write everything, mark the run finished on this rank, stop the
        thread. Idempotent. Raises :class:`WriterError` if the thread failed at any point."""
        self._close(finished=True)

    def _close(self, finished: bool) -> None:
        """``finished=False`` (interpreter exit, an exception): write what is buffered, but mark
        neither the open steps complete nor the run finished."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.append(("close", finished))
            self._cond.notify_all()
        self._thread.join()
        atexit.unregister(self._atexit)
        self._raise_if_failed()

    @property
    def bytes_pending(self) -> int:
        """Bytes handed to the writer and not yet written to disk."""
        with self._cond:
            return self._pending

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:
            self._close(finished=False)
        except WriterError as e:  # keep the body's exception in front, but do not lose the writer's
            if not isinstance(exc, WriterError) and hasattr(exc, "add_note"):
                exc.add_note(f"grpolens: the shard writer failed too: {e}")

    # ------------------------------------------------------------------ producer internals

    def _kept(self, step: int) -> bool:
        """A resumed run already has this step complete: drop what is logged for it (warn once)."""
        if int(step) not in self.kept_steps:
            return False
        if not self._dropped_warned:
            self._dropped_warned = True
            import warnings

            warnings.warn(f"grpolens: {self.run_dir} (resumed) already has step {step} complete on rank {self.rank}; "
                          f"rows logged again for steps up to {max(self.kept_steps)} are dropped", stacklevel=3)
        return True

    @staticmethod
    def _check_step(step: int, where: str) -> None:
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"{where}: step must be a non-negative integer, got {step!r}")

    def _claim_micro_batch(self, step: int, micro_batch: int, where: str) -> None:
        if not isinstance(micro_batch, (int, np.integer)) or not 0 <= micro_batch <= _INT32.max:
            raise ValueError(f"{where}: micro_batch must be a non-negative int32, got {micro_batch!r}")
        seen = self._seen.setdefault(int(step), set())
        self._seen.move_to_end(int(step))
        if micro_batch in seen:
            raise ValueError(f"{where}: micro_batch {micro_batch} of step {step} was already written; "
                             "each loss call of a step needs its own micro_batch index")
        seen.add(int(micro_batch))
        while len(self._seen) > _REMEMBERED_STEPS:
            self._seen.popitem(last=False)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            e = self._error
            raise WriterError(f"grpolens shard writer failed on its background thread: {type(e).__name__}: {e}") from e

    def _raise_if_unusable(self, closing: bool = False) -> None:
        self._raise_if_failed()
        if self._closed and not closing:
            raise RuntimeError("this ShardWriter is closed")

    def _put(self, item: tuple) -> None:
        nbytes = item[3].nbytes if item[0] == "data" else 0
        with self._cond:
            self._raise_if_unusable()
            self._blocked += 1
            try:
                while self._pending > 0 and self._pending + nbytes > self.max_queue_bytes:
                    self._cond.notify_all()  # the thread may need to write open steps to make room
                    self._cond.wait()
                    self._raise_if_unusable()
            finally:
                self._blocked -= 1
            self._pending += nbytes
            self._queue.append(item)
            self._cond.notify_all()

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue:
                        if self._blocked and self._held:  # producers wait and only open steps hold memory
                            break
                        self._cond.wait()
                    item = self._queue.popleft() if self._queue else ("make_room",)
                if item[0] == "data":
                    self._receive(*item[1:])
                elif item[0] == "end":
                    for table in fmt.TABLES:
                        self._write(table, item[1], final=True)
                        self._next_part.pop((table, item[1]), None)  # the disk is the record from now on
                    self._mark(item[1])
                elif item[0] in ("flush", "make_room"):
                    for table, step in list(self._buffers):
                        self._write(table, step, final=False)
                    if item[0] == "flush":
                        with self._cond:
                            self._flush_done = item[1]
                            self._cond.notify_all()
                elif item[0] == "close":
                    finished = item[1]
                    open_steps = sorted({step for _, step in self._buffers})
                    for table, step in list(self._buffers):
                        self._write(table, step, final=True)
                    if finished:
                        for step in open_steps:
                            self._mark(step)
                        self._finish()
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the producer, never swallowed
            with self._cond:
                self._error = e
                self._queue.clear()
                self._buffers.clear()
                self._pending = self._held = 0
                self._cond.notify_all()

    def _receive(self, table: str, step: int, chunk: _Chunk) -> None:
        if chunk.load is not None:
            where = (f"add_tokens(step={step}, micro_batch={chunk.micro_batch})" if table == fmt.TOKENS
                     else f"add_samples(step={step})")
            chunk.columns, chunk.rows = check_columns(table, chunk.load(), where)
            chunk.load = None
        buf = self._buffers.get((table, step))
        if buf is not None and buf.rows and buf.rows + chunk.rows > self.max_part_rows:
            self._write(table, step, final=False)  # split between calls, before this one
            buf = None
        if buf is None:
            buf = self._buffers[(table, step)] = _Buffer([])
        buf.chunks.append(chunk)
        buf.rows += chunk.rows
        buf.nbytes += chunk.nbytes
        with self._cond:
            self._held += chunk.nbytes

    def _write(self, table: str, step: int, final: bool) -> None:
        buf = self._buffers.pop((table, step), None)
        if buf is None:
            return
        part = self._next_part.get((table, step))
        if part is None:
            part = self._first_free_part(table, step)
        if part > 9999:
            raise ValueError(f"step {step} rank {self.rank}: more than 10000 {table} parts; raise max_part_rows")
        name = fmt.shard_relpath(table, step, self.rank, None if (final and part == 0) else part)
        if buf.rows:
            tbl = build_table(table, step, self.rank, buf.chunks)
            if part == 1:
                self._lone_file_becomes_part_zero(table, step)
            atomic_write_table(self.run_dir / name, tbl, self.compression)
            self._next_part[(table, step)] = part + 1
        with self._cond:
            self._pending -= buf.nbytes
            self._held -= buf.nbytes
            self._cond.notify_all()

    def _mark(self, step: int) -> None:
        """Write (step, rank)'s completion marker, naming every shard file it has on disk. Last:
        a reader that sees it can rely on the files."""
        files = []
        for table in fmt.TABLES:
            step_dir = (self.run_dir / fmt.shard_relpath(table, step, self.rank)).parent
            if step_dir.is_dir():
                files += sorted(f"{table}/{step_dir.name}/{f.name}" for f in step_dir.iterdir()
                                if (sh := fmt.parse_shard_path(f, table)) is not None and sh.rank == self.rank)
        write_record(self.run_dir / fmt.marker_relpath(step, self.rank),
                     {"step": int(step), "rank": self.rank, "world_size": self.world_size, "files": sorted(files)})
        self._marked.append(int(step))
        if fmt.is_remote_run(self.run_dir):
            fmt.forget_listings()  # a reader in this process lists the bucket again

    def _finish(self) -> None:
        import datetime as _dt

        write_record(self.run_dir / fmt.finished_relpath(self.rank), {
            "rank": self.rank, "world_size": self.world_size, "steps_marked": len(self._marked),
            "last_step": max(self._marked) if self._marked else None,
            "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})

    def _lone_file_becomes_part_zero(self, table: str, step: int) -> None:
        """Before a second file for (table, step, rank) appears, rename the unsuffixed one to part 0:
        a step has either one unsuffixed file or only parts (run-format.md). The rename is atomic and
        the target name is new, so nothing is overwritten."""
        lone = self.run_dir / fmt.shard_relpath(table, step, self.rank)
        if not lone.exists():
            return
        zero = self.run_dir / fmt.shard_relpath(table, step, self.rank, 0)
        if zero.exists():
            raise FileExistsError(f"{lone} and {zero} both exist; a step has one unsuffixed file or only parts")
        if fmt.is_remote_run(lone):
            lone.rename(zero)  # copy + delete: the step has no marker yet, so no reader counts it
        else:
            os.rename(lone, zero)
            fmt.fsync_dir(lone.parent)

    def _first_free_part(self, table: str, step: int) -> int:
        """Part number after the highest this rank already has on disk for the step (0 if none)."""
        step_dir = (self.run_dir / fmt.shard_relpath(table, step, self.rank)).parent
        if not step_dir.is_dir():
            return 0
        parts = [max(s.part, 0) for f in step_dir.iterdir()
                 if (s := fmt.parse_shard_path(f, table)) is not None and s.rank == self.rank]
        return max(parts) + 1 if parts else 0


# ---------------------------------------------------------------------------------------------
# Opening a run directory: new, resume, overwrite
# ---------------------------------------------------------------------------------------------

def write_record(path: Path, data: dict) -> None:
    fmt.atomic_write_bytes(path, (json.dumps(data, sort_keys=True) + "\n").encode())


def holds_run(run_dir: Path) -> bool:
    """A manifest, any shard, any completion record, or derived files: the directory holds a run."""
    if (run_dir / fmt.MANIFEST_NAME).exists() or _on_disk_steps(run_dir):
        return True
    for sub in (fmt.COMPLETE_DIR, fmt.DERIVED_DIR):
        d = run_dir / sub
        if d.is_dir() and any(True for _ in d.iterdir()):
            return True
    return False


def _on_disk_steps(run_dir: Path, rank: int | None = None) -> set[int]:
    return {sh.step for t in fmt.TABLES for sh in fmt.list_shards(run_dir, t, complete_only=False)
            if rank is None or sh.rank == rank}


def describe_run(run_dir: Path) -> str:
    from grpolens.run.format import read_completion

    c = read_completion(run_dir)
    if c is None:
        steps = sorted(_on_disk_steps(run_dir))
        return f"{len(steps)} step(s) written before completion markers" if steps else "no steps"
    done = c.complete_steps
    tail = f", last {done[-1]}" if done else ""
    return f"{len(done)} complete step(s){tail}{', finished' if c.run_finished else ', not finished'}"


def _rmtree(path) -> None:
    if fmt.is_remote_run(path):
        path.rmtree()
    else:
        shutil.rmtree(path, ignore_errors=True)


def prepare_run_dir(run_dir: Path, mode: str, rank: int) -> frozenset[int] | None:
    """Apply ``mode`` to an existing directory before a writer opens it. Returns, for ``resume``,
    the steps already complete (their rows are dropped), else None. Only rank 0 refuses or deletes."""
    if not holds_run(run_dir):
        return None
    if mode == "new":
        if rank == 0:
            raise RunExistsError(
                f"{run_dir} already holds a grpolens run ({describe_run(run_dir)}); pass mode='resume' to continue "
                f"after its last complete step, or mode='overwrite' to replace it")
        return None
    if mode == "overwrite":
        if rank == 0:
            if not fmt.is_run(run_dir) and any(p.name not in (*fmt.TABLES, fmt.COMPLETE_DIR, fmt.DERIVED_DIR)
                                               for p in run_dir.iterdir()):
                raise RunExistsError(f"{run_dir} is not a grpolens run; refusing to overwrite it")
            for sub in (*fmt.TABLES, fmt.COMPLETE_DIR, fmt.DERIVED_DIR):
                _rmtree(run_dir / sub)
            (run_dir / fmt.MANIFEST_NAME).unlink(missing_ok=True)
        return None
    # resume
    from grpolens.run.format import read_completion

    c = read_completion(run_dir)
    if c is None:  # written before markers: every step on disk counts as complete (today's rules)
        return frozenset(_on_disk_steps(run_dir, rank))
    complete = set(c.complete_steps)
    if rank == 0:
        for step in sorted((_on_disk_steps(run_dir) | set(c.done)) - complete):
            for table in fmt.TABLES:
                _rmtree(run_dir / table / f"step={step:08d}")
            for r in c.done.get(step, ()):
                (run_dir / fmt.marker_relpath(step, r)).unlink(missing_ok=True)
        for r in c.finished:
            (run_dir / fmt.finished_relpath(r)).unlink(missing_ok=True)
    return frozenset(complete)
