"""What a command checks before it reads a run: validate's checks that the Parquet footers can
answer (:func:`check_before_reading`), and the memo of what passed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from grpolens.run import format as fmt
from grpolens.run.tree import tree_digest
from grpolens.run.validate.checks import (  # noqa: F401
    ERROR,
    WARNING,
    _LOGP_COLUMNS,
    POSITIVE_LOGP_TOLERANCE,
    _ORDER,
    NON_NEGATIVE,
    Report,
    _ints,
)
from grpolens.run.validate.validator import (  # noqa: F401
    _Validator,
)


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
                                        (*(os.stat(p) for p in sorted(Path(__file__).parent.glob("*.py"))),
                                         os.stat(fmt.__file__), os.stat(Path(fmt.__file__).with_name("layout.py"))))])

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
