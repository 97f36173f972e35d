"""The grpolens run format, version 1: the one place that knows paths, schemas and the manifest.

A *run* is a directory::

    RUN/
      grpolens.json                                   manifest (format, version, config, ...)
      tokens/step=<step:08d>/rank=<rank:05d>[-<part:04d>].parquet
      samples/step=<step:08d>/rank=<rank:05d>[-<part:04d>].parquet
      grpolens/                                       everything grpolens derives (metrics, sidecars, ...)

Every reader and writer in the package goes through this module; ``docs/run-format.md`` is the
human-readable version of the same contract and a test keeps the two in step.

Two promises the writer makes and readers rely on (they make streaming reductions cheap):

* the rows of one loss call (step, rank, micro_batch) are never split across two part files;
* within a tokens shard, rows are ordered by (micro_batch, sample_id, pos), so each sequence of
  a loss call is one contiguous run of rows.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import pyarrow as pa

# atomic writes live one level down so that the storage layer can use them without importing this module
from grpolens.run.atomic import atomic_file, fsync_dir  # noqa: F401  (fsync_dir: re-exported for the writer)

from grpolens.errors import RunFormatError  # noqa: F401  (re-exported: readers raise it)

# the names, schemas and path names live in grpolens/run/layout.py (#29); they are the format's names too
from grpolens.run.layout import (  # noqa: F401
    _SHARD_RE, _STEP_RE, MAX_WORLD_SIZE, shard_relpath, marker_relpath, finished_relpath, MARKER_RE,
    FINISHED_RE, Shard, parse_shard_path, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, TOKENS, SAMPLES, TABLES,
    DERIVED_DIR, COMPLETE_DIR, REWARD_PREFIX, Column, TOKEN_COLUMNS, SAMPLE_COLUMNS, REWARD_COLUMN_TYPE,
    REQUIRED, COLUMNS, KEY, CONFIG_DEFAULTS, column_types, arrow_schema,
)


# ---------------------------------------------------------------------------------------------
# Where a run is, and its listings
# ---------------------------------------------------------------------------------------------

def as_run(run):
    """A run argument as a local :class:`~pathlib.Path`, or a storage Location for ``s3://``."""
    from grpolens.run.storage import Location, is_remote, location

    if isinstance(run, Location):
        return run if run.remote else Path(run.path)
    if is_remote(run):
        return location(run)
    return Path(run)


def is_remote_run(run) -> bool:
    from grpolens.run.storage import Location, is_remote

    return is_remote(run) or (isinstance(run, Location) and run.remote)


#: A remote table's listing is reused for this many seconds within a process, so that one command
#: lists each table once (one LIST request per 1,000 shards) however many times it asks.
REMOTE_LISTING_TTL = 10.0
_REMOTE_LISTINGS: dict[tuple[str, str], tuple[float, list]] = {}


def _remote_shards(root, table: str) -> list[Shard]:
    import time

    key = (root.url, table)
    hit = _REMOTE_LISTINGS.get(key)
    if hit is not None and time.monotonic() - hit[0] < REMOTE_LISTING_TTL:
        return hit[1]
    base = root / table
    out = []
    for rel, entry in base.walk():
        step_dir, _, name = rel.rpartition("/")
        m, st = _SHARD_RE.match(name), _STEP_RE.match(step_dir)
        if m and st:
            part = int(m.group(2)) if m.group(2) is not None else -1
            out.append(Shard(int(st.group(1)), int(m.group(1)), part, base / rel, table, (entry.size, entry.mtime_ns)))
    out.sort()
    _REMOTE_LISTINGS[key] = (time.monotonic(), out)
    return out


def forget_listings() -> None:
    """Drop cached remote listings (after this process wrote shards, or in tests)."""
    _REMOTE_LISTINGS.clear()
    _REMOTE_NAMES.clear()


def parquet_source(path):
    """What :mod:`pyarrow.parquet` opens: a local path as is, a remote object as a random-access file."""
    from grpolens.run.storage import Location

    return path.open_input() if isinstance(path, Location) else path


def list_shards(run: os.PathLike | str, table: str = TOKENS, steps: Iterable[int] | None = None, *,
                complete_only: bool = True) -> list[Shard]:
    """All shards of ``table`` in ``run``, sorted by (step, rank, part). Stray files are ignored
    here (``grpolens validate`` reports them). With ``steps``, only those steps' directories are
    listed (cheap on a run with thousands of steps). On object storage the table is listed once,
    recursively (one request per 1,000 keys), and the listing reused for :data:`REMOTE_LISTING_TTL`.
    In a local run with completion markers, the shards of incomplete steps are left out (see
    :func:`read_completion`) unless ``complete_only`` is False."""
    if is_remote_run(run):
        every = _remote_shards(as_run(run), table)
        keep = complete_filter(run) if complete_only else None
        wanted = None if steps is None else set(int(s) for s in steps)
        return [sh for sh in every if (wanted is None or sh.step in wanted) and (keep is None or keep(sh.step))]
    if complete_only:
        keep = complete_filter(run)
        if keep is not None:
            return [sh for sh in list_shards(run, table, steps, complete_only=False) if keep(sh.step)]
    root = Path(run) / table
    if steps is None:
        dirs = [d for d in (root.iterdir() if root.is_dir() else ()) if _STEP_RE.match(d.name)]
    else:
        dirs = [root / f"step={int(s):08d}" for s in set(steps)]
    out = []
    for step_dir in dirs:
        try:
            names = os.listdir(step_dir)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            shard = parse_shard_path(step_dir / name, table)
            if shard is not None:
                out.append(shard)
    return sorted(out)


def list_steps(run: os.PathLike | str, table: str = TOKENS, *, complete_only: bool = True) -> list[int]:
    """Steps with a directory under ``table`` (complete steps only, as :func:`list_shards`)."""
    if is_remote_run(run):
        keep = complete_filter(run) if complete_only else None
        return sorted(s for s in {sh.step for sh in _remote_shards(as_run(run), table)} if keep is None or keep(s))
    root = Path(run) / table
    if not root.is_dir():
        return []
    with os.scandir(root) as entries:  # scandir knows directories without a stat per entry
        steps = sorted(int(m.group(1)) for d in entries if (m := _STEP_RE.match(d.name)) and d.is_dir())
    if complete_only:
        keep = complete_filter(run)
        if keep is not None:
            return [s for s in steps if keep(s)]
    return steps


def derived_dir(run: os.PathLike | str) -> Path:
    """Where grpolens keeps what it derives from ``run``: ``RUN/grpolens/``; for a run on object
    storage the local directory ``./<run name>.grpolens/`` (nothing is written to the bucket unless
    asked: ``recompute --out s3://...``), so every command finds a remote run's outputs there.
    A run read through one of its what-if variants (:class:`grpolens.run.variants.VariantRun`)
    derives into the variant's directory, ``RUN/grpolens/variants/<key>/``."""
    variant = getattr(run, "variant", None)
    if variant is not None:
        return variant.dir
    if is_remote_run(run):
        from grpolens.run.names import child

        root = as_run(run)
        return child(".", f"{_remote_run_name(root)}.grpolens", f"run_name in {root.url}/{MANIFEST_NAME}")
    return as_run(run) / DERIVED_DIR


_REMOTE_NAMES: dict[str, str] = {}


def _remote_run_name(root) -> str:
    """The manifest's run name of a remote run (read once per process: one GET)."""
    name = _REMOTE_NAMES.get(root.url)
    if name is None:
        name = _REMOTE_NAMES[root.url] = read_manifest(root).run_name
    return name


#: Columns worth dictionary-encoding: few distinct values per file. Dictionary-encoding random
#: floats costs CPU for nothing (it made the writer ~2x slower and files ~45% larger).
DICTIONARY_COLUMNS = ("step", "rank", "micro_batch", "sample_id", "group_id", "mask", "truncated", "by")


def _atomic(path):
    """:func:`atomic_file` for a local path; for a storage location its atomic writer (a temporary
    key copied onto the final one, see :meth:`grpolens.run.storage.Location.atomic_writer`)."""
    from grpolens.run.storage import Location

    return path.atomic_writer() if isinstance(path, Location) else atomic_file(path)


def atomic_write_bytes(path: os.PathLike | str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees either the old file or the whole new one."""
    with _atomic(path) as f:
        f.write(data)


def atomic_write_table(path: os.PathLike | str, table: pa.Table, compression: str = "zstd") -> None:
    """Write a Parquet file atomically: temp file in the same directory, fsync, rename."""
    import pyarrow.parquet as pq

    dictionary = [c for c in DICTIONARY_COLUMNS if c in table.column_names]
    with _atomic(path) as f:
        pq.write_table(table, f, compression=compression, use_dictionary=dictionary)


# ---------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------

@dataclass
class Manifest:
    run_name: str
    world_size: int = 1
    trainer: dict[str, Any] = field(default_factory=lambda: {"name": None, "version": None})
    config: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    extra: dict[str, Any] = field(default_factory=dict)  # unknown top-level keys, kept on rewrite
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    #: The writer leaves completion markers (complete/): readers judge steps by them. False for
    #: runs written before markers existed, and for runs written by other tools.
    completion_markers: bool = False

    def to_json(self) -> dict[str, Any]:
        d = {
            "format": self.format,
            "version": self.version,
            "run_name": self.run_name,
            "created": self.created,
            "world_size": self.world_size,
            "trainer": self.trainer,
            "config": self.config,
        }
        if self.completion_markers:
            d["completion_markers"] = True
        d.update(self.extra)
        return d

    def resolved_config(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The manifest config over :data:`CONFIG_DEFAULTS`, then ``overrides`` on top."""
        cfg = dict(CONFIG_DEFAULTS)
        cfg.update(self.config)
        if overrides:
            cfg.update(overrides)
        return cfg


def write_manifest(run: os.PathLike | str, manifest: Manifest) -> Path:
    path = as_run(run) / MANIFEST_NAME
    atomic_write_bytes(path, (json.dumps(manifest.to_json(), indent=2, sort_keys=False, default=str) + "\n").encode())
    return path


def read_manifest(run: os.PathLike | str) -> Manifest:
    """Read and check ``RUN/grpolens.json``; raises :class:`RunFormatError` naming the problem."""
    if is_remote_run(run):
        loc = as_run(run) / MANIFEST_NAME
        if not loc.is_file():
            from grpolens.run.storage import storage_errors

            with storage_errors(loc):
                as_run(run)._check_bucket()  # a missing bucket says so, not "manifest missing"
            raise RunFormatError(loc, "manifest missing: a run must contain grpolens.json")
        return _parse_manifest(loc, loc.read_bytes().decode("utf-8", "replace"), as_run(run).name)
    path = Path(run) / MANIFEST_NAME
    if not Path(run).exists():
        raise RunFormatError(run, "run directory does not exist")
    if not Path(run).is_dir():
        raise RunFormatError(run, "not a directory (a run is a directory with grpolens.json)")
    if not path.exists():
        raise RunFormatError(path, "manifest missing: a run directory must contain grpolens.json")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise RunFormatError(path, f"manifest unreadable: {e}") from None
    return _parse_manifest(path, text, Path(run).resolve().name)


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a bad value is quoted in one line, however big."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _parse_manifest(path, text: str, default_name: str) -> Manifest:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RunFormatError(path, f"manifest is not valid JSON: {e}") from None
    except RecursionError:
        raise RunFormatError(path, "manifest is nested too deeply to read (a manifest is a few levels deep)") from None
    if not isinstance(data, dict):
        raise RunFormatError(path, "manifest must be a JSON object")
    if data.get("format") != FORMAT_NAME:
        raise RunFormatError(path, f"'format' must be {FORMAT_NAME!r}, got {_short(data.get('format'))}")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise RunFormatError(path, f"'version' must be an integer, got {_short(version)}")
    if version > FORMAT_VERSION:
        raise RunFormatError(
            path, f"format version {version} is newer than this grpolens understands ({FORMAT_VERSION}); upgrade grpolens"
        )
    if version < 1:
        raise RunFormatError(path, f"format version {version} is not valid")
    config = data.get("config", {})
    if not isinstance(config, dict):
        raise RunFormatError(path, "'config' must be a JSON object")
    trainer = data.get("trainer") or {"name": None, "version": None}
    if not isinstance(trainer, dict):
        raise RunFormatError(path, "'trainer' must be a JSON object with 'name' and 'version'")
    world_size = data.get("world_size", 1)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise RunFormatError(path, f"'world_size' must be an integer from 1 to {MAX_WORLD_SIZE:,} (ranks are "
                                   f"written as 5 digits), got {_short(world_size)}")
    run_name = data.get("run_name")
    if run_name is not None and not isinstance(run_name, str):
        raise RunFormatError(path, f"'run_name' must be a string, got {_short(run_name)}")
    markers = data.get("completion_markers", False)
    if not isinstance(markers, bool):
        raise RunFormatError(path, f"'completion_markers' must be true or false, got {markers!r}")
    known = {"format", "version", "run_name", "created", "world_size", "trainer", "config", "completion_markers"}
    return Manifest(
        run_name=run_name or default_name,
        world_size=world_size,
        trainer=trainer,
        config=config,
        created=str(data.get("created", "")),
        extra={k: v for k, v in data.items() if k not in known},
        format=data["format"],
        version=version,
        completion_markers=markers,
    )


#: Manifest config keys that name a file of the run (relative to the run directory).
CONFIG_FILE_KEYS = ("vocab_file",)
#: Config keys that name a model either by hub name or by directory; a directory must be in the run.
CONFIG_PATH_OR_NAME_KEYS = ("tokenizer",)


def referenced_path_problem(run: os.PathLike | str, key: str, value: Any) -> str | None:
    """Why ``config[key]`` may not be read (it leaves the run directory), or None when it may.

    A run is a self-contained directory: what it references resolves inside it (symbolic links
    included), so a manifest cannot make serve or tokens read an arbitrary file of the machine."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        return f"config.{key} must be a non-empty string path, got {_short(value)}"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return f"config.{key} = {_short(value)} holds a control character (a NUL byte?): not a file name"
    p = Path(value)
    if p.is_absolute() or ".." in p.parts:
        return (f"config.{key} = {value!r} points outside the run directory; files a run references "
                f"must be inside it (a path relative to the run)")
    if is_remote_run(run):
        return None  # object storage has no symbolic links: a relative key stays under the run
    root = Path(run).resolve()
    if key in CONFIG_PATH_OR_NAME_KEYS and not os.path.lexists(root / p):
        return None  # a hub name: nothing of that name in the run
    target = (root / p).resolve()
    if target != root and root not in target.parents:
        return f"config.{key} = {value!r} resolves outside the run directory (through a symbolic link)"
    return None


def run_file(run: os.PathLike | str, key: str, value: Any) -> Path:
    """The path of a file the manifest references, checked to be inside the run directory."""
    problem = referenced_path_problem(run, key, value)
    if problem:
        raise RunFormatError(as_run(run) / MANIFEST_NAME, problem)
    return as_run(run) / value


def is_run(path: os.PathLike | str) -> bool:
    return (as_run(path) / MANIFEST_NAME).is_file()


# ---------------------------------------------------------------------------------------------
# Completion: which steps are whole
# ---------------------------------------------------------------------------------------------
# Which steps of a run are whole: completion markers, finished records, and what readers do with
# steps that are not.
#
# A writer that is killed between the parts of a step (SIGKILL, OOM, a node lost), or one rank of
# several that dies, leaves a step that looks like any other: complete shards, only fewer of them.
# So every writer rank writes, after all of a step's shards are on disk, a *completion marker*
# ``complete/step=S.rank=R.json``, and on a normal close a *finished record*
# ``complete/finished.rank=R.json``. A step is complete when every rank below ``world_size`` has its
# marker; a run is finished when every rank has its finished record.
#
# Readers (:func:`grpolens.run.format.list_shards` and ``list_steps``, which every command goes
# through) leave incomplete steps out and say so once per step on stderr, or fail instead when
# ``GRPOLENS_INCOMPLETE=fail`` is set (or :func:`set_incomplete_policy` was called with ``"fail"``).
# Runs whose manifest does not say ``"completion_markers": true`` were written before markers
# existed (or by another tool): readers take every step as it is, as they always did, and
# ``grpolens validate`` warns that incomplete steps cannot be told apart there.

POLICIES = ("skip", "fail")
POLICY_ENV = "GRPOLENS_INCOMPLETE"
_policy: str | None = None
_lock = threading.Lock()
_cache: dict[str, tuple[tuple, "Completion | None"]] = {}
_reported: set[tuple[str, int]] = set()


@dataclass(frozen=True)
class Completion:
    """The completion records of a marker run."""

    world_size: int
    done: Mapping[int, frozenset[int]]  # step -> ranks with a completion marker
    finished: frozenset[int]  # ranks with a finished record

    def is_complete(self, step: int) -> bool:
        return len(self.done.get(step, ())) >= self.world_size and \
            set(range(self.world_size)) <= self.done.get(step, frozenset())

    @property
    def complete_steps(self) -> list[int]:
        return sorted(s for s in self.done if self.is_complete(s))

    @property
    def run_finished(self) -> bool:
        return set(range(self.world_size)) <= self.finished


def _stamp(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def read_completion(run: os.PathLike | str) -> Completion | None:
    """The run's completion records; None for a run without markers (or without a readable manifest).
    Cached until the manifest or the ``complete/`` directory changes; on object storage for
    :data:`REMOTE_LISTING_TTL`, like the shard listings (one GET of the manifest, one LIST)."""
    if is_remote_run(run):
        return _remote_completion(as_run(run))
    run = Path(run)
    key = (_stamp(run / MANIFEST_NAME), _stamp(run / COMPLETE_DIR))
    with _lock:
        hit = _cache.get(str(run))
        if hit is not None and hit[0] == key:
            return hit[1]
    def names() -> list[str]:
        try:
            return os.listdir(run / COMPLETE_DIR)
        except OSError:
            return []

    result = _completion(run, names)
    with _lock:
        _cache[str(run)] = (key, result)
    return result


def _remote_completion(root) -> Completion | None:
    import time

    key = (root.url, COMPLETE_DIR)
    hit = _REMOTE_LISTINGS.get(key)
    if hit is not None and time.monotonic() - hit[0] < REMOTE_LISTING_TTL:
        return hit[1]
    result = _completion(root, lambda: [entry.name for entry in (root / COMPLETE_DIR).list_dir()])
    _REMOTE_LISTINGS[key] = (time.monotonic(), result)
    return result


def _completion(run, names) -> Completion | None:
    """The completion records of a local or remote ``run`` from the entry ``names()`` of its
    ``complete/`` directory (listed only for a run whose manifest says it writes markers)."""
    try:
        manifest = read_manifest(run)
    except RunFormatError:
        return None
    if not manifest.completion_markers:
        return None
    done: dict[int, set[int]] = {}
    finished: set[int] = set()
    for name in names():
        if (m := MARKER_RE.match(name)):
            done.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        elif (m := FINISHED_RE.match(name)):
            finished.add(int(m.group(1)))
    return Completion(manifest.world_size, {s: frozenset(r) for s, r in done.items()}, frozenset(finished))


def set_incomplete_policy(policy: str | None) -> None:
    """``"skip"`` (default: leave incomplete steps out, one line each on stderr) or ``"fail"``
    (a RunFormatError naming the first incomplete step); None: back to ``$GRPOLENS_INCOMPLETE``."""
    global _policy
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"incomplete-step policy must be one of {POLICIES}, got {policy!r}")
    _policy = policy


def incomplete_policy() -> str:
    p = _policy or os.environ.get(POLICY_ENV, "skip") or "skip"
    if p not in POLICIES:
        from grpolens.errors import UserError

        raise UserError(f"${POLICY_ENV}: must be 'skip' or 'fail', got {p!r}")
    return p


def absent_spans(present: Iterable[int], n: int) -> list[tuple[int, int]]:
    """The ranks of ``range(n)`` not in ``present``, as inclusive ``(first, last)`` spans: the cost
    is that of ``present`` (the files and markers on disk), never of ``n``."""
    spans, nxt = [], 0
    for r in sorted({x for x in present if 0 <= x < n}):
        if r > nxt:
            spans.append((nxt, r - 1))
        nxt = r + 1
    if nxt < n:
        spans.append((nxt, n - 1))
    return spans


def describe_spans(spans: list[tuple[int, int]], limit: int = 8) -> str:
    """``0-3, 7, 9-99999``: at most ``limit`` spans, then ``and N more``; one line however many
    ranks a world_size of 100,000 leaves missing."""
    text = ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in spans[:limit])
    if len(spans) > limit:
        text += f" and {sum(b - a + 1 for a, b in spans[limit:]):,} more"
    return text


def describe_incomplete(c: Completion, step: int) -> str:
    spans = absent_spans(c.done.get(step, ()), c.world_size)
    n = sum(b - a + 1 for a, b in spans)
    return (f"step {step} is incomplete: rank{'s' if n != 1 else ''} {describe_spans(spans)} of "
            f"{c.world_size} ha{'ve' if n != 1 else 's'} no completion marker")


def complete_filter(run: os.PathLike | str):
    """A ``keep(step)`` predicate for a marker run (None for a run without markers): True for a
    complete step; an incomplete one is reported once (or raises, under the "fail" policy)."""
    c = read_completion(run)
    if c is None:
        return None

    def keep(step: int) -> bool:
        if c.is_complete(step):
            return True
        _skip(run, c, step)
        return False

    return keep


def _skip(run: os.PathLike | str, c: Completion, step: int) -> None:
    if incomplete_policy() == "fail":
        raise RunFormatError(run, f"{describe_incomplete(c, step)} (unset ${POLICY_ENV} to skip such steps)")
    key = (str(run) if is_remote_run(run) else str(Path(run).resolve()), int(step))
    with _lock:
        if key in _reported:
            return
        _reported.add(key)
    print(f"grpolens: {run}: skipping {describe_incomplete(c, step)} (`grpolens validate {run}` lists what is missing)",
          file=sys.stderr, flush=True)


def incomplete_steps(run: os.PathLike | str, steps: Iterable[int]) -> list[int]:
    """Those of ``steps`` that are incomplete (none for a run without markers)."""
    c = read_completion(run)
    return [] if c is None else [s for s in steps if not c.is_complete(s)]
