"""``--storage-option key=value``: one definition, shared by every command that takes a RUN.

The pairs are parsed when the command line is, and become the settings of every ``s3://``
location the command opens (:func:`grpolens.run.storage.set_default_options`), so a reader deep
below the command (the dashboard's step pages, a Ray worker's shard) connects the same way as the
command itself. They apply to ``s3://`` runs only; a local run ignores them.
"""

from __future__ import annotations

from typing import List

import typer


def _apply(values: List[str]) -> List[str]:
    from grpolens.run.storage import parse_storage_options, set_default_options

    set_default_options(parse_storage_options(values))  # every invocation: none given resets them
    return values


STORAGE_OPTION = typer.Option(
    [], "--storage-option", callback=_apply,
    help="For s3:// runs: key=value, key one of endpoint_url, region, anonymous, profile, access_key_id, "
         "secret_access_key, session_token (over the AWS_* variables and profiles; docs/distributed.md). Repeatable.")
