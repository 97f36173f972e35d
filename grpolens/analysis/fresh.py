"""Are a recompute's outputs already what the same command would write now?

Answered before anything heavy is imported, so that re-running ``grpolens recompute RUN`` on a run
with nothing new costs one walk of the run's directories, not the metrics engine: on a 1,000-step
run the engine's imports alone (polars, pyarrow, every metric family and profile) cost more than
the whole answer may.

A writing recompute records a *stamp* in its cache state (``cache/state-<profile>.json``): the
request (profile, steps, output folder, per-step rows, overrides), the digest of every entry of
the run (:func:`grpolens.run.tree.tree_digest`), the code (grpolens' version and source files,
and the folders distributions are installed into, so that installing a plugin counts), and the
outputs' sizes and times. The same request finds its outputs fresh only if none of these changed;
anything else takes the ordinary path, which reuses what it can of the per-step cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolens.run.tree import DERIVED_DIR, tree_digest


@dataclass
class Fresh:
    """Outputs that are already up to date."""

    out_dir: Path
    reused_steps: list[int]
    notes: list[str]
    #: the summary's rows (``grpolens.analysis.recompute.key_columns``), as the writing recompute found them
    key_columns: list[str]


def output_files(out_dir: Path) -> dict[str, list[int]]:
    """Size and mtime of each file directly in ``out_dir`` (the recompute's outputs): any change
    there, a file removed or rewritten by someone else, makes the next re-run write them again."""
    try:
        entries = list(os.scandir(out_dir))
    except OSError:
        return {}
    out = {}
    for e in entries:
        if e.is_file(follow_symlinks=False):
            st = e.stat(follow_symlinks=False)
            out[e.name] = [st.st_size, st.st_mtime_ns]
    return dict(sorted(out.items()))


def code_fingerprint() -> str:
    """grpolens' version, the size and time of each of its source files, and the modification times
    of the folders distributions are installed into (an install or uninstall touches them)."""
    import grpolens

    h = hashlib.blake2b(digest_size=16)
    h.update(grpolens.__version__.encode())
    pkg = Path(grpolens.__file__).parent
    for root, dirs, files in os.walk(pkg):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            st = os.stat(os.path.join(root, name))
            h.update(f"{root}/{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for entry in sys.path:
        if entry.endswith(("site-packages", "dist-packages")) and os.path.isdir(entry):
            h.update(f"{entry}\0{os.stat(entry).st_mtime_ns}\n".encode())
    return h.hexdigest()


def request_key(profile: str, steps: Any, out_dir: Path, per_step: bool, overrides: dict | None) -> str:
    blob = json.dumps({"profile": profile, "steps": repr(steps), "out": str(Path(out_dir).resolve()),
                       "per_step": per_step, "overrides": overrides or {}}, sort_keys=True, default=str)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def stamp(run: Path, request: str) -> dict:
    """What a recompute records before it reads the run (a run that changes while it is read then
    no longer matches, and the next re-run does the work again)."""
    return {"request": request, "tree": tree_digest(run), "code": code_fingerprint()}


def state_path(run: Path, profile: str) -> Path:
    """``grpolens.analysis.recompute``'s cache state of a local run (its ``cache_root`` is the derived folder)."""
    return Path(run) / DERIVED_DIR / "cache" / f"state-{profile}.json"


def default_out_dir(run: Path, profile: str) -> Path:
    """``grpolens.run.reader.out_dir`` of a local run, without importing it."""
    d = Path(run) / DERIVED_DIR
    return d if profile == "grpolens" else d / profile


def fresh_outputs(run: os.PathLike | str, out: os.PathLike | str | None, profile: str, steps: Any,
                  per_step: bool) -> Fresh | None:
    """The outputs of ``recompute RUN`` (local run, local output, no overrides) if they are up to
    date, else None. Never raises: anything unexpected means "not known to be fresh"."""
    try:
        run = Path(run)
        out_dir = Path(out) if out is not None else default_out_dir(run, profile)
        state = json.loads(state_path(run, profile).read_text())
        st = state.get("fresh")
        if not isinstance(st, dict) or st.get("request") != request_key(profile, steps, out_dir, per_step, None):
            return None
        if state.get("outputs", {}).get("files") != output_files(out_dir) or "metrics.parquet" not in output_files(out_dir):
            return None
        if st.get("code") != code_fingerprint() or st.get("tree") != tree_digest(run):
            return None
        return Fresh(out_dir, [int(s) for s in st.get("reused", [])], [str(n) for n in state.get("notes") or []],
                     [str(c) for c in st.get("key_columns") or []])
    except Exception:  # noqa: BLE001 - no state, a damaged one, a missing folder: not fresh
        return None
