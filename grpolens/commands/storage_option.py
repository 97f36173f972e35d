"""``--storage-option key=value``: one definition, shared by every command that takes a RUN.

The pairs are parsed when the command line is, and become the settings of every ``s3://``
location the command opens (:func:`grpolens.run.storage.set_default_options`), so a reader deep
below the command (the dashboard's step pages, a Ray worker's shard) connects the same way as the
command itself. They mean something only for ``s3://`` locations: a command whose locations are
all local refuses them (:func:`refuse_unless_remote`) rather than ignoring them, so a user who
believes an endpoint or a credential is in use is told at once that it is not.
"""

from __future__ import annotations

from typing import List, Mapping, Sequence, Union

import typer


def _apply(values: List[str]) -> List[str]:
    import sys

    # none given and the storage layer not loaded yet: nothing to reset, and a local run need not
    # import pyarrow's filesystems at all (a re-run with nothing new must start fast)
    if values or "grpolens.run.storage" in sys.modules:
        from grpolens.run.storage import parse_storage_options, set_default_options

        set_default_options(parse_storage_options(values))  # every invocation: none given resets them
    return values


STORAGE_OPTION = typer.Option(
    [], "--storage-option", callback=_apply,
    help="For s3:// locations: key=value, key one of endpoint_url, region, anonymous, profile, access_key_id, "
         "secret_access_key, session_token (over the AWS_* variables and profiles; docs/distributed.md). "
         "Repeatable; refused when none of the command's locations is s3://.")


def refuse_unless_remote(storage_option: Sequence[str], locations: Mapping[str, Union[str, Sequence[str], None]]) -> None:
    """Exit 2 with one line when ``--storage-option`` was given but none of ``locations`` (the
    command's run, output, baseline...: argument or option name -> value as typed, None when not
    given) is an ``s3://`` URL."""
    if not storage_option:
        return
    given = {name: ([v] if isinstance(v, str) else list(v)) for name, v in locations.items() if v}
    if any(str(x).startswith("s3://") for values in given.values() for x in values):
        return
    from grpolens.errors import UserError

    where = ", ".join(f"{name} {' '.join(map(str, values))}" for name, values in given.items())
    raise UserError(f"--storage-option applies to s3:// locations only, and this command's are local ({where}): "
                    "drop it, or name an s3:// location")
