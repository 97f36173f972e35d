"""Errors that are the user's to fix. The CLI prints them as one precise line and exits non-zero;
it never shows a traceback for them."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a missing file, an unknown option value, a malformed rules file...

    ``exit_code`` follows the CLI convention: 2 for bad input or usage, 1 for "problems found".
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class RunFormatError(ValueError):
    """A run (or a file in it) does not follow the format. ``path`` names the file at fault.

    Defined here rather than in :mod:`grpolens.run.format` so that the CLI can catch it without
    importing pyarrow at start-up; ``grpolens.run.format.RunFormatError`` is the same class.
    """

    def __init__(self, path, message: str, column: str | None = None):
        self.path = str(path)
        self.column = column
        where = f"{self.path}" + (f" (column {column!r})" if column else "")
        super().__init__(f"{where}: {message}")
        self.message = message
