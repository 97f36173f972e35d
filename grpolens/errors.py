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


#: The most threads or worker processes an environment variable may ask for.
MAX_PARALLEL = 1024


def env_int(name: str, minimum: int = 1, maximum: int = MAX_PARALLEL) -> int | None:
    """The whole number in environment variable ``name`` (None when unset or empty), or a
    UserError naming the variable: a setting of the user's, never a traceback. ASCII digits only
    (``int()`` would read Arabic-Indic or fullwidth ones), within ``[minimum, maximum]``."""
    import os

    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or not minimum <= int(text) <= maximum:
        raise UserError(f"{name}: expected a whole number from {minimum} to {maximum:,}, got {raw!r}")
    return int(text)
