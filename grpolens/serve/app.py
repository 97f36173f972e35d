"""The Dash app factory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from grpolens.serve.runs import RunSet, resolve_runs

ASSETS = Path(__file__).parent / "assets"


#: Largest request body the server reads (a callback's inputs are a few kB; see grpolens.serve.inputs).
MAX_REQUEST_BYTES = 1 << 20


def create_app(runs: RunSet | Iterable[os.PathLike | str], baseline: os.PathLike | str | None = None,
               watch: bool = False, host: str = "127.0.0.1", allow_hosts: Iterable[str] = ()):
    """A Dash app serving ``runs`` (a :class:`RunSet`, or run/directory paths to resolve).

    The app only ever reads the runs in the set; see :mod:`grpolens.serve.runs`. It answers only
    requests addressed to the address it listens on, ``host`` (and the ``allow_hosts`` names):
    see :mod:`grpolens.serve.hosts`.
    """
    from dash import Dash

    from grpolens.serve import downloads, hosts
    from grpolens.serve.callbacks import register_callbacks
    from grpolens.serve.layout import build_layout

    if not isinstance(runs, RunSet):
        runs = resolve_runs(list(runs), baseline)
    app = Dash(__name__, title="grpolens", assets_folder=str(ASSETS), update_title=None,
               suppress_callback_exceptions=False)
    hosts.install(app.server, hosts.policy(host, allow_hosts))
    app.server.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES
    app.layout = build_layout(runs, watch)
    register_callbacks(app, runs)
    downloads.register(app, runs)
    app.grpolens_runs = runs  # for tests and the serve command
    warm(runs)
    return app


def warm(runs: RunSet) -> None:
    """Load the metric catalogue and each run's per-step series now, so the first page is quick."""
    from grpolens.serve import data

    data.metric_families()
    for path in runs.runs.values():
        data.series(path)
