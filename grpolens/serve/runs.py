"""Which runs the dashboard may read: discovery from the command line, and the allow-list.

The browser names runs only by the short names listed here; every callback turns a name back into
a path through :meth:`RunSet.path`, which refuses anything that is not one of the runs the server
was started with (an unknown name, a path, ``..``). So no request can make the server read a file
outside those runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from grpolens.run import format as fmt
from grpolens.errors import UserError
from grpolens.run.reader import RunReader
from grpolens.run.variants import list_variants, variant_run

#: Directories never searched for runs (a run's own tables, caches, VCS, environments).
_SKIP = {fmt.TOKENS, fmt.SAMPLES, fmt.DERIVED_DIR, fmt.COMPLETE_DIR, ".git", "__pycache__", "node_modules", ".venv"}


class UnknownRun(UserError):
    """A request named a run the server was not given."""


def find_runs(root: Path, max_depth: int = 3) -> list[Path]:
    """Runs at or below ``root`` (a run's own subdirectories are not searched)."""
    if fmt.is_run(root):
        return [root]
    found: list[Path] = []
    if max_depth <= 0 or not root.is_dir():
        return found
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and p.name not in _SKIP and not p.name.startswith("."))
    except OSError:
        return found
    for child in children:
        found += find_runs(child, max_depth - 1)
    return found


@dataclass
class RunSet:
    """The allow-list: run name -> resolved directory, in the order given."""

    runs: dict[str, Path]
    baseline: str | None = None
    _by_path: dict[Path, str] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._by_path = {p: n for n, p in self.runs.items()}

    @property
    def names(self) -> list[str]:
        return list(self.runs)

    def is_variant(self, name: str) -> bool:
        """Whether ``name`` is a what-if variant of a run (``RUN @ label``), not a run itself."""
        return getattr(self.runs.get(name), "variant", None) is not None

    def run_of(self, name: str) -> str:
        """The run a variant belongs to (``name`` itself for a run)."""
        if not self.is_variant(name):
            return name
        return self._by_path.get(Path(self.runs[name]), name)

    @property
    def run_names(self) -> list[str]:
        """The runs themselves, without their variants (the Tokens and Completions pages: a
        variant's shards are its run's)."""
        return [n for n in self.runs if not self.is_variant(n)]

    def path(self, name: object) -> Path:
        """The directory of run ``name``; :class:`UnknownRun` for anything else."""
        if isinstance(name, str) and name in self.runs:
            return self.runs[name]
        shown = repr(name)[:80]
        raise UnknownRun(f"unknown run {shown}: this server only serves {', '.join(self.names)}")

    def check(self, names: Iterable[object] | object | None) -> list[str]:
        """Validate one name or a list of names; returns them as a list (``None`` -> [])."""
        if names is None:
            return []
        if isinstance(names, (list, tuple)):
            return [n for n in names if self.path(n) is not None]  # path() raises on a bad name
        self.path(names)
        return [names]  # type: ignore[list-item]


def default_step(runs: RunSet, name: str) -> int | None:
    """The step a run's Tokens and Completions pages open on: its last one with tokens (or samples)."""
    steps = fmt.list_steps(runs.path(name), fmt.TOKENS) or fmt.list_steps(runs.path(name), fmt.SAMPLES)
    return steps[-1] if steps else None


def _unique_name(base: str, taken: set[str]) -> str:
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    return name


def _remote_run(url, what: str):
    """An ``s3://`` run as a storage location; one line when it is not a run (or not reachable)."""
    run = fmt.as_run(url)
    if not (run / fmt.MANIFEST_NAME).is_file():
        fmt.read_manifest(run)  # says why: no such bucket, credentials, permission ...
        raise UserError(f"{what}{url}: not a grpolens run (no {fmt.MANIFEST_NAME})")
    return run


def _resolved(p):
    return p if fmt.is_remote_run(p) else p.resolve()


def resolve_runs(args: Iterable[os.PathLike | str], baseline: os.PathLike | str | None = None) -> RunSet:
    """Runs named on the command line (each a run or a directory holding runs) and the baseline.

    Names are the runs' ``run_name`` (or directory name), made unique with a suffix. Each local run's
    what-if variants (``RUN/grpolens/variants/``, :mod:`grpolens.run.variants`) follow it, named
    ``RUN @ label`` (``trl-tiny @ epsilon=0.1``); the baseline's are left out.
    """
    paths: list[Path] = []
    for a in args:
        if fmt.is_remote_run(a):  # s3://...: the run itself (object storage is not searched for runs)
            paths.append(_remote_run(a, ""))
            continue
        p = Path(a)
        if not p.exists():
            raise UserError(f"{p}: no such run or directory")
        hits = find_runs(p)
        if not hits:
            raise UserError(f"{p}: no grpolens run here (a run is a directory with {fmt.MANIFEST_NAME})")
        paths += hits
    base_path = None
    if baseline is not None and fmt.is_remote_run(baseline):
        base_path = _remote_run(baseline, "--baseline ")
        paths.append(base_path)
    elif baseline is not None:
        base_path = Path(baseline)
        if not fmt.is_run(base_path):
            raise UserError(f"--baseline {base_path}: not a grpolens run (no {fmt.MANIFEST_NAME})")
        paths.append(base_path)
    runs: dict[str, Path] = {}
    seen: set[Path] = set()
    base_name = None
    for p in paths:
        rp = _resolved(p)
        if rp in seen:
            if base_path is not None and rp == _resolved(base_path):
                base_name = next(n for n, q in runs.items() if q == rp)
            continue
        seen.add(rp)
        name = _unique_name(fmt.read_manifest(rp).run_name or rp.name, set(runs))
        RunReader(rp).check()
        runs[name] = rp
        if base_path is not None and rp == _resolved(base_path):
            base_name = name
        elif not fmt.is_remote_run(rp):  # its what-ifs (recompute --set), each a run of its own, after it
            for v in list_variants(rp):
                runs[_unique_name(f"{name} @ {v.label}", set(runs))] = variant_run(v)
    if not runs:
        raise UserError("no runs to serve")
    return RunSet(runs, base_name)
