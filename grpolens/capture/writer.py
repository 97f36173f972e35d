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
import os
import threading
import weakref
from typing import Any, Callable, Mapping

import numpy as np

from grpolens.run import format as fmt
from grpolens.run.format import atomic_write_table  # module-level name: tests slow it down to test back-pressure
# the shard's table and the run directory's modes live beside the writer; their names stay importable from here
from grpolens.capture.run_dir import MODES, RunExistsError, describe_run, holds_run, prepare_run_dir, write_record
from grpolens.capture.shard_table import FILLED, _INT32, _Buffer, _Chunk, _nbytes, build_table, check_columns

__all__ = ["FILLED", "MODES", "RunExistsError", "ShardWriter", "WriterError", "build_table", "check_columns",
           "describe_run", "holds_run", "prepare_run_dir", "write_record"]

#: How many ended steps the writer remembers to catch a micro_batch index reused within a step.
_REMEMBERED_STEPS = 256


class WriterError(RuntimeError):
    """The background writer thread failed. Raised by the next call after the failure and by
    ``close()``; the original exception is the ``__cause__``. The writer accepts nothing afterwards."""


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
