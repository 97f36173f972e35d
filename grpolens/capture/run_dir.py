"""Opening a run directory for writing: ``mode="new"`` refuses a run that is there, ``"resume"``
keeps its complete steps, ``"overwrite"`` deletes it first (see :mod:`grpolens.capture.writer`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from grpolens.run import format as fmt

MODES = ("new", "resume", "overwrite")


class RunExistsError(FileExistsError):
    """``mode="new"`` and the directory already holds a grpolens run."""



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
