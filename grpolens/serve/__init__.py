"""``grpolens serve``: a Dash dashboard from step curves down to the tokens behind them.

Modules: :mod:`~grpolens.serve.runs` (run discovery and the allow-list every request goes
through), :mod:`~grpolens.serve.data` (polars data layer with per-run/per-step caches),
:mod:`~grpolens.serve.figures` (plotly figures), :mod:`~grpolens.serve.layout` (pages),
:mod:`~grpolens.serve.callbacks` (callbacks and the plain functions behind them),
:mod:`~grpolens.serve.app` (``create_app``).
"""

from __future__ import annotations


def create_app(*args, **kwargs):
    """See :func:`grpolens.serve.app.create_app` (imported lazily: dash is heavy)."""
    from grpolens.serve.app import create_app as _create

    return _create(*args, **kwargs)
