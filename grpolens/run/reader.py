"""The one reader of a run directory: manifest, config, steps, token and sample shards, output location.

Every command, the analysis modules and the dashboard read a run through :class:`RunReader` (or the
module functions it is built from), so that a run is resolved the same way everywhere:

* **config**: the manifest's config over the format's defaults, then ``--config FILE``, then
  ``--set key=value`` overrides, checked and normalised by :func:`grpolens.run.config.check_config`;
* **steps**: the steps that have token or sample shards, and a ``--steps A:B`` selection of them;
* **tokens**: the wanted columns of one tokens shard (:func:`read_tokens`), required columns checked;
* **samples**: one step's samples rows, all ranks (:meth:`RunReader.samples`), and the set of sample
  columns over the whole run (Parquet footers only);
* **output**: where derived files of a profile go (``RUN/grpolens/`` or ``RUN/grpolens/<profile>/``).

Every unreadable file raises :class:`~grpolens.errors.RunFormatError` naming it; every bad option a
one-line :class:`~grpolens.errors.UserError` naming the option.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

from grpolens.errors import RunFormatError, UserError
from grpolens.run import format as fmt

#: Token columns read by default (all the format defines; absent optional ones are skipped).
READ_COLUMNS = tuple(c.name for c in fmt.TOKEN_COLUMNS)


# ---------------------------------------------------------------------------------------------
# Options: --steps, --set, --config
# ---------------------------------------------------------------------------------------------

def parse_steps(spec: str | None) -> tuple[int | None, int | None]:
    """``A:B`` (inclusive both ends, either side optional) or a single step ``N``."""
    if spec is None or spec == "":
        return None, None
    try:
        if ":" in spec:
            a, b = spec.split(":", 1)
            lo = int(a) if a.strip() else None
            hi = int(b) if b.strip() else None
        else:
            lo = hi = int(spec)
    except ValueError:
        raise UserError(f"--steps: expected A:B or N with integer steps, got {spec!r}") from None
    if lo is not None and hi is not None and lo > hi:
        raise UserError(f"--steps: start {lo} is after end {hi}")
    return lo, hi


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        low = text.lower()
        if low in ("none", "null"):
            return None
        if low in ("true", "false"):
            return low == "true"
        return text


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``key=value`` pairs; values are JSON when they parse as JSON; ``a.b=v`` sets a nested key."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set: expected key=value, got {item!r}")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key:
            raise UserError(f"--set: empty key in {item!r}")
        value = _parse_value(text.strip())
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"--set: {key!r} conflicts with another --set")
        node[parts[-1]] = value
    return out


def load_config_file(path: os.PathLike | str) -> dict[str, Any]:
    """A JSON or TOML file with config keys (a top-level ``config`` table is also accepted)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config: no such file {p}")
    try:
        text = p.read_text()
        if p.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except RecursionError:
        raise UserError(f"--config: {p} is nested too deeply to read") from None
    except Exception as e:  # noqa: BLE001 - any parse or decode error is the user's file
        raise UserError(f"--config: {p} is not valid {'TOML' if p.suffix.lower() == '.toml' else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"--config: {p} must contain a table/object of config keys")
    if isinstance(data.get("config"), dict):
        data = data["config"]
    return data


def deep_update(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` merged in, nested tables merged key by key (neither is modified)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_update(out[k], v)
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# Shard reads
# ---------------------------------------------------------------------------------------------

_KEYS = ("micro_batch", "sample_id", "pos")


def read_tokens(path: Path, columns: Iterable[str] = READ_COLUMNS):
    """Read the wanted columns of one tokens shard (a ``pyarrow.Table``, always with its keys); a
    broken file or a missing required column raises RunFormatError. The order and uniqueness of the
    keys -- what Parquet statistics cannot show, so :meth:`RunReader.check` cannot -- are checked
    here on the key columns just read, with the values, with ``grpolens validate``'s messages
    (:func:`~grpolens.run.token_columns.refuse_bad_tokens`: compiled passes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from grpolens.run.token_columns import refuse_bad_tokens

    try:
        pf = pq.ParquetFile(fmt.parquet_source(path))
        have = set(pf.schema_arrow.names)
        missing = [c for c in fmt.REQUIRED[fmt.TOKENS] if c not in have]
        if missing:
            raise RunFormatError(path, f"required column(s) missing: {', '.join(missing)}", column=missing[0])
        wanted = list(dict.fromkeys([*_KEYS, *columns]))
        table = pf.read(columns=[c for c in wanted if c in have])
    except RunFormatError:
        raise
    except (OSError, pa.ArrowException) as e:
        if fmt.is_remote_run(path):
            from grpolens.run.storage import describe

            raise RunFormatError(path, f"unreadable: {describe(e)}") from None
        raise RunFormatError(path, f"unreadable or truncated Parquet file: {e}") from None
    refuse_bad_tokens(path, table)
    return table


def read_samples(run: os.PathLike | str, step: int, manifest: fmt.Manifest | None = None):
    """The samples rows of one step, all ranks, every column (texts included), as a
    ``polars.DataFrame``; None when the step has no samples shard. ``manifest``: the run's, when
    the caller has it (:meth:`RunReader.samples`), else it is read here (a GET on ``s3://``)."""
    import polars as pl
    import pyarrow.parquet as pq

    shards = fmt.list_shards(run, fmt.SAMPLES, steps=[step])
    if not shards:
        return None
    from grpolens.run.text_columns import checked_text
    from grpolens.run.validate import refuse_bad_values

    max_len = _max_completion_length(run, manifest)
    frames = []
    for sh in shards:
        try:
            # one file, read as one: read_table's dataset discovery and threads cost twice the CPU on
            # a samples shard's few hundred rows
            table = pq.ParquetFile(fmt.parquet_source(sh.path)).read(use_threads=False)
        except UserError:  # a storage error (bucket, credentials, object gone): its own line
            raise
        except Exception as e:  # noqa: BLE001
            raise RunFormatError(sh.path, f"unreadable or truncated Parquet file: {e}") from None
        refuse_bad_values(sh.path, fmt.SAMPLES, table, max_len)
        # text that is not UTF-8 (a foreign writer's) is refused or replaced, never handed to polars
        frames.append(pl.from_arrow(checked_text(table, sh.path)))
    return pl.concat(frames, how="diagonal_relaxed")


def _max_completion_length(run, manifest: fmt.Manifest | None = None) -> int | None:
    """The manifest's max_completion_length (what validate bounds completion_len by), or None."""
    try:
        limit = (manifest or fmt.read_manifest(run)).config.get("max_completion_length")
    except RunFormatError:
        return None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1 else None


def sample_columns(run: os.PathLike | str) -> set[str]:
    """Every column name in the run's samples shards (Parquet footers only)."""
    import pyarrow.parquet as pq

    cols: set[str] = set()
    for sh in fmt.list_shards(run, fmt.SAMPLES):
        try:
            cols.update(pq.read_schema(fmt.parquet_source(sh.path)).names)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001
            raise RunFormatError(sh.path, f"unreadable or truncated Parquet file: {e}") from None
    return cols


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def resolve_config(run: os.PathLike | str, overrides: dict | None = None,
                   config_file: os.PathLike | str | None = None, *, check: bool = True) -> dict[str, Any]:
    """The config the metrics see: manifest (over the defaults), then ``--config``, then ``--set``;
    checked and normalised unless ``check`` is False."""
    return RunReader(run).config(overrides, config_file, check=check)


def out_dir(run: os.PathLike | str, profile: str = "grpolens") -> Path:
    """Where a profile's derived files go: ``RUN/grpolens/`` (default profile) or ``RUN/grpolens/<profile>/``."""
    d = fmt.derived_dir(run)
    return d if profile == "grpolens" else d / profile


class RunReader:
    """A run directory, read the one way every command reads it."""

    def __init__(self, run: os.PathLike | str, storage_options: dict[str, str] | None = None):
        if storage_options:
            from grpolens.run.storage import location

            run = location(run, storage_options)
        #: a local Path, or a storage Location for a run on object storage (``s3://``)
        self.path = fmt.as_run(run)

    @classmethod
    def of(cls, run: "os.PathLike | str | RunReader") -> "RunReader":
        """``run`` as a reader: itself when it is one (its manifest already read), else a new one."""
        return run if isinstance(run, RunReader) else cls(run)

    def __repr__(self) -> str:
        return f"RunReader({str(self.path)!r})"

    @cached_property
    def manifest(self) -> fmt.Manifest:
        return fmt.read_manifest(self.path)

    #: what :meth:`check` found (None before it ran, or for a run on object storage)
    check_report = None

    def check(self, memo: os.PathLike | str | None = None, tree: str | None = None):
        """Refuse the run (RunFormatError, validate's message) when ``grpolens validate`` would
        reject it for anything the Parquet footers show; called once by every command before it
        reads rows (the rest is checked by :func:`read_tokens` and :func:`read_samples`).
        ``memo``: where to remember the files that passed (see :func:`check_before_reading`);
        ``tree``: the run's tree digest, when the caller has just taken it."""
        from grpolens.run.validate import check_before_reading

        # an s3:// run has no local directory to validate: its shards are still checked as read
        if not getattr(self, "_checked", False) and not fmt.is_remote_run(self.path):
            self.check_report = check_before_reading(self.path, memo, tree)
            self._checked = True
        return self

    def config(self, overrides: dict | None = None, config_file: os.PathLike | str | None = None,
               *, check: bool = True) -> dict[str, Any]:
        from grpolens.run.config import check_config, check_keys, known_keys

        cfg = self.manifest.resolved_config()
        known = known_keys(self.manifest.config)
        if config_file is not None:
            extra = load_config_file(config_file)
            check_keys(extra, known, f"--config {config_file}")
            cfg = deep_update(cfg, extra)
        if overrides:
            check_keys(overrides, known, "--set")
            cfg = deep_update(cfg, overrides)
        if not check:
            return cfg

        return check_config(cfg)

    def shards(self, table: str = fmt.TOKENS, steps: Iterable[int] | None = None) -> list[fmt.Shard]:
        return fmt.list_shards(self.path, table, steps=steps)

    def steps(self, table: str | None = None) -> list[int]:
        """Steps with shards of ``table``; with no table, steps with token or sample shards."""
        if table is not None:
            return fmt.list_steps(self.path, table)
        return sorted(set(fmt.list_steps(self.path, fmt.TOKENS)) | set(fmt.list_steps(self.path, fmt.SAMPLES)))

    def select_steps(self, steps: str | tuple[int | None, int | None] | None) -> tuple[list[int], int | None, int | None]:
        """``(selected, lo, hi)``: the run's steps within a ``--steps`` spec (``"A:B"`` or a pair).
        A run without shards is a RunFormatError; an empty selection a UserError."""
        lo, hi = parse_steps(steps) if isinstance(steps, (str, type(None))) else steps
        every = self.steps()
        if not every:
            raise RunFormatError(self.path, "the run has no token or sample shards (expected tokens/step=*/rank=*.parquet)")
        sel = [s for s in every if (lo is None or s >= lo) and (hi is None or s <= hi)]
        if not sel:
            raise UserError(f"--steps: no steps of the run fall in {lo}:{hi} (the run has steps {every[0]}..{every[-1]})")
        return sel, lo, hi

    def tokens(self, step: int, columns: Iterable[str] = READ_COLUMNS):
        """The step's token rows of every rank as one ``pyarrow.Table`` (None without shards)."""
        import pyarrow as pa

        tables = [read_tokens(sh.path, columns) for sh in self.shards(fmt.TOKENS, [step])]
        if not tables:
            return None
        return pa.concat_tables(tables, promote_options="default")

    def samples(self, step: int):
        """:func:`read_samples` of ``step``, with the manifest this reader read once."""
        try:
            manifest = self.manifest
        except RunFormatError:  # unreadable: read_samples tries itself, and bounds nothing
            manifest = None
        return read_samples(self.path, step, manifest)

    def sample_columns(self) -> set[str]:
        return sample_columns(self.path)

    @property
    def derived_dir(self) -> Path:
        return fmt.derived_dir(self.path)

    def out_dir(self, profile: str = "grpolens") -> Path:
        return out_dir(self.path, profile)
