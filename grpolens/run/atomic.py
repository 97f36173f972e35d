"""Atomic local files: a reader sees the old file or the whole new one, never a part.

The lowest piece of the run layer: both the run format (``grpolens.run.format``) and the storage
layer (``grpolens.run.storage``, whose local branch writes through here) import it, so neither
imports the other for it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator



def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems refuse directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_umask() -> int:
    # os.umask can only be read by setting it; do it once, at import, before any writer thread
    # exists (doing it per write raced between writer threads and could leave files 0666)
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_read_umask()  # what an ordinary open() would give; mkstemp gives 0600


def _umask_mode() -> int:
    return _FILE_MODE


@contextlib.contextmanager
def atomic_file(path: os.PathLike | str) -> Iterator[BinaryIO]:
    """Open a temp file beside ``path`` for writing; on success it is fsynced and renamed onto
    ``path`` (a reader sees the old file or the whole new one), on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _umask_mode())
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
