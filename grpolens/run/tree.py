"""One digest of every entry of a run directory: equal digests, same files.

Used to skip work that depends only on the run's files when none changed: the checks before
reading (``grpolens.run.validate``) and a re-run of ``grpolens recompute`` with nothing new
(``grpolens.analysis.fresh``). Light on purpose (standard library only): it is called before the
heavy modules are imported.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: the run's derived folder (``grpolens.run.format.DERIVED_DIR``; not imported from there, which
#: would import pyarrow): what commands write into a run is not part of the run
DERIVED_DIR = "grpolens"


def tree_digest(run: os.PathLike | str) -> str:
    """Digest of every entry under ``run`` (path, kind and mode, size, modification time, inode),
    the derived folder excepted. Shards and markers are written by rename, so a rewritten file
    shows as a new inode even within the file system's time resolution."""
    run = Path(run)
    h = hashlib.blake2b(digest_size=16)
    stack = [run]
    while stack:
        folder = stack.pop()
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if folder == run and e.name == DERIVED_DIR:
                continue
            st = e.stat(follow_symlinks=False)
            h.update(f"{e.path}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
            if e.is_dir(follow_symlinks=False):
                stack.append(Path(e.path))
    return h.hexdigest()
