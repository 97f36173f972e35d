"""Derived tables written step by step: memory holds one step's rows, not the run's.

A recompute writes tables with rows for every step (the completions table, the top tokens, the
rollout-IS histograms). Held in memory until the end, they grow with the number of steps (a
10,000-step run's completions table alone is millions of rows). Instead each recomputed step's
rows go to a spill file as soon as the step is done (:class:`StepSpill`; the first
:data:`HOLD_BYTES` of them stay in memory, which spares a short run's many small steps a file
written and read back each), and
:func:`write_step_table` writes the final file in step order from the spilled steps and the
earlier file's rows of the steps kept from the cache, one step (or one row group) at a time.

The file is the one a single ``concat(...).sort(...)`` of everything would give: columns in order
of first appearance (earlier file first, then the steps in order), each column cast to the common
type of its pieces, rows sorted by the given keys (step first).
"""

from __future__ import annotations

import contextlib
import os

import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import polars as pl

#: rows per Parquet row group of the written table (a step is never split across two writes)
ROW_GROUP_ROWS = 256 * 1024
#: rows per batch when streaming the earlier file
READ_BATCH_ROWS = 64 * 1024
#: bytes of spilled rows a recompute's own spill keeps in memory (all tables together) before it
#: writes them to files: the tables of ~100 small steps, so a run of any length stays bounded
HOLD_BYTES = 64 << 20


class StepSpill:
    """Each step's rows of the recompute's derived tables, kept until the tables are written: in
    memory while they total at most ``hold_bytes`` (:data:`HOLD_BYTES`), the later steps' on disk.

    The files live in a private temporary folder under ``parent`` (beside the cache, so on the
    run's disk, not in a RAM-backed /tmp), made on the first one; :meth:`close` removes it,
    whatever happened. Worker processes computing steps in parallel send their steps' rows to the
    recompute's process, which puts them here (:mod:`grpolens.analysis.step_workers`)."""

    def __init__(self, parent: Path, hold_bytes: int | None = None):
        self.parent = parent
        self.dir: Path | None = None  # made on the first file: a re-run with nothing new makes none
        self._tables: dict[str, SpilledSteps] = {}
        self.hold_left = HOLD_BYTES if hold_bytes is None else hold_bytes  # bytes still to hold in memory

    def folder(self) -> Path:
        """The spill's folder (made now if it is not yet)."""
        if self.dir is None:
            self.parent.mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix=".spill-", dir=self.parent))
        return self.dir

    def put(self, table: str, step: int, rows: pl.DataFrame | None) -> None:
        self.table(table).put(step, rows)

    def table(self, name: str) -> "SpilledSteps":
        if name not in self._tables:
            self._tables[name] = SpilledSteps(lambda: self.folder() / name, self)
        return self._tables[name]

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def __enter__(self) -> "StepSpill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _os_error(e: Exception, path: Path) -> Exception:
    """polars reports a failed write (a full disk) as a ComputeError naming ``os error N``: the
    OSError it is, with the path, so that the CLI says the one line it says for every write."""
    import errno
    import re

    m = re.search(r"\(os error ([0-9]+)\)", str(e))
    if not m:
        return e
    code = int(m.group(1))
    return OSError(code, os.strerror(code) if code in errno.errorcode else str(e), str(path))


class SpilledSteps(Mapping[int, pl.DataFrame]):
    """step -> that step's rows, held in memory or read back from its spill file on access (steps
    without rows are absent)."""

    def __init__(self, folder: Callable[[], Path], spill: StepSpill | None = None):
        self._folder = folder
        self._spill = spill  # whose memory budget a put may use
        self._files: dict[int, Path] = {}
        self._held: dict[int, pl.DataFrame] = {}
        self.schemas: dict[int, pl.Schema] = {}
        self._distinct: dict[tuple, pl.Schema] = {}

    def put(self, step: int, rows: pl.DataFrame | None) -> None:
        if rows is None or rows.height == 0:
            return
        if self._spill is not None and self._spill.hold_left > 0:
            self._spill.hold_left -= rows.estimated_size()
            self._held[step] = rows
            self._note_schema(step, rows.schema)
            return
        folder = self._folder()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{step}.parquet"
        try:
            rows.write_parquet(path, compression="lz4", statistics=False)  # read back once: fast, not small
        except pl.exceptions.ComputeError as e:
            raise _os_error(e, path) from None
        self._files[step] = path
        self._note_schema(step, rows.schema)

    def _note_schema(self, step: int, schema: pl.Schema) -> None:
        # one object per distinct schema: the steps of a table nearly always share one, and a
        # schema per step (~4 KB) made memory grow with the run's length
        self.schemas[step] = self._distinct.setdefault(tuple(schema.items()), schema)

    def __getitem__(self, step: int) -> pl.DataFrame:
        held = self._held.get(step)
        return pl.read_parquet(self._files[step]) if held is None else held

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._files.keys() | self._held.keys()))

    def __len__(self) -> int:
        return len(self._files.keys() | self._held.keys())


def write_step_table(path: Path, new: Mapping[int, pl.DataFrame], kept_steps: Iterable[int], sort: list[str],
                     descending: list[bool] | None = None, order: Callable[[list[str]], list[str]] | None = None,
                     empty: pl.DataFrame | None = None, schemas: Mapping[int, pl.Schema] | None = None) -> bool:
    """Write ``path`` (atomically): the earlier file's rows of ``kept_steps`` and the rows of each step
    in ``new``, in step order, sorted by ``sort`` (``sort[0]`` is ``"step"``); ``order`` reorders the
    columns. With no rows at all, ``empty`` is written if given; else nothing is written (False).

    ``schemas`` (step -> schema of ``new[step]``) saves reading every spilled step twice."""
    import pyarrow.parquet as pq

    from grpolens.run.atomic import atomic_file
    from grpolens.run.format import DICTIONARY_COLUMNS, atomic_write_table

    assert sort[0] == "step"
    descending = descending or [False] * len(sort)
    kept = set(kept_steps) - set(new)
    old_schema = _old_schema(path) if kept else None
    pieces_schemas = ([old_schema] if old_schema is not None else []) + [
        (schemas[s] if schemas is not None and s in schemas else new[s].schema) for s in sorted(new)]
    if not pieces_schemas:
        if empty is None:
            return False
        atomic_write_table(path, empty.to_arrow())
        return True
    distinct = list({tuple(s.items()): s for s in pieces_schemas}.values())  # first appearances, in order
    unified = pl.concat([pl.DataFrame(schema=s) for s in distinct], how="diagonal_relaxed")
    columns = order(unified.columns) if order else unified.columns
    template = unified.select(columns)

    def conform(df: pl.DataFrame) -> pl.DataFrame:
        if df.schema == template.schema:  # the usual case: nothing to add, cast or reorder
            return df
        return pl.concat([template, df], how="diagonal_relaxed").select(columns)

    def new_rows(step: int) -> pl.DataFrame:
        return new[step].sort(sort, descending=descending)

    chunks = _merged(_old_chunks(path, kept, sort, descending) if old_schema is not None else iter(()),
                     sorted(new), new_rows)
    arrow_schema = template.to_arrow().schema
    dictionary = [c for c in DICTIONARY_COLUMNS if c in columns]
    wrote = False
    with atomic_file(path) as f:
        writer = pq.ParquetWriter(f, arrow_schema, compression="zstd", use_dictionary=dictionary)
        try:
            buffer: list[pl.DataFrame] = []
            rows = 0
            for chunk in chunks:
                if chunk.height == 0:
                    continue
                buffer.append(conform(chunk))
                rows += chunk.height
                if rows >= ROW_GROUP_ROWS:
                    writer.write_table(pl.concat(buffer).to_arrow().cast(arrow_schema))
                    buffer, rows, wrote = [], 0, True
            if buffer:
                writer.write_table(pl.concat(buffer).to_arrow().cast(arrow_schema))
                wrote = True
            if not wrote and empty is not None:
                writer.write_table(conform(empty.head(0)).to_arrow().cast(arrow_schema))
        except BaseException:
            # closed while its file is open (the file is then removed): left to the garbage
            # collector, it would write to the closed file and print a traceback (seen on Ctrl-C)
            with contextlib.suppress(Exception):
                writer.close()
            raise
        writer.close()
    return True


def _old_schema(path: Path) -> pl.Schema | None:
    try:
        return pl.read_parquet_schema(path) if path.is_file() else None
    except Exception:  # noqa: BLE001 - an unreadable earlier file: its kept steps are simply not carried
        return None


def _old_chunks(path: Path, kept: set[int], sort: list[str], descending: list[bool]) -> Iterator[pl.DataFrame]:
    """The earlier file's rows of ``kept`` steps in step order, a batch at a time. Every writer of
    these tables sorts by step; a file that is not sorted (written by another tool) is read whole
    and sorted, as before streaming. An unreadable file carries nothing: its steps are rebuilt."""
    import pyarrow.parquet as pq

    keep = sorted(kept)
    try:
        pf = pq.ParquetFile(path)
        in_order = pl.from_arrow(pf.read(columns=["step"])).to_series().is_sorted()
    except Exception:  # noqa: BLE001
        return
    if not in_order:
        yield pl.read_parquet(path).filter(pl.col("step").is_in(keep)).sort(sort, descending=descending)
        return
    try:
        for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS):
            part = pl.from_arrow(batch).filter(pl.col("step").is_in(keep))
            if part.height:
                yield part
    except Exception:  # noqa: BLE001 - damaged half-way: the steps not yet read are rebuilt on demand
        return


def _merged(old: Iterator[pl.DataFrame], new_steps: list[int], new_rows: Callable[[int], pl.DataFrame]) -> Iterator[pl.DataFrame]:
    """Old chunks (sorted by step, steps disjoint from ``new_steps``) and new steps, in step order."""
    i = 0
    for chunk in old:
        while i < len(new_steps) and chunk.height and new_steps[i] <= chunk["step"][-1]:
            s = new_steps[i]
            yield chunk.filter(pl.col("step") < s)
            chunk = chunk.filter(pl.col("step") > s)
            yield new_rows(s)
            i += 1
        yield chunk
    for s in new_steps[i:]:
        yield new_rows(s)
