"""Check a run against the format contract and report every problem at once.

:func:`validate_run` streams the run one Parquet file at a time, reading only the columns a check
needs, in record batches, so its memory is bounded by one batch plus one integer per completion
(the set of sample ids, for the tokens→samples join). Problems are *errors* (the run breaks the
contract; analysis may be wrong or fail) or *warnings* (suspicious but analysable: non-finite
log-probs, token rows without a samples row, leftover temporary files).

Every other command reads a run only after :func:`check_before_reading`, which applies the same
checks with the same messages at the cost of the Parquet footers: the manifest, the layout, each
file's schema, and the row-group statistics (nulls, negative keys, step/rank against the path,
positive log-probs, micro-batch ranges of part files). A file whose statistics are suspicious or
absent gets the full row checks of ``grpolens validate``. What statistics cannot show -- the order
and uniqueness of the keys within a tokens shard, and invalid UTF-8 in text -- is checked by the
readers on the columns they hold in memory (:func:`key_order_problems`, :mod:`grpolens.run.text_columns`),
with these same messages.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from grpolens.run import format as fmt
from grpolens.run.format import absent_spans, describe_spans
from grpolens.run.tree import tree_digest
from grpolens.run.storage import StorageError as _StorageError

ERROR, WARNING = "error", "warning"
_BATCH_ROWS = 1 << 20
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
    return int(pc.sum(pc.less(values, bound)).as_py() or 0)


def _count_above(values: pa.Array | pa.ChunkedArray, bound: int) -> tuple[int, int | None]:
    """(values > ``bound``, the first of them), nulls skipped."""
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


def check_before_reading(run: os.PathLike | str, memo: os.PathLike | str | None = None,
                         tree: str | None = None) -> Report:
    """What a command checks before it reads ``run``: every error ``grpolens validate`` would
    report that the Parquet footers can show, with the same messages; raises
    :class:`~grpolens.errors.RunFormatError` for the first (as :meth:`Report.raise_for_errors`).

    ``memo``: a JSON file (``recompute`` keeps one in its cache) remembering the files and
    completion markers that passed, by size and modification time; those are not opened again,
    so a re-run costs a ``stat`` per file plus the run-wide checks, and a new step costs its own
    files. The updated memo is ``report.memo``; the caller saves it (``report.memo.save(memo)``)
    once its own work succeeded, so that a command that fails writes nothing."""
    run = Path(run)
    if not run.exists():
        raise fmt.RunFormatError(run, "run directory does not exist")
    if not run.is_dir():
        raise fmt.RunFormatError(run, "not a directory (a run is a directory with grpolens.json)")
    memo_state = _CheckMemo.load(memo) if memo is not None else None
    if memo_state is not None and tree is None:  # ``tree``: a digest the caller took just before
        tree = tree_digest(run)
    if tree is not None and memo_state.tree == tree:  # not one entry of the run changed since it passed
        report = Report(run)
        report.memo = memo_state
        return report
    v = _FooterValidator(run, memo_state)
    report = v.run()
    report.raise_for_errors()
    if v.memo is not None:
        v.memo.tree, v.memo.changed = tree, True
    report.memo = v.memo
    return report


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


def _count_duplicates(pf, columns: list[str]) -> int:
    t = pf.read(columns=columns)
    return _sorted_duplicates([_ints(t.column(c)) for c in columns])


def _count_positive(values: pa.Array) -> int:
    a = values.to_numpy(zero_copy_only=False)
    # null -> NaN, not counted; +inf is a non-finite value (a warning of its own), not counted here
    return int(np.count_nonzero(np.isfinite(a) & (a > POSITIVE_LOGP_TOLERANCE)))


class _CheckMemo:
    """Files and markers that passed :func:`check_before_reading`, keyed by relative path, with the
    (size, mtime_ns, inode) they had. A changed file, an edited checker or a damaged memo: checked
    again. Like ``make``, it trusts that a file with the same size, time and inode is the same file;
    ``recompute --full`` checks every file."""

    @staticmethod
    def checker() -> str:
        """Which checks the memo vouches for: this grpolens, and these very modules (a checkout
        whose checks were edited does not trust what an older copy passed)."""
        from grpolens import __version__

        return ":".join([__version__, *(f"{st.st_size}.{st.st_mtime_ns}" for st in
                                        (os.stat(__file__), os.stat(fmt.__file__)))])

    def __init__(self, files: dict | None = None, markers: dict | None = None, tree: str | None = None):
        self.files: dict[str, list] = files or {}
        self.markers: dict[str, list] = markers or {}
        #: :func:`grpolens.run.tree.tree_digest` of the whole run when it last passed
        self.tree = tree
        self.changed = False

    @classmethod
    def load(cls, path: os.PathLike | str) -> "_CheckMemo":
        import json

        try:
            data = json.loads(Path(path).read_text())
            if data.get("checker") == cls.checker() and isinstance(data.get("files"), dict) \
                    and isinstance(data.get("markers"), dict):
                return cls(data["files"], data["markers"], data.get("tree"))
        except (OSError, ValueError, AttributeError, RecursionError):
            pass  # none yet, or damaged: every file is checked, and the memo written anew
        return cls()

    def save(self, path: os.PathLike | str) -> None:
        import json

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fmt.atomic_write_bytes(path, json.dumps({"checker": self.checker(), "files": self.files,
                                                 "markers": self.markers, "tree": self.tree}).encode())


def _stat(path) -> list[int]:
    # the inode too: shards are written by rename, so a rewrite within the file system's time
    # resolution, at the same size, still shows as a new file
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


class _FooterValidator(_Validator):
    """The checks of :class:`_Validator` that the Parquet footers can answer.

    Per file: readability, schema, rank against world_size, and the row-group statistics --
    null counts of non-nullable columns, minima of the key columns, step and rank against the path,
    maxima of the log-prob columns. A file whose statistics show a problem, or that has none, gets
    the full row checks, so the message (with its counts) is validate's own. The samples' sample_id
    column (one integer per completion) is read for the run-wide uniqueness check. Warnings that
    need the rows (non-finite values, token rows without a samples row) are validate's alone."""

    #: an incomplete step is no reason to refuse the run: readers leave it out, with their own line
    reports_incomplete_steps = False
    #: every command checks the config it resolves (manifest, --config, --set) with the same schema
    checks_config = False

    def __init__(self, run: Path, memo: _CheckMemo | None = None):
        super().__init__(run)
        self.memo = memo

    def check_file(self, shard: fmt.Shard, table: str) -> None:
        import pyarrow.parquet as pq

        rel = self.begin_file(shard, table)
        stat = _stat(shard.path) if self.memo is not None else None
        if stat is not None and self._recall(rel, shard, table, stat):
            return
        before = len(self.report.problems)
        try:
            pf = pq.ParquetFile(fmt.parquet_source(shard.path))
            schema = pf.schema_arrow
            rows = pf.metadata.num_rows
            self.report.rows[table] += rows
            usable = self.check_schema(rel, schema, table)
            stats = _column_stats(pf, usable)
            if table == fmt.TOKENS:
                if _tokens_suspicious(stats, shard, usable):
                    self.check_token_rows(rel, shard, pf, usable)
                    return
                mb = stats.get("micro_batch")
                span = [int(mb[0]), int(mb[1])] if mb and rows else None
                self.parts.setdefault((shard.step, shard.rank), []).append((rel, _span_set(span), shard.part))
                facts = [span]
            else:
                self.samples_incomplete |= "sample_id" not in usable
                if _samples_suspicious(stats, shard, usable, self.max_len):
                    self.check_sample_rows(rel, shard, pf, usable)
                    return
                if "sample_id" not in usable:
                    return
                ids = _ints(pf.read(columns=["sample_id"]).column(0))
                self.sample_ids.append(ids)
                self.sample_id_files.append(rel)
                facts = [ids.tolist()]
        except Exception as e:  # pyarrow raises several types for truncated/garbage files
            self.add(ERROR, rel, f"unreadable or truncated Parquet file: {e}")
            self.samples_incomplete |= table == fmt.SAMPLES
            return
        if stat is not None and len(self.report.problems) == before:
            self.memo.files[rel] = [*stat, table, rows, *facts]

    def _recall(self, rel: str, shard: fmt.Shard, table: str, stat: list[int]) -> bool:
        """Restore what ``check_file`` learnt of an unchanged file that passed before."""
        hit = self.memo.files.get(rel)
        if not isinstance(hit, list) or len(hit) != 6 or hit[:4] != [*stat, table]:
            return False
        self.report.rows[table] += hit[4]
        if table == fmt.TOKENS:
            self.parts.setdefault((shard.step, shard.rank), []).append((rel, _span_set(hit[5]), shard.part))
        else:
            self.sample_ids.append(np.asarray(hit[5], dtype=np.int64))
            self.sample_id_files.append(rel)
        return True

    def _check_marker(self, path: Path, step: int, rank: int, files: set[str]) -> None:
        if self.memo is None:
            return super()._check_marker(path, step, rank, files)
        rel = self.rel(path)
        seen = [*_stat(path), sorted(files)]
        if self.memo.markers.get(rel) == seen:
            return
        before = len(self.report.problems)
        super()._check_marker(path, step, rank, files)
        if len(self.report.problems) == before:
            self.memo.markers[rel] = seen

    def check_parts(self) -> None:
        """Part files whose micro_batch ranges overlap get their exact micro_batch sets read (the
        ranges are what the statistics give); then validate's own check."""
        import pyarrow.parquet as pq

        for key, parts in self.parts.items():
            # a range from the statistics (its ends are O(1)), or the exact set of a file whose rows were read
            spans = sorted((m[0], m[-1]) if isinstance(m, range) else (min(m), max(m)) for _, m, _ in parts if m)
            if any(b[0] <= a[1] for a, b in zip(spans, spans[1:])):
                exact = []
                for rel, _, part in parts:
                    col = pq.read_table(fmt.parquet_source(self.root / rel), columns=["micro_batch"]).column(0)
                    exact.append((rel, set(np.unique(_ints(col.drop_null())).tolist()), part))
                self.parts[key] = exact
            else:  # disjoint ranges split no loss call (and a range is never listed value by value)
                self.parts[key] = []
        super().check_parts()


def _span_set(span: list[int] | None) -> range:
    """The micro_batch values a file may hold, from its statistics' [min, max] (None: no rows): a
    range, not a set, since the statistics are the file's word (0 and 2**31 - 1 are two numbers)."""
    return range(span[0], span[1] + 1) if span else range(0)


def _column_stats(pf, usable: set[str]) -> dict[str, tuple | None]:
    """column -> (min, max, null count) over the row groups; None where a row group lacks them."""
    md = pf.metadata
    index = {md.schema.column(i).name: i for i in range(md.num_columns)}
    out: dict[str, tuple | None] = {}
    for name in usable:
        i = index[name]  # ``usable`` names top-level primitive columns: each is a Parquet leaf of that name
        lo = hi = None
        nulls = 0
        for g in range(md.num_row_groups):
            col = md.row_group(g).column(i)
            s = col.statistics
            if md.row_group(g).num_rows == 0:
                continue
            if s is None or not s.has_null_count or (not s.has_min_max and s.null_count < col.num_values):
                out[name] = None
                break
            nulls += s.null_count
            if s.has_min_max:
                lo = s.min if lo is None else min(lo, s.min)
                hi = s.max if hi is None else max(hi, s.max)
        else:
            out[name] = (lo, hi, nulls)
    return out


def _path_and_nulls_suspicious(stats: dict, shard: fmt.Shard, usable: set[str], table: str) -> bool:
    for c in fmt.COLUMNS[table]:
        if c.name in usable and not c.nullable:
            s = stats.get(c.name)
            if s is None or s[2]:
                return True
    for name in ("step", "rank"):
        s = stats.get(name)
        expected = getattr(shard, name)
        if s is not None and s[0] is not None and (s[0] != expected or s[1] != expected):
            return True
    return False


def _tokens_suspicious(stats: dict, shard: fmt.Shard, usable: set[str]) -> bool:
    if _path_and_nulls_suspicious(stats, shard, usable, fmt.TOKENS):
        return True
    for c in _ORDER:
        s = stats.get(c)
        if c in usable and (s is None or (s[0] is not None and s[0] < 0)):
            return True
    for c in _LOGP_COLUMNS:
        if c in usable:
            s = stats.get(c)
            # NaN never enters Parquet statistics; an all-NaN/null column has no maximum
            if s is None or (s[1] is not None and s[1] > POSITIVE_LOGP_TOLERANCE):
                return True
    return False


def _samples_suspicious(stats: dict, shard: fmt.Shard, usable: set[str], max_len: int | None = None) -> bool:
    if _path_and_nulls_suspicious(stats, shard, usable, fmt.SAMPLES):
        return True
    for c in NON_NEGATIVE[fmt.SAMPLES]:
        s = stats.get(c)
        if c in usable and (s is None or (s[0] is not None and s[0] < 0)):
            return True
    s = stats.get("completion_len")
    return max_len is not None and "completion_len" in usable and s is not None and s[1] is not None and s[1] > max_len
