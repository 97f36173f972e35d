"""The one place where a name becomes part of a path.

Names that grpolens writes under come from places it does not control: the manifest's
``run_name``, a variant's label, ``--name`` of a tracker, a W&B run id. Each is one path
component, checked here before it is joined to a directory, so that no name can write outside
the directory it was meant for (``../../x``, ``/etc``), into a hidden or special entry (``.``,
``..``, a NUL byte, a control character) or past what a file system takes in one name (255 bytes).
A name that fails is refused with one line naming where it came from; nothing is renamed behind
the user's back (two runs could then share a directory).
"""

from __future__ import annotations

import os
from pathlib import Path

from grpolens.errors import UserError

#: The longest file name (in UTF-8 bytes) that common file systems take (ext4, XFS, APFS, NTFS's 255 units).
MAX_NAME_BYTES = 255


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be one path component (None when it can)."""
    if not isinstance(name, str):
        return f"must be a string, got {type(name).__name__}"
    if not name.strip():
        return "is empty"
    if name in (".", ".."):
        return "is a special directory name"
    for bad, what in (("/", "'/'"), ("\\", "'\\'")):
        if bad in name:
            return f"contains {what} (a name is one path component)"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "contains a control character"
    if name.startswith("."):
        return "starts with '.' (a hidden name)"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    if size > MAX_NAME_BYTES:
        return f"is {size} bytes long, more than the {MAX_NAME_BYTES} a file name may have"
    return None


def path_component(name: object, source: str) -> str:
    """``name`` itself when it can name one file or directory; else a UserError saying why, naming
    ``source`` (where the name came from: ``"--name"``, ``"run_name in RUN/grpolens.json"``)."""
    problem = name_problem(name)
    if problem:
        raise UserError(f"{source}: {name!r} cannot name a file or directory: it {problem}")
    return name  # type: ignore[return-value]


def child(parent: os.PathLike | str, name: object, source: str) -> Path:
    """``parent / name`` for a checked ``name`` (see :func:`path_component`)."""
    return Path(parent) / path_component(name, source)
