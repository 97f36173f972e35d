"""What every tracker exporter shares: the data read from a run, the options, the export loop."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from grpolens.errors import UserError

PREFIX = "grpolens/"
STEP_KEY = PREFIX + "step"
#: tables exported where the tracker has a table type: name -> file in the profile's output directory
TABLES = {"completions": "completions.parquet", "top_tokens": "top_tokens.parquet"}


@dataclass
class ExportOptions:
    project: str = "grpolens"          # W&B project, MLflow experiment, trackio project
    name: str | None = None            # the run's name in the tracker (default: the grpolens run name)
    resume: str | None = None          # W&B: add to this existing run id
    online: bool = False               # W&B: sync to the server instead of an offline run directory
    logdir: Path | None = None         # TensorBoard: where the event files go
    tracking_uri: str | None = None    # MLflow: tracking server or store
    tables: bool = True                # export the completions and top-token tables
    explain: bool = False              # export the explanation of each flagged step as a table


@dataclass
class ExportSource:
    """A run's exportable data: metrics rows (``metrics.jsonl``, finite values only) and tables."""

    run: Path
    run_name: str
    profile: str
    out_dir: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None  # the what-if variant's key (grpolens.run.variants), None for the run's own metrics

    @property
    def nonfinite(self) -> list[tuple[int, str, float]]:
        """``(step, metric, value)`` of every NaN or infinite metric value: ``metrics.jsonl`` (what
        is exported) leaves them out, and no tracker takes them alike (TensorBoard and W&B store
        them, MLflow and trackio refuse or drop them), so none exports them and the export says so."""
        import polars as pl

        path = self.out_dir / "metrics.parquet"
        if not path.is_file():
            return []
        df = pl.read_parquet(path)
        out = []
        for c in df.columns:
            if c == "step" or not df.schema[c].is_float():
                continue
            bad = df.filter(pl.col(c).is_nan() | pl.col(c).is_infinite())
            out += [(int(st), c, float(v)) for st, v in zip(bad["step"], bad[c])]
        return sorted(out)

    @property
    def key(self) -> str:
        """A stable id of this run, profile (and variant): the same destination run on every re-export."""
        what = f"{self.where}|{self.profile}" + (f"|{self.variant}" if self.variant else "")
        return hashlib.sha1(what.encode()).hexdigest()[:12]

    @property
    def where(self) -> str:
        """The run's absolute path, or its ``s3://`` URL."""
        from grpolens.run import format as fmt

        return str(self.run) if fmt.is_remote_run(self.run) else str(Path(self.run).resolve())

    def table(self, name: str):
        """The table as a polars DataFrame, or None when recompute wrote none."""
        import polars as pl

        path = self.out_dir / TABLES[name]
        return pl.read_parquet(path) if path.is_file() else None

    @classmethod
    def load(cls, run: Path, profile: str, progress: Callable[[int, int], None] | None = None,
             variant=None) -> "ExportSource":
        """Recompute (incrementally: cheap when up to date) and read the profile's ``metrics.jsonl``;
        with a ``variant`` (:class:`grpolens.run.variants.Variant`), that what-if's, named ``RUN @ LABEL``."""
        from grpolens.analysis.recompute import recompute
        from grpolens.run import format as fmt
        from grpolens.run.reader import deep_update

        run = fmt.as_run(run)
        manifest = fmt.read_manifest(run)
        overrides = variant.overrides if variant is not None else None
        res = recompute(run, profile=profile, progress=progress, result=True, overrides=overrides)
        path = res.out_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if variant is None:
            return cls(run, manifest.run_name, profile, res.out_dir, rows, manifest.resolved_config())
        return cls(run, f"{manifest.run_name} @ {variant.label}", profile, res.out_dir, rows,
                   deep_update(manifest.resolved_config(), variant.overrides), variant.key)


class Exporter:
    """One tracker. Subclasses open the destination in ``__init__`` and implement the methods."""

    #: the --to name
    tracker = ""
    #: whether the tracker has a table type (log_table does something)
    has_tables = False
    #: the tracker-specific :class:`ExportOptions` fields it reads (``resume``, ``logdir``, ...):
    #: ``grpolens export`` refuses each of them for a tracker that does not own it
    owns: tuple[str, ...] = ()

    def __init__(self, source: ExportSource, options: ExportOptions):
        self.source, self.options = source, options

    def exported_steps(self) -> set[int]:
        """Steps the destination already has (re-export skips them)."""
        raise NotImplementedError

    def log_step(self, step: int, values: dict[str, float]) -> None:
        """One training step's values, keys already prefixed, ``grpolens/step`` included."""
        raise NotImplementedError

    def log_table(self, name: str, df) -> None:
        """The rows of the steps just exported (a ``step`` column first); default: the tracker has no table type."""

    def finish(self) -> str:
        """Close the destination; a line saying where the data is."""
        raise NotImplementedError


def tracker_name(source: ExportSource, options: ExportOptions) -> tuple[str, str]:
    """The run's name in the tracker and where it came from (what an error about it names)."""
    if options.name:
        return options.name, "--name"
    label = " with the variant's label" if source.variant else ""
    return source.run_name, f"the run name (run_name in {source.run}/grpolens.json{label}; give --name)"


#: --to name -> its exporter, in registration order (the built-ins first, as ``--to`` lists them)
EXPORTERS: dict[str, type[Exporter]] = {}


def register_exporter(cls: type[Exporter]) -> type[Exporter]:
    """Register a tracker's :class:`Exporter` under its ``tracker`` name: the built-ins do it in
    their modules, a plugin (an entry point in the ``grpolens.plugins`` group) the same way."""
    if not cls.tracker:
        raise ValueError(f"exporter {cls.__name__}: no tracker name")
    if EXPORTERS.get(cls.tracker, cls) is not cls:
        raise ValueError(f"exporter {cls.tracker} registered twice")
    unknown = set(cls.owns) - set(ExportOptions.__dataclass_fields__)
    if unknown:
        raise ValueError(f"exporter {cls.tracker}: unknown options {sorted(unknown)}")
    EXPORTERS[cls.tracker] = cls
    return cls


def needs(module: str, extra: str):
    """Import a tracker's client, or a one-line error naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"--to {extra}: the {module} client is not installed; pip install \"grpolens[{extra}]\"") from None


def step_values(row: dict[str, Any]) -> tuple[int, dict[str, float]]:
    step = int(row["step"])
    values = {PREFIX + k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))
              and not isinstance(v, bool)}
    values[STEP_KEY] = step
    return step, values


def export_run(source: ExportSource, exporter: Exporter, progress: Callable[[int, int], None] | None = None) -> dict:
    """Log every step the destination lacks, then the tables; returns counts and the destination line."""
    done = exporter.exported_steps()
    todo = [r for r in source.rows if int(r["step"]) not in done]
    for i, row in enumerate(todo, 1):
        step, values = step_values(row)
        exporter.log_step(step, values)
        if progress:
            progress(i, len(todo))
    tables = []
    if exporter.options.tables and exporter.has_tables and todo:
        import polars as pl

        new = [int(r["step"]) for r in todo]
        for name in TABLES:
            df = source.table(name)
            df = df.filter(pl.col("step").is_in(new)) if df is not None else None
            if df is not None and df.height:  # the new steps' rows only: appended, never duplicated
                exporter.log_table(name, df)
                tables.append(name)
    if exporter.options.explain and exporter.has_tables and todo and source.variant is None:
        from grpolens.export import explanations

        df = explanations.table(source.run, [int(r["step"]) for r in todo])
        if df is not None:
            exporter.log_table(explanations.NAME, df)
            tables.append(explanations.NAME)
    where = exporter.finish()
    new = {int(r["step"]) for r in todo}
    not_exported = [x for x in source.nonfinite if x[0] in new]
    return {"exported": len(todo), "skipped": len(source.rows) - len(todo), "tables": tables, "where": where,
            "not_exported": not_exported}


def describe_not_exported(values: list[tuple[int, str, float]], limit: int = 5) -> str:
    """One line naming the values an export left out (NaN or infinite), the first ``limit`` of them."""
    shown = ", ".join(f"{m} at step {st} ({'NaN' if v != v else f'{v:+}'})" for st, m, v in values[:limit])
    more = f" and {len(values) - limit:,} more" if len(values) > limit else ""
    return (f"{len(values):,} value(s) not exported, as trackers take finite numbers only: {shown}{more} "
            f"(grpolens recompute shows them)")
