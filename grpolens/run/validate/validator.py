"""``grpolens validate``: every check of the format, on every row (:func:`validate_run`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from grpolens.run import format as fmt
from grpolens.run.format import absent_spans, describe_spans
from grpolens.run.storage import StorageError as _StorageError
from grpolens.run.validate.checks import (
    ERROR,
    WARNING,
    _TMP_RE,
    _FLOAT_TOKEN_COLUMNS,
    _LOGP_COLUMNS,
    _ORDER,
    _TEXT_COLUMNS,
    positive_logp_message,
    NON_NEGATIVE,
    NEGATIVE_MESSAGE,
    too_long_message,
    _count_below,
    _count_above,
    rejected_in_loss_message,
    _count_rejected_in_loss,
    unsorted_message,
    duplicates_message,
    _adjacent_order,
    Problem,
    Report,
    _same_type,
    _ints,
    _non_null,
    _NonFinite,
    _count_duplicates,
    _count_positive,
)


#: Rows per record batch the row checks read (a test makes it small).
_BATCH_ROWS = 1 << 20


def validate_run(run: os.PathLike | str) -> Report:
    """Check ``run`` (a directory or an ``s3://`` prefix: the same checks, through the storage
    layer); a path that is not a directory raises :class:`~grpolens.run.format.RunFormatError`."""
    run = fmt.as_run(run)
    if fmt.is_remote_run(run):
        return _Validator(run).run()  # a prefix always "exists": a missing manifest says what is wrong
    if not run.exists():
        raise fmt.RunFormatError(run, "run directory does not exist")
    if not run.is_dir():
        raise fmt.RunFormatError(run, "not a directory (a run is a directory with grpolens.json)")
    return _Validator(run).run()




class _Validator:
    #: name steps that lack a rank's completion marker (``validate`` does; readers skip them instead)
    reports_incomplete_steps = True

    def __init__(self, run: Path):
        self.root = run
        self.report = Report(run)
        self.world_size: int | None = None
        self.nonfinite = _NonFinite()
        self.sample_ids: list[np.ndarray] = []  # per samples file
        # A samples file that could not give its ids (already an error) would make every token
        # row of that step look orphaned: the join is skipped then.
        self.samples_incomplete = False
        self.sample_id_files: list[str] = []
        # (step, rank) -> [(rel path, set of micro_batches, part)]
        self.parts: dict[tuple[int, int], list[tuple[str, set[int], int]]] = {}
        self.orphans = [0, [], None, None]  # rows, the orphan ids seen (per batch), first file, first id
        self.markers: bool | None = None  # the manifest says the writer leaves completion markers
        self.listed: dict[str, list[fmt.Shard]] = {}  # table -> its shards, as run() listed them
        self.max_len: int | None = None  # the manifest's max_completion_length: no completion is longer

    def add(self, severity: str, path: Path | str, message: str, column: str | None = None) -> None:
        rel = path if isinstance(path, str) else self.rel(path)
        self.report.problems.append(Problem(severity, str(rel).replace(os.sep, "/"), column, message))

    def rel(self, path) -> str:
        """``path`` (a local path or a storage location under the run) relative to the run, with ``/``."""
        if fmt.is_remote_run(self.root):
            return path.relative_to(self.root)
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    # -- the whole run -------------------------------------------------------------------------
    def run(self) -> Report:
        self.check_manifest()
        self.check_layout()
        # listed once here, reused by the completion check (a listing is a directory read per step)
        self.listed = {t: fmt.list_shards(self.root, t, complete_only=False) for t in (fmt.SAMPLES, fmt.TOKENS)}
        for shard in self.listed[fmt.SAMPLES]:  # first: tokens are joined against them
            self.check_file(shard, fmt.SAMPLES)
        self.check_sample_ids()
        for shard in self.listed[fmt.TOKENS]:
            self.check_file(shard, fmt.TOKENS)
        self.check_parts()
        self.check_completion()
        self.report.problems += self.nonfinite.problems()
        rows, seen, first_file, first_id = self.orphans
        if rows:
            # one id's rows can sit in several batches and files (a sequence cut by a record batch,
            # a completion trained on in several loss calls): count it once
            ids = len(np.unique(np.concatenate(seen)))
            self.add(WARNING, first_file, (
                f"{rows:,} token rows reference {ids:,} sample_id(s) with no samples row (first: {first_id} "
                f"in this file); per-sample metrics (rewards, lengths) will miss them"), column="sample_id")
        if self.report.files[fmt.TOKENS] == 0 and self.report.files[fmt.SAMPLES] == 0:
            self.add(ERROR, fmt.TOKENS, "no token or samples shards: expected tokens/step=<8 digits>/rank=<5 digits>.parquet")
        elif self.report.files[fmt.TOKENS] == 0:
            # an imported run (verl rollout dumps, MaxEnt sidecars) has completions but no tokens
            self.add(WARNING, fmt.TOKENS, "no token shards: a samples-only run; per-token (policy, KL, clip, "
                     "mismatch) metrics are unavailable")
        elif self.report.files[fmt.SAMPLES] == 0:
            self.add(WARNING, fmt.SAMPLES, "no samples shards: rewards, lengths and groups are unknown to analysis")
        return self.report

    def check_manifest(self) -> None:
        try:
            manifest = fmt.read_manifest(self.root)
        except fmt.RunFormatError as e:
            # named relative to the run, as every other problem (on object storage too)
            self.add(ERROR, fmt.as_run(e.path), e.message, e.column)
            return
        self.world_size = manifest.world_size
        for key in (*fmt.CONFIG_FILE_KEYS, *fmt.CONFIG_PATH_OR_NAME_KEYS):
            problem = fmt.referenced_path_problem(self.root, key, manifest.config.get(key))
            if problem:
                self.add(ERROR, fmt.MANIFEST_NAME, problem)
        self.markers = manifest.completion_markers
        self.check_config(manifest)
        from grpolens.run.names import name_problem

        problem = name_problem(manifest.run_name)
        if problem:
            self.add(WARNING, fmt.MANIFEST_NAME, f"run_name {manifest.run_name!r} cannot name a directory: it "
                     f"{problem}; export --to tensorboard needs --name")

    #: check the manifest's config against the schema (commands check the config they resolve,
    #: with their --set and --config, themselves: a bad manifest value can be overridden there)
    checks_config = True

    def check_config(self, manifest: fmt.Manifest) -> None:
        from grpolens.errors import UserError
        from grpolens.run.config import check_config

        cfg = manifest.resolved_config()
        try:
            cfg = check_config(cfg)
        except UserError as e:
            if self.checks_config:
                self.add(ERROR, fmt.MANIFEST_NAME, e.message)
        limit = cfg.get("max_completion_length")
        self.max_len = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1 else None

    def check_tokenizer(self, path) -> None:
        """``tokenizer.json`` must load with the ``tokenizers`` library; otherwise views show ids."""
        from grpolens.run.decode import TokenizerFileError, load_tokenizer_file

        try:
            load_tokenizer_file(path, remote=fmt.is_remote_run(self.root))
        except TokenizerFileError as e:  # any failure to load is the finding
            self.add(WARNING, path, f"not a tokenizers JSON file ({e}): views show token ids instead of text")

    def check_layout(self) -> None:
        """Every entry must be part of the layout; readers silently skip the rest."""
        from grpolens.run.decode import TOKENIZER_FILE

        allowed = {fmt.MANIFEST_NAME, fmt.DERIVED_DIR, fmt.COMPLETE_DIR, *fmt.TABLES, TOKENIZER_FILE}
        for entry in sorted(self.root.iterdir()):
            if entry.name == TOKENIZER_FILE:
                self.check_tokenizer(entry)
            elif entry.name in fmt.TABLES:
                if not entry.is_dir():
                    self.add(ERROR, entry, f"'{entry.name}' must be a directory")
                else:
                    self.check_table_dir(entry)
            elif entry.name not in allowed:
                kind = "leftover temporary file from an interrupted write" if _TMP_RE.match(entry.name) else \
                    "not part of the run layout (ignored by grpolens)"
                self.add(WARNING, entry, kind)

    def check_table_dir(self, table_dir: Path) -> None:
        for step_dir in sorted(table_dir.iterdir()):
            if not (fmt._STEP_RE.match(step_dir.name) and step_dir.is_dir()):
                self.add(ERROR, step_dir, "stray entry: expected a directory step=<8 digits>; readers ignore it")
                continue
            entries = sorted(step_dir.iterdir())
            if not entries:
                self.add(WARNING, step_dir, "empty step directory")
            for f in entries:
                if fmt._SHARD_RE.match(f.name) and f.is_file():
                    continue
                if _TMP_RE.match(f.name):
                    self.add(WARNING, f, "leftover temporary file from an interrupted write (safe to delete)")
                else:
                    self.add(ERROR, f, "stray file: expected rank=<5 digits>[-<4 digits>].parquet; readers ignore it")

    # -- one file ------------------------------------------------------------------------------
    def begin_file(self, shard: fmt.Shard, table: str) -> str:
        """Count the file and check its rank against world_size; its path relative to the run."""
        rel = shard.relpath()  # the listing matched its canonical name
        self.report.files[table] += 1
        if self.world_size is not None and shard.rank >= self.world_size:
            self.add(ERROR, rel, f"rank {shard.rank} is outside the manifest's world_size {self.world_size}")
        return rel

    def check_file(self, shard: fmt.Shard, table: str) -> None:
        import pyarrow.parquet as pq

        rel = self.begin_file(shard, table)
        try:
            pf = pq.ParquetFile(fmt.parquet_source(shard.path))
            schema = pf.schema_arrow
        except _StorageError:  # the bucket, credentials or permissions: one line, not a line per file
            raise
        except Exception as e:  # pyarrow raises several types for truncated/garbage files
            self.add(ERROR, rel, f"unreadable or truncated Parquet file: {e}")
            self.samples_incomplete |= table == fmt.SAMPLES
            return
        self.report.rows[table] += pf.metadata.num_rows
        usable = self.check_schema(rel, schema, table)
        self.samples_incomplete |= table == fmt.SAMPLES and "sample_id" not in usable
        try:
            if table == fmt.TOKENS:
                self.check_token_rows(rel, shard, pf, usable)
            else:
                self.check_sample_rows(rel, shard, pf, usable)
        except Exception as e:  # a corrupt page shows up only when read
            self.add(ERROR, rel, f"unreadable or truncated Parquet file: {e}")
            self.samples_incomplete |= table == fmt.SAMPLES

    def check_schema(self, rel: str, schema: pa.Schema, table: str) -> set[str]:
        """Report missing and mistyped columns; return the names that are present with the right type."""
        types = fmt.column_types(table)
        names = set(schema.names)
        for name in fmt.REQUIRED[table]:
            if name not in names:
                self.add(ERROR, rel, f"required column missing (expected {types[name]})", column=name)
        usable = set()
        for f in schema:
            expected = types.get(f.name)
            if expected is None and table == fmt.SAMPLES and f.name.startswith(fmt.REWARD_PREFIX):
                expected = fmt.REWARD_COLUMN_TYPE
            if expected is None:
                continue  # extra columns are allowed
            if _same_type(f.type, expected):
                usable.add(f.name)
            else:
                self.add(ERROR, rel, f"column has type {f.type}, expected {expected}", column=f.name)
        return usable

    def _null_checks(self, batch: pa.RecordBatch, table: str, nulls: dict[str, int]) -> None:
        nullable = {c.name: c.nullable for c in fmt.COLUMNS[table]}
        for name in batch.schema.names:
            if nullable.get(name) is False:
                nulls[name] = nulls.get(name, 0) + batch.column(name).null_count

    def _report_nulls(self, rel: str, nulls: dict[str, int]) -> None:
        for name, n in nulls.items():
            if n:
                self.add(ERROR, rel, f"{n:,} null values in a non-nullable column", column=name)

    def _check_path_agrees(self, shard: fmt.Shard, batch: pa.RecordBatch, values: dict[str, np.ndarray],
                           bad: dict[str, list]) -> None:
        for name, expected in (("step", shard.step), ("rank", shard.rank)):
            if name in values:
                wrong = values[name] != expected
                if batch.column(name).null_count:  # a null is an error of its own, not a value (_ints' -1)
                    wrong &= _non_null(batch.column(name))
                if wrong.any():
                    b = bad.setdefault(name, [0, None])
                    b[0] += int(wrong.sum())
                    b[1] = b[1] if b[1] is not None else int(values[name][wrong][0])

    def _report_path_disagreement(self, rel: str, shard: fmt.Shard, bad: dict[str, list]) -> None:
        for name, (n, example) in bad.items():
            self.add(ERROR, rel, f"{n:,} rows hold {name}={example} (or another value) but the path says "
                                 f"{name}={getattr(shard, name)}", column=name)

    def check_token_rows(self, rel: str, shard: fmt.Shard, pf, usable: set[str]) -> None:
        wanted = [c for c in ("step", "rank", *_ORDER) if c in usable]
        floats = [c for c in _FLOAT_TOKEN_COLUMNS if c in usable]
        others = [c for c in ("mask", "rollout_rejected") if c in usable]  # the non-float columns read
        columns = wanted + floats + others
        nulls: dict[str, int] = {}
        bad_path: dict[str, list] = {}
        can_order = all(c in usable for c in _ORDER)
        last = None  # the previous batch's last (micro_batch, sample_id, pos)
        unsorted_at = None
        dups = 0
        row0 = 0
        micro_batches: set[int] = set()
        negatives: set[str] = set()
        positive: dict[str, int] = {}
        rejected_in_loss = 0
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
            self._null_checks(batch, fmt.TOKENS, nulls)
            vals = {c: _ints(batch.column(c)) for c in wanted}
            self._check_path_agrees(shard, batch, vals, bad_path)
            for c in _ORDER:
                if c in vals and len(vals[c]) and vals[c].min() < 0 and batch.column(c).null_count == 0:
                    negatives.add(c)
            for c in floats:
                self.nonfinite.add(c, batch.column(c), rel)
                if c in _LOGP_COLUMNS:
                    positive[c] = positive.get(c, 0) + _count_positive(batch.column(c))
            if "rollout_rejected" in batch.schema.names and "mask" in batch.schema.names:
                rejected_in_loss += _count_rejected_in_loss(batch.column("rollout_rejected"), batch.column("mask"))
            if "micro_batch" in vals:
                mb = vals["micro_batch"]
                if batch.column("micro_batch").null_count:  # a null is no micro_batch (its error is the null)
                    mb = mb[_non_null(batch.column("micro_batch"))]
                heads = np.flatnonzero(np.r_[True, mb[1:] != mb[:-1]]) if len(mb) else mb
                micro_batches.update(np.unique(mb[heads]).tolist())
            if can_order and batch.num_rows:
                keys = [vals[c] for c in _ORDER]
                if last is not None:
                    keys = [np.r_[l, k] for l, k in zip(last, keys)]
                lt, eq = _adjacent_order(keys)
                if unsorted_at is None and lt.any():
                    unsorted_at = row0 + int(np.argmax(lt)) + (0 if last is not None else 1)
                dups += int(eq.sum())
                last = [k[-1:] for k in keys]
            if "sample_id" in vals:
                col = batch.column("sample_id")  # a null id is an error of its own, not an orphan id -1
                self._join_samples(rel, vals["sample_id"][_non_null(col)]
                                   if col.null_count else vals["sample_id"])
            row0 += batch.num_rows
        self._report_nulls(rel, nulls)
        self._report_path_disagreement(rel, shard, bad_path)
        if any(nulls.get(c) for c in _ORDER):  # keys with nulls are their error: order and uniqueness
            unsorted_at, dups = None, 0  # are not judged on the stand-in value (_ints' -1)
        for c in sorted(negatives):
            self.add(ERROR, rel, NEGATIVE_MESSAGE, column=c)
        for c, n in positive.items():
            if n:
                self.add(ERROR, rel, positive_logp_message(n), column=c)
        if rejected_in_loss:
            self.add(ERROR, rel, rejected_in_loss_message(rejected_in_loss), column="rollout_rejected")
        if unsorted_at is not None:
            self.add(ERROR, rel, unsorted_message(unsorted_at))
            dups = _count_duplicates(pf, list(_ORDER))  # adjacent comparison undercounts when unsorted
        if dups:
            self.add(ERROR, rel, duplicates_message(dups))
        self.parts.setdefault((shard.step, shard.rank), []).append((rel, micro_batches, shard.part))

    def _join_samples(self, rel: str, sample_id: np.ndarray) -> None:
        if not self.sample_ids or self.samples_incomplete or not len(sample_id):
            return
        known = self._known_ids
        heads = np.flatnonzero(np.r_[True, sample_id[1:] != sample_id[:-1]])
        runs = np.diff(np.r_[heads, len(sample_id)])
        ids = sample_id[heads]
        idx = np.minimum(np.searchsorted(known, ids), len(known) - 1)
        missing = known[idx] != ids
        if missing.any():
            o = self.orphans
            o[0] += int(runs[missing].sum())
            o[1].append(np.unique(ids[missing]))
            if o[2] is None:
                o[2], o[3] = rel, int(ids[missing][0])

    def check_sample_rows(self, rel: str, shard: fmt.Shard, pf, usable: set[str]) -> None:
        from grpolens.run.text_columns import REPLACE, invalid_rows, invalid_utf8_message, policy

        non_null = {c.name for c in fmt.SAMPLE_COLUMNS if not c.nullable}
        columns = [c for c in usable if c in non_null or c in _TEXT_COLUMNS or c in NON_NEGATIVE[fmt.SAMPLES]]
        negatives: set[str] = set()
        too_long = [0, None]  # completions longer than max_completion_length, the first length
        nulls: dict[str, int] = {}
        bad_path: dict[str, list] = {}
        bad_text: dict[str, list[int]] = {}  # column -> [count, first row]
        ids = []
        row0 = 0
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
            self._null_checks(batch, fmt.SAMPLES, nulls)
            for c in _TEXT_COLUMNS:
                if c in batch.schema.names:
                    bad = invalid_rows(batch.column(c))
                    if len(bad):
                        b = bad_text.setdefault(c, [0, row0 + int(bad[0])])
                        b[0] += len(bad)
            row0 += batch.num_rows
            vals = {c: _ints(batch.column(c)) for c in ("step", "rank") if c in usable}
            self._check_path_agrees(shard, batch, vals, bad_path)
            for c in NON_NEGATIVE[fmt.SAMPLES]:
                if c in usable and _count_below(batch.column(c), 0):
                    negatives.add(c)
            if "completion_len" in usable and self.max_len is not None:
                n, first = _count_above(batch.column("completion_len"), self.max_len)
                too_long[0] += n
                too_long[1] = too_long[1] if too_long[1] is not None else first
            if "sample_id" in usable:
                col = batch.column("sample_id")
                ids.append(col.drop_null().to_numpy().astype(np.int64) if col.null_count else _ints(col))
        self._report_nulls(rel, nulls)
        self._report_path_disagreement(rel, shard, bad_path)
        for c, (n, first) in bad_text.items():
            # readable with the bytes replaced when the user chose so: then only a warning
            self.add(WARNING if policy() == REPLACE else ERROR, rel, invalid_utf8_message(n, first), column=c)
        for c in sorted(negatives):
            self.add(ERROR, rel, NEGATIVE_MESSAGE, column=c)
        if too_long[0]:
            self.add(ERROR, rel, too_long_message(too_long[0], self.max_len, too_long[1]), column="completion_len")
        if ids:
            self.sample_ids.append(np.concatenate(ids))
            self.sample_id_files.append(rel)

    # -- across files --------------------------------------------------------------------------
    def check_sample_ids(self) -> None:
        """sample_id is unique within the run; prepare the sorted id set for the tokens join."""
        if not self.sample_ids:
            return  # no samples file gave ids: the tokens join is off (_join_samples)
        ids = np.concatenate(self.sample_ids)
        file_of = np.repeat(np.arange(len(self.sample_ids)), [len(a) for a in self.sample_ids])
        order = np.argsort(ids, kind="stable")
        s = ids[order]
        dup = np.flatnonzero(s[1:] == s[:-1])
        if len(dup):
            first = order[dup[0] + 1]
            self.add(ERROR, self.sample_id_files[file_of[first]], (
                f"{len(dup):,} duplicate sample_id values across the samples table (first: {s[dup[0]]}, "
                f"also in {self.sample_id_files[file_of[order[dup[0]]]]}); sample_id must be unique in a run"),
                column="sample_id")
        self._known_ids = np.unique(s)

    _known_ids: np.ndarray

    def check_completion(self) -> None:
        """Every (step, rank) up to world_size has a completion marker that names exactly the shard
        files on disk; every rank left a finished record. Runs written before markers: a warning."""
        if self.world_size is None:
            return
        shards = [sh for t in fmt.TABLES for sh in self.listed[t]]  # run() listed both tables before
        if not self.markers:
            if shards:
                self.add(WARNING, fmt.MANIFEST_NAME, "written without completion markers (before grpolens wrote them, "
                         "or by another tool): a step cut short by a killed writer, or missing a rank, cannot be "
                         "told from a whole one; readers take every step as it is")
            return
        on_disk: dict[tuple[int, int], set[str]] = {}
        for sh in shards:
            on_disk.setdefault((sh.step, sh.rank), set()).add(sh.relpath())  # the listing matched its canonical name
        marked: dict[tuple[int, int], Path] = {}
        finished: set[int] = set()
        cdir = self.root / fmt.COMPLETE_DIR
        for entry in sorted(cdir.iterdir()) if cdir.is_dir() else ():
            if (m := fmt.MARKER_RE.match(entry.name)):
                marked[(int(m.group(1)), int(m.group(2)))] = entry
            elif (m := fmt.FINISHED_RE.match(entry.name)):
                finished.add(int(m.group(1)))
            elif _TMP_RE.match(entry.name):
                self.add(WARNING, entry, "leftover temporary file from an interrupted write")
            else:
                self.add(ERROR, entry, "stray entry: expected step=<8 digits>.rank=<5 digits>.json or "
                         "finished.rank=<5 digits>.json")
        steps = sorted({s for s, _ in on_disk} | {s for s, _ in marked})
        ws = self.world_size
        for step in steps:
            # what is on disk drives the cost, not world_size (up to 100,000 ranks)
            have = {r for (s, r) in on_disk if s == step}
            done = {r for (s, r) in marked if s == step}
            if self.reports_incomplete_steps:
                unmarked = sorted(r for r in have - done if r < ws)
                self._report_ranks(step, [(r, r) for r in unmarked], "shards without a completion marker (its "
                                   f"writer stopped before the step ended); readers skip step {step}")
                self._report_ranks(step, absent_spans(have | done, ws), "missing (no shards and no completion "
                                   f"marker, world_size {ws}); readers skip step {step}")
            for rank in sorted(r for r in done if r < ws):
                self._check_marker(marked[(step, rank)], step, rank, on_disk.get((step, rank), set()))
        for step, rank in sorted(marked):
            if rank >= ws:
                self.add(ERROR, marked[(step, rank)], f"completion marker of rank {rank}, outside world_size {ws}")
        unfinished = absent_spans(finished, ws)
        if unfinished and (shards or marked):
            self.add(WARNING, fmt.COMPLETE_DIR, f"no finished record for rank(s) {describe_spans(unfinished)}: "
                     "still training, or stopped before the writer was closed")

    #: up to this many ranks of a step are reported one by one; more, in one summary line
    RANKS_LISTED = 8

    def _report_ranks(self, step: int, spans: list[tuple[int, int]], what: str) -> None:
        n = sum(b - a + 1 for a, b in spans)
        if not n:
            return
        if n <= self.RANKS_LISTED:
            for a, b in spans:
                for rank in range(a, b + 1):
                    self.add(ERROR, fmt.marker_relpath(step, rank), f"step {step} rank {rank}: {what}")
            return
        self.add(ERROR, fmt.marker_relpath(step, spans[0][0]),
                 f"step {step}: {n:,} ranks ({describe_spans(spans)}) {what}")

    def _check_marker(self, path: Path, step: int, rank: int, files: set[str]) -> None:
        import json

        try:
            data = json.loads(path.read_text())  # a local file or an object
            listed = set(data["files"])
            if not all(isinstance(f, str) for f in listed):
                raise TypeError("files must be strings")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            self.add(ERROR, path, f"unreadable completion marker: {'nested too deeply' if isinstance(e, RecursionError) else e}")
            return
        for f in sorted(files - listed):
            self.add(ERROR, f, f"not named by the completion marker of step {step} rank {rank}: written after it "
                     "(a second run into the same folder?); readers would count its rows twice")
        for f in sorted(listed - files):
            self.add(ERROR, path, f"names {f}, which is missing")

    def check_parts(self) -> None:
        """A loss call (step, rank, micro_batch) must not be split across part files."""
        for (step, rank), parts in sorted(self.parts.items()):
            seen: dict[int, str] = {}
            split: dict[int, list[str]] = {}
            for rel, mbs, _ in sorted(parts, key=lambda p: p[2]):
                for mb in sorted(mbs):
                    if mb in seen:
                        split.setdefault(mb, [seen[mb]]).append(rel)
                    else:
                        seen[mb] = rel
            for mb, files in sorted(split.items()):
                self.add(ERROR, files[-1], f"micro_batch {mb} of step {step} rank {rank} is split across part files "
                                           f"{', '.join(files)}; the writer keeps a loss call in one part",
                         column="micro_batch")
            if split:
                self._cross_part_duplicates(step, rank, sorted(split), [p[0] for p in parts])

    def _cross_part_duplicates(self, step: int, rank: int, mbs: list[int], files: list[str]) -> None:
        import pyarrow.parquet as pq

        keys, owner = [], []
        for i, rel in enumerate(files):
            try:
                t = pq.read_table(fmt.parquet_source(self.root / rel), columns=list(_ORDER),
                                  filters=[("micro_batch", "in", mbs)])
            except Exception:
                continue  # already reported as unreadable or mistyped
            t = t.drop_null()  # a row with a null key is that null's error, no duplicate
            keys.append([_ints(t.column(c)) for c in _ORDER])
            owner.append(np.full(t.num_rows, i))
        if not keys:
            return
        k = [np.concatenate([x[j] for x in keys]) for j in range(3)]
        who = np.concatenate(owner)
        order = np.lexsort(k[::-1])
        k = [a[order] for a in k]
        who = who[order]
        same = (k[0][1:] == k[0][:-1]) & (k[1][1:] == k[1][:-1]) & (k[2][1:] == k[2][:-1]) & (who[1:] != who[:-1])
        if same.any():
            self.add(ERROR, files[0], f"{int(same.sum()):,} duplicate (step, rank, micro_batch, sample_id, pos) keys "
                                      f"across the part files of step {step} rank {rank}")


